"""The steps a profile measures: a timed step without the profiler, a clocked step (without
the profiler, its modules timed by hooks), a profiled step (times alone, or in detail:
shapes, FLOPs and memory) attributed to modules, and the median of a mode's profiled steps
with the detail step's figures merged in."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from te_lab import device as devices
from te_lab.inputs import output_tensors

from . import regions, trace_files
from .attribution import attribute
from .chatter import without_profiler_chatter
from .modes import LOSS_KEY, Mode
from .module_clock import ModuleClock, own_times
from .report import Region


def _loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in output_tensors(output) if t.requires_grad]
    if not tensors:
        raise ValueError("te_lab.profile: backward=True, but the target's output has no tensor that requires grad")
    return sum(t.float().sum() for t in tensors)


def timed_step(mode: Mode, backward: bool, device: torch.device) -> tuple[float, float, float, float]:
    """(step ms, forward ms, backward ms, process CPU seconds) of one step."""
    devices.synchronize(device)
    cpu_start = time.process_time()
    with devices.Timer(device) as forward_timer:
        output = mode.run()
    backward_ms = 0.0
    if backward:
        with devices.Timer(device) as backward_timer:
            mode.backpropagate(_loss(output), mode.leaves)
        backward_ms = backward_timer.elapsed_ms
    cpu_seconds = time.process_time() - cpu_start
    return forward_timer.elapsed_ms + backward_ms, forward_timer.elapsed_ms, backward_ms, cpu_seconds


@dataclass
class Profiled:
    trace: Any
    wall_ms: float
    peak_memory_bytes: Optional[int]
    peak_memory_source: str


def profiled_step(mode: Mode, backward: bool, device: torch.device, detail: bool) -> Profiled:
    """One step under the profiler. ``detail``: record shapes, FLOPs and memory too, which
    costs about ten times more per op event than the times alone (see :mod:`.correction`):
    the steps that time modules leave them out, and one detail step per mode gives bytes
    moved, FLOPs, input shapes and peak memory (:func:`with_details`)."""
    with mode.context():
        with regions.labelled(mode.labels()):
            if devices.is_gpu(device):
                devices.synchronize(device)
                devices.reset_peak_memory_stats(device)
                before = devices.memory_allocated(device)
            profiler = torch.profiler.profile(activities=devices.profiler_activities(device), record_shapes=detail,
                                              with_flops=detail, profile_memory=detail)
            with without_profiler_chatter():
                profiler.start()
            try:
                wall_ms = timed_step(mode, backward, device)[0]
            finally:
                with without_profiler_chatter():
                    profiler.stop()
            trace_files.export(profiler, mode.name)
            trace = attribute(profiler, mode.name, LOSS_KEY, devices.is_gpu(device), costs=detail)
    if devices.is_gpu(device):
        return Profiled(trace, wall_ms, devices.max_memory_allocated(device) - before, "allocator peak above the "
                         "step's start (max_memory_allocated)")
    return Profiled(trace, wall_ms, trace.peak_memory_bytes, "profiler memory records: peak of allocations "
                     "minus frees during the step")


@dataclass
class Clocked:
    """A step without the profiler whose modules were timed by hooks (:mod:`.module_clock`)."""

    step_ms: float  # the step, less what the hooks spent
    modules: dict  # key -> (forward ms, backward ms), each module's own (nested keyed modules left out)


def clocked_step(mode: Mode, backward: bool, device: torch.device) -> Clocked:
    """One step without the profiler, each module the mode labels timed by hooks, except
    the LM head + loss, whose loss ops run outside the head module (the profile keeps its
    profiled time)."""
    with mode.context():
        modules = {key: module for key, module in mode.labels().items() if not key.endswith(LOSS_KEY)}
        with ModuleClock(modules) as clock:
            step_ms = timed_step(mode, backward, device)[0]
        times = clock.take()
    return Clocked(step_ms - clock.hooks_ms, own_times(times, modules))


def median_run(runs: list[Profiled]) -> Profiled:
    """The first run, with each region's forward and backward time from the run where the
    region's total is the median (lower median for an even count), so the region's total
    is the median total its speedup interval is bootstrapped from (launches, bytes and
    FLOPs do not vary between runs), and the wall time and compute time the medians. The
    runs' times are corrected first (:func:`.assembly.correct_runs`), each to the
    unprofiled step."""
    first = runs[0]
    for key, region in first.trace.regions.items():
        found = sorted((r for r in (run.trace.regions.get(key) for run in runs) if r is not None),
                       key=lambda r: r.total_ms)
        middle = found[(len(found) - 1) // 2]
        region.forward_ms, region.backward_ms = middle.forward_ms, middle.backward_ms
    first.trace.attributed_us = sum(r.total_ms for r in first.trace.regions.values()) * 1e3
    first.trace.communication_us = statistics.median(run.trace.communication_us for run in runs)
    first.trace.compute_ms = statistics.median(run.trace.compute_ms for run in runs)
    first.wall_ms = statistics.median(run.wall_ms for run in runs)
    return first


def with_details(timed: Profiled, detail: Profiled) -> Profiled:
    """``timed`` (a step that timed the modules without shapes, FLOPs and memory) with
    each key's bytes moved and FLOPs, the step's and its compute's bytes, the peak memory,
    and the timeline's input shapes and bytes (the n-th op of a name, module and phase gets
    the n-th one's) of ``detail``,
    the same step recorded in detail."""
    for key, region in detail.trace.regions.items():
        timed.trace.regions.setdefault(key, Region()).bytes_moved = region.bytes_moved
        timed.trace.regions[key].flops = region.flops
    shapes: dict = {}
    for event in detail.trace.timeline:
        shapes.setdefault((event.name, event.path, event.phase), []).append(event)
    for event in timed.trace.timeline:
        recorded = shapes.get((event.name, event.path, event.phase))
        if recorded:
            detailed = recorded.pop(0)
            event.input_shapes, event.input_bytes = detailed.input_shapes, detailed.input_bytes
            event.bytes_read, event.bytes_written = detailed.bytes_read, detailed.bytes_written
    timed.peak_memory_bytes, timed.peak_memory_source = detail.peak_memory_bytes, detail.peak_memory_source
    timed.trace.compute_bytes, timed.trace.step_bytes = detail.trace.compute_bytes, detail.trace.step_bytes
    return timed
