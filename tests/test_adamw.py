"""FusedAdamW and the fused adamw op: every backend trained side by side with
torch.optim.AdamW on the same gradients, and its state dicts loaded both ways."""

import copy

import pytest
import torch
from torch import nn
from torch.optim.adamw import adamw as torch_adamw

from conftest import DEVICE, assert_close, backend_params, fused_backends, interpreted
from te_lab.kernels import adamw
from te_lab.kernels.adamw import ADAMW, FusedAdamW, adamw_reference_step
from te_lab.kernels.registry import ENV_VAR, aten_kernel_exists, select_backend

# The optimizer's own per-parameter loop is a backend too.
BACKENDS = [pytest.param("reference", id="reference")] + backend_params(ADAMW)
STEPS = 20
# Odd sizes, a scalar, and a 2-D weight; 4097 elements span several chunks of the
# triton kernel (the interpreter's chunks are 1024 elements: the CPU has few units).
SHAPES = [(), (1000,), (4097,), (7, 13)]


def _groups_with_lr_change(params):
    return [dict(params=params[:2], lr=2e-2, weight_decay=5e-2),
            dict(params=params[2:], lr=5e-3, weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6)]


def _halve_first_group_lr(optimizer, step):
    if step == STEPS // 2:
        optimizer.param_groups[0]["lr"] = 1e-2


# name -> (optimizer options, param groups from the params, hook(optimizer, step) before each step)
VARIANTS = {
    "defaults": (dict(lr=1e-2), None, None),
    "maximize": (dict(lr=1e-2, maximize=True), None, None),
    "amsgrad": (dict(lr=1e-2, amsgrad=True), None, None),
    "groups": (dict(), _groups_with_lr_change, _halve_first_group_lr),
}


def _initial_params(dtype, shapes=SHAPES, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(DEVICE, dtype) for shape in shapes]


def _gradients(dtype, shapes=SHAPES, steps=STEPS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator).to(DEVICE, dtype) for shape in shapes]
            for _ in range(steps)]


def _build(make_optimizer, initial, variant):
    options, grouping, _ = VARIANTS[variant]
    params = [nn.Parameter(value.clone()) for value in initial]
    return params, make_optimizer(params if grouping is None else grouping(params), **options)


def _train(params, optimizer, gradients, variant, first_step=0):
    hook = VARIANTS[variant][2]
    for step, step_grads in enumerate(gradients, start=first_step):
        if hook is not None:
            hook(optimizer, step)
        for param, grad in zip(params, step_grads):
            param.grad = None if grad is None else grad.clone()
        optimizer.step()


def _fused(backend):
    return lambda params, **options: FusedAdamW(params, backend=backend, **options)


def assert_same_training(params, optimizer, want_params, want_optimizer, dtype, backend, **tolerance):
    """Parameters and every state entry agree, with torch's keys, dtypes and devices."""
    for param, want in zip(params, want_params):
        assert param.dtype == want.dtype and param.shape == want.shape
        assert_close(param.detach(), want.detach(), dtype, backend, **tolerance)
        state, want_state = optimizer.state[param], want_optimizer.state[want]
        assert state.keys() == want_state.keys()
        for key, value in state.items():
            expected = want_state[key]
            assert (value.dtype, value.shape) == (expected.dtype, expected.shape), key
            if key == "step":
                # torch's fused AdamW keeps the count on the parameter's device, its default on the CPU
                assert value.device.type == "cpu" and torch.equal(value, expected.cpu())
            else:
                assert value.device == expected.device
                assert_close(value, expected, dtype, backend, **tolerance)


def _reference_copy(params, optimizer):
    """Copies of ``params`` and a reference-backend FusedAdamW with ``optimizer``'s groups and state."""
    copies = {param: nn.Parameter(param.detach().clone()) for param in params}
    groups = [dict(group, params=[copies[param] for param in group["params"]])
              for group in optimizer.param_groups]
    ref_optimizer = FusedAdamW(groups, backend="reference")
    ref_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return list(copies.values()), ref_optimizer


