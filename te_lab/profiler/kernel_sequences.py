"""Which host call launched which device work in a GPU trace, from Kineto's activities
(:mod:`.kineto`): the frequent kernel sequences of an operator, by Holistic Trace
Analysis' definition (``TraceAnalysis.get_frequent_cuda_kernel_sequences``), and the
chains of memory-bound kernels a fusion could merge (:func:`trace_opportunities`).

**The call tree** (:class:`KernelLaunches`). On each host thread the host activities
(CPU ops, annotations, Python functions, runtime and driver calls) nest by their
intervals: a call's parent is the innermost call still open when it starts. Of two calls
that start together the longer is the parent (the earlier in the file where they last as
long); a call that starts exactly where another ends is its sibling, unless it lasts no
time: then it belongs to the call that ends there. As HTA does, where one thread holds the
``ProfilerStep#N`` annotations and one other (and no third) runs autograd's calls, the
backward thread's top-level calls go under the main thread's ``## backward ##`` annotation
whose interval holds them (its ``ProfilerStep#N`` where it has no such annotation), so a
step holds its backward. A device-side event hangs under
the host call that shares its correlation id (the launch, a runtime or driver call):
kernels, memcpys and memsets, and CUDA's per-stream waits ("Stream Sync", "Stream Wait
Event", which HTA counts as stream events; the device-wide "Context Sync" and "Event Sync"
it does not).

**Frequent sequences** (:func:`frequent_kernel_sequences`), as HTA defines them:

- in a trace of two or more ``ProfilerStep#N``, the last step is left out (it may be cut
  off): the host calls that start from its start on, and what they launched;
- the candidates are the host calls whose name *contains* ``operator_name``;
- only the shallowest of them in the tree count, so an op is not counted again inside
  another candidate (with ``"aten::"``, only top-level ATen ops);
- each with at least ``min_pattern_len`` device events under it is one instance of its
  pattern: its own name, then those events' names in start order;
- patterns are ranked by count, then by HTA's pattern string (``op|kernel|kernel``).

Where this differs from HTA 0.5 (the traces in tests/data/gpu-traces agree wherever HTA
runs, ``tests/test_kernel_sequences.py``): kernels on stream 0 count (HTA links only
streams above 0, so a ROCm trace, whose kernels run on the null stream, gives it no
sequence); the host calls are told by their kind (HTA takes every event with a
``stream`` argument for a device event: Inductor's CPU op around a Triton launch carries
one, so ``"triton_"`` finds nothing there), and the candidates are host calls only (HTA
matches device events' names too); times are the file's, to the ns (HTA rounds a
nanosecond-resolution trace inward to whole µs, and its call tree then fails on the events
that come out negative: it gives no sequence for such a trace at all).

**Fusion opportunities** (:func:`trace_opportunities`): on each stream, a *chain* is a
run of consecutive memory-bound kernels of one phase (the timeline's: forward, backward,
optimizer); at least two make a chain, and the chains of one kernel-name pattern, phase and
launching operator (the innermost CPU op around all their launches; the stream where
none is) are one row. A kernel is memory-bound unless it is compute (its
name is a GEMM, convolution or attention kernel's, :data:`COMPUTE_KERNEL_NAMES`, or an op
around its launch is a GEMM or attention op, :func:`.ceiling.is_compute`, or a
convolution), communication (NCCL / MCCL), te_lab's own (an op ``te_lab::...`` launched
it: fused already), or not a kernel at all: a memcpy or memset is the copy engine's or
the driver's work, which no fused kernel takes over, so it ends a chain too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Optional

from te_lab.device import lookup_peak

from .ceiling import is_compute
from .estimates import element_size, op_cost
from .kineto import DEVICE_KINDS, Activity
from .opportunities import fused_bytes, launch_us
from .opportunity_table import Opportunity, ranked
from .report import TimelineEvent

# Activities that are no host call: device work, CUDA's syncs, Kineto's device-side copies
# of annotations, and its span of the whole trace.
NOT_HOST_KINDS = DEVICE_KINDS + ("cuda_sync", "gpu_user_annotation", "Trace")
STREAM_SYNCS = ("Stream Sync", "Stream Wait Event")
STEP_PREFIX = "ProfilerStep#"  # what marks the main thread, as HTA tells it
STEP_NAME = "ProfilerStep"  # what a step's name contains, as HTA counts steps
BACKWARD_ANNOTATION = "## backward ##"
# GEMM, convolution and attention kernels by what their names contain, lowercased (cuBLAS,
# CUTLASS, cuDNN, flash attention; "fbgemm", a library of embedding kernels, left out), and
# Tensile's on ROCm by their prefix: for those launched outside the ops is_compute knows.
COMPUTE_KERNEL_NAMES = ("gemm", "cutlass", "cublas", "xmma", "scudnn", "winograd", "fft2d", "dgrad", "wgrad", "flash",
                        "fmha", "attention")
COMPUTE_KERNEL_PREFIXES = ("Cijk_",)
_CONVOLUTION_OP = re.compile(r"conv(olution|_transpose|\dd|_tbc)", re.IGNORECASE)
MIN_CHAIN_KERNELS = 2


@dataclass(frozen=True)
class KernelSequence:
    """One pattern of :func:`frequent_kernel_sequences`: the operator and the device
    events it launched, in start order, with HTA's figures summed over its instances."""

    operator: str  # the host call's name (HTA's pattern starts with it)
    kernels: tuple[str, ...]  # device event names (kernels, memcpys, memsets, stream syncs), in start order
    count: int
    device_us: float  # the events' device time ("GPU kernel duration (us)")
    host_us: float  # the operator calls' host time ("CPU op duration (us)")

    @property
    def hta_pattern(self) -> str:
        """HTA's ``pattern`` column: the operator and kernel names joined by ``|``."""
        return "|".join((self.operator, *self.kernels))


