"""``te_lab.open_trace(path)``: a torch.profiler / Kineto trace file read into the
dashboard's GPU views, so a run profiled on a GPU cluster can be read on a laptop.

The file (``.json`` or ``.json.gz``, as ``export_chrome_trace`` or
``tensorboard_trace_handler`` write it on CUDA, MUSA or ROCm; ``te-lab profile
--trace-dir`` writes them too) becomes :class:`~te_lab.profiler.kineto.Activity` records,
the form live profiles take as well, and from there the same code gives the device
kernels and their figures (:func:`~te_lab.profiler.device_kernels.device_figures`):

- over the whole trace, from its first to its last device activity (mode ``"trace"``);
- per ``ProfilerStep#N`` the trace marks: the device activity queued during the step's
  host interval, from its first to its last (mode ``"ProfilerStep#N"``);
- Holistic Trace Analysis' temporal breakdown by HTA's own definitions (mode ``"HTA
  temporal breakdown"``, :mod:`~te_lab.profiler.temporal_breakdown`): idle, compute and
  non-compute over HTA's span, which leaves out the last ProfilerStep and counts CUDA's
  sync events, so its idle share differs from ``1 - device busy`` by a point or two on
  real multi-step traces.

A kernel's phase and module path in the timeline come from the host intervals around the
call that queued it: autograd's ``evaluate_function`` (backward), ``Optimizer.step``
(optimizer), te_lab's module regions (forward, with the module's path), else forward.

The host calls' tree and the device work each launched (``launches``,
:mod:`~te_lab.profiler.kernel_sequences`) give the frequent kernel sequences of an
operator (:func:`~te_lab.profiler.kernel_sequences.frequent_kernel_sequences`, HTA's
definition) and the fusion opportunities: chains of memory-bound kernels per stream,
ranked (``opportunities``).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from .attribution import BACKWARD_PREFIX, HostOp, LaunchIndex
from .device_kernels import DeviceKernel, device_figures, device_kernels
from .kernel_sequences import KernelLaunches, kernel_launches, trace_opportunities
from .kineto import HOST_OP_KINDS, Activity, file_activities, has_fractional_timestamps
from .opportunity_table import table_lines
from .regions import OPTIMIZER_PREFIX, PREFIX, TORCH_OPTIMIZER_STEP_PREFIX
from .report import Figure, TimelineEvent
from .temporal_breakdown import breakdown_figures, temporal_breakdown

TRACE_MODE = "trace"
_STEP = re.compile(r"^ProfilerStep#\d+$")


@dataclass(frozen=True)
class Step:
    """A ``ProfilerStep#N`` annotation's host interval (ns)."""

    name: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class KernelRow:
    """One row of the kernel table: every device activity of one name."""

    name: str
    kind: str  # "kernel", "gpu_memcpy", "gpu_memset"
    count: int
    total_us: float
    share: float  # of all device activity time


@dataclass
class GpuTrace:
    """A trace file's GPU views: ``kernels``, ``figures``, ``steps``, ``timeline``,
    :meth:`kernel_table`, ``opportunities``; :meth:`show` draws them, :meth:`to_html`
    writes them."""

    path: str
    device_name: str
    multiprocessors: Optional[int]
    kernels: list = field(default_factory=list)  # DeviceKernel
    steps: list = field(default_factory=list)  # Step
    figures: list = field(default_factory=list)  # Figure: mode "trace", then one set per step
    timeline: list = field(default_factory=list)  # TimelineEvent, mode "trace", lane "stream N"
    notes: list = field(default_factory=list)
    opportunities: list = field(default_factory=list)  # Opportunity (mode "trace"), ranked
    launches: Optional[KernelLaunches] = field(default=None, repr=False)  # host calls and what each launched

    def kernel_table(self) -> list[KernelRow]:
        """Device time, count and share per kernel name, largest time first."""
        totals: Counter = Counter()
        counts: Counter = Counter()
        kinds = {}
        for kernel in self.kernels:
            totals[kernel.name] += kernel.duration_ns
            counts[kernel.name] += 1
            kinds[kernel.name] = kernel.kind
        overall = sum(totals.values())
        return [KernelRow(name, kinds[name], counts[name], total / 1e3, total / overall if overall else 0.0)
                for name, total in totals.most_common()]

    def figure(self, name: str, mode: str = TRACE_MODE) -> Optional[float]:
        """The value of the figure ``name`` for ``mode`` (``"trace"`` or a step's name)."""
        for figure in self.figures:
            if figure.name == name and figure.mode == mode:
                return figure.value
        known = sorted({f.mode for f in self.figures})
        raise KeyError(f"GpuTrace.figure: no figure {name!r} for mode {mode!r} (modes: {', '.join(known)})")

    def summary(self, kernels: int = 10, opportunities: int = 5) -> str:
        lines = [f"{self.path}: {self.device_name}, {len(self.kernels)} device activities on "
                 f"{len({k.stream for k in self.kernels})} stream(s), {len(self.steps)} ProfilerStep(s)"]
        for figure in self.figures:
            value = "-" if figure.value is None else f"{100 * figure.value:.2f}%"
            lines.append(f"  {figure.mode:>16}  {figure.name:<42} {value}")
        lines.append(f"  top kernels (of {len(self.kernel_table())}): time us, count, share")
        for row in self.kernel_table()[:kernels]:
            lines.append(f"    {row.total_us:12.1f} {row.count:6d} {100 * row.share:6.2f}%  {row.name[:100]}")
        if self.kernels:
            lines.append(f"  fusion opportunities: {len(self.opportunities)} pattern(s) of chained memory-bound "
                         "kernels")
            lines += ["  " + line for line in table_lines(self.opportunities, opportunities)]
        lines += self.notes
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def read_trace_json(path) -> dict:
    """The JSON document of a ``.json`` or ``.json.gz`` trace file."""
    source = pathlib.Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"te_lab.open_trace: {str(path)!r} is not a file")
    opener = gzip.open if source.suffix == ".gz" else open
    try:
        with opener(source, "rt", encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"te_lab.open_trace: {str(path)!r} is not a JSON trace (.json, or gzipped .json.gz): "
                         f"{error}") from error
    if not isinstance(document, dict):
        raise ValueError(f"te_lab.open_trace: {str(path)!r} holds a JSON {type(document).__name__}, expected a "
                         "torch.profiler (Kineto) trace object with 'traceEvents'")
    return document


