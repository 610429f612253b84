"""Holistic Trace Analysis' temporal breakdown, by HTA's definitions, from Kineto's
activities: the device's idle, compute and non-compute shares of HTA's span.

te_lab's own "device busy" figures (:mod:`.device_kernels`) cover every kernel, memcpy and
memset of the trace over the span from its first to its last; HTA's differ in four ways,
each worth about a point on a real multi-GPU trace:

- **which steps**: with two or more ``ProfilerStep#N`` annotations, HTA drops the device
  activity queued from the last step on (it may be cut off), keeping only activity whose
  queuing host call (same correlation id) started before the last step began;
- **what runs on the device**: every event that names a stream (``args.stream`` other
  than -1), so CUDA's synchronisation events (``cuda_sync``: "Event Sync", "Stream
  Sync") count as device time, next to kernels, memcpys and memsets;
- **the span**: from the first to the last of those events;
- **whole microseconds**: where a file's timestamps are not all whole µs (its ``ts`` column
  is not integral: nanosecond resolution, or an event without one), HTA rounds every event
  inward, its start up and its end down (pytorch/pytorch#122425), so an event shorter than a
  µs can come out empty or negative. It then merges the events by start, one interval per run
  of events that start before the running maximum end, and counts each interval's end minus
  start (a lone negative event counts negative there too);
- **compute**: kernels that are not NCCL (``nccl...Kernel``), not memory (names that
  start with Memcpy, Memset or dma) and not synchronisation (names containing Memcpy,
  Memset or ending in Sync); non-compute is busy time minus compute time
  (communication, memory, synchronisation).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from .kineto import Activity
from .report import Figure

MODE = "HTA temporal breakdown"
_COMMUNICATION = re.compile(r"^nccl.*Kernel")
_MEMORY = re.compile(r"^(Memcpy|Memset|dma)")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_STEP = "ProfilerStep"


@dataclass(frozen=True)
class TemporalBreakdown:
    """Shares of HTA's span (fractions; HTA prints them as percentages)."""

    idle: float
    compute: float
    non_compute: float
    span_ns: int
    activities: int  # the stream events counted


def _stream(activity: Activity) -> Optional[int]:
    stream = activity.metadata.get("stream")
    return stream if isinstance(stream, int) and stream != -1 else None


def is_compute(name: str) -> bool:
    """HTA's computation kernel: not communication, memory or synchronisation."""
    return not (_COMMUNICATION.match(name) or _MEMORY.match(name) or _NOT_COMPUTE.match(name))


def _times(activity: Activity, rounded: bool) -> tuple[int, int]:
    """(start, end) as HTA reads them, in ns: rounded inward to whole µs where ``rounded``."""
    if not rounded:
        return activity.start_ns, activity.end_ns
    start_us = activity.start_ns / 1000  # the float HTA reads (exact: kineto._ns)
    return math.ceil(start_us) * 1000, math.floor(start_us + activity.duration_ns / 1000) * 1000


def counted_activities(activities: list[Activity], rounded: bool = False) -> list[Activity]:
    """The stream events HTA counts: all of them, or with two or more ProfilerSteps those
    queued by a host call that started before the last step began."""
    on_streams = [a for a in activities if _stream(a) is not None]
    steps = [a for a in activities if _stream(a) is None and _STEP in a.name]
    if len({a.name for a in steps}) < 2:
        return on_streams
    last_start = max(_times(a, rounded)[0] for a in steps)
    queued_before = {a.correlation for a in activities
                     if _stream(a) is None and _times(a, rounded)[0] < last_start and a.correlation}
    return [a for a in on_streams if a.correlation in queued_before]


def _merged(intervals: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(summed length, first start, last end) of the intervals merged as HTA merges them."""
    intervals = sorted(intervals)
    total, start, end = 0, intervals[0][0], intervals[0][1]
    first = start
    for next_start, next_end in intervals[1:]:
        if next_start > end:
            total += end - start
            start, end = next_start, next_end
        else:
            end = max(end, next_end)
    return total + end - start, first, end


def temporal_breakdown(activities: list[Activity], rounded: bool = False) -> Optional[TemporalBreakdown]:
    """HTA's idle / compute / non-compute split (see the module doc), times rounded to
    whole µs where ``rounded`` (:func:`te_lab.profiler.kineto.has_fractional_timestamps`);
    None without stream events."""
    counted = counted_activities(activities, rounded)
    if not counted:
        return None
    busy, start, end = _merged([_times(a, rounded) for a in counted])
    span = end - start
    if span <= 0:
        return None
    computing = [_times(a, rounded) for a in counted if is_compute(a.name)]
    compute = _merged(computing)[0] if computing else 0
    return TemporalBreakdown((span - busy) / span, compute / span, (busy - compute) / span, span, len(counted))


def breakdown_figures(breakdown: Optional[TemporalBreakdown]) -> list[Figure]:
    """The breakdown as figures, labelled as HTA's definitions."""
    span = ("HTA's span: first to last stream event, the last ProfilerStep's device activity left out when "
            "there are two or more")
    values = (None, None, None) if breakdown is None else (breakdown.idle, breakdown.compute, breakdown.non_compute)
    note = "" if breakdown is None else f"{breakdown.activities} stream events over {breakdown.span_ns / 1e3:.1f} µs"
    return [
        Figure("idle (HTA's definition)", MODE, values[0], "fraction",
               f"(span - union of stream events, cuda_sync included) / {span}", note),
        Figure("compute (HTA's definition)", MODE, values[1], "fraction",
               f"union of kernels other than NCCL, memory and sync / {span}", note),
        Figure("non-compute (HTA's definition)", MODE, values[2], "fraction",
               f"(union of stream events - compute) / {span}: communication, memcpy, memset, sync", note),
    ]
