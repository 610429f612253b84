"""GPU kernel figures from a profiler trace: busy fraction, estimated SM efficiency,
achieved occupancy, and the device's idle time split into waiting-on-host vs other.

They read Kineto's activities (``kineto_results.trace_activities()``): kernels carry
their launch grid and CUPTI's estimated occupancy in their metadata ("grid",
"est. achieved occupancy %"), and each kernel shares a correlation id with the host
runtime call that launched it. A trace without those fields gives ``None`` for the
figure, never a guess. (Checked against synthetic traces on the CPU; no GPU run yet.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

KERNEL_TYPES = ("kernel",)
LAUNCH_TYPES = ("cuda_runtime", "privateuse1_runtime", "cuda_driver")


@dataclass(frozen=True)
class DeviceKernel:
    name: str
    start_ns: int
    duration_ns: int
    blocks: Optional[int]
    occupancy: Optional[float]  # fraction
    launched_ns: Optional[int]  # when the host call that launched it started
    stream: int = 0

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


def _metadata(activity) -> dict:
    text = activity.metadata_json() or ""
    try:
        return json.loads("{" + text + "}") if text else {}
    except ValueError:
        return {}


def device_kernels(activities) -> list[DeviceKernel]:
    activities = list(activities)
    launches = {a.correlation_id(): a.timestamp() for a in activities if a.type() in LAUNCH_TYPES}
    kernels = []
    for activity in activities:
        if activity.type() not in KERNEL_TYPES:
            continue
        metadata = _metadata(activity)
        grid = metadata.get("grid")
        occupancy = metadata.get("est. achieved occupancy %")
        kernels.append(DeviceKernel(
            activity.name(), activity.timestamp(), max(activity.duration(), 0),
            math.prod(grid) if isinstance(grid, list) and grid else None,
            occupancy / 100 if isinstance(occupancy, (int, float)) else None,
            launches.get(activity.correlation_id()), activity.resource_id()))
    return sorted(kernels, key=lambda k: k.start_ns)


def busy_ns(kernels: list[DeviceKernel]) -> int:
    """The union of the kernels' intervals (overlapping streams count once)."""
    return union_ns((kernel.start_ns, kernel.end_ns) for kernel in kernels)


def union_ns(intervals) -> int:
    """The length of the union of (start, end) intervals, given sorted by start."""
    total, covered_until = 0, None
    for start, end in intervals:
        if covered_until is not None and end <= covered_until:
            continue
        total += end - (start if covered_until is None else max(start, covered_until))
        covered_until = end
    return total


def sm_efficiency(kernels: list[DeviceKernel], multiprocessors: int, wall_ns: int) -> Optional[float]:
    """sum over kernels of min(blocks / multiprocessors, 1) x duration / wall time."""
    if not kernels or wall_ns <= 0 or any(k.blocks is None for k in kernels):
        return None
    return sum(min(k.blocks / multiprocessors, 1.0) * k.duration_ns for k in kernels) / wall_ns


def achieved_occupancy(kernels: list[DeviceKernel]) -> Optional[float]:
    """CUPTI's estimated achieved occupancy, averaged over kernels weighted by duration."""
    timed = [k for k in kernels if k.occupancy is not None and k.duration_ns > 0]
    if not timed:
        return None
    return sum(k.occupancy * k.duration_ns for k in timed) / sum(k.duration_ns for k in timed)


def idle_split_ns(kernels: list[DeviceKernel], start_ns: int, end_ns: int) -> Optional[tuple[int, int]]:
    """(waiting on the host, other) device idle time between ``start_ns`` and ``end_ns``.

    A gap before a kernel is waiting-on-host for the part before the host call that
    launched that kernel began: the device had nothing queued. The rest of each gap
    (the launch was queued, yet the kernel had not started: launch latency, syncs,
    copies not traced as kernels) is "other".
    """
    if not kernels or any(k.launched_ns is None for k in kernels):
        return None
    host = other = 0
    cursor = start_ns
    for kernel in kernels:
        if kernel.start_ns > cursor:
            waiting = max(0, min(kernel.launched_ns, kernel.start_ns) - cursor)
            host += waiting
            other += kernel.start_ns - cursor - waiting
        cursor = max(cursor, kernel.end_ns)
    if end_ns > cursor:
        other += end_ns - cursor
    return host, other
