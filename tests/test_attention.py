"""Attention: every backend against the explicit softmax formula.

Shapes stay small (seq <= 70, a few heads): under Triton's interpreter every block
of every program runs in numpy. They still cover several query and key blocks, partial
blocks, and head dims that are not powers of two.
"""

import contextlib
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, DTYPES, TOLERANCES, assert_close, backend_params, fused_backends, interpreted, leaf
from te_lab.kernels import registry, use_backend
from te_lab.kernels.attention import ATTENTION, attention, attention_reference

# the module, not the function of the same name that te_lab.kernels exports
attention_module = importlib.import_module("te_lab.kernels.attention")

BACKENDS = backend_params(ATTENTION)
TRITON = [param for param in BACKENDS if param.values[0] == "triton"]

# dQ, dK and dV sum over whole rows of keys or queries. The fused kernels (SDPA's CPU
# flash kernel as much as te_lab's Triton ones, as FlashAttention does) round P and dS to
# the input dtype before their matmuls, where the reference keeps float32 until a single
# final rounding; in float16 that alone exceeds the 1e-3 tolerance at seq 70 (measured
# for SDPA too). So half-precision gradients must instead be as accurate as the
# reference: within ACCURACY_FACTOR times its error from the float64 result, plus atol,
# the way FlashAttention's tests and test_bias_act.py judge fused kernels.
ACCURACY_FACTOR = 2
HALF_DTYPES = (torch.float16, torch.bfloat16)

# (batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, mask kind)
# mask kinds: "pad-add"/"pad-bool" are [batch, 1, 1, seq_k] padding masks (the last keys
# of the first sequence masked), "full-add" a float32 [batch, heads_q, seq_q, seq_k] bias,
# "full-bool" a [1, 1, seq_q, seq_k] boolean pattern.
CASES = [
    pytest.param(1, 2, 2, 70, 70, 64, True, None, id="causal-two-blocks"),
    pytest.param(1, 2, 2, 37, 37, 32, False, None, id="non-causal-odd-length"),
    pytest.param(1, 4, 2, 45, 45, 64, True, "pad-add", id="gqa-4-2-causal-padding-additive"),
    pytest.param(2, 4, 1, 33, 33, 16, False, "pad-bool", id="mqa-4-1-padding-boolean"),
    pytest.param(1, 2, 1, 5, 70, 32, False, "full-add", id="seq-q-5-seq-k-70-full-additive"),
    pytest.param(1, 2, 2, 70, 23, 16, False, "full-bool", id="seq-q-70-seq-k-23-full-boolean"),
    pytest.param(1, 2, 2, 41, 41, 80, True, "full-bool", id="head-dim-80-causal-boolean"),
    pytest.param(1, 2, 1, 20, 33, 128, False, "pad-add", id="head-dim-128-gqa-padding-additive"),
    pytest.param(1, 1, 1, 1, 1, 64, True, None, id="single-token"),
]


def _mask(kind, batch, heads_q, seq_q, seq_k, dtype, generator):
    if kind is None:
        return None
    if kind.startswith("pad"):
        keep = torch.ones(batch, 1, 1, seq_k, dtype=torch.bool)
        keep[0, ..., -(seq_k // 4):] = False  # every query keeps its first key: no empty row
        return keep.to(DEVICE) if kind == "pad-bool" else torch.zeros(keep.shape).masked_fill(~keep, -math.inf).to(
            DEVICE, dtype)
    if kind == "full-add":
        return torch.randn(batch, heads_q, seq_q, seq_k, generator=generator).to(DEVICE)
    keep = torch.rand(1, 1, seq_q, seq_k, generator=generator) > 0.3
    keep[..., 0] = True
    return keep.to(DEVICE)


def _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, mask_kind, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=generator).to(DEVICE, dtype)
    k = torch.randn(batch, heads_kv, seq_k, head_dim, generator=generator).to(DEVICE, dtype)
    v = torch.randn(batch, heads_kv, seq_k, head_dim, generator=generator).to(DEVICE, dtype)
    return q, k, v, _mask(mask_kind, batch, heads_q, seq_q, seq_k, dtype, generator)


def _run(fn, q, k, v, upstream_dtype=None, **kwargs):
    """The output and the gradients of q, k and v for an upstream gradient drawn in
    ``upstream_dtype`` (the output's by default): the same numbers on every run, also
    when a float64 run checks a half-precision one."""
    q, k, v = (leaf(t) for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    generator = torch.Generator().manual_seed(0)
    upstream = torch.randn(out.shape, generator=generator).to(upstream_dtype or out.dtype).to(out.device, out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), upstream))


