"""From one profiled step to per-key figures: time forward and backward, launches,
bytes moved and FLOPs, and the timeline.

- Forward work belongs to the innermost labelled module region around it
  (:mod:`te_lab.profiler.regions`).
- Backward work belongs to the module whose forward created it: autograd runs each
  node inside ``autograd::engine::evaluate_function: <Node>``, and that event carries the
  sequence number of the forward op that made the node.
- The loss (eager cross-entropy ops, or te_lab's fused linear cross-entropy) belongs to
  ``loss_key`` wherever it runs outside a region.
- Optimizer work (inside ``Optimizer.step``, or a parameter's update during backward by
  ``te_lab.optim.overlap_step``) has the phase "optimizer" and, for the latter, the
  parameter's name as its path; it belongs to no module region.
- Time on the CPU is wall time: a module's forward region from entry to exit (regions
  nested in it left out), and the backward autograd nodes its forward made, start to
  end with the engine's gaps between them, so the Python inside a module counts for it;
  the loss's ops outside any region count by their durations. On GPUs it is the kernels' device time.
- *Launches* are the ops the framework dispatches: on the CPU, every op not nested in
  another op; on GPUs, the device kernels under them. An op's time is its host time on
  the CPU and its kernels' device time (``device_time_total``) on GPUs.
- A GPU trace with no device activity at all (CUPTI or MUPTI unavailable, or the device
  activity not requested) falls back to the CPU's figures, host times, and says so in
  ``StepTrace.notes``: zero device time per module would be wrong, not missing.
- The timeline holds the top-level ops per thread on the CPU, the kernels per stream
  on GPUs; a kernel belongs to the top-level op over the CPU op it is linked to (its
  linked correlation id), else to the op whose host interval holds its launch.
- Kineto's CPU ops are keyed by their correlation id only among the events whose linked
  correlation id is 0: runtime calls and kernels carry CUPTI's / MUPTI's ids there,
  which may equal a CPU op's.
- Bytes and FLOPs sum :func:`te_lab.profiler.estimates.op_cost` over the ops that do
  the work: te_lab's ops and ops with a cost rule of their own (GEMMs, copies,
  reductions) as a whole, and other aten ops with no ops but views inside them.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

from torch.autograd import DeviceType

from .ceiling import is_compute
from .communication import communication_ns
from .device_kernels import device_kernels
from .estimates import element_size, has_rule, op_cost
from .kineto import live_activities
from .regions import OPTIMIZER_PREFIX, PREFIX, TORCH_OPTIMIZER_STEP_PREFIX
from .report import Region, TimelineEvent

BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
OP_NAMESPACES = ("aten::", "te_lab::")
LOSS_OPS = frozenset({
    "te_lab::fused_linear_cross_entropy", "te_lab::cross_entropy", "aten::cross_entropy_loss",
    "aten::log_softmax", "aten::_log_softmax", "aten::nll_loss", "aten::nll_loss_nd", "aten::nll_loss_forward",
})
# Ops that move no data: views, metadata, allocation.
VIEW_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::as_strided", "aten::unsqueeze", "aten::squeeze", "aten::slice",
    "aten::select", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::detach",
    "aten::alias", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resolve_conj",
    "aten::resolve_neg", "aten::lift_fresh", "aten::result_type", "aten::narrow", "aten::numpy_T",
})


# torch.compile's autograd function around a compiled graph's forward: its node
# (CompiledFunctionBackward) runs the compiled backward, and carries its sequence number.
COMPILED_FORWARDS = frozenset({"CompiledFunction"})


def _is_op(event) -> bool:
    return event.name.startswith(OP_NAMESPACES)


@dataclass
class StepTrace:
    """One mode's profiled step, attributed."""

    regions: dict = field(default_factory=dict)  # key -> Region
    timeline: list = field(default_factory=list)
    launches: int = 0
    attributed_us: float = 0.0
    peak_memory_bytes: Optional[int] = None
    kernels: list = field(default_factory=list)  # DeviceKernel, on GPUs
    communication_us: float = 0.0  # while collectives ran (te_lab.profiler.communication)
    collectives: int = 0
    notes: list = field(default_factory=list)  # what the report should say about how this was measured
    # On the CPU: key -> [forward, backward] profiler events recorded inside the time the key
    # is charged with, and every event the step recorded (:mod:`te_lab.profiler.correction`
    # takes each event's cost off the time it landed in).
    events: dict = field(default_factory=dict)
    recorded_events: int = 0
    event_cost_us: float = 0.0  # what recording one event cost, measured in the step (:func:`event_cost_us`)
    # The step's compute (GEMMs and attention kernels, :mod:`te_lab.profiler.ceiling`): their
    # time (host time on the CPU, kernel time on GPUs; corrected by .assembly.correct_runs into
    # compute_ms), the events recorded inside them, and bytes moved by them and by every op of
    # the step (with costs)
    compute_us: float = 0.0
    compute_events: int = 0
    compute_ms: float = 0.0
    compute_bytes: int = 0
    step_bytes: int = 0


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _events_under(event, stop_at_regions: bool = False) -> int:
    """The profiler events ``event`` holds, itself included; with ``stop_at_regions``,
    module regions nested in it (and what they hold) are left out: they count for their own key."""
    return 1 + sum(_events_under(child, stop_at_regions) for child in event.cpu_children
                   if not (stop_at_regions and child.name.startswith(PREFIX)))


