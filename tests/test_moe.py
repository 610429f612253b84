"""The Mixture-of-Experts op: routing variants, every backend's experts against the
reference (outputs and the gradients of x, the router logits, the expert weights and
biases), gpt-oss's clamped SwiGLU with its clamps active, autocast, torch.compile and the
errors. The blocks of real model families are fused in tests/test_fuse_moe.py."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, TOLERANCES, backend_params, interpreted
from te_lab.kernels.moe import (
    MOE,
    moe,
    moe_experts,
    moe_experts_reference,
    moe_reference,
    moe_routing,
)

BACKENDS = backend_params(MOE)
# Tokens, hidden, expert width, experts, top-k: nothing a power of two, one expert left
# without tokens by the routing below (see _case).
T, H, W, E, K = 37, 24, 10, 6, 2

# (name, transposed, interleaved, activation, biases): Mixtral / Qwen3-MoE / OLMoE's layout,
# gpt-oss's, and GeGLU experts with interleaved halves.
LAYOUTS = {
    "linear-silu": (False, False, "silu", False),
    "gpt-oss": (True, True, "clamped_swiglu", True),
    "linear-interleaved-gelu_tanh": (False, True, "gelu_tanh", True),
}
# gpt-oss's clamp at a limit the pre-activations cross on both sides.
LIMIT, ALPHA = 0.8, 1.702


def _case(dtype, layout, seed=0, experts=E):
    """Leaf tensors: x, router logits, gate_up, down and the biases (or None)."""
    transposed, _, _, biases = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(DEVICE, dtype)

    e = experts
    logits = randn(T, e)
    logits[:, e - 1] -= 100  # the last expert never wins: an empty slice in every pass
    gate_up = randn(e, H, 2 * W, scale=H ** -0.5) if transposed else randn(e, 2 * W, H, scale=H ** -0.5)
    down = randn(e, W, H, scale=W ** -0.5) if transposed else randn(e, H, W, scale=W ** -0.5)
    tensors = [randn(T, H), logits, gate_up, down]
    tensors += [randn(e, 2 * W, scale=0.3), randn(e, H, scale=0.3)] if biases else [None, None]
    return [None if t is None else t.requires_grad_() for t in tensors]


def _run(fn, tensors, layout, **kwargs):
    """The output and the gradients of every given tensor under a fixed upstream gradient."""
    x, logits, gate_up, down, gate_up_bias, down_bias = tensors
    transposed, interleaved, activation, _ = LAYOUTS[layout]
    out = fn(x, logits, gate_up, down, K, "softmax_topk", True, gate_up_bias, down_bias, transposed=transposed,
             interleaved=interleaved, activation=activation, alpha=ALPHA, limit=LIMIT, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, out.dtype)
    given = [t for t in tensors if t is not None]
    return [out, *torch.autograd.grad((out.float() * upstream.float()).sum(), given)]


def assert_normwise(actual, expected, dtype, backend=None):
    """|a - b| within the dtype's tolerance against the tensor's scale: gradients sum over
    tokens (and expert weights' over each expert's tokens), so an element whose terms cancel
    carries the rounding of the whole sum (the probe compares gradients so too)."""
    tolerance = TOLERANCES[dtype]
    atol = tolerance["atol"] * (2 if dtype == torch.bfloat16 and interpreted(backend) else 1)
    error = float((actual.detach().double() - expected.detach().double()).abs().max())
    assert error <= atol + tolerance["rtol"] * float(expected.detach().double().abs().max()), (error, actual.shape)


def _check(backend, dtype, layout, experts=E):
    got = _run(moe, _case(dtype, layout, experts=experts), layout, backend=backend)
    want = _run(moe_reference, _case(dtype, layout, experts=experts), layout)
    assert len(got) == len(want) == 5 + 2 * LAYOUTS[layout][3]
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_normwise(a, b, dtype, backend)
    assert float(got[2].abs().max()) > 0  # the router logits' gradient flows through the weights


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "inductor"])
def test_backends_match_the_reference(backend, dtype, layout):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("triton refuses float64 (tested below)")
    _check(backend, dtype, layout)


# Inductor compiles a forward and a backward graph per dtype and option set, one GEMM per
# expert unrolled (minutes on a loaded 2-core machine): one layout per dtype, between them
# every code path, with 3 experts (one of them empty).
@pytest.mark.slow
@pytest.mark.parametrize("dtype, layout", [(torch.float32, "gpt-oss"), (torch.float64, "linear-silu")], ids=str)
def test_inductor_matches_the_reference(dtype, layout):
    _check("inductor", dtype, layout, experts=3)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "inductor"])
def test_half_precision_within_twice_the_references_error(backend):
    """Against the float64 truth, docs/design.md's GPU-check rule: at most twice the error
    of the reference in the same dtype, plus the dtype's tolerance at the largest value. (With
    gpt-oss's clamps a pre-activation one rounding from the limit takes the other side of the
    clamp's gradient in either computation; fused and reference miss the truth alike there.)"""
    for dtype in (torch.float16, torch.bfloat16):
        for layout in LAYOUTS:
            got = _run(moe, _case(dtype, layout), layout, backend=backend)
            want = _run(moe_reference, _case(dtype, layout), layout)
            truth = _run(moe_reference, _case(torch.float64, layout), layout)
            for a, b, c in zip(got, want, truth):
                assert a.dtype == b.dtype == dtype
                fused_error = float((a.detach().double() - c.detach()).abs().max())
                reference_error = float((b.detach().double() - c.detach()).abs().max())
                tolerance = TOLERANCES[dtype]
                budget = 2 * reference_error + tolerance["atol"] + tolerance["rtol"] * float(c.detach().abs().max())
                assert fused_error <= budget, (dtype, layout, fused_error, reference_error)