def _assert_as_accurate(got, want, exact, dtype, backend):
    """No further from the float64 result than ACCURACY_FACTOR times the reference's own
    error, plus the dtype's atol (twice it for bf16 under the interpreter, see conftest)."""
    atol = TOLERANCES[dtype]["atol"] * (2 if dtype == torch.bfloat16 and interpreted(backend) else 1)
    got_error = (got.double() - exact).abs().max().item()
    want_error = (want.double() - exact).abs().max().item()
    assert got_error <= ACCURACY_FACTOR * want_error + atol, (
        f"{got_error=:.3g} from the float64 result; the {dtype} reference's is {want_error:.3g}")


def _explicit(q, k, v, causal, mask, scale, sinks=None, softcap=None):
    """The formula written out once more, in float64, independently of te_lab; with
    gpt-oss's sinks (one more softmax column whose value is zero) and Gemma 2's capped
    scores where given."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores + (mask.double() if mask.is_floating_point()
                           else torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf))
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(seq_q, seq_k, dtype=torch.bool).triu(1), -math.inf)
    if sinks is not None:
        column = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.cat((scores, column), -1).softmax(-1)[..., :-1] @ v
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("mask_kind", [None, "pad-add", "full-bool"])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_the_explicit_formula_and_agrees_with_sdpa(causal, mask_kind):
    q, k, v, mask = _inputs(2, 4, 2, 19, 19, 8, mask_kind, torch.float64)
    scale = 0.3
    got = attention_reference(q, k, v, causal=causal, mask=mask, scale=scale)
    torch.testing.assert_close(got, _explicit(q, k, v, causal, mask, scale), rtol=1e-12, atol=1e-12)
    # SDPA's math path: top-left causal alignment and repeat_interleave head grouping
    if causal and mask is not None:
        mask = mask.masked_fill(~torch.ones(19, 19, dtype=torch.bool).tril(), -math.inf) \
            if mask.is_floating_point() else mask & torch.ones(19, 19, dtype=torch.bool).tril()
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask,
                                          is_causal=causal and mask is None, scale=scale)
    torch.testing.assert_close(got, sdpa, rtol=1e-10, atol=1e-10)


def test_reference_default_scale_and_half_precision_compute():
    q, k, v, _ = _inputs(1, 2, 2, 9, 9, 16, None, torch.bfloat16)
    got = attention_reference(q, k, v)
    assert got.dtype == torch.bfloat16
    want = _explicit(q, k, v, False, None, 1 / math.sqrt(16))
    assert_close(got, want.to(torch.bfloat16))


@pytest.mark.parametrize("batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, mask_kind", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_gradients_match_reference(backend, dtype, batch, heads_q, heads_kv, seq_q, seq_k, head_dim,
                                               causal, mask_kind):
    q, k, v, mask = _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, mask_kind, dtype)
    got = _run(attention, q, k, v, causal=causal, mask=mask, backend=backend)
    want = _run(attention_reference, q, k, v, causal=causal, mask=mask)
    exact = _run(attention_reference, q.double(), k.double(), v.double(), dtype, causal=causal, mask=mask)
    for name, g, w, e in zip(("out", "dq", "dk", "dv"), got, want, exact):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name != "out" and dtype in HALF_DTYPES:
            _assert_as_accurate(g, w, e, dtype, backend)
        else:
            assert_close(g, w, dtype, backend)


@contextlib.contextmanager
def _exact_bf16_dot_in_the_interpreter():
    """Triton's interpreter keeps bf16 as its uint16 bit pattern and tl.dot multiplies those
    as integers; widening them to float32 first (exact: bf16 is float32's upper half) gives
    what a GPU's bf16 tensor cores compute, float32 products accumulated in float32."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    integer_dot = builder.create_dot

    def widened(operand):
        if operand.dtype.scalar.name != "bf16":
            return operand
        as_float32 = (operand.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(as_float32, interpreter.tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return integer_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = integer_dot


@pytest.mark.triton_interpreter
@pytest.mark.skipif(not TRITON or not interpreted("triton"), reason="needs the triton backend through the interpreter")
@pytest.mark.parametrize("batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, mask_kind", [CASES[2], CASES[7]])
def test_bf16_tensor_core_branch(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, mask_kind):
    """What GPUs run for bf16: q, k, v and the rounded P and dS fed to tl.dot in bf16 (the
    interpreter otherwise gets float32 operands, see _dot_dtype), launched as a GPU would
    launch them and computed as its tensor cores would."""
    from te_lab.gpu_checks.kernel_launches import recording_launches

    q, k, v, mask = _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, mask_kind, torch.bfloat16)
    with _exact_bf16_dot_in_the_interpreter(), recording_launches(execute=True) as log:
        got = _run(attention, q, k, v, causal=causal, mask=mask, backend="triton")
    dot_dtypes = {record["kernel"].split(":")[1]: record["arguments"]["DOT"]["name"]
                  for record in log.records.values() if "DOT" in record["arguments"]}
    assert dot_dtypes == {name: "bf16" for name in ("_attention_forward_kernel", "_attention_dkdv_kernel",
                                                    "_attention_dq_kernel")}
    want = _run(attention_reference, q, k, v, causal=causal, mask=mask)
    exact = _run(attention_reference, q.double(), k.double(), v.double(), torch.bfloat16, causal=causal, mask=mask)
    assert_close(got[0], want[0], torch.bfloat16, "triton")
    for g, w, e in zip(got[1:], want[1:], exact[1:]):
        _assert_as_accurate(g, w, e, torch.bfloat16, "triton")


@pytest.mark.triton_interpreter
@pytest.mark.skipif(not TRITON or not interpreted("triton"), reason="needs the triton backend through the interpreter")
def test_float32_dots_follow_torch_matmul_precision():
    """As SDPA's kernels on GPUs: float32 attention multiplies in TF32 where torch's float32
    matmul precision allows it and in IEEE float32 otherwise; bf16 is exact either way."""
    from te_lab.gpu_checks.kernel_launches import recording_launches
    from te_lab.gpu_checks.kernel_scenarios import tf32_float32_matmuls

    def precisions(dtype):
        q, k, v, _ = _inputs(1, 2, 2, 16, 16, 32, None, dtype)
        with recording_launches() as log:  # launches recorded, not run: only their arguments matter
            _run(attention, q, k, v, causal=True, backend="triton")
        return {record["arguments"]["PRECISION"]["value"]
                for record in log.records.values() if "PRECISION" in record["arguments"]}

    assert precisions(torch.float32) == {"ieee"}
    with tf32_float32_matmuls():
        assert precisions(torch.float32) == {"tf32"}
        assert precisions(torch.bfloat16) == {"ieee"}
    assert precisions(torch.float32) == {"ieee"}


@pytest.mark.triton_interpreter
@pytest.mark.skipif(not TRITON or not interpreted("triton"), reason="needs the triton backend through the interpreter")
def test_tf32_launches_compute_the_same_attention():
    """The TF32 launches (dK/dV over 16 keys per program) give the formula's numbers where the
    interpreter multiplies in float32, causal and GQA included."""
    from te_lab.gpu_checks.kernel_scenarios import tf32_float32_matmuls

    q, k, v, mask = _inputs(1, 4, 2, 45, 45, 64, "pad-add", torch.float32)
    with tf32_float32_matmuls():
        got = _run(attention, q, k, v, causal=True, mask=mask, backend="triton")
    want = _run(attention_reference, q, k, v, causal=True, mask=mask)
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32, "triton")


@pytest.mark.triton_interpreter
@pytest.mark.skipif(not TRITON or not interpreted("triton"), reason="needs the triton backend through the interpreter")
@pytest.mark.parametrize("dtype, head_dim, causal, blocks", [
    # float32 IEEE at head_dim 64 without causality or a mask: dK/dV owns 16 keys, dQ walks 16
    (torch.float32, 64, False, {"_attention_dkdv_kernel": (32, 16), "_attention_dq_kernel": (32, 16)}),
    # half precision at head_dim 256: dQ owns 16 queries, dK/dV 16 keys
    (torch.float16, 256, True, {"_attention_dkdv_kernel": (32, 16), "_attention_dq_kernel": (16, 32)}),
    (torch.bfloat16, 256, False, {"_attention_dkdv_kernel": (32, 16), "_attention_dq_kernel": (16, 32)}),
], ids=["fp32-head-dim-64", "fp16-head-dim-256-causal", "bf16-head-dim-256"])
def test_retiled_backward_launches_compute_the_same_attention(dtype, head_dim, causal, blocks):
    """The backward blocks chosen where 32 spilled on sm_80/sm_90 (see _backward_blocks) are
    the ones launched, and give the formula's numbers over partial blocks and GQA."""
    from te_lab.gpu_checks.kernel_launches import recording_launches

    q, k, v, _ = _inputs(1, 4, 2, 45, 45, head_dim, None, dtype)
    # launched as on a GPU: bf16 operands reach tl.dot, multiplied as tensor cores would
    with _exact_bf16_dot_in_the_interpreter(), recording_launches(execute=True) as log:
        got = _run(attention, q, k, v, causal=causal, backend="triton")
    launched = {record["kernel"].split(":")[1]: (record["arguments"]["BLOCK_M"]["value"],
                                                 record["arguments"]["BLOCK_N"]["value"])
                for record in log.records.values() if record["kernel"].split(":")[1] in blocks}
    assert launched == blocks
    want = _run(attention_reference, q, k, v, causal=causal)
    exact = _run(attention_reference, q.double(), k.double(), v.double(), dtype, causal=causal)
    assert_close(got[0], want[0], dtype, "triton")
    for g, w, e in zip(got[1:], want[1:], exact[1:]):
        if dtype in HALF_DTYPES:
            _assert_as_accurate(g, w, e, dtype, "triton")
        else:
            assert_close(g, w, dtype, "triton")


@pytest.mark.parametrize("path", [
    # what CUDA and MUSA run: SDPA with its own autograd
    pytest.param(dict(_cpu_flash=lambda device_type: False), id="sdpa-autograd"),
    # torch < 2.9: the CPU flash kernel needs as many key/value heads as query heads
    pytest.param(dict(_CPU_FLASH_TAKES_GQA=False), id="cpu-flash-repeated-kv-heads"),
])
@pytest.mark.parametrize("mask_kind", ["pad-bool", "full-add"])
def test_native_paths_of_other_devices_and_older_torch(monkeypatch, path, mask_kind):
    for name, value in path.items():
        monkeypatch.setattr(attention_module, name, value)
    q, k, v, mask = _inputs(2, 4, 2, 21, 21, 16, mask_kind, torch.float32)
    got = _run(attention, q, k, v, causal=True, mask=mask, backend="native")
    want = _run(attention_reference, q, k, v, causal=True, mask=mask)
    for g, w in zip(got, want):
        assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_expanded_upstream_gradient(backend):
    """[batch, seq, heads, head_dim] tensors transposed to SDPA's layout (what model code
    passes), and ``.sum().backward()``, whose upstream gradient has stride 0."""
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 29, 4, 32, generator=generator).to(DEVICE).transpose(1, 2) for _ in range(3))
    results = []
    for fn, kwargs in ((attention, dict(backend=backend)), (attention_reference, {})):
        leaves = [leaf(t) for t in (q, k, v)]  # clone keeps the transposed strides
        assert not leaves[0].is_contiguous()
        out = fn(*leaves, causal=True, **kwargs)
        out.sum().backward()
        results.append([out] + [t.grad for t in leaves])
    for got, want in zip(*results):
        assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_rows_with_nothing_to_attend_give_zeros(backend):
    """SDPA's convention: a fully masked row outputs zeros and passes no gradient (the
    explicit formula gives NaN there); the other rows are untouched."""
    q, k, v, _ = _inputs(1, 2, 1, 20, 20, 16, None, torch.float32)
    keep = torch.ones(1, 1, 20, 20, dtype=torch.bool, device=DEVICE)
    keep[..., 3, :] = False
    out, dq, dk, dv = _run(attention, q, k, v, mask=keep, backend=backend)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.equal(dq[:, :, 3], torch.zeros_like(dq[:, :, 3]))
    assert all(torch.isfinite(grad).all() for grad in (dq, dk, dv))
    want = attention_reference(q, k, v, mask=keep)
    rows = [row for row in range(20) if row != 3]
    assert_close(out[:, :, rows], want[:, :, rows])


