"""te_lab's linear op (projections on oneDNN's GEMM) against F.linear, and how the twins route
their projections through it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import te_lab
from conftest import DEVICE, assert_close, backend_params, grads_of, leaf
from te_lab import models
from te_lab.kernels import use_backend
from te_lab.kernels.linear import LINEAR, linear, linear_reference
from te_lab.modules import FusedGatedMLP
from te_lab.modules.projection import MIN_ROUTED_WEIGHT, project, routes_to_linear

BACKENDS = backend_params(LINEAR)
needs_native = pytest.mark.skipif("native" not in [p.values[0] for p in BACKENDS],
                                  reason="no oneDNN linear kernel in this torch build / on this device")


def _inputs(lead, in_features, out_features, bias, dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(*lead, in_features, device=DEVICE, dtype=dtype)
    weight = torch.randn(out_features, in_features, device=DEVICE, dtype=dtype) / in_features**0.5
    return x, weight, (torch.randn(out_features, device=DEVICE, dtype=dtype) if bias else None)


def _run(fn, x, weight, bias, **kwargs):
    inputs = [leaf(t) for t in (x, weight, bias) if t is not None]
    out = fn(*inputs, **kwargs)
    return out, grads_of((out,), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("lead, in_features, out_features", [((2, 37), 300, 129), ((64,), 17, 5)])
def test_forward_and_gradients_match_f_linear(backend, bias, lead, in_features, out_features):
    x, weight, b = _inputs(lead, in_features, out_features, bias)
    out, grads = _run(linear, x, weight, b, backend=backend)
    want, want_grads = _run(linear_reference, x, weight, b)
    assert out.shape == (*lead, out_features) and len(grads) == (3 if bias else 2)
    for got, expected in zip((out,) + grads, (want,) + want_grads):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert_close(got, expected)


@needs_native
def test_native_reads_transposed_inputs_in_place_and_skips_unneeded_gradients():
    x, weight, _ = _inputs((40,), 24, 16, False)
    x_t = leaf(x.t().contiguous()).t()  # a transposed view: strides (1, 40)
    frozen = weight.clone()  # requires no gradient
    out = linear(x_t, frozen, backend="native")
    (dx,) = torch.autograd.grad(out.sum(), [x_t])
    assert_close(out, F.linear(x, weight))
    assert_close(dx, torch.ones(40, 16) @ weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ops_pass_opcheck(backend):
    x, weight, bias = (leaf(t) for t in _inputs((3, 5), 8, 6, True))
    torch.library.opcheck(torch.ops.te_lab.linear, (x, weight, bias, backend))
    dy = torch.randn(3, 5, 6)
    torch.library.opcheck(torch.ops.te_lab.linear_backward,
                          (dy, x.detach(), weight.detach(), True, True, True, backend))


@needs_native
def test_automatic_choice_keeps_other_dtypes_on_f_linear_and_forced_native_refuses_float64():
    x, weight, _ = _inputs((4,), 8, 8, False, torch.float64)
    with torch.profiler.profile() as trace:
        out = linear(x, weight)
    assert "te_lab::linear" not in {event.name for event in trace.events()}  # float64 is F.linear's
    assert_close(out, F.linear(x, weight))
    with pytest.raises(ValueError, match=r"linear: backend 'native' \(from backend=\) cannot run its GEMMs in "
                                         r"torch.float64: oneDNN takes float32"):
        linear(x, weight, backend="native")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2-only CPUs: refused, with the reason
        with use_backend(linear="native"), pytest.raises(ValueError, match="oneDNN takes float32 on this CPU"):
            linear(x.bfloat16(), weight.bfloat16())
        return
    with use_backend(linear="native"):
        half = linear(x.bfloat16(), weight.bfloat16())
    assert_close(half, F.linear(x, weight).bfloat16(), torch.bfloat16)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_under_autocast_the_gemms_run_in_the_regions_dtype_as_f_linear_does(dtype):
    x, weight, bias = (leaf(t) for t in _inputs((6,), 32, 16, True))
    with torch.autocast("cpu", dtype=dtype):
        out = linear(x, weight, bias)
        want = F.linear(x, weight, bias)
    assert out.dtype == want.dtype == dtype
    assert_close(out, want, dtype)
    for got, expected in zip(grads_of((out,), [x, weight, bias]), grads_of((want,), [x, weight, bias])):
        assert got.dtype == expected.dtype == torch.float32
        assert_close(got, expected, dtype)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="cannot run its GEMMs in "
                                                                                      "torch.float16"):
        linear(x, weight, backend="native")


@pytest.mark.parametrize("call, error, message", [
    (lambda: linear(torch.ones(2, 3), torch.ones(4, 5)), ValueError,
     r"linear: weight has shape \(4, 5\); expected \(out_features, 3\)"),
    (lambda: linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.float64)), TypeError,
     "linear: weight has dtype torch.float64; expected torch.float32 like x"),
    (lambda: linear(torch.ones(2, 3), torch.ones(4, 3), torch.ones(3)), ValueError,
     r"linear: bias has shape \(3,\); expected \(4,\), the out_features of weight"),
    (lambda: linear(torch.ones(2, 3, dtype=torch.int64), torch.ones(4, 3)), TypeError,
     "linear: x has dtype torch.int64"),
])
def test_errors_name_the_op_the_argument_and_what_was_expected(call, error, message):
    with pytest.raises(error, match=message):
        call()


def _gated_mlp(hidden, intermediate):
    torch.manual_seed(0)
    mlp = nn.Module()
    mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
    mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
    mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)
    return mlp


@needs_native
def test_twins_route_large_plain_linear_children_and_call_the_rest_as_modules():
    mlp = _gated_mlp(256, 512)
    assert all(routes_to_linear(child) for child in mlp.children())
    twin = FusedGatedMLP(mlp, gate="gate_proj", up="up_proj", down="down_proj", activation="silu")
    assert twin.kernel_names() == ["te_lab::glu", "te_lab::linear"]
    x = torch.randn(2, 8, 256)
    # Whether oneDNN pays for 16 tokens is measured per machine; the routing is forced here.
    with use_backend(linear="native"), torch.profiler.profile() as trace:
        twin(x)
    assert sum(event.name == "te_lab::linear" for event in trace.events()) == 3

    small = nn.Linear(16, 16)
    assert small.weight.numel() < MIN_ROUTED_WEIGHT and not routes_to_linear(small)
    calls = []
    hooked = mlp.down_proj
    hooked.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    assert not routes_to_linear(hooked)  # a direct linear() would skip its hook
    assert twin.kernel_names() == ["te_lab::glu", "te_lab::linear"]  # gate and up are still routed
    twin(x)
    assert calls == [torch.Size([2, 8, 256])]
    assert_close(project(hooked, x.new_ones(3, 512), None), hooked(x.new_ones(3, 512)))


@needs_native
def test_a_fused_llama_with_routed_projections_trains_like_the_original():
    """Large enough for its q/o and gate/up/down projections to be routed (k/v, 128 x 256, are
    not): every probe passes on oneDNN's GEMMs and the loss and gradients match."""
    model = models.llama("tiny", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    batch = model.example_batch(2, 32)
    with use_backend(linear="native"):  # whether oneDNN pays here is the machine's measurement
        _fused_llama_trains_like_the_original(model, batch)


def _fused_llama_trains_like_the_original(model, batch):
    report = te_lab.fuse(model, sample=batch, progress=False)
    assert all(row.status == "fused" for row in report.rows), str(report)
    assert report.model_check.within_tolerance
    for row in report.rows:
        if row.rule in ("attention", "gated_mlp"):
            assert "te_lab::linear" in row.kernels and row.backends["linear"] == "native"
    with torch.profiler.profile() as trace:
        loss = model(**batch).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
    names = [event.name for event in trace.events()]
    # per layer: q and o, gate, up and down forward, and their backward
    assert names.count("te_lab::linear") == 2 * 5 and names.count("te_lab::linear_backward") == 2 * 5
    with te_lab.unfused(model):
        expected_loss = model(**batch).loss
        expected = torch.autograd.grad(expected_loss, list(model.parameters()))
    assert_close(loss, expected_loss)
    for grad, want in zip(grads, expected):
        # weight gradients are sums over every token: fp32 needs 1e-4 there (docs/design.md)
        assert_close(grad, want, rtol=1e-4, atol=1e-5)