def open_trace(path, *, multiprocessors: Optional[int] = None) -> GpuTrace:
    """Read a torch.profiler / Kineto trace file (``.json`` / ``.json.gz``) into its GPU
    views. ``multiprocessors`` stands in for the trace's ``numSms`` (Kineto writes it in
    ``deviceProperties``; torch's Python export, ``use_python_export=True``, does not)."""
    if multiprocessors is not None and (not isinstance(multiprocessors, int) or multiprocessors < 1):
        raise ValueError(f"te_lab.open_trace: multiprocessors must be a positive int, got {multiprocessors!r}")
    document = read_trace_json(path)
    activities = file_activities(document)
    kernels = device_kernels(activities)
    device = Counter(a.device for a in activities if a.on_device).most_common(1)
    name, listed = _device_properties(document, device[0][0] if device else 0)
    multiprocessors = multiprocessors or listed
    trace = GpuTrace(str(path), name, multiprocessors, kernels, _steps(activities))
    if not kernels:
        trace.notes.append("the trace holds no device activity: it was recorded without CUDA / PrivateUse1 "
                           "activities, or CUPTI / MUPTI was unavailable")
    elif multiprocessors is None:
        trace.notes.append("the trace's deviceProperties give no numSms: SM efficiency is unknown (pass "
                           "multiprocessors=)")
    trace.figures = trace_figures(kernels, trace.steps, multiprocessors)
    trace.figures += breakdown_figures(temporal_breakdown(activities, has_fractional_timestamps(document)))
    trace.timeline = _timeline(kernels, activities)
    trace.launches = kernel_launches(activities)
    trace.opportunities = trace_opportunities(trace)
    return trace


def trace_figures(kernels: list[DeviceKernel], steps: list[Step], multiprocessors: Optional[int]) -> list[Figure]:
    """The figures over the whole trace, then over each step's device activity."""
    figures = device_figures(kernels, _first_start(kernels), _last_end(kernels), multiprocessors, TRACE_MODE,
                             "the span from the first to the last device activity (te_lab's definition: every "
                             "step, kernels, memcpy and memset; HTA's temporal breakdown is its own mode)")
    for step in steps:
        queued = [k for k in kernels if step.start_ns <= _queued_ns(k) <= step.end_ns]
        figures += device_figures(queued, _first_start(queued), _last_end(queued), multiprocessors, step.name,
                                  f"the span of the device activity queued during {step.name}")
    return figures


def _first_start(kernels: list[DeviceKernel]) -> int:
    return min((k.start_ns for k in kernels), default=0)


def _last_end(kernels: list[DeviceKernel]) -> int:
    return max((k.end_ns for k in kernels), default=0)


def _queued_ns(kernel: DeviceKernel) -> int:
    return kernel.launched_ns if kernel.launched_ns is not None else kernel.start_ns


def _steps(activities: list[Activity]) -> list[Step]:
    # Host annotations only: Kineto mirrors annotations onto the device (gpu_user_annotation).
    steps = {a.name: Step(a.name, a.start_ns, a.end_ns) for a in activities
             if a.kind in HOST_OP_KINDS and _STEP.match(a.name)}
    return sorted(steps.values(), key=lambda s: s.start_ns)


def _device_properties(document: dict, device: int) -> tuple[str, Optional[int]]:
    """(name, multiprocessor count) of ``device`` from the trace's deviceProperties."""
    for entry in document.get("deviceProperties") or []:
        if isinstance(entry, dict) and entry.get("id") == device:
            count = entry.get("numSms")
            return str(entry.get("name", "unknown device")), count if isinstance(count, int) and count > 0 else None
    return "unknown device", None


def _timeline(kernels: list[DeviceKernel], activities: list[Activity]) -> list[TimelineEvent]:
    """Each device activity on its stream, with the phase and te_lab module path of the
    host interval its queuing call ran in."""
    context = []
    for activity in activities:
        if activity.kind not in HOST_OP_KINDS:
            continue
        if activity.name.startswith(BACKWARD_PREFIX):
            context.append(HostOp(activity.start_ns, activity.end_ns, "", "backward"))
        elif activity.name.startswith((TORCH_OPTIMIZER_STEP_PREFIX, OPTIMIZER_PREFIX)):
            context.append(HostOp(activity.start_ns, activity.end_ns, "", "optimizer"))
        elif activity.name.startswith(PREFIX):
            context.append(HostOp(activity.start_ns, activity.end_ns, activity.name[len(PREFIX):], "forward"))
    index = LaunchIndex(context)
    first = _first_start(kernels)
    several_devices = len({k.device for k in kernels}) > 1
    events = []
    for kernel in kernels:
        host = index.launcher(_queued_ns(kernel))
        lane = f"device {kernel.device} stream {kernel.stream}" if several_devices else f"stream {kernel.stream}"
        events.append(TimelineEvent(TRACE_MODE, kernel.name, (kernel.start_ns - first) / 1e3,
                                    kernel.duration_ns / 1e3, lane, host.path if host else "",
                                    host.phase if host else "forward"))
    return events
