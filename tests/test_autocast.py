"""Fused ops and fused models under torch.autocast behave like the code they replace:
each op against the ATen op (or model code) it stands for, run under the same autocast
(output dtype, values, gradients and their dtypes); the tiny demo Llama trained fused
and unfused under bf16 autocast; fp16 training with a GradScaler, whose skipping of
overflowed steps must survive the fused kernels and FusedAdamW."""

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F

import te_lab
from conftest import DEVICE, TOLERANCES, backend_params, interpreted
from te_lab import models
from te_lab.benchmarks.cases import OPTIMIZER_OPS, Size, op_cases
from te_lab.kernels import (
    FusedAdamW,
    attention,
    cross_entropy,
    fused_linear_cross_entropy,
    glu,
    layer_norm,
    linear_act,
    rms_norm,
    rope,
    rope_reference,
)
from te_lab.kernels.attention import ATTENTION
from te_lab.kernels.bias_act import BIAS_ACT
from te_lab.kernels.cross_entropy import CROSS_ENTROPY
from te_lab.kernels.fused_linear_cross_entropy import FUSED_LINEAR_CROSS_ENTROPY
from te_lab.kernels.glu import GLU
from te_lab.kernels.layer_norm import LAYER_NORM
from te_lab.kernels.linear import LINEAR, linear
from te_lab.kernels.registry import DISPATCH_KEYS, registered_ops
from te_lab.kernels.rms_norm import RMS_NORM
from te_lab.kernels.rope import ROPE
from te_lab.modules import FusedRMSNorm

AUTOCAST_DTYPE = torch.bfloat16


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(DEVICE, dtype).requires_grad_(True)


