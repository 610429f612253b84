"""attribute() on real CPU profiles, with the device side a GPU trace would add injected:
Kineto's runtime and kernel ids must not be mistaken for CPU ops' ids, device activity is
linked to its CPU op through the linked correlation id, and a GPU trace without device
activity falls back to host times and says so; the per-event cost the profiler is
charged with, on hand-made events."""

import types

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

from te_lab.profiler import regions
from te_lab.profiler.attribution import (
    BACKWARD_PREFIX,
    NO_DEVICE_ACTIVITY_NOTE,
    StepTrace,
    _add_wall_times,
    attribute,
    event_cost_us,
)
from te_lab.profiler.regions import PREFIX


def profiled_ops():
    """A profile with two module regions: "block" (a linear: aten::addmm nested in
    aten::linear) and "mm" (one aten::mm, nothing under it)."""
    x, weight, bias, other = torch.randn(32, 64), torch.randn(48, 64), torch.randn(48), torch.randn(64, 48)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                with_flops=True, profile_memory=True) as profiler:
        with record_function(PREFIX + "block"):
            torch.nn.functional.linear(x, weight, bias)
        with record_function(PREFIX + "mm"):
            torch.mm(x, other)
    return profiler


class Injected:
    """A finished profiler with extra Kineto events and activities, as a GPU run adds them."""

    def __init__(self, real, events=(), activities=()):
        results = real.profiler.kineto_results
        self._real = real
        self.profiler = types.SimpleNamespace(kineto_results=types.SimpleNamespace(
            events=lambda: list(results.events()) + list(events),
            trace_activities=lambda: list(results.trace_activities()) + list(activities)))

    def events(self):
        return self._real.events()


def kineto_event(correlation, linked, shapes):
    """A runtime call as Kineto records it on the host: a CPU-side event whose correlation
    id is the runtime's (here equal to a CPU op's) and whose linked id names its op."""
    return types.SimpleNamespace(
        correlation_id=lambda: correlation, linked_correlation_id=lambda: linked, device_type=lambda: DeviceType.CPU,
        name=lambda: "cudaLaunchKernel", shapes=lambda: shapes, dtypes=lambda: ["float"] * len(shapes),
        flops=lambda: 0, start_ns=lambda: 0, end_ns=lambda: 1)


def live_activity(kind, name, start, duration, correlation, linked):
    values = dict(type=kind, name=name, timestamp=start, duration=duration, correlation_id=correlation,
                  linked_correlation_id=linked, device_id=0, resource_id=7, metadata_json="")
    return types.SimpleNamespace(**{key: (lambda value=value: value) for key, value in values.items()})


def op_id(profiler, name):
    (event,) = [e for e in profiler.events() if e.name == name]
    return event.id


def test_a_runtime_id_equal_to_a_cpu_op_id_does_not_replace_that_op():
    profiler = profiled_ops()
    clean = attribute(profiler, "eager", None, on_gpu=False).regions["mm"]
    mm = op_id(profiler, "aten::mm")
    # Keyed by correlation id over every event, the runtime call's shapes would be the mm's.
    colliding = kineto_event(mm, linked=mm + 1000, shapes=[[4096, 4096], [4096, 4096]])
    injected = attribute(Injected(profiler, events=[colliding]), "eager", None, on_gpu=False).regions["mm"]
    assert (injected.bytes_moved, injected.flops) == (clean.bytes_moved, clean.flops)
    # [32, 64] @ [64, 48] in float32: reads both, writes [32, 48]
    assert clean.bytes_moved == 4 * (32 * 64 + 64 * 48 + 32 * 48)
    assert clean.flops == 2 * 32 * 64 * 48


def test_a_gemm_counts_as_a_whole_not_as_the_views_and_copies_inside_it():
    regions = attribute(profiled_ops(), "eager", None, on_gpu=False).regions
    # aten::linear -> aten::addmm, which calls resolve_conj and copies the bias into y first:
    # the GEMM's cost is bias, x and W read, y written
    assert regions["block"].bytes_moved == 4 * (48 + 32 * 64 + 48 * 64 + 32 * 48)
    assert regions["block"].flops == 2 * 32 * 64 * 48


