"""RMSNorm (optionally with the residual add): every backend against the reference."""

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
from te_lab.kernels import rms_norm, rms_norm_reference
from te_lab.kernels.rms_norm import RMS_NORM

BACKENDS = backend_params(RMS_NORM)

# (leading shape, hidden): hidden sizes that are not powers of two or block multiples.
SHAPES = [((2, 3), 1000), ((5,), 4097)]
# residual?, weight?, weight_offset: plain, Llama-style with residual, Gemma-style (1 + w).
VARIANTS = [
    pytest.param(False, True, 0.0, id="weight"),
    pytest.param(True, True, 0.0, id="residual"),
    pytest.param(True, True, 1.0, id="gemma"),
    pytest.param(False, False, 0.0, id="no-weight"),
]


def _inputs(lead, n, dtype, with_residual, with_weight, weight_dtype=None):
    torch.manual_seed(0)
    x = torch.randn(*lead, n, device=DEVICE, dtype=dtype)
    residual = torch.randn(*lead, n, device=DEVICE, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(weight_dtype or dtype) if with_weight else None
    return x, residual, weight


def _run(fn, x, residual, weight, offset, **kwargs):
    """Forward output(s) and the gradients of every input that takes one."""
    x, residual, weight = (None if t is None else leaf(t) for t in (x, residual, weight))
    out = fn(x, weight, 1e-6, residual=residual, weight_offset=offset, **kwargs)
    outputs = out if isinstance(out, tuple) else (out,)
    inputs = [t for t in (x, residual, weight) if t is not None]
    return outputs, grads_of(outputs, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_residual, with_weight, offset", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_reference(backend, dtype, with_residual, with_weight, offset):
    for lead, n in SHAPES:
        x, residual, weight = _inputs(lead, n, dtype, with_residual, with_weight)
        outputs, grads = _run(rms_norm, x, residual, weight, offset, backend=backend)
        ref_outputs, ref_grads = _run(rms_norm_reference, x, residual, weight, offset)
        assert len(outputs) == (2 if with_residual else 1)
        for got, want in zip(outputs + grads, ref_outputs + ref_grads):
            assert got.shape == want.shape and got.dtype == want.dtype
            # the weight gradient sums over every row: an fp32 reduction over thousands of terms
            assert_close(got, want, dtype, backend, **({"atol": 1e-4} if dtype == torch.float32 else {}))


@pytest.mark.triton_interpreter
@pytest.mark.skipif("triton" not in fused_backends(RMS_NORM), reason="needs the triton backend")
@pytest.mark.parametrize("with_residual, with_weight, offset", [VARIANTS[1], VARIANTS[3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_wider_than_one_column_block(monkeypatch, dtype, with_residual, with_weight, offset):
    """Rows over MAX_COLUMN_BLOCK (8192, Llama 3 405B's 16384 among them) are walked block by
    block; a block of 256 gives the same path at a size the interpreter runs quickly, with a
    partial last block and several rows per program (sized for a 1-multiprocessor GPU)."""
    from te_lab.gpu_checks.kernel_launches import recording_launches
    from te_lab.kernels import triton_support

    monkeypatch.setattr(triton_support, "MAX_COLUMN_BLOCK", 256)
    x, residual, weight = _inputs((11,), 600, dtype, with_residual, with_weight)
    with recording_launches(multiprocessors=1, execute=True) as log:
        outputs, grads = _run(rms_norm, x, residual, weight, offset, backend="triton")
    ref_outputs, ref_grads = _run(rms_norm_reference, x, residual, weight, offset)
    assert_walks_column_blocks(log, "rms_norm", block=256, rows_per_program=3)
    for got, want in zip(outputs + grads, ref_outputs + ref_grads):
        assert_close(got, want, dtype, "triton", **({"atol": 1e-4} if dtype == torch.float32 else {}))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_weight_with_bf16_activations(backend):
    x, residual, weight = _inputs((3,), 1000, torch.bfloat16, True, True, weight_dtype=torch.float32)
    outputs, grads = _run(rms_norm, x, residual, weight, 0.0, backend=backend)
    ref_outputs, ref_grads = _run(rms_norm_reference, x, residual, weight, 0.0)
    assert grads[2].dtype == torch.float32
    for got, want in zip(outputs + grads, ref_outputs + ref_grads):
        assert_close(got, want, torch.bfloat16, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_one_dimensional_inputs(backend):
    torch.manual_seed(1)
    wide = torch.randn(6, 2 * 300, device=DEVICE)
    x = wide[:, ::2]  # every other column: not contiguous in the last dimension
    transposed = torch.randn(300, 4, device=DEVICE).t()  # rows are strided
    weight = torch.randn(300, device=DEVICE)
    for inp in (x, transposed, torch.randn(300, device=DEVICE)):
        assert_close(rms_norm(inp, weight, backend=backend), rms_norm_reference(inp, weight))


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_gradcheck_float64(backend):
    torch.manual_seed(2)
    x = torch.randn(3, 7, device=DEVICE, dtype=torch.float64, requires_grad=True)
    residual = torch.randn(3, 7, device=DEVICE, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, device=DEVICE, dtype=torch.float64, requires_grad=True)

    def fn(x, residual, weight):
        return rms_norm(x, weight, residual=residual, weight_offset=1.0, backend=backend)

    assert torch.autograd.gradcheck(fn, (x, residual, weight))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch.manual_seed(3)
    x, residual, weight = (leaf(t) for t in _inputs((4,), 96, torch.float32, True, True))

    def block(x, residual, weight):
        y, h = rms_norm(x, weight, residual=residual, backend=backend)
        return (y * 2).sum() + h.sum()

    explanation = torch._dynamo.explain(block)(x, residual, weight)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True)
    got = compiled(x, residual, weight)
    got_grads = torch.autograd.grad(got, (x, residual, weight))
    y, h = rms_norm_reference(x, weight, residual=residual)
    want = (y * 2).sum() + h.sum()
    want_grads = torch.autograd.grad(want, (x, residual, weight))
    assert_close(got, want, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, torch.float32)


def test_profiler_sees_the_fused_op_and_its_backward():
    backend = fused_backends(RMS_NORM)[0]
    x = torch.randn(8, 64, device=DEVICE, requires_grad=True)
    weight = torch.randn(64, device=DEVICE, requires_grad=True)
    with torch.profiler.profile() as prof:
        rms_norm(x, weight, backend=backend).sum().backward()
    names = {event.name for event in prof.events()}
    assert {"te_lab::rms_norm", "te_lab::rms_norm_backward"} <= names


def test_unused_residual_output_still_gives_gradients():
    backend = fused_backends(RMS_NORM)[0]
    x, residual, weight = (leaf(t) for t in _inputs((3,), 50, torch.float32, True, True))
    y, _ = rms_norm(x, weight, residual=residual, backend=backend)
    y.sum().backward()
    ref_x, ref_r, ref_w = (leaf(t) for t in (x, residual, weight))
    rms_norm_reference(ref_x, ref_w, residual=ref_r)[0].sum().backward()
    for got, want in ((x.grad, ref_x.grad), (residual.grad, ref_r.grad), (weight.grad, ref_w.grad)):
        assert_close(got, want, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(weight=torch.ones(9)), ValueError, ["rms_norm", "weight", "(9,)", "(8,)"]),
        (dict(residual=torch.ones(2, 9)), ValueError, ["rms_norm", "residual", "(2, 9)", "(2, 8)"]),
        (dict(residual=torch.ones(2, 8, dtype=torch.float64)), TypeError, ["rms_norm", "residual", "float64"]),
        (dict(residual=torch.ones(2, 8, device="meta")), ValueError, ["rms_norm", "residual", "meta"]),
        (dict(weight=torch.ones(8, device="meta")), ValueError, ["rms_norm", "weight", "meta"]),
        (dict(eps=0.0), ValueError, ["rms_norm", "eps", "positive"]),
        (dict(weight=[1.0] * 8), TypeError, ["rms_norm", "weight", "list"]),
        (dict(backend="cuda"), ValueError, ["rms_norm", "backend", "'cuda'"]),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    with pytest.raises(error) as raised:
        rms_norm(torch.ones(2, 8), **kwargs)
    for word in words:
        assert word in str(raised.value)


def test_integer_input_is_refused():
    with pytest.raises(TypeError, match="rms_norm: x has dtype torch.int64"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64))