def test_mask_takes_no_gradient():
    q, k, v, mask = _inputs(1, 2, 2, 8, 8, 16, "full-add", torch.float32)
    mask.requires_grad_(True)
    q = leaf(q)
    attention(q, k, v, mask=mask).sum().backward()
    assert q.grad is not None and mask.grad is None


# not triton: Triton 3.2's tl.dot has no float64, and the triton backend refuses it (tested below)
@pytest.mark.parametrize("backend", ["reference"] + [name for name in fused_backends(ATTENTION) if name != "triton"])
def test_gradcheck_float64(backend):
    q, k, v, mask = _inputs(1, 2, 1, 3, 4, 4, "full-add", torch.float64, seed=5)
    inputs = [leaf(t) for t in (q, k, v)]
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v: attention(q, k, v, causal=causal, mask=mask, backend=backend), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    q, k, v, mask = _inputs(2, 4, 2, 24, 24, 16, "pad-bool", torch.float32, seed=6)
    q, k, v = (leaf(t) for t in (q, k, v))

    def block(q, k, v, mask):
        return (attention(q, k, v, causal=True, mask=mask, backend=backend) * 2).sum()

    explanation = torch._dynamo.explain(block)(q, k, v, mask)
    assert explanation.graph_break_count == 0
    got = torch.compile(block, fullgraph=True)(q, k, v, mask)
    got_grads = torch.autograd.grad(got, (q, k, v))
    want = (attention_reference(q, k, v, causal=True, mask=mask) * 2).sum()
    want_grads = torch.autograd.grad(want, (q, k, v))
    assert_close(got, want, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w)