def test_a_kernel_belongs_to_the_top_level_op_over_the_op_it_is_linked_to():
    profiler = profiled_ops()
    addmm = op_id(profiler, "aten::addmm")
    # Launched at time 0, outside every op's host interval: only the linked id can place it.
    device_side = [live_activity("cuda_runtime", "cudaLaunchKernel", 0, 5, 77, addmm),
                   live_activity("kernel", "ampere_sgemm_32x32", 10, 100, 77, addmm)]
    trace = attribute(Injected(profiler, activities=device_side), "fused", None, on_gpu=True)
    (kernel,) = trace.timeline  # the only device activity
    assert (kernel.name, kernel.lane, kernel.path, kernel.phase) == ("ampere_sgemm_32x32", "stream 7", "block",
                                                                      "forward")
    assert trace.notes == []
    assert [k.op_id for k in trace.kernels] == [addmm]


def test_a_gpu_trace_without_device_activity_falls_back_to_host_times_and_says_so():
    profiler = profiled_ops()
    on_cpu = attribute(profiler, "fused", None, on_gpu=False)
    fallback = attribute(profiler, "fused", None, on_gpu=True)
    assert fallback.notes == [NO_DEVICE_ACTIVITY_NOTE.format(mode="fused")]
    block = fallback.regions["block"]
    assert block.forward_ms == pytest.approx(on_cpu.regions["block"].forward_ms) and block.forward_ms > 0
    assert block.launches == on_cpu.regions["block"].launches == 1
    assert [e.lane for e in fallback.timeline] == [e.lane for e in on_cpu.timeline] != []
    assert fallback.kernels == []


def test_a_live_gpu_step_gets_the_same_figures_as_a_trace_file_would():
    from te_lab.profiler import assembly, measurement
    from te_lab.profiler.device_kernels import device_figures

    profiler = profiled_ops()
    addmm, mm = op_id(profiler, "aten::addmm"), op_id(profiler, "aten::mm")
    metadata = '"grid": [54, 1, 1], "est. achieved occupancy %": 50'
    device_side = [live_activity("cuda_runtime", "cudaLaunchKernel", 1_000, 5, 77, addmm),
                   live_activity("kernel", "gemm", 2_000, 400, 77, addmm),
                   live_activity("cuda_runtime", "cudaLaunchKernel", 2_500, 5, 78, mm),
                   live_activity("kernel", "gemm", 3_000, 600, 78, mm)]
    for kernel in device_side[1::2]:
        kernel.metadata_json = lambda: metadata
    trace = attribute(Injected(profiler, activities=device_side), "fused", None, on_gpu=True)
    assert [(e.path, e.start_us) for e in trace.timeline] == [("block", 0.0), ("mm", 1.0)]
    profiled = measurement.Profiled(trace, wall_ms=0.002, peak_memory_bytes=None, peak_memory_source="")
    figures = {f.name: f.value for f in assembly._device_figures("fused", profiled, 108)}
    # over the 2 µs from the first kernel: kernels 2000..2400 and 3000..3600 ns
    assert figures["device busy"] == pytest.approx(1000 / 2000)
    assert figures["estimated SM efficiency"] == pytest.approx(0.5 * 1000 / 2000)
    assert figures["achieved occupancy"] == pytest.approx(0.5)
    # the gap 2400..3000: the second launch began at 2500 (100 ns waiting on the host), then 500 ns other;
    # after the last kernel, 3600..4000: other
    assert figures["device idle: waiting on host"] == pytest.approx(100 / 2000)
    assert figures["device idle: other"] == pytest.approx((500 + 400) / 2000)
    assert [(f.name, f.value) for f in device_figures(trace.kernels, 2_000, 4_000, 108, "fused", "x")] == \
        list(figures.items())


def _node(name, start, end, sequence_nr, thread=1):
    """An autograd node's event as the profiler gives it (what _add_wall_times reads)."""
    return types.SimpleNamespace(name=BACKWARD_PREFIX + name, sequence_nr=sequence_nr, thread=thread, cpu_parent=None,
                                 cpu_children=[], time_range=types.SimpleNamespace(
                                     start=start, end=end, elapsed_us=lambda: end - start))


def test_the_engines_gap_counts_for_a_module_only_between_its_own_nodes():
    # module a's nodes at 0-10 and 12-20 us, then b's at 30-40 us: a gets its 2 us gap, the
    # 10 us between a's last node and b's first are no one's ("(other)")
    trace = StepTrace()
    _add_wall_times(trace, [_node("A1", 0, 10, 7), _node("A2", 12, 20, 6), _node("B", 30, 40, 3)],
                    {7: "a", 6: "a", 3: "b"})
    assert trace.regions["a"].backward_ms == pytest.approx(0.020)
    assert trace.regions["b"].backward_ms == pytest.approx(0.010)
    assert trace.attributed_us == pytest.approx(30.0)
    assert trace.events == {"a": [0, 2], "b": [0, 1]}  # one event per node (no children here)


