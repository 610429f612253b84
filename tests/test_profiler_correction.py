"""te_lab.profiler.correction and .compiles: the factor that scales profiled op times to the
unprofiled step, the overhead warning, and counting compilations (hand-made numbers;
the integration with a real profile is in test_profiler.py)."""

import pytest
import torch

from te_lab.profiler import correction
from te_lab.profiler.compiles import CompileCounter


def test_cpu_times_scale_by_unprofiled_over_profiled_step():
    # a 30 ms profiled step of which 24 ms are attributed ops, 10 ms unprofiled
    scale = correction.attribution_scale(10.0, 30.0, 24.0, device_times=False)
    assert scale == pytest.approx(1 / 3)
    other_ms = 10.0 - 24.0 * scale  # what the engine gives "(other)": the rest of the unprofiled step
    assert other_ms == pytest.approx(2.0) and 24.0 * scale + other_ms == pytest.approx(10.0)


def test_cpu_times_never_sum_past_the_step_when_medians_disagree():
    # medians per region can add up past the profiled wall time's median
    scale = correction.attribution_scale(10.0, 20.0, 25.0, device_times=False)
    assert 25.0 * scale == pytest.approx(10.0)


def test_gpu_kernel_times_stay_unless_they_exceed_the_step():
    assert correction.attribution_scale(10.0, 40.0, 6.0, device_times=True) == 1.0
    assert correction.attribution_scale(10.0, 40.0, 12.5, device_times=True) == pytest.approx(0.8)


def test_missing_times_leave_the_scale_at_one():
    assert correction.attribution_scale(0.0, 5.0, 5.0, device_times=False) == 1.0
    assert correction.attribution_scale(5.0, 0.0, 0.0, device_times=False) == 1.0
    assert correction.attribution_scale(5.0, 0.0, 0.0, device_times=True) == 1.0


def test_the_overhead_warning_starts_past_a_quarter():
    assert correction.overhead_warning("fused", 10.0, 12.5) == ""
    warning = correction.overhead_warning("fused", 10.0, 12.6)
    assert warning.startswith("warning: the profiler slowed the fused step by 26%")
    assert "12.600 ms profiled against 10.000 ms unprofiled" in warning


def test_the_compile_counter_sees_a_dynamo_compile_and_nothing_else():
    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="eager")  # Dynamo only: fast, no Inductor
    x = torch.randn(4)
    with CompileCounter() as counter:
        double(x)
    assert counter.count == 0
    with counter:
        compiled(x)
    assert counter.count == 1
    with counter:
        compiled(x)  # compiled already: guards pass, nothing compiles
    assert counter.count == 1


def test_the_compile_counter_counts_tritons_post_compile_hook_and_hands_it_on():
    knobs = pytest.importorskip("triton.knobs")  # Triton >= 3.4 (3.2's hook is JITFunction.compiled_hook)
    seen = []
    owner = knobs.runtime
    before = owner.jit_post_compile_hook
    owner.jit_post_compile_hook = lambda *args, **kwargs: seen.append(kwargs) or "previous"
    try:
        previous = owner.jit_post_compile_hook
        with CompileCounter() as counter:
            # what Triton's JIT calls after compiling a kernel
            assert owner.jit_post_compile_hook(key="kernel", warmup=False) == "previous"
        assert counter.count == 1 and seen == [{"key": "kernel", "warmup": False}]
        assert owner.jit_post_compile_hook is previous  # put back as found
    finally:
        owner.jit_post_compile_hook = before