def _count_events(trace: StepTrace, key: str, phase: str, count: int) -> None:
    trace.events.setdefault(key, [0, 0])[phase == "backward"] += count


def _kernels_under(event) -> int:
    return len(getattr(event, "kernels", []) or []) + sum(_kernels_under(child) for child in event.cpu_children)


def _cost_events(event):
    """The ops under (and including) a top-level op that do its work: an op with a cost
    rule of its own (te_lab's ops, GEMMs, copies, reductions) as a whole, else the ops
    inside it, views left out (``aten::mm`` calls ``aten::resolve_conj`` on its operands,
    and ``aten::addmm`` copies its bias into the output first: neither is the GEMM). Ops on
    0-dim tensors alone inside another op are its scalar arguments' conversion
    (``x * 1.7`` runs ``aten::to`` on the wrapped 1.7), not its work, and are left out too."""
    if event.name.startswith("te_lab::") or has_rule(event.name):
        yield event
        return
    children = [child for child in event.cpu_children
                if _is_op(child) and child.name not in VIEW_OPS and not _on_scalars_only(child)]
    if not children:
        if event.name not in VIEW_OPS:
            yield event
        return
    for child in children:
        yield from _cost_events(child)


def _on_scalars_only(event) -> bool:
    shapes = event.input_shapes or []
    return bool(shapes) and all(not shape for shape in shapes)


NO_DEVICE_ACTIVITY_NOTE = ("{mode}: the GPU trace holds no device activity (CUPTI / MUPTI unavailable, or not "
                           "recorded), so module times are the ops' host times and launches count top-level ops, "
                           "as on the CPU")


def host_ops_by_id(events) -> dict[int, object]:
    """Kineto's CPU ops by their correlation id: the frontend events (linked correlation
    id 0), as torch's parser keys them; runtime calls and device activity are left out."""
    return {e.correlation_id(): e for e in events
            if e.device_type() == DeviceType.CPU and e.linked_correlation_id() == 0}


