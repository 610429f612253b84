"""Rotary position embedding on q and k: every backend against the reference."""

from dataclasses import dataclass

import pytest
import torch

from conftest import DEVICE, DTYPES, assert_close, backend_params, grads_of, interpreted, leaf
from te_lab.kernels import cpu_kernels
from te_lab.kernels.precision import TOLERANCES, error_budget
from te_lab.kernels.rope import ROPE, rope, rope_reference

BACKENDS = backend_params(ROPE)

BATCH, HEADS_Q = 3, 4


@dataclass(frozen=True)
class Case:
    layout: str
    interleaved: bool
    heads_k: int
    head_dim: int
    rotary_dim: int
    seq: int
    tables: str  # cos/sin shape: "seq" [seq, rotary_dim], "batch1" [1, seq, rotary_dim], "batch" [batch, ...]
    storage: str  # how q and k are laid out in memory: "contiguous", "hf_views", "fused_qkv"
    fp32_tables: bool  # cos/sin in float32 whatever q's dtype


# On the inductor backend each case is a compiled graph of its own (layout, interleaving and
# the rank of cos/sin key it), so four cases cover every axis at few compiles. Sizes differ
# from each other where they can: torch.compile unifies equal sizes and guards on it.
CASES = [
    # Llama/Mistral: GQA, q and k as Hugging Face makes them (a [batch, seq, heads, dim]
    # projection viewed as [batch, heads, seq, dim]), tables cast to q's dtype.
    pytest.param(Case("bhsd", False, 2, 16, 16, 5, "seq", "hf_views", False), id="llama-gqa-hf-views"),
    # GPT-J: interleaved pairs, partial rotary, MQA, per-sequence positions, fp32 tables.
    pytest.param(Case("bhsd", True, 1, 16, 8, 7, "batch", "contiguous", True), id="gptj-mqa-partial"),
    # GPT-NeoX/Phi: partial rotary over a rotary_dim and a pass-through that are not powers
    # of two, q and k sliced out of one fused qkv projection (strided, with gaps).
    pytest.param(Case("bshd", False, 2, 22, 12, 7, "batch1", "fused_qkv", True), id="neox-partial-fused-qkv"),
    # flash-attn's layout with interleaved pairs, as many k heads as q heads.
    pytest.param(Case("bshd", True, 4, 16, 16, 9, "batch", "contiguous", False), id="interleaved-bshd-mha"),
]


def _qk_shape(case, heads):
    if case.layout == "bhsd":
        return (BATCH, heads, case.seq, case.head_dim)
    return (BATCH, case.seq, heads, case.head_dim)