class KernelLaunches:
    """A trace's host calls as a tree, and the device events each launched (see the
    module doc). Call i, in the file's order, is ``names[i]`` (Kineto's kind
    ``kinds[i]``) from ``starts[i]`` to ``ends[i]`` (ns), under call ``parents[i]`` (-1:
    top level); a CPU op that recorded its inputs has ``inputs[i]``, its (Input Dims,
    Input type). ``events`` are the device events linked to a launch, ``launcher[j]`` the
    call that launched event j. The calls are flat lists rather than objects: tens of
    thousands of objects cost open_trace more in the garbage collector than in building
    them."""

    def __init__(self, names: list[str], kinds: list[str], starts: list[int], ends: list[int], inputs: dict,
                 parents: list[int], events: list[Activity], launcher: list[int]):
        self.names, self.kinds, self.starts, self.ends, self.inputs = names, kinds, starts, ends, inputs
        self.parents = parents
        self.events = events
        self.launcher = launcher
        steps = [index for index, name in enumerate(names) if STEP_NAME in name]
        # HTA reads a trace of two or more steps without its last one, which may be cut off
        self.last_step_ns = max(starts[i] for i in steps) if len({names[i] for i in steps}) > 1 else None
        self._by_kernel = {_kernel_key(event.device, event.resource, event.start_ns, event.name): call
                           for event, call in zip(events, launcher) if event.on_device}
        self._children: Optional[dict[int, list[int]]] = None
        self._launched: Optional[dict[int, list[int]]] = None
        self._depths: Optional[list[int]] = None

    @property
    def depths(self) -> list[int]:
        """Each call's depth: 0 at the top level, its parent's + 1 below."""
        if self._depths is None:
            self._depths = _depths(self.parents)
        return self._depths

    def before_last_step(self, index: int) -> bool:
        """Whether call ``index`` started before the last of two or more ProfilerSteps
        (always, in a trace of fewer)."""
        return self.last_step_ns is None or self.starts[index] < self.last_step_ns

    def events_under(self, index: int) -> list[int]:
        """The device events launched from call ``index`` or any call below it that started
        before the last ProfilerStep (:meth:`before_last_step`), in start order (the
        file's order between events that start together)."""
        if self._children is None:
            self._children, self._launched = defaultdict(list), defaultdict(list)
            for call, parent in enumerate(self.parents):
                if parent >= 0:
                    self._children[parent].append(call)
            for event, call in enumerate(self.launcher):
                self._launched[call].append(event)
        found, pending = [], [index]
        while pending:
            call = pending.pop()
            if self.before_last_step(call):
                found += self._launched.get(call, ())
                pending += self._children.get(call, ())
        return sorted(found, key=lambda event: (self.events[event].start_ns, event))

    def launch_of(self, kernel) -> Optional[int]:
        """The call that launched ``kernel`` (a :class:`~.device_kernels.DeviceKernel`),
        None where the trace links it to none."""
        return self._by_kernel.get(_kernel_key(kernel.device, kernel.stream, kernel.start_ns, kernel.name))

    def ops_around(self, index: int) -> list[int]:
        """The CPU ops that enclose call ``index`` (itself included), innermost first."""
        ops = []
        while index >= 0:
            if self.kinds[index] == "cpu_op":
                ops.append(index)
            index = self.parents[index]
        return ops