def _assert_each_step_matches_reference(params, optimizer, gradients, variant, backend):
    """Step by step, the optimizer's update equals the reference backend's update of the
    same state. Used where rounding differences would compound over many steps."""
    hook = VARIANTS[variant][2]
    for step, step_grads in enumerate(gradients):
        if hook is not None:
            hook(optimizer, step)
        ref_params, ref_optimizer = _reference_copy(params, optimizer)
        for param, ref_param, grad in zip(params, ref_params, step_grads):
            param.grad, ref_param.grad = grad.clone(), grad.clone()
        optimizer.step()
        ref_optimizer.step()
        assert_same_training(params, optimizer, ref_params, ref_optimizer, params[0].dtype, backend)


def _torch_adamw_for(dtype):
    """What FusedAdamW must agree with. For float32, torch.optim.AdamW's default. For
    bfloat16, torch's default rounds after every elementary op, loses updates smaller than
    half a bf16 step (weight decay of 1e-4 of a weight never applies) and drifts tens of
    bf16 steps away in 20 steps; torch.optim.AdamW(fused=True) computes in float32 and
    rounds once, as FusedAdamW does, so it is the one to agree with where it exists."""
    if dtype == torch.float32:
        return torch.optim.AdamW
    if aten_kernel_exists("aten::_fused_adamw_", DEVICE.type):
        return lambda params, **options: torch.optim.AdamW(params, fused=True, **options)
    return _fused("reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_matches_torch_adamw(backend, variant, dtype):
    initial, gradients = _initial_params(dtype), _gradients(dtype)
    params, optimizer = _build(_fused(backend), initial, variant)
    if dtype == torch.bfloat16 and interpreted(backend):
        # Triton's interpreter truncates float32 to bfloat16 where GPUs (and torch) round to
        # nearest, so every step drifts by up to one bf16 step toward zero and 20 steps
        # compound it; compiled kernels round correctly. Each interpreted step is checked
        # against the reference's update of the same state instead.
        _assert_each_step_matches_reference(params, optimizer, gradients, variant, backend)
        return
    want_params, want_optimizer = _build(_torch_adamw_for(dtype), initial, variant)
    _train(params, optimizer, gradients, variant)
    _train(want_params, want_optimizer, gradients, variant)
    assert_same_training(params, optimizer, want_params, want_optimizer, dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_params_update_in_float64(backend):
    initial, gradients = _initial_params(torch.float64), _gradients(torch.float64)
    params, optimizer = _build(_fused(backend), initial, "amsgrad")
    want_params, want_optimizer = _build(torch.optim.AdamW, initial, "amsgrad")
    _train(params, optimizer, gradients, "amsgrad")
    _train(want_params, want_optimizer, gradients, "amsgrad")
    assert_same_training(params, optimizer, want_params, want_optimizer, torch.float64, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_updates_in_float32(backend):
    """torch's default AdamW adds eps=1e-8 in float16, where it is 0, and divides by zero
    where a gradient underflows; te_lab computes in float32 and matches its reference."""
    initial, gradients = _initial_params(torch.float16), _gradients(torch.float16)
    params, optimizer = _build(_fused(backend), initial, "defaults")
    ref_params, ref_optimizer = _build(_fused("reference"), initial, "defaults")
    _train(params, optimizer, gradients, "defaults")
    _train(ref_params, ref_optimizer, gradients, "defaults")
    assert all(torch.isfinite(param).all() for param in params)
    assert_same_training(params, optimizer, ref_params, ref_optimizer, torch.float16, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_round_trips_both_ways(backend):
    """Half the run with one optimizer, the other half with the other after
    load_state_dict: both ways end where an uninterrupted torch run ends."""
    initial, gradients = _initial_params(torch.float32), _gradients(torch.float32)
    half = STEPS // 2
    want_params, want_optimizer = _build(torch.optim.AdamW, initial, "groups")
    _train(want_params, want_optimizer, gradients, "groups")
    for first, second in ((_fused(backend), torch.optim.AdamW), (torch.optim.AdamW, _fused(backend))):
        params, optimizer = _build(first, initial, "groups")
        _train(params, optimizer, gradients[:half], "groups")
        saved = optimizer.state_dict()
        resumed_params, resumed = _build(second, [param.detach() for param in params], "groups")
        resumed.load_state_dict(saved)
        _train(resumed_params, resumed, gradients[half:], "groups", first_step=half)
        assert_same_training(resumed_params, resumed, want_params, want_optimizer, torch.float32, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_params_without_grad_are_skipped(backend):
    """A parameter without a gradient keeps its value and gets no state; once it has
    gradients its step count lags the others', and one launch handles both counts."""
    initial = _initial_params(torch.float32)
    gradients = _gradients(torch.float32)
    for step_grads in gradients[:STEPS // 2]:
        step_grads[1] = None
    never = nn.Parameter(torch.randn(5, device=DEVICE))
    params, optimizer = _build(_fused(backend), initial, "defaults")
    optimizer.add_param_group(dict(params=[never]))
    want_params, want_optimizer = _build(torch.optim.AdamW, initial, "defaults")
    _train(params, optimizer, gradients[:3], "defaults")
    assert len(optimizer.state[params[1]]) == 0 and len(optimizer.state[never]) == 0
    _train(params, optimizer, gradients[3:], "defaults", first_step=3)
    _train(want_params, want_optimizer, gradients, "defaults")
    assert optimizer.state[params[1]]["step"].item() == STEPS // 2
    assert len(optimizer.state[never]) == 0 and never.grad is None
    assert_same_training(params, optimizer, want_params, want_optimizer, torch.float32, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_complex_params(backend):
    """Transposed weights (walked in place when the gradient shares the layout, through
    contiguous stand-ins when it does not), a strided slice, a complex parameter, and a
    view starting 4 bytes into its storage (no 16-byte alignment for the kernel to assume)."""
    def make(optimizer_class):
        torch.manual_seed(3)
        wide = torch.randn(10, 20, device=DEVICE)
        params = [nn.Parameter(torch.randn(13, 7, device=DEVICE).t()),
                  nn.Parameter(torch.randn(5, 9, device=DEVICE).t()), nn.Parameter(wide[:, ::2]),
                  nn.Parameter(torch.randn(33, dtype=torch.complex64, device=DEVICE)),
                  nn.Parameter(torch.randn(2049, device=DEVICE)[1:])]
        return params, optimizer_class(params, lr=1e-2)

    params, optimizer = make(_fused(backend))
    want_params, want_optimizer = make(torch.optim.AdamW)
    generator = torch.Generator().manual_seed(4)
    for _ in range(5):
        for index, (param, want) in enumerate(zip(params, want_params)):
            grad = torch.randn(param.shape, generator=generator, dtype=param.dtype).to(DEVICE)
            if index == 0:
                grad = torch.empty_like(param).copy_(grad)  # the transposed layout of its parameter
            param.grad, want.grad = grad.clone(memory_format=torch.preserve_format), grad.clone()
        optimizer.step()
        want_optimizer.step()
    assert params[0].grad.stride() == params[0].stride() and params[1].grad.stride() != params[1].stride()
    assert not params[2].is_contiguous() and params[4].data_ptr() % 16 != 0
    for param, want in zip(params, want_params):
        torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-5)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[param][key], want_optimizer.state[want][key],
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graph_kept_across_the_step_refuses_to_read_the_updated_weights(backend):
    # Like torch's optimizers: the step is an in-place change autograd must know of,
    # even where a kernel writes through data pointers.
    weight = nn.Parameter(torch.randn(8, 8, device=DEVICE))
    loss = (weight @ weight).sum()
    loss.backward(retain_graph=True)
    version = weight._version
    FusedAdamW([weight], lr=1e-2, backend=backend).step()
    assert weight._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_lr_is_read_as_a_float(backend):
    initial, gradients = _initial_params(torch.float32), _gradients(torch.float32, steps=3)
    params, optimizer = _build(lambda p, **o: FusedAdamW(p, lr=torch.tensor(1e-2), backend=backend),
                               initial, "defaults")
    want_params, want_optimizer = _build(torch.optim.AdamW, initial, "defaults")
    _train(params, optimizer, gradients, "defaults")
    _train(want_params, want_optimizer, gradients, "defaults")
    assert_same_training(params, optimizer, want_params, want_optimizer, torch.float32, backend)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(lr=-1e-3), "lr"),
    (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
    (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
], ids=["lr", "beta1", "beta2", "eps", "weight_decay"])
def test_bad_hyperparameters_raise_value_error_like_torch(kwargs, argument):
    param = nn.Parameter(torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError):
        torch.optim.AdamW([param], **kwargs)
    with pytest.raises(ValueError, match=f"FusedAdamW: {argument} must be"):
        FusedAdamW([param], **kwargs)
    optimizer = FusedAdamW([param])
    with pytest.raises(ValueError, match=f"FusedAdamW param group 1: {argument} must be"):
        optimizer.add_param_group(dict(params=[nn.Parameter(torch.zeros(2, device=DEVICE))], **kwargs))
    assert len(optimizer.param_groups) == 1


def test_sparse_gradients_are_refused():
    embedding = nn.Embedding(10, 4, sparse=True).to(DEVICE)
    embedding(torch.tensor([1, 2], device=DEVICE)).sum().backward()
    optimizer = FusedAdamW(embedding.parameters())
    with pytest.raises(RuntimeError, match="parameter 0 in param group 0 is sparse"):
        optimizer.step()


def test_backend_without_implementation_is_refused_at_construction():
    with pytest.raises(ValueError, match="adamw: backend 'inductor'"):
        FusedAdamW([nn.Parameter(torch.zeros(3, device=DEVICE))], backend="inductor")


def test_cpu_default_is_the_fused_aten_kernel(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert select_backend(ADAMW, torch.device("cpu")) == "native"


def test_profiler_shows_the_step():
    param = nn.Parameter(torch.randn(10, device=DEVICE))
    optimizer = FusedAdamW([param])
    param.grad = torch.randn_like(param)
    with torch.profiler.profile() as profile:
        optimizer.step()
    assert "te_lab::adamw_step" in {event.name for event in profile.events()}


def test_reference_step_is_torch_functional_adamw():
    """adamw_reference_step takes torch.optim.adamw.adamw's arguments and computes the same."""
    outcomes = []
    for step_fn in (adamw_reference_step, torch_adamw):
        torch.manual_seed(5)
        param, grad, exp_avg = (torch.randn(17, device=DEVICE) for _ in range(3))
        exp_avg_sq, max_exp_avg_sq = (torch.rand(17, device=DEVICE) for _ in range(2))
        lists = [[param], [grad], [exp_avg], [exp_avg_sq], [max_exp_avg_sq], [torch.tensor(3.0)]]
        step_fn(*lists, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                amsgrad=True, maximize=True)
        outcomes.append(lists)
    for got, want in zip(*outcomes):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.triton_interpreter
@pytest.mark.skipif("triton" not in fused_backends(ADAMW), reason="the triton backend cannot run here")
def test_triton_launches_once_per_dtype(monkeypatch):
    """Five parameters in two dtypes, two param groups, one strided: two launches per
    step (one per dtype), each with one program per chunk of every tensor."""
    launches = []
    kernel = adamw._adamw_multi_tensor_kernel

    class CountingKernel:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(adamw, "_adamw_multi_tensor_kernel", CountingKernel())
    params = [nn.Parameter(torch.randn(shape, device=DEVICE, dtype=dtype)) for shape, dtype in
              [((4097,), torch.float32), ((3, 5), torch.bfloat16), ((), torch.float32),
               ((64,), torch.bfloat16)]]
    params.append(nn.Parameter(torch.randn(8, 6, device=DEVICE)[:, ::2]))
    optimizer = FusedAdamW([dict(params=params[:2]), dict(params=params[2:], lr=1e-2)], backend="triton")
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    assert len(launches) == 2
    # chunks of 1024 elements (the least): bf16 1 + 1, float32 5 + 1 + 1
    assert sorted(grid[0] for grid in launches) == [2, 7]