def attribute(profiler, mode: str, loss_key: Optional[str], on_gpu: bool, costs: bool = True) -> StepTrace:
    """``profiler``'s step attributed (see the module doc); ``costs``: the step recorded
    shapes and FLOPs, and bytes moved and FLOPs are summed per key (else they stay 0)."""
    events = [e for e in profiler.events() if e.device_type == DeviceType.CPU]
    kineto = host_ops_by_id(profiler.profiler.kineto_results.events())
    trace = StepTrace()
    activities = live_activities(profiler.profiler.kineto_results.trace_activities()) if on_gpu else []
    if on_gpu and not any(activity.on_device for activity in activities):
        on_gpu = False
        trace.notes.append(NO_DEVICE_ACTIVITY_NOTE.format(mode=mode))

    def region_of(event) -> Optional[str]:
        for ancestor in _ancestors(event):
            if ancestor.name.startswith(PREFIX):
                return ancestor.name[len(PREFIX):]
        return None

    # Forward ops that made autograd nodes, by sequence number. An op records the number the
    # next node will get whether or not it makes one, so a no-op at the end of one module
    # (eager RMSNorm's ``.to(dtype)`` of a tensor already in it) carries the number of the
    # next module's first node: the last op to record a number is the one that made its node.
    forward_key: dict[int, Optional[str]] = {}
    for event in sorted(events, key=lambda e: e.time_range.start):
        if (_is_op(event) or event.name in COMPILED_FORWARDS) and event.sequence_nr >= 0 and not any(
                a.name.startswith(BACKWARD_PREFIX) for a in _ancestors(event)):
            key = region_of(event)
            if key is None and any(op.name in LOSS_OPS for op in (event, *_ancestors(event))):
                key = loss_key  # a loss op or an op inside one (log_softmax in cross_entropy)
            forward_key[event.sequence_nr] = key

    def key_and_phase(event) -> tuple[Optional[str], str]:
        updated = _optimizer_target(event)
        if updated is not None:
            return updated or None, "optimizer"
        for ancestor in _ancestors(event):
            if ancestor.name.startswith(BACKWARD_PREFIX):
                return forward_key.get(ancestor.sequence_nr), "backward"
            if ancestor.name.startswith(PREFIX):
                return ancestor.name[len(PREFIX):], "forward"
        return (loss_key if event.name in LOSS_OPS else None), "forward"

    top_level = [e for e in events if _is_op(e) and not any(_is_op(a) for a in _ancestors(e))]
    if not top_level:
        return trace
    start = min(e.time_range.start for e in top_level)
    host_ops: dict[int, HostOp] = {}  # on GPUs, by event id: the window each top-level op launched kernels in
    for event in top_level:
        key, phase = key_and_phase(event)
        launches = _kernels_under(event) if on_gpu else 1
        # On GPUs an op's time is its kernels' device time; its host time is mostly launch.
        duration_us = event.device_time_total if on_gpu else event.time_range.elapsed_us()
        trace.launches += launches
        recorded = kineto.get(event.id)
        if on_gpu and recorded is not None:
            host_ops[event.id] = HostOp(recorded.start_ns(), recorded.end_ns(), key or "", phase)
        costs_of_op = []
        for worker in (_cost_events(event) if costs else ()):
            cost = _cost(worker, kineto)
            if cost is None:
                continue
            costs_of_op.append(cost)
            trace.step_bytes += cost.bytes_moved
            if any(is_compute(op.name) for op in (worker, *_ancestors(worker))):
                trace.compute_bytes += cost.bytes_moved
        if not on_gpu:
            trace.timeline.append(_timeline_event(mode, event, recorded, event.time_range.start - start, duration_us,
                                                  key or "", phase, costs_of_op if costs else None))
        if key is None or phase == "optimizer":
            continue
        region = trace.regions.setdefault(key, Region())
        region.launches += launches
        if on_gpu or not (phase == "backward" or region_of(event) is not None):
            if phase == "forward":
                region.forward_ms += duration_us / 1e3
            else:
                region.backward_ms += duration_us / 1e3
            trace.attributed_us += duration_us
            if not on_gpu:
                _count_events(trace, key, phase, _events_under(event))
        for cost in costs_of_op:
            region.bytes_moved += cost.bytes_moved
            region.flops += cost.flops
    _add_compute(trace, events, on_gpu)
    if not on_gpu:
        _add_wall_times(trace, events, forward_key)
        trace.recorded_events = len(events)
        trace.event_cost_us = event_cost_us(events)
    trace.peak_memory_bytes = peak_live_bytes(profiler)
    if on_gpu:
        trace.kernels = device_kernels(activities)
        first = min((k.start_ns for k in trace.kernels), default=0)
        trace.timeline, launches_from = [], LaunchIndex(list(host_ops.values()))
        top_level_op = _top_level_host_ops(events, host_ops)
        for kernel in trace.kernels:
            launcher = (kernel.op_id and top_level_op.get(kernel.op_id)) or launches_from.launcher(kernel.launched_ns)
            trace.timeline.append(TimelineEvent(
                mode, kernel.name, (kernel.start_ns - first) / 1e3, kernel.duration_ns / 1e3,
                f"stream {kernel.stream}", launcher.path if launcher else "", launcher.phase if launcher else ""))
    communication, trace.collectives = communication_ns(events, trace.kernels)
    trace.communication_us = communication / 1e3
    return trace