def _kernel_key(device: int, stream: int, start_ns: int, name: str) -> tuple:
    return device, stream, start_ns, name


def _depths(parents: list[int]) -> list[int]:
    """Each call's depth from its parents', each computed once."""
    depths = [-1] * len(parents)
    for index in range(len(parents)):
        chain, at = [], index
        while at >= 0 and depths[at] < 0:
            chain.append(at)
            at = parents[at]
        depth = depths[at] if at >= 0 else -1
        for call in reversed(chain):
            depth += 1
            depths[call] = depth
    return depths


def _on_stream(activity: Activity) -> bool:
    return activity.on_device or (activity.kind == "cuda_sync" and activity.name in STREAM_SYNCS)


def kernel_launches(activities: list[Activity]) -> KernelLaunches:
    """The call tree of ``activities`` (a trace file's, :func:`.kineto.file_activities`)
    and the device events each host call launched (see the module doc)."""
    names, kinds, starts, ends, inputs = [], [], [], [], {}
    lanes, by_correlation = defaultdict(list), {}
    for activity in activities:
        if activity.kind in NOT_HOST_KINDS:
            continue
        index = len(names)
        if activity.kind == "cpu_op":
            dims, types = activity.metadata.get("Input Dims"), activity.metadata.get("Input type")
            if isinstance(dims, list) and isinstance(types, list):
                inputs[index] = (dims, types)
        lanes[(activity.device, activity.resource)].append(index)
        if activity.correlation:
            by_correlation[activity.correlation] = index  # the last of several, as HTA links them
        names.append(activity.name)
        kinds.append(activity.kind)
        starts.append(activity.start_ns)
        ends.append(activity.end_ns)
    parents = [-1] * len(names)
    for indices in lanes.values():
        _nest(starts, ends, indices, parents)
    _attach_backward(names, starts, ends, lanes, parents)
    events, launcher = [], []
    for activity in activities:
        call = by_correlation.get(activity.correlation) if activity.correlation and _on_stream(activity) else None
        if call is not None:
            events.append(activity)
            launcher.append(call)
    return KernelLaunches(names, kinds, starts, ends, inputs, parents, events, launcher)


_LONGER_FIRST = 2**64  # above any duration in ns: start * this - duration orders by start, then longest first


def _nest(starts: list[int], ends: list[int], indices: list[int], parents: list[int]) -> None:
    """Set the parents of one thread's calls (see the module doc); ``indices`` are in the
    file's order, which the stable sort keeps between calls that start and end together."""
    open_calls: list[int] = []
    for index in sorted(indices, key=lambda i: starts[i] * _LONGER_FIRST - (ends[i] - starts[i])):
        start = starts[index]
        while open_calls:
            outer_end = ends[open_calls[-1]]
            if start < outer_end or (start == outer_end and ends[index] == start):
                break
            open_calls.pop()
        if open_calls:
            parents[index] = open_calls[-1]
        open_calls.append(index)


def _attach_backward(names: list[str], starts: list[int], ends: list[int], lanes: dict, parents: list[int]) -> None:
    """Put the backward thread's top-level calls under the main thread's annotations, as
    HTA links the two threads (see the module doc)."""
    labels = {}
    for lane, indices in lanes.items():
        if any(names[i].startswith(STEP_PREFIX) for i in indices):
            labels[lane] = "main"
        elif any("autograd::" in names[i] for i in indices):
            labels[lane] = "backward"
    if len(labels) != 2:
        return
    backward, main = sorted(labels, key=lambda lane: (labels[lane], lane))
    annotations = [i for i in lanes[main] if names[i].startswith(BACKWARD_ANNOTATION)] or \
        [i for i in lanes[main] if names[i].startswith(STEP_PREFIX)]
    top_level = [i for i in lanes[backward] if parents[i] < 0]
    for annotation in annotations:
        start, end = starts[annotation], ends[annotation]
        for index in top_level:
            if parents[index] < 0 and start <= starts[index] and ends[index] <= end:
                parents[index] = annotation