@pytest.mark.parametrize("backend", [param for param in BACKENDS if param.values[0] != "reference"])
def test_custom_ops_pass_opcheck(backend):
    """Schema, autograd registration, and fake outputs whose shapes and strides equal the
    real ones (Inductor asserts them), for the op and its backward."""
    q, k, v, mask = _inputs(2, 4, 2, 19, 19, 16, "pad-bool", torch.float32)
    q, k, v = (leaf(t) for t in (q, k, v))
    sinks = leaf(torch.randn(4, device=DEVICE))
    for with_sinks in (None, sinks):
        torch.library.opcheck(torch.ops.te_lab.attention, (q, k, v, mask, with_sinks, True, 0.25, backend))
    q, k, v, sinks = (t.detach() for t in (q, k, v, sinks))  # the backward op has no backward of its own
    for with_sinks in (None, sinks):
        out, lse = torch.ops.te_lab.attention(q, k, v, mask, with_sinks, True, 0.25, backend)
        torch.library.opcheck(torch.ops.te_lab.attention_backward,
                              (torch.randn_like(out), q, k, v, mask, with_sinks, out, lse, True, 0.25, backend))


def test_output_layout_makes_merging_heads_free():
    q, k, v, _ = _inputs(2, 4, 4, 9, 9, 16, None, torch.float32)
    out = attention(q, k, v)
    merged = out.transpose(1, 2).reshape(2, 9, 4 * 16)
    assert merged.data_ptr() == out.data_ptr() and merged.is_contiguous()


