"""te_lab.profiler.correction, .measurement's median run and .compiles: the profiler's
per-event cost taken off a module's time, the factor that scales profiled op times to the
unprofiled step, each profiled step corrected on its own, the median run, the overhead
warning, and counting
compilations (hand-made numbers;
the integration with a real profile is in test_profiler.py)."""

import pytest
import torch

from te_lab.profiler import correction
from te_lab.profiler.assembly import correct_runs, per_round_totals
from te_lab.profiler.attribution import StepTrace
from te_lab.profiler.compiles import CompileCounter
from te_lab.profiler.measurement import Profiled, median_run
from te_lab.profiler.report import OTHER_KEY, Region


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


def test_a_modules_recorded_events_cost_comes_off_its_own_time():
    # 0.75 us per event: a norm of 80 events (0.25 ms profiled) loses 0.06 ms, an MLP of
    # 100 events (4 ms) 0.075 ms: by events, not in proportion to time
    per_event = 0.75e-3
    assert correction.without_events(0.25, 80, per_event) == pytest.approx(0.19)
    assert correction.without_events(4.0, 100, per_event) == pytest.approx(3.925)
    assert correction.without_events(0.01, 80, per_event) == 0.0  # never below zero



def _run(wall_ms, norm_ms, mlp_ms=0.0, norm_events=0, recorded_events=0, event_cost_us=0.0):
    regions = {"norm": Region(forward_ms=norm_ms / 2, backward_ms=norm_ms / 2)}
    if mlp_ms:
        regions["mlp"] = Region(forward_ms=mlp_ms)
    trace = StepTrace(regions=regions, events={"norm": (norm_events // 2, norm_events - norm_events // 2)},
                      recorded_events=recorded_events, event_cost_us=event_cost_us)
    return Profiled(trace, wall_ms, None, "")


def test_each_profiled_run_is_corrected_with_its_own_event_cost_and_speed():
    # two profiled steps of one mode whose unprofiled steps took 30 ms (median): the first
    # 40 ms with 2000 events at 0.5 us (1 ms), the norm 3 ms of it with 400 events (0.2 ms);
    # the second, on a busier moment, 60 ms with the events at 1 us (2 ms), the norm 4 ms
    runs = {"eager": [_run(40.0, 3.0, 20.0, 400, 2000, 0.5), _run(60.0, 4.0, 36.0, 400, 2000, 1.0)]}
    corrections = correct_runs(runs, {"eager": 30.0}, device_times=False)
    first, second = (run.trace for run in runs["eager"])
    assert first.regions["norm"].total_ms == pytest.approx(2.8 * 30 / 39)  # (3 - 0.2) x 30 / (40 - 1)
    assert first.regions["mlp"].total_ms == pytest.approx(20.0 * 30 / 39)  # no events counted: none off
    assert second.regions["norm"].total_ms == pytest.approx(3.6 * 30 / 58)  # (4 - 0.4) x 30 / (60 - 2)
    assert second.attributed_us == pytest.approx((3.6 + 36.0) * 30 / 58 * 1e3)
    assert corrections["eager"] == pytest.approx((0.75e-3, (30 / 39 + 30 / 58) / 2))


def test_gpu_kernel_times_stay_unless_they_exceed_the_unprofiled_step():
    runs = {"fused": [_run(40.0, 1.0, 5.0), _run(50.0, 2.0, 10.0)]}
    for run in runs["fused"]:
        run.trace.kernels = ["a kernel"]  # device activity: the regions hold kernel times
    corrections = correct_runs(runs, {"fused": 10.0}, device_times=True)
    assert runs["fused"][0].trace.regions["norm"].total_ms == pytest.approx(1.0)  # 6 ms of kernels < 10 ms
    assert runs["fused"][1].trace.regions["norm"].total_ms == pytest.approx(2.0 * 10 / 12)
    assert corrections["fused"] == pytest.approx((0.0, (1.0 + 10 / 12) / 2))


def test_the_median_run_takes_each_regions_median_total_and_the_median_wall_time():
    runs = [_run(40.0, 1.0), _run(50.0, 1.3), _run(80.0, 1.1)]
    merged = median_run(runs)
    assert merged.trace.regions["norm"].total_ms == pytest.approx(1.1)
    assert merged.wall_ms == 50.0 and merged.trace.attributed_us == pytest.approx(1100.0)


def test_the_rounds_other_is_the_rest_of_the_unprofiled_step():
    runs = {"eager": [_run(40.0, 1.0, 6.0), _run(50.0, 1.5, 7.0)]}
    totals = per_round_totals(runs, {"eager": 10.0})
    assert totals["norm"]["eager"] == {0: 1.0, 1: 1.5}
    assert totals[OTHER_KEY]["eager"] == pytest.approx({0: 3.0, 1: 1.5})