def test_clamped_swiglu_clamps_are_active_and_match_gpt_oss_math():
    x, logits, gate_up, down, gate_up_bias, down_bias = _case(torch.float64, "gpt-oss")
    weights, indices = moe_routing(logits, K)
    h = x @ gate_up[indices[0, 0]] + gate_up_bias[indices[0, 0]]
    gate, up = h[..., ::2], h[..., 1::2]
    assert bool((gate > LIMIT).any()) and bool((up.abs() > LIMIT).any())  # both clamps bite
    # gpt-oss's GptOssExperts._apply_gate, written out, for one token through its first expert.
    gate_c, up_c = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    expected = ((up_c + 1) * gate_c * torch.sigmoid(gate_c * ALPHA))[0] @ down[indices[0, 0]] \
        + down_bias[indices[0, 0]]
    only_first = torch.zeros_like(weights)
    only_first[0, 0] = 1
    out = moe_experts(x, only_first, indices, gate_up, down, gate_up_bias, down_bias, transposed=True,
                      interleaved=True, activation="clamped_swiglu", alpha=ALPHA, limit=LIMIT, backend="cpp")
    torch.testing.assert_close(out[0], expected, rtol=1e-12, atol=1e-12)
    assert float(out[1:].detach().abs().max()) == 0


def test_routing_variants_follow_the_families():
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    probs = logits.softmax(-1)
    top, chosen = probs.topk(3, -1)
    weights, indices = moe_routing(logits, 3)  # Mixtral: softmax, top-k, renormalised
    assert torch.equal(indices, chosen)
    torch.testing.assert_close(weights, (top / top.sum(-1, keepdim=True)).float())
    weights, _ = moe_routing(logits, 3, normalize=False)  # Qwen3-MoE with norm_topk_prob=False
    torch.testing.assert_close(weights, top.float())
    values, chosen = logits.topk(3, -1)  # gpt-oss: top-k logits, then softmax over them
    weights, indices = moe_routing(logits, 3, "topk_softmax")
    assert torch.equal(indices, chosen)
    torch.testing.assert_close(weights, values.float().softmax(-1))
    top, chosen = logits.sigmoid().topk(3, -1)
    weights, indices = moe_routing(logits, 3, "sigmoid_topk")
    assert torch.equal(indices, chosen)
    torch.testing.assert_close(weights, (top / top.sum(-1, keepdim=True)).float())


