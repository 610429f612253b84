"""te_lab's C++ CPU kernels (the ``cpp`` backend): built on this machine, reached from an
eager call with one crossing into C++, seen by profiles and torch.compile as the same op,
and refused with the reason where they cannot be built."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import assert_close
from te_lab.kernels import cpu_kernels, measured_choice, registered_ops, registry, rms_norm, select_backend
from te_lab.kernels.registry import measured_cpu_choice, unavailable_reason
from te_lab.kernels.rms_norm import rms_norm_reference

RMS_NORM = registered_ops()["rms_norm"]
BUILT = cpu_kernels.unavailable_reason() is None
needs_build = pytest.mark.skipif(not BUILT, reason=f"C++ kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _inputs(shape=(6, 48), dtype=torch.float32, residual=True):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator, dtype=dtype, requires_grad=True)
    r = torch.randn(*shape, generator=generator, dtype=dtype, requires_grad=True) if residual else None
    weight = torch.randn(shape[-1], generator=generator, requires_grad=True)
    return x, r, weight


@needs_build
def test_an_eager_call_is_one_op_whose_backward_runs_in_cpp():
    x, r, weight = _inputs()
    with torch.profiler.profile() as trace:
        y, h = rms_norm(x, weight, residual=r, backend="cpp")
        assert "RmsNormFunction" in y.grad_fn.name()  # a C++ autograd node, not a Python Function
        torch.autograd.grad((y, h), (x, r, weight), (torch.ones_like(y), torch.ones_like(h)))
    names = [event.name for event in trace.events()]
    assert names.count("te_lab::rms_norm") == 1 and names.count("te_lab::rms_norm_backward") == 1


@needs_build
def test_residual_gradient_reaches_both_inputs_and_an_unused_output_is_allowed():
    x, r, weight = _inputs()
    y, h = rms_norm(x, weight, residual=r, weight_offset=1.0, backend="cpp")
    want_y, want_h = rms_norm_reference(x, weight, residual=r, weight_offset=1.0)
    # Only y's gradient flows (h unused), then only h's (y unused).
    for outputs, expected in (((y,), (want_y,)), ((h,), (want_h,))):
        got = torch.autograd.grad(outputs[0].pow(2).sum(), (x, r), retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(expected[0].pow(2).sum(), (x, r), retain_graph=True)
        for a, b in zip(got, want):
            assert_close(a, b, torch.float32, "cpp")


@needs_build
def test_weight_gradient_only_where_asked():
    x, _, weight = _inputs(residual=False)
    frozen = weight.detach()
    y = rms_norm(x, frozen, backend="cpp")
    [dx] = torch.autograd.grad(y.sum(), (x,))
    [want] = torch.autograd.grad(rms_norm_reference(x, frozen).sum(), (x,))
    assert_close(dx, want, torch.float32, "cpp")
    y = rms_norm(x.detach(), weight, backend="cpp")  # weight needs its gradient, x does not
    [dw] = torch.autograd.grad(y.sum(), (weight,))
    [want_dw] = torch.autograd.grad(rms_norm_reference(x.detach(), weight).sum(), (weight,))
    assert_close(dw, want_dw, torch.float32, "cpp")


@needs_build
@pytest.mark.parametrize("rows", [1, 3, 4096])
def test_many_rows_split_across_threads_sum_the_weight_gradient(rows):
    x, r, weight = _inputs((rows, 256))
    upstream = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(rms_norm(x, weight, residual=r, backend="cpp")[0], (x, r, weight), upstream)
    want = torch.autograd.grad(rms_norm_reference(x, weight, residual=r)[0], (x, r, weight), upstream)
    for a, b in zip(got, want):
        assert_close(a, b, torch.float32, "cpp", atol=1e-4)


@needs_build
def test_torch_compile_traces_through_the_cpp_backend():
    x, r, weight = _inputs()

    def step(x, r, weight):
        y, h = rms_norm(x, weight, residual=r, backend="cpp")
        return (y * 2 + h).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, r, weight), (x, r, weight))
    want = torch.autograd.grad(step(x, r, weight), (x, r, weight))
    for a, b in zip(got, want):
        assert_close(a, b, torch.float32, "cpp")


@needs_build
def test_the_automatic_choice_measures_cpp_against_inductor(tmp_path, monkeypatch):
    monkeypatch.setenv(measured_choice.CACHE_ENV, str(tmp_path))
    measured_choice._decisions.clear()
    measured_choice._known.clear()
    try:
        assert select_backend(RMS_NORM, torch.device("cpu")) == "cpp"
        chosen = measured_cpu_choice(RMS_NORM, torch.float32, (64, 64))
        [decision] = [value for key, value in measured_choice.decisions().items() if key.startswith("rms_norm")]
        assert chosen == decision["choice"] and set(decision["median_us"]) == {"cpp", "inductor", "reference"}
        # A process that cannot build the kernels reads the same cache: a choice of cpp is
        # measured again among what it can run; any other stands.
        measured_choice._known.clear()
        monkeypatch.setattr(cpu_kernels, "_reasons", {"cpu": "no compiler"})
        again = measured_cpu_choice(RMS_NORM, torch.float32, (64, 64))
        [redecided] = [value for key, value in measured_choice.decisions().items() if key.startswith("rms_norm")]
        assert again == redecided["choice"] != "cpp"
        assert redecided == decision if decision["choice"] != "cpp" else set(redecided["median_us"]) == {
            "inductor", "reference"}
    finally:
        measured_choice._decisions.clear()
        measured_choice._known.clear()


def test_without_the_kernels_the_op_falls_back_and_a_forced_cpp_says_why(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_reasons", {"cpu": "te_lab's C++ CPU kernels could not be built here (x)"})
    monkeypatch.setattr(registry, "_automatic", {})  # the remembered automatic answers, restored afterwards
    cpu = torch.device("cpu")
    assert unavailable_reason(RMS_NORM, "cpp", cpu).endswith("(x)")
    assert select_backend(RMS_NORM, cpu) == "inductor"
    x, _, weight = _inputs(residual=False)
    with pytest.raises(ValueError, match=r"rms_norm: backend 'cpp' .* could not be built here \(x\)"):
        rms_norm(x, weight, backend="cpp")
    assert unavailable_reason(RMS_NORM, "cpp", torch.device("meta")) == "te_lab's C++ kernels run on the CPU only"


def _fresh_process(tmp_path, **env):
    code = ("from te_lab.kernels import cpu_kernels; import sys; reason = cpu_kernels.unavailable_reason(); "
            "print(reason); sys.exit(0 if reason is None else 1)")
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=300)


def test_a_machine_without_a_working_compiler_gets_the_reason_not_a_crash(tmp_path):
    done = _fresh_process(tmp_path, CXX="/nonexistent/c++")
    assert done.returncode == 1, done.stderr
    assert "te_lab's C++ CPU kernels could not be built here" in done.stdout
    assert "building te_lab's C++ CPU kernels" in done.stderr  # the build was attempted, and said so
    assert not list(tmp_path.glob("te_lab/cpu-kernels/*/built"))


def test_the_switch_turns_them_off_and_bad_values_are_refused(tmp_path):
    done = _fresh_process(tmp_path, TE_LAB_CPP="off")
    assert done.returncode == 1 and done.stdout.strip() == "TE_LAB_CPP=off"
    done = _fresh_process(tmp_path, TE_LAB_CPP="maybe")
    assert done.returncode == 1 and "TE_LAB_CPP='maybe': expected 'on' or 'off'" in done.stderr