def _timeline_event(mode: str, event, recorded, start_us: float, duration_us: float, key: str, phase: str,
                    costs: Optional[list]) -> TimelineEvent:
    """A top-level op on the CPU's timeline; with ``costs`` (a detail step), its bytes."""
    pairs = [(list(shape), dtype) for shape, dtype in zip(recorded.shapes(), recorded.dtypes()) if shape] \
        if recorded is not None else []
    timeline_event = TimelineEvent(mode, event.name, start_us, duration_us, f"thread {event.thread}", key, phase,
                                   [shape for shape, _ in pairs])
    if costs is not None and recorded is not None:
        timeline_event.bytes_read = sum(cost.bytes_read for cost in costs)
        timeline_event.bytes_written = sum(cost.bytes_written for cost in costs)
        timeline_event.input_bytes = [math.prod(shape) * (element_size(dtype) or 0) for shape, dtype in pairs]
    return timeline_event


def _cost(event, kineto: dict):
    """The cost model's bytes and FLOPs of one recorded op (None where kineto lacks it)."""
    recorded = kineto.get(event.id)
    if recorded is None:
        return None
    return op_cost(event.name, recorded.shapes(), recorded.dtypes(), int(recorded.flops()))


def _add_compute(trace: StepTrace, events, on_gpu: bool) -> None:
    """The time of the step's compute ops (:func:`te_lab.profiler.ceiling.is_compute`)
    where no other compute op encloses them, and the events recorded inside them. (Their
    bytes are counted with every op's, where the cost model reads them: a compute op inside
    an op costed as a whole, the chunks' GEMMs of te_lab's fused linear cross-entropy,
    stays in that op's bytes.)"""
    for event in events:
        if not is_compute(event.name) or any(is_compute(a.name) for a in _ancestors(event)):
            continue
        trace.compute_us += event.device_time_total if on_gpu else event.time_range.elapsed_us()
        trace.compute_events += _events_under(event)


def _add_wall_times(trace: StepTrace, events, forward_key: dict) -> None:
    """On the CPU a module's time is wall time, as the step spends it: its forward region
    from entry to exit (less the regions nested in it), the Python between its ops
    included, and in the backward the autograd nodes its forward made, each from start to
    end with the gap since the node before it on its thread where that node was the
    module's too (the engine's work between a module's nodes; between two modules' it is
    "(other)"'s). Op
    durations alone leave that Python to "(other)" in proportion to the op count,
    so "(other)" would shrink with fusion though its code does not change."""
    own_us: dict[int, float] = {}
    keys: dict[int, str] = {}
    for event in events:
        if not event.name.startswith(PREFIX) or event.name.startswith(OPTIMIZER_PREFIX):
            continue
        ancestors = list(_ancestors(event))
        if any(a.name.startswith(BACKWARD_PREFIX) for a in ancestors):
            continue  # recomputed in the backward (checkpointing): inside its node's time
        own_us[event.id] = own_us.get(event.id, 0.0) + event.time_range.elapsed_us()
        keys[event.id] = event.name[len(PREFIX):]
        _count_events(trace, keys[event.id], "forward", _events_under(event, stop_at_regions=True))
        enclosing = next((a for a in ancestors if a.name.startswith(PREFIX)), None)
        if enclosing is not None:
            own_us[enclosing.id] = own_us.get(enclosing.id, 0.0) - event.time_range.elapsed_us()
    for event_id, key in keys.items():
        trace.regions.setdefault(key, Region()).forward_ms += own_us[event_id] / 1e3
        trace.attributed_us += own_us[event_id]
    nodes = sorted((e for e in events if e.name.startswith(BACKWARD_PREFIX) and not any(
        a.name.startswith(BACKWARD_PREFIX) for a in _ancestors(e))), key=lambda e: (e.thread, e.time_range.start))
    previous: dict[int, tuple[float, Optional[str]]] = {}  # thread -> (end, key) of its node before
    for event in nodes:
        key = forward_key.get(event.sequence_nr)
        # The engine's work between two nodes of one module (scheduling, releasing buffers)
        # is the module's; between two modules', no one's ("(other)").
        end, key_before = previous.get(event.thread, (event.time_range.start, None))
        gap = max(event.time_range.start - end, 0.0) if key_before == key else 0.0
        previous[event.thread] = (event.time_range.end, key)
        if key is None:
            continue
        elapsed = event.time_range.elapsed_us() + gap
        trace.regions.setdefault(key, Region()).backward_ms += elapsed / 1e3
        trace.attributed_us += elapsed
        _count_events(trace, key, "backward", _events_under(event))


