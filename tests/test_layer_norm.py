"""LayerNorm (optionally with the residual add): every backend against the reference."""

import pytest
import torch

from conftest import (
    DEVICE,
    DTYPES,
    assert_close,
    assert_walks_column_blocks,
    backend_params,
    fused_backends,
    grads_of,
    leaf,
)
from te_lab.kernels.layer_norm import LAYER_NORM, layer_norm, layer_norm_reference
from te_lab.kernels.precision import error_budget

BACKENDS = backend_params(LAYER_NORM)

# (leading shape, hidden): hidden sizes that are not powers of two or block multiples.
SHAPES = [((2, 3), 1000), ((5,), 4097)]
# residual?, weight?, bias?: nn.LayerNorm, pre-norm block with residual, weight without
# bias (elementwise_affine with bias=False), and no affine parameters at all.
VARIANTS = [
    pytest.param(False, True, True, id="affine"),
    pytest.param(True, True, True, id="residual"),
    pytest.param(True, True, False, id="residual-no-bias"),
    pytest.param(False, False, False, id="no-affine"),
]


def _inputs(lead, n, dtype, with_residual, with_weight, with_bias, param_dtype=None):
    torch.manual_seed(0)
    x = torch.randn(*lead, n, device=DEVICE, dtype=dtype)
    residual = torch.randn(*lead, n, device=DEVICE, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(param_dtype or dtype) if with_weight else None
    bias = (0.1 * torch.randn(n, device=DEVICE)).to(param_dtype or dtype) if with_bias else None
    return x, residual, weight, bias


def _run(fn, x, residual, weight, bias, **kwargs):
    """Forward output(s) and the gradients of every input that takes one."""
    x, residual, weight, bias = (None if t is None else leaf(t) for t in (x, residual, weight, bias))
    out = fn(x, weight, bias, 1e-5, residual=residual, **kwargs)
    outputs = out if isinstance(out, tuple) else (out,)
    inputs = [t for t in (x, residual, weight, bias) if t is not None]
    return outputs, grads_of(outputs, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_residual, with_weight, with_bias", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_reference(backend, dtype, with_residual, with_weight, with_bias):
    for lead, n in SHAPES:
        x, residual, weight, bias = _inputs(lead, n, dtype, with_residual, with_weight, with_bias)
        outputs, grads = _run(layer_norm, x, residual, weight, bias, backend=backend)
        ref_outputs, ref_grads = _run(layer_norm_reference, x, residual, weight, bias)
        assert len(outputs) == (2 if with_residual else 1)
        for got, want in zip(outputs + grads, ref_outputs + ref_grads):
            assert got.shape == want.shape and got.dtype == want.dtype
            # weight and bias gradients sum over every row: fp32 reductions over thousands of terms
            assert_close(got, want, dtype, backend, **({"atol": 1e-4} if dtype == torch.float32 else {}))


@pytest.mark.triton_interpreter
@pytest.mark.skipif("triton" not in fused_backends(LAYER_NORM), reason="needs the triton backend")
@pytest.mark.parametrize("with_residual, with_weight, with_bias", [VARIANTS[1], VARIANTS[3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_wider_than_one_column_block(monkeypatch, dtype, with_residual, with_weight, with_bias):
    """Rows over MAX_COLUMN_BLOCK (8192, Llama 3 405B's 16384 among them) are walked block by
    block; a block of 256 gives the same path at a size the interpreter runs quickly, with a
    partial last block and several rows per program (sized for a 1-multiprocessor GPU)."""
    from te_lab.gpu_checks.kernel_launches import recording_launches
    from te_lab.kernels import triton_support

    monkeypatch.setattr(triton_support, "MAX_COLUMN_BLOCK", 256)
    x, residual, weight, bias = _inputs((11,), 600, dtype, with_residual, with_weight, with_bias)
    x = x + 3.0  # off zero mean: the variance pass must subtract the row's mean
    with recording_launches(multiprocessors=1, execute=True) as log:
        outputs, grads = _run(layer_norm, x, residual, weight, bias, backend="triton")
    ref_outputs, ref_grads = _run(layer_norm_reference, x, residual, weight, bias)
    assert_walks_column_blocks(log, "layer_norm", block=256, rows_per_program=3)
    for got, want in zip(outputs + grads, ref_outputs + ref_grads):
        assert_close(got, want, dtype, "triton", **({"atol": 1e-4} if dtype == torch.float32 else {}))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_parameters_with_bf16_activations(backend):
    x, residual, weight, bias = _inputs((3,), 1000, torch.bfloat16, True, True, True, param_dtype=torch.float32)
    outputs, grads = _run(layer_norm, x, residual, weight, bias, backend=backend)
    ref_outputs, ref_grads = _run(layer_norm_reference, x, residual, weight, bias)
    assert grads[2].dtype == torch.float32 and grads[3].dtype == torch.float32
    for got, want in zip(outputs + grads, ref_outputs + ref_grads):
        assert_close(got, want, torch.bfloat16, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_far_from_zero_mean(backend):
    """Rows of standard-normal inputs have a mean near zero, which hides a variance taken
    without centring; here the mean is large against the spread."""
    x, residual, weight, bias = _inputs((4,), 1000, torch.float32, False, True, True)
    outputs, grads = _run(layer_norm, x + 100, residual, weight, bias, backend=backend)
    ref_outputs, ref_grads = _run(layer_norm_reference, x + 100, residual, weight, bias)
    for got, want in zip(outputs + grads, ref_outputs + ref_grads):
        # x - mean carries float32's rounding of values near 100 (~1e-5)
        assert_close(got, want, torch.float32, backend, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_one_dimensional_inputs(backend):
    torch.manual_seed(1)
    wide = torch.randn(6, 2 * 300, device=DEVICE)
    x = wide[:, ::2]  # every other column: not contiguous in the last dimension
    transposed = torch.randn(300, 4, device=DEVICE).t()  # rows are strided
    weight, bias = torch.randn(300, device=DEVICE), torch.randn(300, device=DEVICE)
    for inp in (x, transposed, torch.randn(300, device=DEVICE)):
        assert_close(layer_norm(inp, weight, bias, backend=backend), layer_norm_reference(inp, weight, bias))


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_gradcheck_float64(backend):
    torch.manual_seed(2)
    x = torch.randn(3, 7, device=DEVICE, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(3, 7, device=DEVICE, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, device=DEVICE, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, device=DEVICE, dtype=torch.float64, requires_grad=True)

    def fn(x, residual, weight, bias):
        return layer_norm(x, weight, bias, residual=residual, backend=backend)

    assert torch.autograd.gradcheck(fn, (x, residual, weight, bias))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_offset_at_checkpoint_magnitudes_matches_the_float64_truth(backend, dtype, with_residual):
    """Nemotron's LayerNorm1P (``1 + weight``) on a residual stream like a pretrained
    checkpoint's (outlier channels of 5e3, up to 2e4, among values of a few units, norm
    weights far from 0; float16 holds no more): the output and every gradient as close to
    the float64 truth as the budget allows against the reference's own rounding in ``dtype``."""
    x, residual, weight, bias = _inputs((3, 5), 1000, torch.float32, with_residual, True, True)
    x[..., :3] *= 5e3
    weight = weight * 10 - 11  # 1 + weight spans about +-1 around 0, LayerNorm1P's checkpoints' range
    x, residual, weight, bias = (None if t is None else t.to(dtype) for t in (x, residual, weight, bias))
    truth = _run(layer_norm_reference, *(None if t is None else t.double() for t in (x, residual, weight, bias)),
                 weight_offset=1.0)
    unfused = _run(layer_norm_reference, x, residual, weight, bias, weight_offset=1.0)
    fused = _run(layer_norm, x, residual, weight, bias, weight_offset=1.0, backend=backend)
    for got, eager, want in zip(fused[0] + fused[1], unfused[0] + unfused[1], truth[0] + truth[1]):
        budget = error_budget((eager.double() - want).abs().max().item(), want.abs().max().item(), dtype)
        assert (got.double() - want).abs().max().item() <= budget
    # The offset matters: without it the output is another one.
    plain = layer_norm(x, weight, bias, 1e-5, residual=residual, backend=backend)
    assert ((plain[0] if with_residual else plain).double() - truth[0][0]).abs().max() > 0.5


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_gradcheck_float64_weight_offset(backend):
    torch.manual_seed(3)
    x, residual = (torch.randn(3, 7, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight, bias = (torch.randn(7, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))

    def fn(x, residual, weight, bias):
        return layer_norm(x, weight, bias, residual=residual, weight_offset=1.0, backend=backend)

    assert torch.autograd.gradcheck(fn, (x, residual, weight, bias))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch.manual_seed(3)
    x, residual, weight, bias = (leaf(t) for t in _inputs((4,), 96, torch.float32, True, True, True))

    def block(x, residual, weight, bias):
        y, h = layer_norm(x, weight, bias, residual=residual, backend=backend)
        return (y * 2).sum() + h.sum()

    explanation = torch._dynamo.explain(block)(x, residual, weight, bias)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True)
    got = compiled(x, residual, weight, bias)
    got_grads = torch.autograd.grad(got, (x, residual, weight, bias))
    y, h = layer_norm_reference(x, weight, bias, residual=residual)
    want = (y * 2).sum() + h.sum()
    want_grads = torch.autograd.grad(want, (x, residual, weight, bias))
    assert_close(got, want, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, torch.float32)


def test_profiler_sees_the_fused_op_and_its_backward():
    backend = fused_backends(LAYER_NORM)[0]
    x = torch.randn(8, 64, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, device=DEVICE, requires_grad=True)
    bias = torch.randn(64, device=DEVICE, requires_grad=True)
    with torch.profiler.profile() as prof:
        layer_norm(x, weight, bias, backend=backend).sum().backward()
    names = {event.name for event in prof.events()}
    assert {"te_lab::layer_norm", "te_lab::layer_norm_backward"} <= names


def test_only_one_output_used_still_gives_gradients():
    backend = fused_backends(LAYER_NORM)[0]
    upstream = torch.arange(50.0, device=DEVICE)
    x, residual, weight, bias = _inputs((3,), 50, torch.float32, True, True, True)
    for used in (0, 1):  # only y (the residual stream's gradient is None), then only h (dy is None)
        inputs = [leaf(t) for t in (x, residual, weight, bias)]
        ref_inputs = [leaf(t) for t in (x, residual, weight, bias)]
        got = layer_norm(inputs[0], inputs[2], inputs[3], residual=inputs[1], backend=backend)[used]
        want = layer_norm_reference(ref_inputs[0], ref_inputs[2], ref_inputs[3], residual=ref_inputs[1])[used]
        (got * upstream).sum().backward()
        (want * upstream).sum().backward()
        for inp, ref in zip(inputs, ref_inputs):
            if ref.grad is None:  # h does not depend on weight and bias
                assert inp.grad is None or not inp.grad.any()
            else:
                assert_close(inp.grad, ref.grad, atol=1e-4)


def test_frozen_parameters_get_no_gradient():
    backend = fused_backends(LAYER_NORM)[0]
    x = torch.randn(4, 32, device=DEVICE, requires_grad=True)
    weight, bias = torch.randn(32, device=DEVICE), torch.randn(32, device=DEVICE)
    layer_norm(x, weight, bias, backend=backend).sum().backward()
    assert x.grad is not None and weight.grad is None and bias.grad is None


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(weight=torch.ones(9)), ValueError, ["layer_norm", "weight", "(9,)", "(8,)"]),
        (dict(bias=torch.ones(2, 8)), ValueError, ["layer_norm", "bias", "(2, 8)", "(8,)"]),
        (dict(residual=torch.ones(2, 9)), ValueError, ["layer_norm", "residual", "(2, 9)", "(2, 8)"]),
        (dict(residual=torch.ones(2, 8, dtype=torch.float64)), TypeError, ["layer_norm", "residual", "float64"]),
        (dict(residual=torch.ones(2, 8, device="meta")), ValueError, ["layer_norm", "residual", "meta"]),
        (dict(weight=torch.ones(8, device="meta")), ValueError, ["layer_norm", "weight", "meta"]),
        (dict(bias=torch.ones(8, dtype=torch.int32)), TypeError, ["layer_norm", "bias", "torch.int32"]),
        (dict(eps=0.0), ValueError, ["layer_norm", "eps", "positive"]),
        (dict(eps=-1e-5), ValueError, ["layer_norm", "eps", "positive"]),
        (dict(weight=[1.0] * 8), TypeError, ["layer_norm", "weight", "list"]),
        (dict(backend="cuda"), ValueError, ["layer_norm", "backend", "'cuda'"]),
        (dict(weight_offset="1"), TypeError, ["layer_norm", "weight_offset", "'1'"]),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    with pytest.raises(error) as raised:
        layer_norm(torch.ones(2, 8), **kwargs)
    for word in words:
        assert word in str(raised.value)


def test_integer_input_is_refused():
    with pytest.raises(TypeError, match="layer_norm: x has dtype torch.int64"):
        layer_norm(torch.ones(2, 8, dtype=torch.int64))