@pytest.mark.parametrize("routing", ["topk_softmax", "sigmoid_topk"])
def test_each_routing_through_the_fused_op_matches_the_reference(routing):
    def run(fn, tensors, **kwargs):
        x, logits, gate_up, down, _, _ = tensors
        out = fn(x, logits, gate_up, down, K, routing, False, **kwargs)
        return [out, *torch.autograd.grad(out.sum(), (x, logits, gate_up, down))]

    for a, b in zip(run(moe, _case(torch.float64, "linear-silu"), backend="cpp"),
                    run(moe_reference, _case(torch.float64, "linear-silu"))):
        assert_normwise(a, b, torch.float64)


def test_under_autocast_the_op_computes_in_its_inputs_dtype():
    """As Hugging Face's default (grouped_mm) experts, which are on no autocast list."""
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = _run(moe, _case(torch.float32, "linear-silu"), "linear-silu", backend="cpp")
    want = _run(moe_reference, _case(torch.float32, "linear-silu"), "linear-silu")
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        assert_normwise(a, b, torch.float32)


@pytest.mark.slow
def test_torch_compile_fullgraph_traces_the_op_as_one_node():
    x, logits, gate_up, down, _, _ = _case(torch.float32, "linear-silu")
    weights, indices = moe_routing(logits.detach(), K)

    def block(x, gate_up, down):
        return moe_experts(x, weights, indices, gate_up, down, backend="cpp")

    compiled = torch.compile(block, fullgraph=True)
    got = compiled(x, gate_up, down)
    torch.testing.assert_close(got, block(x, gate_up, down))
    grads = torch.autograd.grad(got.sum(), (x, gate_up, down))
    want = torch.autograd.grad(moe_experts_reference(x, weights, indices, gate_up, down).sum(), (x, gate_up, down))
    for a, b in zip(grads, want):
        assert_normwise(a, b, torch.float32)


def test_errors_name_the_argument():
    x, logits, gate_up, down, _, _ = _case(torch.float32, "linear-silu")
    weights, indices = moe_routing(logits, K)
    with pytest.raises(ValueError, match="top_k must be an int in"):
        moe_routing(logits, E + 1)
    with pytest.raises(ValueError, match="routing must be one of"):
        moe_routing(logits, K, "softmax")
    with pytest.raises(TypeError, match="indices must be an int64 tensor"):
        moe_experts(x, weights, indices.int(), gate_up, down)
    with pytest.raises(ValueError, match="do not fit x's hidden size"):
        moe_experts(x, weights, indices, gate_up, down, transposed=True)
    with pytest.raises(ValueError, match=r"gate_up_bias is \(6, 10\)"):
        moe_experts(x, weights, indices, gate_up, down, torch.zeros(E, W))
    with pytest.raises(ValueError, match="activation must be one of"):
        moe_experts(x, weights, indices, gate_up, down, activation="relu")
    with pytest.raises(ValueError, match="weights .* and indices .* must both be"):
        moe_experts(x, weights[:-1], indices[:-1], gate_up, down)
    with pytest.raises(RuntimeError, match="expert index outside"):
        moe_experts(x, weights, indices + E, gate_up, down, backend="cpp")
    if "triton" in MOE.implementations and any(b.values[0] == "triton" for b in BACKENDS):
        with pytest.raises(ValueError, match="has no float64"):
            moe_experts(x.double(), weights, indices, gate_up.double(), down.double(), backend="triton")


def test_f_linear_router_gradient_reaches_the_router_weight():
    """The op's routing weights carry the router's gradient, as the unfused block's do."""
    x, _, gate_up, down, _, _ = _case(torch.float64, "linear-silu")
    router = torch.randn(E, H, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    fused = torch.autograd.grad(moe(x, F.linear(x, router), gate_up, down, K, backend="cpp").sum(), router)[0]
    reference = torch.autograd.grad(moe_reference(x, F.linear(x, router), gate_up, down, K).sum(), router)[0]
    assert float(fused.abs().max()) > 0
    assert_normwise(fused, reference, torch.float64)