def event_cost_us(events) -> float:
    """What the profiler cost per event it recorded in this step, measured where nothing
    but the profiler runs between events: between two consecutive ATen ops called by the
    same ATen op (no Python between them), the time from the one's end to the other's start
    is the recording of the first's end and the second's start. The median over those
    gaps; on the 2-core CPU it read 0.31-0.46 us (an event's recording inside its own span,
    the shortest leaf ops' whole time, is 0.03-0.05 us more). A parent's own time beyond
    its children's, per child, which this measured before, read twice that (0.7-0.9 us):
    it holds the parent's own work too, and over-charged the modules densest in events
    (the eager norms by 5-13% at one thread). 0.0 where no such pair ran."""
    gaps = []
    for event in events:
        children = event.cpu_children
        if len(children) > 1 and event.name.startswith("aten::") and all(c.name.startswith("aten::") for c in children):
            ordered = sorted(children, key=lambda child: child.time_range.start)
            gaps += [max(b.time_range.start - a.time_range.end, 0.0) for a, b in zip(ordered, ordered[1:])]
    return statistics.median(gaps) if gaps else 0.0


def _top_level_host_ops(events, host_ops: dict[int, "HostOp"]) -> dict[int, "HostOp"]:
    """Every CPU op's id -> the HostOp of the top-level op it runs in (itself included).
    Runtime calls are left out: their ids are the runtime's correlation ids."""
    found = {}
    for event in events:
        if getattr(event, "linked_correlation_id", 0):
            continue
        outermost = event
        for ancestor in _ancestors(event):
            if _is_op(ancestor):
                outermost = ancestor
        if outermost.id in host_ops:
            found[event.id] = host_ops[outermost.id]
    return found


@dataclass(frozen=True)
class HostOp:
    """A top-level op's host-side interval (kineto's clock, ns) and what it was part of."""

    start_ns: int
    end_ns: int
    path: str
    phase: str


class LaunchIndex:
    """Finds the top-level op a kernel's launch came from: the latest-starting one whose
    host interval holds the launch time."""

    def __init__(self, host_ops: list[HostOp]):
        self._ops = sorted(host_ops, key=lambda op: op.start_ns)
        self._starts = [op.start_ns for op in self._ops]

    def launcher(self, launched_ns: Optional[int]) -> Optional[HostOp]:
        """None for a kernel launched outside every op, or with no recorded launch."""
        if launched_ns is None:
            return None
        # Ops on other threads may start inside a longer op and end before the launch.
        for index in range(bisect.bisect_right(self._starts, launched_ns) - 1, -1, -1):
            if launched_ns <= self._ops[index].end_ns:
                return self._ops[index]
        return None


def _optimizer_target(event) -> Optional[str]:
    """The parameter an op updates inside overlap_step's per-parameter region, "" inside
    any other optimizer step, None outside optimizer steps."""
    target = None
    for ancestor in _ancestors(event):
        if ancestor.name.startswith(OPTIMIZER_PREFIX):
            return ancestor.name[len(OPTIMIZER_PREFIX):]
        if ancestor.name.startswith(TORCH_OPTIMIZER_STEP_PREFIX):
            target = ""
    return target


def peak_live_bytes(profiler) -> int:
    """Peak of allocations minus frees over the step, from the profiler's memory records."""
    live = peak = 0
    for event in profiler.profiler.kineto_results.events():
        if event.name() == "[memory]":
            live += event.nbytes()
            peak = max(peak, live)
    return peak