def test_profiler_sees_the_fused_op_and_its_backward():
    q, k, v, _ = _inputs(1, 2, 2, 16, 16, 16, None, torch.float32)
    q, k, v = (leaf(t) for t in (q, k, v))
    with torch.profiler.profile() as prof:
        attention(q, k, v, causal=True, backend=fused_backends(ATTENTION)[0]).sum().backward()
    names = {event.name for event in prof.events()}
    assert {"te_lab::attention", "te_lab::attention_backward"} <= names


def test_automatic_choice_on_the_cpu_is_sdpa():
    assert registry.select_backend(ATTENTION, torch.device("cpu")) == "native"


def test_dropout_runs_on_native_when_chosen_automatically():
    q, k, v, _ = _inputs(1, 2, 2, 32, 32, 16, None, torch.float32)
    v = leaf(v)
    torch.manual_seed(7)
    dropped = attention(q, k, v, dropout_p=0.5)
    plain = attention(q, k, v)
    assert not torch.allclose(dropped, plain)  # dropout was applied, not dropped
    dropped.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


def test_calls_an_automatic_triton_refuses_go_to_native(monkeypatch):
    """On a GPU auto-selection picks triton; a call its kernels refuse (dropout, float64,
    heads too wide) goes to native instead of failing."""
    monkeypatch.setattr(registry, "_automatic_backend", lambda op, device: "triton")
    monkeypatch.setattr(registry, "_automatic_order", lambda op, device: ("triton", "native", "inductor", "reference"))

    def chosen(q, dropout_p, sinks, softcap):
        return registry.choose(ATTENTION, attention_module._call(q, dropout_p, sinks, softcap, None))[0]

    q = torch.zeros(1, 1, 1, 16)
    assert chosen(q, 0.1, None, None) == "native"
    assert chosen(q.double(), 0.0, None, None) == "native"
    assert chosen(torch.zeros(1, 1, 1, 160), 0.0, None, None) == "native"
    assert chosen(q, 0.0, None, None) == "triton"
    # Soft-capping has no fused kernel; sinks with dropout need the log-sum-exp SDPA does not give.
    assert chosen(q, 0.0, None, 30.0) == "reference"
    assert chosen(q, 0.1, torch.zeros(1), None) == "reference"


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize(
    "kwargs, dtype, head_dim, words",
    [
        (dict(dropout_p=0.1), torch.float32, 16, ["attention", "triton", "dropout_p=0.1", "expected 0.0"]),
        (dict(), torch.float64, 16, ["attention", "triton", "float64", "float32, float16 or bfloat16"]),
        (dict(), torch.float16, 264, ["attention", "triton", "head_dim 264", "at most 256"]),
        (dict(), torch.float32, 160, ["attention", "triton", "head_dim 160", "at most 128 for torch.float32"]),
    ],
)
def test_triton_refuses_what_it_does_not_compute(backend, kwargs, dtype, head_dim, words):
    q = torch.zeros(1, 1, 4, head_dim, device=DEVICE, dtype=dtype)
    for force in (lambda: attention(q, q, q, backend=backend, **kwargs),
                  lambda: _in_context(backend, lambda: attention(q, q, q, **kwargs))):
        with pytest.raises(ValueError) as raised:
            force()
        for word in words:
            assert word in str(raised.value)