def test_each_keys_recorded_events_are_counted_and_the_per_event_cost_measured():
    block, head = torch.nn.Linear(64, 48), torch.nn.Linear(48, 8)
    x = torch.randn(32, 64, requires_grad=True)
    with regions.labelled({"block": block, "head": head}):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            head(torch.relu(block(x))).sum().backward()
    trace = attribute(profiler, "eager", None, on_gpu=False, costs=False)
    events = [e for e in profiler.events() if e.device_type == DeviceType.CPU]
    (block_region,) = [e for e in events if e.name == PREFIX + "block"]

    def under(event):
        return 1 + sum(under(child) for child in event.cpu_children)

    forward, backward = trace.events["block"]
    assert forward == under(block_region)  # the region, aten::linear and everything under it
    assert backward >= 2  # at least the addmm's node and the weight's transpose node, with their ops
    assert set(trace.events) == {"block", "head"}
    assert sum(map(sum, trace.events.values())) <= trace.recorded_events == len(events)
    # aten::linear calls aten::t then aten::addmm: the gap between them is the recording
    assert 0.0 < trace.event_cost_us < 50.0


class _Event:
    """What event_cost_us reads of a profiler event: its name, time range and children."""

    def __init__(self, name, start, end, children=()):
        self.name, self.cpu_children = name, list(children)
        self.time_range = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)


def test_the_per_event_cost_is_the_median_gap_between_aten_siblings():
    # gaps of 0.3, 0.5 (linear: t, then addmm after 0.3 us; mean: sum, div after 0.5 us, and
    # copy_ 0.4 us later) and 0.4 us: median 0.4. A parent's own time before and after its
    # children (2 and 1.5 us here) is its own work, not the recording: left out.
    linear = _Event("aten::linear", 0.0, 10.0, [_Event("aten::t", 2.0, 3.0), _Event("aten::addmm", 3.3, 9.0)])
    mean = _Event("aten::mean", 20.0, 30.0, [_Event("aten::sum", 21.0, 24.0), _Event("aten::div", 24.5, 26.0),
                                              _Event("aten::copy_", 26.4, 28.5)])
    # a Python-level region or a single child gives no gap; a non-ATen child is not counted
    region = _Event("te_lab::mlp", 40.0, 60.0, [_Event("aten::mm", 41.0, 45.0), _Event("aten::mm", 50.0, 55.0)])
    single = _Event("aten::to", 70.0, 72.0, [_Event("aten::_to_copy", 70.5, 71.5)])
    mixed = _Event("aten::foo", 80.0, 90.0, [_Event("aten::a", 81.0, 82.0), _Event("my::op", 85.0, 86.0)])
    events = [linear, mean, region, single, mixed] + linear.cpu_children + mean.cpu_children
    assert event_cost_us(events) == pytest.approx(0.4)
    assert event_cost_us([region, single]) == 0.0


class _ScaleThenCast(torch.nn.Module):
    """Ends in a cast to the dtype its tensor already has: a no-op that makes no autograd
    node but records the number the next node will get (as eager RMSNorm's ``.to``)."""

    def forward(self, x):
        return (x * 2).to(torch.float32)


def test_a_node_belongs_to_the_module_whose_op_made_it_not_to_a_no_op_before_it():
    scale, linear = _ScaleThenCast(), torch.nn.Linear(16, 4)
    x = torch.randn(8, 16, requires_grad=True)
    with regions.labelled({"scale": scale, "linear": linear}):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            linear(scale(x)).sum().backward()
    events = [e for e in profiler.events() if e.device_type == DeviceType.CPU]
    casts = [e for e in events if e.name == "aten::to" and e.sequence_nr >= 0]
    transposes = [e for e in events if e.name == "aten::t" and e.sequence_nr >= 0]
    # the premise: the cast and the linear's transpose record the same number
    assert casts and transposes and casts[0].sequence_nr == transposes[0].sequence_nr
    trace = attribute(profiler, "eager", None, on_gpu=False, costs=False)

    def under(event):
        return 1 + sum(under(child) for child in event.cpu_children)

    nodes = {e.name[len(BACKWARD_PREFIX):]: e for e in events if e.name.startswith(BACKWARD_PREFIX)}
    assert trace.events["scale"][1] == under(nodes["MulBackward0"])  # its one node, not the transpose's
    assert trace.events["linear"][1] == sum(under(nodes[name]) for name in ("TBackward0", "AddmmBackward0"))