def _launches_of(trace, caller: str) -> KernelLaunches:
    launches = getattr(trace, "launches", None)
    if not isinstance(launches, KernelLaunches):
        raise TypeError(f"{caller}: trace must be a GpuTrace (te_lab.open_trace(path) reads a trace file into one), "
                        f"got {type(trace).__name__}")
    return launches


def _check_count(value, name: str, caller: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or None" if optional else "a positive int"
        raise ValueError(f"{caller}: {name} must be {expected}, got {value!r}")


def frequent_kernel_sequences(trace, operator_name: str, *, min_pattern_len: int = 3,
                              max_pattern_len: Optional[int] = None, top_k: Optional[int] = 5) -> list[KernelSequence]:
    """The most frequent sequences of device events launched from the host calls whose
    name contains ``operator_name``, in a GpuTrace (``te_lab.open_trace(path)``), as
    HTA's ``get_frequent_cuda_kernel_sequences`` finds them (see the module doc): its
    parameters, with ``max_pattern_len`` (calls that launched more are left out; None: no
    bound) and ``top_k`` the number of patterns returned (HTA returns all and draws
    ``top_k``; None: all). Raises ValueError where no host call's name contains
    ``operator_name``; an empty list means such calls exist but none launched
    ``min_pattern_len`` events."""
    caller = "frequent_kernel_sequences"
    launches = _launches_of(trace, caller)
    if not isinstance(operator_name, str) or not operator_name:
        raise ValueError(f"{caller}: operator_name must be a non-empty string (part of a host op's name, "
                         f"'aten::linear'), got {operator_name!r}")
    _check_count(min_pattern_len, "min_pattern_len", caller)
    _check_count(max_pattern_len, "max_pattern_len", caller, optional=True)
    _check_count(top_k, "top_k", caller, optional=True)
    if max_pattern_len is not None and max_pattern_len < min_pattern_len:
        raise ValueError(f"{caller}: max_pattern_len ({max_pattern_len}) must be at least min_pattern_len "
                         f"({min_pattern_len})")
    candidates = [index for index, name in enumerate(launches.names)
                  if operator_name in name and launches.before_last_step(index)]
    if not candidates:
        raise ValueError(f"{caller}: no host call's name contains operator_name {operator_name!r}; the trace's "
                         f"most frequent CPU ops: {', '.join(_frequent_ops(launches))}")
    shallowest = min(launches.depths[index] for index in candidates)
    totals: dict[tuple, list] = {}
    for index in candidates:
        if launches.depths[index] != shallowest:
            continue
        events = launches.events_under(index)
        if len(events) < min_pattern_len or (max_pattern_len is not None and len(events) > max_pattern_len):
            continue
        name = launches.names[index]
        total = totals.setdefault((name, tuple(launches.events[e].name for e in events)), [0, 0, 0])
        total[0] += 1
        total[1] += sum(launches.events[e].duration_ns for e in events)
        total[2] += launches.ends[index] - launches.starts[index]
    sequences = sorted((KernelSequence(operator, kernels, count, device_ns / 1e3, host_ns / 1e3)
                        for (operator, kernels), (count, device_ns, host_ns) in totals.items()),
                       key=lambda sequence: (-sequence.count, sequence.hta_pattern))
    return sequences if top_k is None else sequences[:top_k]


def _frequent_ops(launches: KernelLaunches, count: int = 5) -> list[str]:
    frequency: dict[str, int] = defaultdict(int)
    for name, kind in zip(launches.names, launches.kinds):
        if kind == "cpu_op":
            frequency[name] += 1
    return sorted(frequency, key=lambda name: -frequency[name])[:count] or ["none"]


class _Link(NamedTuple):
    """One kernel of a chain: its duration and the CPU ops around its launch, innermost
    first (none where the trace links it to no launch)."""

    duration_ns: int
    ops: tuple


def trace_opportunities(trace, *, bandwidth_gbs: Optional[float] = None) -> list[Opportunity]:
    """The chains of memory-bound kernels of a GpuTrace (see the module doc) as ranked
    :class:`~.opportunity_table.Opportunity` rows (mode ``"trace"``), one per launching
    operator (the innermost CPU op around every launch of the chain; ``"stream N"``
    where none is), phase and kernel-name pattern: ``time_ms`` the kernels' device
    time, ``launches`` their number. Bytes are known only where every op that launched
    a kernel of the row recorded inputs the cost model reads (``Input Dims`` and ``Input
    type``, ``record_shapes=True``): then ``bytes_unfused`` is those ops' inputs and outputs by
    the cost model, ``bytes_fused`` and ``fused_ms`` follow the live finder's formulas
    (:mod:`.opportunity_table`; the launch cost from the trace's kernels), at
    ``bandwidth_gbs`` or the device's listed figure (``te_lab.device.PEAK_TABLE``);
    without one, ``fused_ms`` stays None."""
    caller = "trace_opportunities"
    launches = _launches_of(trace, caller)
    if bandwidth_gbs is not None and (isinstance(bandwidth_gbs, bool) or not isinstance(bandwidth_gbs, (int, float))
                                      or not bandwidth_gbs > 0):
        raise ValueError(f"{caller}: bandwidth_gbs must be a positive number of GB/s or None, got {bandwidth_gbs!r}")
    if bandwidth_gbs is None:
        listed = lookup_peak(trace.device_name)
        bandwidth_gbs = listed.memory_bandwidth_gbs if listed is not None else None
    costs = _OpCosts(launches)
    rows: dict[tuple, Opportunity] = {}
    for lane, phase, chain, names in _chains(trace.kernels, trace.timeline, launches):
        module = _launching_op(launches, chain) or lane
        row = rows.get((module, phase, names))
        if row is None:
            row = rows[(module, phase, names)] = Opportunity("trace", module, "", phase, list(names), bytes_unfused=0,
                                                             bytes_fused=0)
        row.instances += 1
        row.launches += len(chain)
        row.time_ms += sum(link.duration_ns for link in chain) / 1e6
        events = costs.chain_events(chain)
        if events is None or row.bytes_unfused is None:
            row.bytes_unfused = row.bytes_fused = None
        else:
            row.bytes_unfused += sum(event.bytes_read + event.bytes_written for event in events)
            row.bytes_fused += fused_bytes(events)
    costed = [row for row in rows.values() if row.bytes_fused is not None]
    launch_ms = costs.launch_us(trace.kernels) / 1e3 if costed and bandwidth_gbs is not None else 0.0
    for row in rows.values():
        if row.bytes_fused is None:
            row.note = "bytes unknown: the ops that launched these kernels recorded no inputs the cost model reads"
        elif bandwidth_gbs is None:
            row.note = (f"no bandwidth for {trace.device_name!r} (te_lab.device.PEAK_TABLE lists none): "
                        "trace_opportunities(trace, bandwidth_gbs=...) estimates the fused time")
        else:
            row.bandwidth_gbs = float(bandwidth_gbs)
            row.fused_ms = row.bytes_fused / (bandwidth_gbs * 1e9) * 1e3 + row.instances * launch_ms
    return ranked(list(rows.values()))


def _chains(kernels: list, timeline: list[TimelineEvent], launches: KernelLaunches):
    """(lane, phase, chain of _Link, kernel names) for every chain, stream by stream."""
    lanes: dict[str, list] = defaultdict(list)
    for kernel, event in zip(kernels, timeline):
        lanes[event.lane].append((kernel, event.phase))
    links = _Links(launches)
    for lane, stream in lanes.items():
        chain, names, chain_phase = [], [], None
        for kernel, phase in stream + [(None, None)]:
            link = links.of(kernel) if kernel is not None else None
            if chain and (link is None or phase != chain_phase):
                if len(chain) >= MIN_CHAIN_KERNELS:
                    yield lane, chain_phase, chain, tuple(names)
                chain, names = [], []
            if link is not None:
                chain.append(link)
                names.append(kernel.name)
                chain_phase = phase


class _Links:
    """Each kernel's :class:`_Link`, or None for a kernel that is not memory-bound (see
    the module doc); the verdicts by kernel name and by op name are kept."""

    def __init__(self, launches: KernelLaunches):
        self.launches = launches
        self.by_kernel_name: dict[str, bool] = {}
        self.by_op_name: dict[str, bool] = {}

    def of(self, kernel) -> Optional[_Link]:
        named = self.by_kernel_name.get(kernel.name)
        if named is None:
            named = self.by_kernel_name[kernel.name] = (
                kernel.kind == "kernel" and not kernel.is_collective and not is_compute_kernel(kernel.name))
        if not named:
            return None
        launch = self.launches.launch_of(kernel)
        ops = tuple(self.launches.ops_around(launch)) if launch is not None else ()
        if not all(self._fusable_op(self.launches.names[op]) for op in ops):
            return None
        return _Link(kernel.duration_ns, ops)

    def _fusable_op(self, name: str) -> bool:
        """Not a GEMM, attention or convolution op, nor one of te_lab's (fused already)."""
        verdict = self.by_op_name.get(name)
        if verdict is None:
            verdict = self.by_op_name[name] = not (is_compute(name) or _CONVOLUTION_OP.search(name)
                                                  or name.startswith("te_lab::"))
        return verdict


def is_compute_kernel(name: str) -> bool:
    """Whether kernel ``name`` is a GEMM, convolution or attention kernel's, by its name
    (:data:`COMPUTE_KERNEL_NAMES`)."""
    lowered = name.lower().replace("fbgemm", "")
    return name.startswith(COMPUTE_KERNEL_PREFIXES) or any(part in lowered for part in COMPUTE_KERNEL_NAMES)


def _launching_op(launches: KernelLaunches, chain: list[_Link]) -> Optional[str]:
    """The name of the innermost CPU op around every launch of ``chain``, if any."""
    common = list(chain[0].ops)
    for link in chain[1:]:
        around = set(link.ops)
        common = [op for op in common if op in around]
    return launches.names[common[0]] if common else None


class _OpCosts:
    """The launching ops' recorded inputs as timeline events with the cost model's bytes
    (what :func:`.opportunities.fused_bytes` and :func:`.opportunities.launch_us` read)."""

    def __init__(self, launches: KernelLaunches):
        self.launches = launches
        self.by_op: dict[int, Optional[TimelineEvent]] = {}

    def event(self, op: int) -> Optional[TimelineEvent]:
        """CPU op ``op``'s inputs and bytes, None where it recorded no inputs the cost model
        reads (a tensor list, recorded as nested dims, moves nothing by it)."""
        if op not in self.by_op:
            name, (dims, types) = self.launches.names[op], self.launches.inputs.get(op, (None, None))
            self.by_op[op] = None
            cost = op_cost(name, dims, types) if dims is not None else None
            if cost is not None and cost.bytes_read + cost.bytes_written > 0:
                pairs = [(list(shape), dtype) for shape, dtype in zip(dims, types)
                         if isinstance(shape, list) and shape and all(isinstance(n, int) for n in shape)]
                self.by_op[op] = TimelineEvent(
                    "trace", name, 0.0, 0.0, "", "", "", [shape for shape, _ in pairs], cost.bytes_read,
                    cost.bytes_written, [math.prod(shape) * (element_size(dtype) or 0) for shape, dtype in pairs])
        return self.by_op[op]

    def chain_events(self, chain: list[_Link]) -> Optional[list[TimelineEvent]]:
        """One event per op that launched the chain's kernels (an op that launched several
        of them in a row, once), None where one of them recorded no inputs."""
        events, last_op = [], None
        for link in chain:
            op = link.ops[0] if link.ops else None
            event = self.event(op) if op is not None else None
            if event is None:
                return None
            if op != last_op:
                events.append(event)
                last_op = op
        return events

    def launch_us(self, kernels: list) -> float:
        """What a fused kernel still pays per call: :func:`.opportunities.launch_us` over
        the trace's kernels whose launching op recorded its inputs, each with its device
        time and its op's name and bytes."""
        timed = []
        for kernel in kernels:
            launch = self.launches.launch_of(kernel)
            ops = self.launches.ops_around(launch) if launch is not None else []
            event = self.event(ops[0]) if ops else None
            if event is not None:
                timed.append(dataclasses.replace(event, duration_us=kernel.duration_ns / 1e3))
        return launch_us(timed, 0.0)