def _in_context(backend, fn):
    with use_backend(attention=backend):
        return fn()


def _bad(**overrides):
    """attention's arguments with some replaced: q [2, 4, 8, 16], k/v [2, 2, 8, 16]."""
    arguments = dict(q=torch.ones(2, 4, 8, 16), k=torch.ones(2, 2, 8, 16), v=torch.ones(2, 2, 8, 16))
    arguments.update(overrides)
    return arguments


@pytest.mark.parametrize(
    "arguments, error, words",
    [
        (_bad(k=torch.ones(2, 3, 8, 16), v=torch.ones(2, 3, 8, 16)), ValueError, ["attention", "3 heads", "4 heads"]),
        (_bad(k=torch.ones(2, 2, 8, 32), v=torch.ones(2, 2, 8, 32)), ValueError,
         ["attention", "k", "(2, 2, 8, 32)", "16"]),
        (_bad(v=torch.ones(2, 2, 8, 8)), ValueError, ["attention", "v", "(2, 2, 8, 8)", "(2, 2, 8, 16)"]),
        (_bad(q=torch.ones(4, 8, 16)), ValueError, ["attention", "q", "(4, 8, 16)", "4 dimensions"]),
        (_bad(k=torch.ones(3, 2, 8, 16), v=torch.ones(3, 2, 8, 16)), ValueError, ["attention", "k", "batch"]),
        (_bad(mask=torch.ones(2, 1, 8, 7)), ValueError, ["attention", "mask", "(2, 1, 8, 7)", "[2, 4, 8, 8]"]),
        (_bad(mask=torch.ones(3, 8, 8)), ValueError, ["attention", "mask", "(3, 8, 8)", "broadcastable"]),
        (_bad(mask=torch.ones(1, 8, dtype=torch.int64)), TypeError, ["attention", "mask", "int64", "torch.bool"]),
        (_bad(mask=torch.ones(1, 8, device="meta")), ValueError, ["attention", "mask", "meta"]),
        (_bad(v=torch.ones(2, 2, 8, 16, dtype=torch.float64)), TypeError, ["attention", "v", "float64", "float32"]),
        (_bad(k=torch.ones(2, 2, 8, 16, device="meta")), ValueError, ["attention", "k", "meta", "cpu"]),
        (_bad(q=torch.ones(2, 4, 8, 16, dtype=torch.int32)), TypeError, ["attention", "q", "int32"]),
        (_bad(dropout_p=1.0), ValueError, ["attention", "dropout_p", "1.0", "[0, 1)"]),
        (_bad(scale=-1.0), ValueError, ["attention", "scale", "-1.0", "positive"]),
        (_bad(causal=1), TypeError, ["attention", "causal", "bool"]),
        (_bad(backend="flash"), ValueError, ["attention", "backend", "'flash'"]),
        (_bad(sinks=torch.zeros(2)), ValueError, ["attention", "sinks", "(2,)", "[4]", "per query head"]),
        (_bad(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, ["attention", "sinks", "int64"]),
        (_bad(softcap=0.0), ValueError, ["attention", "softcap", "0.0", "positive"]),
        (_bad(softcap=30.0, backend="native"), ValueError, ["attention", "'native'", "soft-capping"]),
    ],
)
def test_bad_input_names_the_argument(arguments, error, words):
    with pytest.raises(error) as raised:
        attention(**arguments)
    for word in words:
        assert word in str(raised.value)


# ---- attention sinks and logit soft-capping ----


def _run_with_sinks(fn, q, k, v, sinks, **kwargs):
    q, k, v, sinks = (leaf(t) for t in (q, k, v, sinks))
    out = fn(q, k, v, sinks=sinks, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device, out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v, sinks), upstream))