def _tables(case, dtype, seed=1):
    """cos/sin drawn at random, not from frequencies: every rotary dim gets its own values,
    so a kernel that mixes up the members of a pair or the positions cannot pass."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    lead = {"seq": (), "batch1": (1,), "batch": (BATCH,)}[case.tables]
    shape = (*lead, case.seq, case.rotary_dim)
    table_dtype = torch.float32 if case.fp32_tables else dtype
    return tuple((2 * torch.rand(shape, generator=generator) - 1).to(DEVICE, table_dtype) for _ in range(2))


def _sources(case, dtype):
    """The leaf tensors gradients are taken for, and a function making q and k from them."""
    torch.manual_seed(0)
    if case.storage == "fused_qkv":
        assert case.layout == "bshd"
        qkv = leaf(torch.randn(BATCH, case.seq, HEADS_Q + 2 * case.heads_k, case.head_dim, device=DEVICE, dtype=dtype))
        return (qkv,), lambda qkv: (qkv[:, :, :HEADS_Q], qkv[:, :, HEADS_Q:HEADS_Q + case.heads_k])
    if case.storage == "hf_views":
        assert case.layout == "bhsd"
        projections = [leaf(torch.randn(BATCH, case.seq, heads, case.head_dim, device=DEVICE, dtype=dtype))
                       for heads in (HEADS_Q, case.heads_k)]
        return tuple(projections), lambda q, k: (q.transpose(1, 2), k.transpose(1, 2))
    q = leaf(torch.randn(_qk_shape(case, HEADS_Q), device=DEVICE, dtype=dtype))
    k = leaf(torch.randn(_qk_shape(case, case.heads_k), device=DEVICE, dtype=dtype))
    return (q, k), lambda q, k: (q, k)


def _run(fn, case, sources, make_qk, cos, sin, **kwargs):
    """Both outputs and the gradients of the source tensors."""
    q, k = make_qk(*sources)
    outputs = fn(q, k, cos, sin, interleaved=case.interleaved, layout=case.layout, **kwargs)
    return tuple(outputs), grads_of(outputs, sources)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_reference(backend, dtype, case):
    sources, make_qk = _sources(case, dtype)
    cos, sin = _tables(case, dtype)
    outputs, grads = _run(rope, case, sources, make_qk, cos, sin, backend=backend)
    ref_outputs, ref_grads = _run(rope_reference, case, sources, make_qk, cos, sin)
    for out, x in zip(outputs, make_qk(*sources)):
        assert out.shape == x.shape and out.dtype == dtype
        # laid out like Hugging Face's transposed q and k (no transposing copy), else contiguous
        assert out.stride() == (x.stride() if case.storage == "hf_views" else x.contiguous().stride())
    for got, want in zip(outputs + grads, ref_outputs + ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, dtype, backend)


# ---- Hugging Face's code, copied, to pin down what the reference means ----

def _llama_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _llama_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_llama_rotate_half(q) * sin), (k * cos) + (_llama_rotate_half(k) * sin)


def _gptj_rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _gptj_apply_rotary_pos_emb(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (_gptj_rotate_every_two(tensor) * sin)


def _frequencies(position_ids, rotary_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    return position_ids[..., None].float() * inv_freq  # [batch, seq, rotary_dim / 2]


def test_reference_is_hugging_face_math():
    torch.manual_seed(4)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])  # the second sequence continues a cache
    batch, seq = position_ids.shape

    # Llama: rotate-half, [batch, heads, seq, head_dim], cos = cat(freqs, freqs).cos()
    q, k = torch.randn(batch, 4, seq, 16), torch.randn(batch, 2, seq, 16)
    freqs = _frequencies(position_ids, 16)
    emb = torch.cat((freqs, freqs), dim=-1)
    for got, want in zip(rope_reference(q, k, emb.cos(), emb.sin()),
                         _llama_apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    # GPT-J: interleaved pairs over the first rotary_dim dims, [batch, seq, heads, head_dim]
    rotary_dim = 8
    q, k = torch.randn(batch, seq, 4, 16), torch.randn(batch, seq, 2, 16)
    freqs = _frequencies(position_ids, rotary_dim)
    want = [torch.cat((_gptj_apply_rotary_pos_emb(x[..., :rotary_dim], freqs.sin(), freqs.cos()),
                       x[..., rotary_dim:]), dim=-1) for x in (q, k)]
    cos, sin = freqs.repeat_interleave(2, dim=-1).cos(), freqs.repeat_interleave(2, dim=-1).sin()
    got = rope_reference(q, k, cos, sin, interleaved=True, layout="bshd")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_gradcheck_float64(backend, interleaved):
    """Random tables (the two members of a pair with different sin) check that the
    backward is the exact transpose, not just a rotation by -sin. Under Triton's
    interpreter, where each launch takes long, fast mode checks random projections of
    the Jacobian instead of every entry."""
    torch.manual_seed(2)
    q = torch.randn(2, 3, 5, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 5, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    cos, sin = (torch.randn(2, 5, 4, device=DEVICE, dtype=torch.float64) for _ in range(2))

    def fn(q, k):
        return rope(q, k, cos, sin, interleaved=interleaved, backend=backend)

    # the values too, in float64's precision: gradcheck checks the backward against the
    # backend's own forward
    for got, want in zip(fn(q, k), rope_reference(q, k, cos, sin, interleaved=interleaved)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(fn, (q, k), fast_mode=interpreted(backend))


def _simple_inputs(batch=2, heads_q=4, heads_k=2, seq=5, head_dim=16):
    torch.manual_seed(3)
    q = leaf(torch.randn(batch, heads_q, seq, head_dim, device=DEVICE))
    k = leaf(torch.randn(batch, heads_k, seq, head_dim, device=DEVICE))
    cos, sin = (torch.rand(seq, head_dim, device=DEVICE) for _ in range(2))
    return q, k, cos, sin


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch.manual_seed(5)
    # projections [batch, seq, heads, head_dim], viewed as [batch, heads, seq, head_dim] as in HF
    q_proj = leaf(torch.randn(2, 5, 4, 16, device=DEVICE))
    k_proj = leaf(torch.randn(2, 5, 2, 16, device=DEVICE))
    cos, sin = (torch.rand(5, 16, device=DEVICE) for _ in range(2))
    q_weight, k_weight = torch.randn(2, 4, 5, 16, device=DEVICE), torch.randn(2, 2, 5, 16, device=DEVICE)

    def attention_input(rotate, q_proj, k_proj):
        q_out, k_out = rotate(q_proj.transpose(1, 2), k_proj.transpose(1, 2), cos, sin)
        return (q_out * q_weight).sum() + (k_out * k_weight).sum()

    def fused(q, k, cos, sin):
        return rope(q, k, cos, sin, backend=backend)

    explanation = torch._dynamo.explain(attention_input)(fused, q_proj, k_proj)
    assert explanation.graph_break_count == 0
    got = torch.compile(attention_input, fullgraph=True)(fused, q_proj, k_proj)
    got_grads = torch.autograd.grad(got, (q_proj, k_proj))
    want = attention_input(rope_reference, q_proj, k_proj)
    want_grads = torch.autograd.grad(want, (q_proj, k_proj))
    assert_close(got, want, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_heads_are_rotated_in_blocks(backend):
    # 40 query heads of 128 dims exceed one Triton tile, so the kernel loops over head blocks.
    q, k, cos, sin = _simple_inputs(heads_q=40, heads_k=8, seq=3, head_dim=128)
    got = rope(q.detach(), k.detach(), cos, sin, backend=backend)
    for g, w in zip(got, rope_reference(q.detach(), k.detach(), cos, sin)):
        assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_profiler_sees_the_fused_op_and_its_backward_once_each(backend):
    q, k, cos, sin = _simple_inputs()
    with torch.profiler.profile() as prof:
        q_out, k_out = rope(q, k, cos, sin, backend=backend)
        (q_out.sum() + k_out.sum()).backward()
    names = [event.name for event in prof.events()]
    assert names.count("te_lab::rope") == 1 and names.count("te_lab::rope_backward") == 1
    if backend == "cpp":  # an eager call crosses into C++ once; its backward runs there
        assert "RopeFunction" in q_out.grad_fn.name()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_k_output_still_gives_gradients(backend):
    q, k, cos, sin = _simple_inputs()
    q_out, _ = rope(q, k, cos, sin, backend=backend)
    q_out.sum().backward()
    ref_q = leaf(q)
    rope_reference(ref_q, k.detach(), cos, sin)[0].sum().backward()
    assert_close(q.grad, ref_q.grad)
    assert torch.count_nonzero(k.grad) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_cos_and_sin_are_constants(backend):
    q, k, cos, sin = _simple_inputs()
    cos, sin = leaf(cos), leaf(sin)
    q_out, k_out = rope(q, k, cos, sin, backend=backend)
    (q_out.sum() + k_out.sum()).backward()
    assert cos.grad is None and sin.grad is None
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_gives_empty_outputs(backend):
    q, k, cos, sin = _simple_inputs()
    q_out, k_out = rope(q[:0], k[:0], cos, sin, backend=backend)
    assert q_out.shape == (0, *q.shape[1:]) and k_out.shape == (0, *k.shape[1:])


def _bad(**changes):
    inputs = dict(q=torch.ones(2, 4, 5, 8), k=torch.ones(2, 2, 5, 8), cos=torch.ones(5, 8), sin=torch.ones(5, 8))
    inputs.update(changes)
    return inputs


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (_bad(k=torch.ones(2, 2, 5, 6)), ValueError, ["rope", "k", "(2, 2, 5, 6)", "head_dim 8"]),
        (_bad(k=torch.ones(2, 2, 6, 8)), ValueError, ["rope", "k", "(2, 2, 6, 8)", "seq 5"]),
        (_bad(k=torch.ones(3, 2, 5, 8)), ValueError, ["rope", "k", "(3, 2, 5, 8)", "batch 2"]),
        (_bad(q=torch.ones(4, 5, 8)), ValueError,
         ["rope", "q", "(4, 5, 8)", "4 dims", "[batch, heads, seq, head_dim]"]),
        (_bad(cos=torch.ones(5, 7), sin=torch.ones(5, 7)), ValueError, ["rope", "cos", "rotary_dim", "7", "even"]),
        (_bad(cos=torch.ones(5, 10), sin=torch.ones(5, 10)), ValueError, ["rope", "cos", "10", "head_dim 8"]),
        (_bad(cos=torch.ones(6, 8), sin=torch.ones(6, 8)), ValueError, ["rope", "cos", "(6, 8)", "seq 5"]),
        (_bad(cos=torch.ones(3, 5, 8), sin=torch.ones(3, 5, 8)), ValueError,
         ["rope", "cos", "(3, 5, 8)", "batch 1 or 2"]),
        (_bad(cos=torch.ones(1, 1, 5, 8), sin=torch.ones(1, 1, 5, 8)), ValueError,
         ["rope", "cos", "(1, 1, 5, 8)", "[seq, rotary_dim]"]),
        (_bad(sin=torch.ones(5, 6)), ValueError, ["rope", "sin", "(5, 6)", "(5, 8)"]),
        (_bad(k=torch.ones(2, 2, 5, 8, dtype=torch.float64)), TypeError, ["rope", "k", "float64", "float32"]),
        (_bad(sin=torch.ones(5, 8, dtype=torch.float16)), TypeError, ["rope", "sin", "float16", "float32"]),
        (_bad(q=torch.ones(2, 4, 5, 8, dtype=torch.int64)), TypeError, ["rope", "q", "int64"]),
        (_bad(q=[[1.0]]), TypeError, ["rope", "q", "list"]),
        (_bad(k=torch.ones(2, 2, 5, 8, device="meta")), ValueError, ["rope", "k", "meta", "cpu"]),
        (_bad(cos=torch.ones(5, 8, device="meta")), ValueError, ["rope", "cos", "meta", "cpu"]),
        (_bad(layout="sbhd"), ValueError, ["rope", "layout", "'sbhd'", "bhsd"]),
        (_bad(interleaved="yes"), TypeError, ["rope", "interleaved", "'yes'"]),
        (_bad(backend="native"), ValueError, ["rope", "'native'"]),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    with pytest.raises(error) as raised:
        rope(**kwargs)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason="te_lab's C++ kernels are not built")
def test_the_cpp_op_refuses_tables_off_the_cpu():
    """A direct call of the C++ overload (the public op checks devices before it) names
    the devices it got instead of reading another device's memory."""
    q, k, cos, sin = torch.ones(1, 2, 5, 8), torch.ones(1, 1, 5, 8), torch.ones(5, 8), torch.zeros(5, 8)
    with pytest.raises(ValueError, match="rope: q, k, cos and sin must be on the CPU, got cpu, cpu, meta and meta"):
        torch.ops.te_lab.rope.cpp(q, k, cos.to("meta"), sin.to("meta"), False, "bhsd", None, None, 1e-6, 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_and_strided_tables_give_the_reference(backend):
    """Tables broadcast over the batch with expand (stride 0) or sliced out of wider ones,
    already in float32: every backend reads their values, not the memory behind them."""
    q, k, cos, sin = _simple_inputs(batch=2, heads_q=4, heads_k=2, seq=5, head_dim=16)
    for make in (lambda t: t[None].expand(2, -1, -1), lambda t: torch.cat((t, t), -1)[..., ::2]):
        c, s = make(cos), make(sin)
        assert not c.is_contiguous()
        got = rope(q, k, c, s, backend=backend)
        want = rope_reference(q, k, c.contiguous(), s.contiguous())
        for g, w in zip(got, want):
            assert_close(g, w)


# ---- QK-norm (RMSNorm over each head) fused into the rotation --------------------------

def _qk_norm_sources(dtype, layout, head_dim=24, seq=6, seed=6):
    """q and k as a real checkpoint's projections give them (activations of ~1e3, two
    outlier channels of ~1e4; Hugging Face's transposed views in "bhsd"), and QK-norm
    weights around 1 with a few larger entries, as trained ones have."""
    generator = torch.Generator().manual_seed(seed)
    projections = []
    for heads in (HEADS_Q, 2):
        x = torch.randn(BATCH, seq, heads, head_dim, generator=generator) * 1e3
        x[..., 3] *= 10
        x[..., head_dim - 2] *= -8
        projections.append(x.to(DEVICE, dtype))
    weights = []
    for _ in range(2):
        w = 1 + 0.3 * torch.randn(head_dim, generator=generator)
        w[5] = 7.0
        weights.append(w.to(DEVICE, dtype))
    views = (lambda q, k: (q.transpose(1, 2), k.transpose(1, 2))) if layout == "bhsd" else (lambda q, k: (q, k))
    return projections, weights, views


def _qk_norm_run(fn, projections, weights, views, cos, sin, interleaved, layout, offset, **kwargs):
    """Both outputs and the gradients of q's and k's projections and of both norm weights."""
    leaves = [leaf(t) for t in (*projections, *weights)]
    q, k = views(*leaves[:2])
    outputs = fn(q, k, cos, sin, interleaved=interleaved, layout=layout, q_norm_weight=leaves[2],
                 k_norm_weight=leaves[3], norm_eps=1e-6, norm_weight_offset=offset, **kwargs)
    return tuple(outputs) + grads_of(outputs, leaves)


# Each case is two compiled graphs on the inductor backend: a few cover every axis.
QK_NORM_CASES = [
    # Qwen3: rotate-half over the whole head, HF's transposed views, in every dtype.
    *(pytest.param(dtype, "bhsd", False, 24, 0.0, id=f"qwen3-{dtype}") for dtype in DTYPES),
    # Gemma 3's (1 + weight), interleaved pairs, partial rotary, flash-attn's layout.
    pytest.param(torch.bfloat16, "bshd", True, 16, 1.0, id="gemma-offset-interleaved-partial-bf16"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, layout, interleaved, rotary_dim, offset", QK_NORM_CASES)
def test_qk_norm_is_as_close_to_the_float64_truth_as_the_unfused_math(backend, dtype, layout, interleaved, rotary_dim,
                                                                       offset):
    """Outputs and the gradients of q, k and both norm weights, at real-like magnitudes:
    each within the error budget of docs/design.md (twice the unfused reference's own
    error in this dtype, plus the dtype's tolerance at the true values' scale) from the
    reference run in float64."""
    projections, weights, views = _qk_norm_sources(dtype, layout)
    generator = torch.Generator().manual_seed(7)
    cos, sin = ((2 * torch.rand(6, rotary_dim, generator=generator) - 1).to(DEVICE) for _ in range(2))
    args = (cos, sin, interleaved, layout, offset)
    fused = _qk_norm_run(rope, projections, weights, views, *args, backend=backend)
    unfused = _qk_norm_run(rope_reference, projections, weights, views, *args)
    truth = _qk_norm_run(rope_reference, [t.double() for t in projections], [w.double() for w in weights],
                         views, cos.double(), sin.double(), interleaved, layout, offset)
    names = ("q_out", "k_out", "d q", "d k", "d q_norm_weight", "d k_norm_weight")
    for name, got, reference, want in zip(names, fused, unfused, truth):
        assert got.shape == want.shape and got.dtype == dtype
        error, reference_error = ((t.double() - want).abs().max().item() for t in (got, reference))
        budget = error_budget(reference_error, want.abs().max().item(), dtype)
        if dtype == torch.bfloat16 and interpreted(backend):
            budget += TOLERANCES[dtype]["atol"]  # the interpreter's truncating bf16 cast (see assert_close)
        assert error <= budget, f"{name}: {error:.3g} from float64, unfused {reference_error:.3g}, budget {budget:.3g}"
    for out, x in zip(fused[:2], views(*projections)):
        assert out.stride() == x.contiguous().stride() if layout == "bshd" else out.stride() == x.stride()


@pytest.mark.parametrize("backend", [pytest.param("reference", id="reference")] + BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_qk_norm_gradcheck_float64(backend, interleaved):
    """The backward, norm weights included, is the exact derivative of the forward
    (partial rotary, Gemma's weight offset, random tables)."""
    torch.manual_seed(8)
    q = torch.randn(2, 3, 5, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 5, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    q_weight, k_weight = (torch.randn(6, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cos, sin = (torch.randn(2, 5, 4, device=DEVICE, dtype=torch.float64) for _ in range(2))

    def fn(q, k, q_weight, k_weight, rotate=rope, **kwargs):
        return rotate(q, k, cos, sin, interleaved=interleaved, q_norm_weight=q_weight, k_norm_weight=k_weight,
                      norm_eps=1e-5, norm_weight_offset=0.5, **kwargs)

    inputs = (q, k, q_weight, k_weight)
    for got, want in zip(fn(*inputs, backend=backend), fn(*inputs, rotate=rope_reference)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *xs: fn(*xs, backend=backend), inputs, fast_mode=interpreted(backend))


@pytest.mark.parametrize("family, offset", [("qwen3", 0.0), ("gemma3", 1.0)])
def test_qk_norm_reference_is_hugging_face_math(family, offset):
    """The reference with norm weights is the family's own q/k RMSNorm followed by its
    apply_rotary_pos_emb, exactly, in float32."""
    modeling = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    norm_class = getattr(modeling, f"{family.capitalize()}RMSNorm")
    torch.manual_seed(9)
    q, k = torch.randn(2, 4, 5, 16) * 1e3, torch.randn(2, 2, 5, 16) * 1e3
    emb = _frequencies(torch.arange(5)[None], 16)
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()
    norms = []
    for _ in range(2):
        norm = norm_class(16, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16))
        norms.append(norm)
    want = modeling.apply_rotary_pos_emb(norms[0](q), norms[1](k), cos, sin)
    got = rope_reference(q, k, cos, sin, q_norm_weight=norms[0].weight, k_norm_weight=norms[1].weight,
                                 norm_eps=1e-6, norm_weight_offset=offset)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize(
    "changes, error, words",
    [
        (dict(q_norm_weight=torch.ones(8)), ValueError, ["rope", "q_norm_weight and k_norm_weight", "only q"]),
        (dict(q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(6)), ValueError,
         ["rope", "k_norm_weight", "(6,)", "(8,)", "head_dim"]),
        (dict(q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8), norm_eps=0.0), ValueError,
         ["rope", "norm_eps", "positive"]),
        (dict(q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8), norm_weight_offset="1"), TypeError,
         ["rope", "norm_weight_offset", "'1'"]),
    ],
)
def test_bad_qk_norm_arguments_name_the_argument(changes, error, words):
    with pytest.raises(error) as raised:
        rope(**_bad(), **changes)
    for word in words:
        assert word in str(raised.value)


def test_apply_rotary_is_a_deprecated_alias_of_rope():
    from te_lab import kernels

    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    for old, new in ((kernels.apply_rotary, rope), (kernels.apply_rotary_reference, rope_reference)):
        renamed = f"te_lab.kernels.{old.__name__} is now te_lab.kernels.{new.__name__}"
        with pytest.warns(DeprecationWarning, match=renamed):
            got = old(q, k, cos, sin)
        torch.testing.assert_close(got, new(q, k, cos, sin), rtol=0, atol=0)