def _run(fn, inputs, dtype=AUTOCAST_DTYPE):
    """``fn(*inputs)`` under autocast, and the gradients of a fixed random function of its
    output with respect to ``inputs`` (backward outside the region, as AMP recipes do)."""
    with torch.autocast(DEVICE.type, dtype=dtype):
        out = fn(*inputs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad((out.float() * upstream).sum(), inputs)
    return out, grads


def assert_matches_normwise(actual, expected, dtype, backend=None, what="output"):
    """Same dtype and ``max |a - b| <= atol + rtol * max |b|`` with ``dtype``'s tolerance
    (as the fusion probe compares): elements of reductions over many low-precision
    products carry rounding noise of the whole sum."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    tolerance = dict(TOLERANCES[dtype])
    if dtype == torch.bfloat16 and interpreted(backend):
        tolerance["atol"] *= 2  # see conftest.assert_close
    error = (actual.double() - expected.double()).abs().max().item()
    bound = tolerance["atol"] + tolerance["rtol"] * expected.double().abs().max().item()
    assert error <= bound, f"{what}: max abs error {error:.3g} > {bound:.3g}"


def assert_op_matches_under_autocast(fused, original, inputs, backend):
    out, grads = _run(fused, inputs)
    expected_out, expected_grads = _run(original, inputs)
    assert_matches_normwise(out, expected_out, AUTOCAST_DTYPE, backend)
    for index, (grad, expected) in enumerate(zip(grads, expected_grads)):
        assert_matches_normwise(grad, expected, AUTOCAST_DTYPE, backend, what=f"gradient of input {index}")
    return out


def test_every_te_lab_custom_op_has_an_autocast_kernel_on_every_device_type():
    # An op without one would run its implementation inside the autocast region. The C++
    # overloads (te_lab::<op>.cpp, cross_entropy_backward.cpp_in_place) are exempt: te_lab
    # calls them directly only where no autocast region is active (kernels/custom_ops.py),
    # and inside the op's own implementation, on inputs its autocast kernel has already cast.
    ops = sorted(name for name in torch._C._dispatch_get_all_op_names()
                 if name.startswith("te_lab::") and "." not in name)
    assert "te_lab::rms_norm" in ops and "te_lab::attention_backward" in ops
    missing = [(op, key) for op in ops for key in DISPATCH_KEYS.values()
               if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "Autocast" + key)]
    assert not missing


# ---- each op against the ATen op or model code it replaces ----

@pytest.mark.parametrize("backend", backend_params(LINEAR))
def test_linear_runs_in_low_precision_like_torch_linear(backend):
    if backend == "native" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 inner product on this CPU (it needs AVX512-BF16 or AMX)")
    x, weight, bias = _randn(4, 6, 32), _randn(48, 32, seed=1, scale=0.2), _randn(48, seed=2)
    out = assert_op_matches_under_autocast(lambda x, w, b: linear(x, w, b, backend=backend), F.linear,
                                           (x, weight, bias), backend)
    assert out.dtype == AUTOCAST_DTYPE


@pytest.mark.parametrize("backend", backend_params(RMS_NORM))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32-stream", "bf16-activation"])
def test_rms_norm_follows_torch_rms_norm(backend, x_dtype):
    x, weight = _randn(4, 6, 64, dtype=x_dtype), _randn(64, seed=1)
    assert_op_matches_under_autocast(lambda x, w: rms_norm(x, w, 1e-6, backend=backend),
                                     lambda x, w: F.rms_norm(x, (64,), w, 1e-6), (x, weight), backend)


@pytest.mark.parametrize("backend", backend_params(LAYER_NORM))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32-stream", "bf16-activation"])
def test_layer_norm_follows_torch_layer_norm(backend, x_dtype):
    x, weight, bias = _randn(4, 6, 64, dtype=x_dtype), _randn(64, seed=1), _randn(64, seed=2)
    assert_op_matches_under_autocast(lambda x, w, b: layer_norm(x, w, b, 1e-5, backend=backend),
                                     lambda x, w, b: F.layer_norm(x, (64,), w, b, 1e-5), (x, weight, bias), backend)


@pytest.mark.parametrize("backend", backend_params(BIAS_ACT))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32-stream", "bf16-activation"])
def test_linear_act_runs_its_gemm_in_low_precision_like_linear(backend, x_dtype):
    x, weight, bias = _randn(4, 6, 32, dtype=x_dtype), _randn(48, 32, seed=1, scale=0.2), _randn(48, seed=2)
    out = assert_op_matches_under_autocast(lambda x, w, b: linear_act(x, w, b, "gelu_tanh", backend=backend),
                                           lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"),
                                           (x, weight, bias), backend)
    assert out.dtype == AUTOCAST_DTYPE


@pytest.mark.parametrize("backend", backend_params(GLU))
def test_glu_keeps_the_dtype_of_its_low_precision_inputs(backend):
    gate, up = _randn(4, 6, 64, dtype=AUTOCAST_DTYPE), _randn(4, 6, 64, dtype=AUTOCAST_DTYPE, seed=1)
    out = assert_op_matches_under_autocast(lambda g, u: glu(g, u, "silu", backend=backend),
                                           lambda g, u: F.silu(g) * u, (gate, up), backend)
    assert out.dtype == AUTOCAST_DTYPE


@pytest.mark.parametrize("backend", backend_params(ROPE))
def test_rope_rotates_low_precision_heads_with_float32_tables(backend):
    q, k = _randn(2, 4, 8, 16, dtype=AUTOCAST_DTYPE), _randn(2, 2, 8, 16, dtype=AUTOCAST_DTYPE, seed=1)
    angles = torch.arange(8.0, device=DEVICE)[:, None] * torch.linspace(0.1, 1.0, 8, device=DEVICE)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    both = lambda rotated: torch.cat([t.flatten() for t in rotated])  # noqa: E731
    out = assert_op_matches_under_autocast(lambda q, k: both(rope(q, k, cos, sin, backend=backend)),
                                           lambda q, k: both(rope_reference(q, k, cos, sin)), (q, k), backend)
    assert out.dtype == AUTOCAST_DTYPE


@pytest.mark.parametrize("backend", backend_params(ATTENTION))
def test_attention_runs_in_low_precision_like_sdpa(backend):
    q, k, v = _randn(2, 4, 16, 16), _randn(2, 2, 16, 16, seed=1), _randn(2, 2, 16, 16, seed=2)
    out = assert_op_matches_under_autocast(
        lambda q, k, v: attention(q, k, v, causal=True, backend=backend),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        (q, k, v), backend)
    assert out.dtype == AUTOCAST_DTYPE


@pytest.mark.parametrize("backend", backend_params(CROSS_ENTROPY))
def test_cross_entropy_of_low_precision_logits_is_float32_like_torch(backend):
    logits = _randn(24, 100, dtype=AUTOCAST_DTYPE, scale=3.0)
    labels = torch.randint(100, (24,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    labels[::5] = -100
    out, (grad,) = _run(lambda x: cross_entropy(x, labels, backend=backend), (logits,))
    expected, (expected_grad,) = _run(lambda x: F.cross_entropy(x, labels), (logits,))
    assert out.dtype == expected.dtype == torch.float32
    assert_matches_normwise(out, expected, AUTOCAST_DTYPE, backend)
    assert_matches_normwise(grad, expected_grad, AUTOCAST_DTYPE, backend, what="logits gradient")


@pytest.mark.parametrize("backend", backend_params(FUSED_LINEAR_CROSS_ENTROPY))
def test_fused_linear_cross_entropy_matmuls_in_low_precision_and_loss_in_float32(backend):
    hidden, weight = _randn(24, 32), _randn(100, 32, seed=1, scale=0.5)
    labels = torch.randint(100, (24,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = assert_op_matches_under_autocast(
        lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=8, backend=backend),
        # what model code runs: the LM head under autocast, the loss on upcast logits
        lambda h, w: F.cross_entropy(F.linear(h, w).float(), labels), (hidden, weight), backend)
    assert out.dtype == torch.float32


def test_an_op_outside_autocast_keeps_insisting_on_one_dtype():
    # Without autocast nothing casts, so mixing dtypes stays an error, as in F.linear.
    with pytest.raises(TypeError, match="weight has dtype torch.float32; expected torch.bfloat16"):
        linear_act(torch.randn(2, 8, dtype=torch.bfloat16, device=DEVICE), torch.randn(4, 8, device=DEVICE))


# ---- whole models ----

def _fused_and_unfused(name="llama-tiny", seq=16):
    model = models.build_model(name, seed=0).to(DEVICE)
    reference = copy.deepcopy(model)
    report = te_lab.fuse(model, sample=model.example_batch(2, seq))
    assert all(row.status == "fused" for row in report.rows), str(report)
    return model, reference


def _batches(model, steps, seq=16):
    return [model.example_batch(2, seq, seed=step) for step in range(steps)]


def _step_loss(model, batch, dtype):
    with torch.autocast(DEVICE.type, dtype=dtype):
        return model(**batch).loss


def test_fusing_inside_an_autocast_region_probes_with_the_regions_tolerance():
    model = models.build_model("llama-tiny", seed=0).to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        report = te_lab.fuse(model, sample=model.example_batch(2, 16), progress=False)
    assert all(row.status == "fused" for row in report.rows), str(report)
    assert report.model_check.within_tolerance
    # The probes saw bf16 math: the attention twin's differences exceed float32's tolerance.
    attention_rows = [row for row in report.rows if row.rule == "attention"]
    assert attention_rows and all(row.grad_max_abs > 1e-4 for row in attention_rows)


@pytest.mark.slow
def test_fused_llama_trains_like_the_unfused_one_under_bf16_autocast():
    model, reference = _fused_and_unfused()
    batches = _batches(model, 10)
    # Autocast changes the numbers: the comparison below is between bf16 runs.
    with torch.no_grad():
        assert _step_loss(reference, batches[0], torch.bfloat16) != reference(**batches[0]).loss

    # Gradients of the first step, every parameter, in the parameters' dtype (float32).
    for trained in (model, reference):
        trained.zero_grad(set_to_none=True)
        _step_loss(trained, batches[0], torch.bfloat16).backward()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert_matches_normwise(param.grad, expected.grad, torch.bfloat16, what=f"gradient of {name}")

    losses = {}
    for label, trained in (("fused", model), ("unfused", reference)):
        optimizer = torch.optim.AdamW(trained.parameters(), lr=3e-3)
        losses[label] = []
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = _step_loss(trained, batch, torch.bfloat16)
            assert loss.dtype == torch.float32
            loss.backward()
            optimizer.step()
            losses[label].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["fused"]), torch.tensor(losses["unfused"]),
                               **TOLERANCES[torch.bfloat16])


def _fp16_autocast_works() -> bool:
    try:
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            return torch.mm(torch.ones(2, 2, device=DEVICE), torch.ones(2, 2, device=DEVICE)).dtype == torch.float16
    except RuntimeError:
        return False


needs_fp16_autocast = pytest.mark.skipif(
    not _fp16_autocast_works(), reason=f"this torch has no float16 autocast on {DEVICE.type}")


def _scaled_step(model, optimizer, scaler, batch, corrupt_gradient=False):
    """One GradScaler step; ``corrupt_gradient`` puts an inf into one gradient after backward."""
    optimizer.zero_grad(set_to_none=True)
    loss = _step_loss(model, batch, torch.float16)
    scaler.scale(loss).backward()
    if corrupt_gradient:
        next(model.parameters()).grad.view(-1)[0] = torch.inf
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def _snapshot(model):
    return [param.detach().clone() for param in model.parameters()]


def _unchanged(model, snapshot):
    return all(torch.equal(param, before) for param, before in zip(model.parameters(), snapshot))


@pytest.mark.slow
@needs_fp16_autocast
def test_fp16_gradscaler_training_of_a_fused_llama_with_fused_adamw_skips_overflowed_steps():
    model, reference = _fused_and_unfused()
    batch = model.example_batch(2, 16, seed=0)
    runs = {}
    for label, trained in (("fused", model), ("unfused", reference)):
        optimizer = FusedAdamW(trained.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10)

        # A gradient made infinite after backward: the step is skipped, the scale halved.
        before = _snapshot(trained)
        _scaled_step(trained, optimizer, scaler, batch, corrupt_gradient=True)
        assert _unchanged(trained, before) and not optimizer.state, label
        assert scaler.get_scale() == 2.0**9, label

        # A loss scale so large that the fp16 backward through the fused kernels overflows.
        scaler.update(2.0**40)
        _scaled_step(trained, optimizer, scaler, batch)
        assert _unchanged(trained, before) and not optimizer.state, label
        assert scaler.get_scale() == 2.0**39, label

        scaler.update(2.0**10)
        runs[label] = [_scaled_step(trained, optimizer, scaler, batch) for _ in range(8)]
        assert not _unchanged(trained, before), label
        assert int(optimizer.state[next(trained.parameters())]["step"]) == 8, label
    # Fitting one batch: the loss falls, fused as unfused, and the two runs agree: the first
    # step within fp16's tolerance; later ones within bf16's, the looser one, since each
    # step's fp16 rounding differences move the next update (measured: 0.02 after 8 steps
    # at lr 1e-2, the loss down from 5.56 to 2.4).
    assert runs["fused"][-1] < runs["fused"][0] - 1.0
    torch.testing.assert_close(runs["fused"][0], runs["unfused"][0], **TOLERANCES[torch.float16])
    torch.testing.assert_close(torch.tensor(runs["fused"]), torch.tensor(runs["unfused"]),
                               **TOLERANCES[torch.bfloat16])


# ---- the float32 rule, which the CPU's autocast lists never trigger ----

@pytest.fixture
def autocast_lists_norms_as_float32(monkeypatch):
    """Autocast rules as CUDA's: layer_norm and rms_norm on the float32 list."""
    autocast_rules = importlib.import_module("te_lab.kernels.autocast")
    listed = autocast_rules.aten_kernel_exists
    monkeypatch.setattr(autocast_rules, "aten_kernel_exists", lambda name, device_type, autocast=False: (
        autocast and name in ("aten::layer_norm", "aten::rms_norm")) or listed(name, device_type, autocast))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norms_compute_and_return_float32_where_autocast_lists_them_so(op, autocast_lists_norms_as_float32):
    x, weight = _randn(4, 6, 64, dtype=torch.bfloat16), _randn(64, seed=1)
    fused = {"layer_norm": lambda x, w: layer_norm(x, w), "rms_norm": lambda x, w: rms_norm(x, w)}[op]
    # What the ATen op does under such a rule: its inputs cast to float32.
    original = {"layer_norm": lambda x, w: F.layer_norm(x.float(), (64,), w),
                "rms_norm": lambda x, w: F.rms_norm(x.float(), (64,), w, 1e-6)}[op]
    out, grads = _run(fused, (x, weight))
    expected, expected_grads = _run(original, (x, weight))
    assert out.dtype == torch.float32
    assert_matches_normwise(out, expected, torch.float32)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_matches_normwise(grad, expected_grad, torch.float32, what="gradient")


def test_fused_rms_norm_without_eps_takes_the_epsilon_of_float32_where_autocast_casts_to_it(
        autocast_lists_norms_as_float32):
    norm = torch.nn.RMSNorm(64, eps=None).to(DEVICE)
    fused = FusedRMSNorm(norm, eps=None)
    x = _randn(4, 64, dtype=torch.bfloat16, scale=1e-3)  # rms near bf16's epsilon: eps matters
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = fused(x)
    expected = F.rms_norm(x.float(), (64,), norm.weight, torch.finfo(torch.float32).eps)
    assert_matches_normwise(out, expected, torch.float32)


# ---- the reference path: the fused op's dtypes on whichever backend is chosen ----

# Every declared op's benchmark case (the op alone) at the smallest size all of them take.
REFERENCE_SIZE = Size(tokens=8, hidden=512)
# Left out for time, with why. Every fused backend runs behind the same custom op and its
# autocast kernel, so the op's dtypes are checked on the backends that remain.
SLOW_UNDER_REFERENCE_SIZE = {
    ("moe", "inductor"): "its case's 32 experts: Inductor unrolls a GEMM per expert (minutes to compile)",
    ("moe", "triton"): "its case's 32 experts through Triton's interpreter (minutes)",
}
REFERENCE_CASES = [pytest.param(name, param.values[0], id=f"{name}-{param.values[0]}", marks=param.marks)
                   for name, op in sorted(registered_ops().items()) if name not in OPTIMIZER_OPS
                   for param in backend_params(op) if (name, param.values[0]) not in SLOW_UNDER_REFERENCE_SIZE]


def _outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("inputs_dtype", [torch.float32, torch.bfloat16], ids=["fp32-inputs", "bf16-inputs"])
@pytest.mark.parametrize("name, backend", REFERENCE_CASES)
def test_every_op_on_its_reference_path_matches_its_fused_backends_under_autocast(
        name, backend, inputs_dtype, autocast_lists_norms_as_float32):
    # The reference path may be chosen by measurement, so it must not change the dtype a
    # fused backend returns. CPU autocast's own rules, plus CUDA's float32 rule for the norms.
    for case in op_cases(name, DEVICE, inputs_dtype, REFERENCE_SIZE, dispatch=True):
        with torch.autocast(DEVICE.type, dtype=AUTOCAST_DTYPE):
            try:
                fused = _outputs(case.fused(*case.inputs, backend=backend))
            except ValueError as declined:
                if f"'{backend}'" not in str(declined) or "cannot run" not in str(declined):
                    raise
                pytest.skip(str(declined))
            reference = _outputs(case.fused(*case.inputs, backend="reference"))
        assert len(reference) == len(fused)
        for index, (actual, expected) in enumerate(zip(reference, fused)):
            assert_matches_normwise(actual, expected, AUTOCAST_DTYPE, backend, what=f"{case.name} output {index}")