@pytest.mark.parametrize("mask_kind", [None, "pad-add", "full-bool"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_sinks_match_the_formula_with_a_sink_column(backend, mask_kind):
    """Sinks of real scale (gpt-oss's are O(1) logits against scores of a few units):
    the output and the gradients of q, k, v and the sinks, on every backend."""
    q, k, v, mask = _inputs(2, 4, 2, 23, 23, 16, mask_kind, torch.float32)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE)
    got = _run_with_sinks(lambda *a, **kw: attention(*a, **kw, backend=backend), q, k, v, sinks,
                          causal=True, mask=mask, scale=0.3)
    want = _run_with_sinks(attention_reference, q, k, v, sinks, causal=True, mask=mask, scale=0.3)
    exact = _explicit(q, k, v, True, mask, 0.3, sinks, None)
    torch.testing.assert_close(want[0].double(), exact, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        # dsinks sums over every query row of the batch (46 per head): the scale-wise 1e-4 of docs/design.md
        assert_close(g, w, **(dict(rtol=1e-4, atol=1e-4) if name == "dsinks" else {})), name


def test_sinks_shrink_every_row_and_a_very_negative_sink_changes_nothing():
    q, k, v, _ = _inputs(1, 2, 2, 9, 9, 16, None, torch.float32)
    plain = attention(q, k, v, causal=True)
    assert_close(attention(q, k, v, causal=True, sinks=torch.full((2,), -1e4)), plain)
    sunk = attention(q, k, v, causal=True, sinks=torch.full((2,), 3.0))
    # The sink takes part of every row's probability mass and gives it to a zero value.
    assert (sunk.norm(dim=-1) < plain.norm(dim=-1)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_capped_attention_is_the_capped_formula(backend):
    """Scores of up to ~60 capped at 20: the cap changes the result, and every backend
    computes it (the fused ones through the reference when chosen automatically)."""
    q, k, v, mask = _inputs(1, 4, 2, 17, 17, 16, "pad-add", torch.float32)
    q = q * 4
    exact = _explicit(q, k, v, True, mask, 0.5, None, 20.0)
    uncapped = _explicit(q, k, v, True, mask, 0.5, None, None)
    assert (exact - uncapped).abs().max() > 0.1
    if backend == "reference":
        got = attention(q, k, v, causal=True, mask=mask, scale=0.5, softcap=20.0, backend=backend)
    else:
        with pytest.raises(ValueError, match="soft-capping"):
            attention(q, k, v, causal=True, mask=mask, scale=0.5, softcap=20.0, backend=backend)
        got = attention(q, k, v, causal=True, mask=mask, scale=0.5, softcap=20.0)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
