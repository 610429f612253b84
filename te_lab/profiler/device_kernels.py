"""GPU figures from Kineto's activities (:mod:`te_lab.profiler.kineto`, live or from a
trace file): device busy, computation and communication and their overlap, estimated SM
efficiency, achieved occupancy, and the device's idle time split into waiting-on-host vs
other.

Device activity is what runs on a device stream: kernels, memcpys and memsets. Kernels
carry their launch grid and CUPTI's estimated occupancy in their metadata ("grid", "est.
achieved occupancy %"), and each device activity shares a correlation id with the runtime
or driver call that queued it. A trace without those fields gives ``None`` for the figure,
never a guess. Checked on real A100 and MI250 traces (``tests/data/gpu-traces``); these are
te_lab's definitions (HTA's differ: :mod:`.temporal_breakdown`). No GPU has run the live path yet.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .kineto import Activity
from .report import Figure

# Kineto's names for the host calls that queue device work: CUDA (and ROCm, which Kineto
# files under cuda_runtime), CUDA's driver API (Triton launches through cuLaunchKernel),
# MUSA's runtime and driver, and PrivateUse1 (MUSA through torch_musa's profiler).
LAUNCH_TYPES = ("cuda_runtime", "cuda_driver", "musa_runtime", "musa_driver", "privateuse1_runtime",
                "privateuse1_driver")
# NCCL (CUDA; RCCL on ROCm keeps NCCL's kernel names) and MCCL (MUSA).
COLLECTIVE_KERNEL_PREFIXES = ("nccl", "mccl")


@dataclass(frozen=True)
class DeviceKernel:
    """One device activity: a kernel, or a memcpy / memset (``kind``)."""

    name: str
    start_ns: int
    duration_ns: int
    blocks: Optional[int]
    occupancy: Optional[float]  # fraction
    launched_ns: Optional[int]  # when the host call that queued it started
    stream: int = 0
    kind: str = "kernel"  # Kineto's activity type: "kernel", "gpu_memcpy", "gpu_memset"
    op_id: int = 0  # the CPU op it ran under (its external id / linked correlation id); 0: none recorded
    device: int = 0

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns

    @property
    def is_collective(self) -> bool:
        return self.kind == "kernel" and self.name.startswith(COLLECTIVE_KERNEL_PREFIXES)

    @property
    def is_computation(self) -> bool:
        return self.kind == "kernel" and not self.is_collective


def device_kernels(activities: list[Activity]) -> list[DeviceKernel]:
    """The device activities, sorted by start, each with its launching call's start."""
    launches = {a.correlation: a.start_ns for a in activities if a.kind in LAUNCH_TYPES and a.correlation}
    kernels = []
    for activity in activities:
        if not activity.on_device:
            continue
        grid = activity.metadata.get("grid")
        occupancy = activity.metadata.get("est. achieved occupancy %")
        kernels.append(DeviceKernel(
            activity.name, activity.start_ns, activity.duration_ns,
            math.prod(grid) if isinstance(grid, list) and grid else None,
            occupancy / 100 if isinstance(occupancy, (int, float)) else None,
            launches.get(activity.correlation) if activity.correlation else None, activity.resource,
            activity.kind, activity.external_id, activity.device))
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


def _clipped(kernels: list[DeviceKernel], start_ns: int, end_ns: int) -> list[DeviceKernel]:
    """The kernels' parts inside [start_ns, end_ns], sorted by start."""
    clipped = []
    for kernel in kernels:
        begin, end = max(kernel.start_ns, start_ns), min(kernel.end_ns, end_ns)
        if end > begin:
            clipped.append(dataclasses.replace(kernel, start_ns=begin, duration_ns=end - begin))
    return sorted(clipped, key=lambda k: k.start_ns)


def sm_efficiency(kernels: list[DeviceKernel], multiprocessors: int, wall_ns: int) -> Optional[float]:
    """sum over kernels of min(blocks / multiprocessors, 1) x duration / wall time
    (memcpys and memsets are not kernels and are left out)."""
    kernels = [k for k in kernels if k.kind == "kernel"]
    if not kernels or wall_ns <= 0 or any(k.blocks is None for k in kernels):
        return None
    return sum(min(k.blocks / multiprocessors, 1.0) * k.duration_ns for k in kernels) / wall_ns


def achieved_occupancy(kernels: list[DeviceKernel]) -> Optional[float]:
    """CUPTI's estimated achieved occupancy, averaged over kernels weighted by duration."""
    timed = [k for k in kernels if k.kind == "kernel" and k.occupancy is not None and k.duration_ns > 0]
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


def overlap_ns(first: list[DeviceKernel], second: list[DeviceKernel]) -> int:
    """How long activity of ``first`` and of ``second`` ran at the same time."""
    both = sorted(first + second, key=lambda k: k.start_ns)
    return busy_ns(first) + busy_ns(second) - busy_ns(both)


def device_figures(kernels: list[DeviceKernel], start_ns: int, end_ns: int, multiprocessors: Optional[int],
                   mode: str, span: str) -> list[Figure]:
    """The device's figures over [start_ns, end_ns] (``span`` says what that is, for the
    formulas), activity outside it cut off. ``mode`` labels them ("eager", "fused", a
    trace's step). The one implementation for live profiles and trace files."""
    wall_ns = end_ns - start_ns
    if not kernels or wall_ns <= 0:
        return [Figure("device busy", mode, None, "fraction", f"union of device activity intervals / {span}",
                       "no device activity in this span")]
    inside = _clipped(kernels, start_ns, end_ns)
    computation = [k for k in inside if k.is_computation]
    communication = [k for k in inside if k.is_collective]
    figures = [
        Figure("device busy", mode, busy_ns(inside) / wall_ns, "fraction",
               f"union of device activity intervals (kernels, memcpy, memset) / {span}"),
        Figure("device busy: computation", mode, busy_ns(computation) / wall_ns, "fraction",
               f"union of kernels other than collectives / {span}"),
        Figure("device busy: communication", mode, busy_ns(communication) / wall_ns, "fraction",
               f"union of collective kernels ({', '.join(COLLECTIVE_KERNEL_PREFIXES)}*) / {span}"),
        Figure("communication overlapped with computation", mode,
               overlap_ns(communication, computation) / busy_ns(communication) if communication else None,
               "fraction", "time collectives and other kernels ran together / time collectives ran",
               "" if communication else "no collective kernels"),
        Figure("estimated SM efficiency", mode,
               sm_efficiency(inside, multiprocessors, wall_ns) if multiprocessors else None, "fraction",
               f"sum over kernels of min(blocks / {multiprocessors or '?'} multiprocessors, 1) x duration / {span}"),
        Figure("achieved occupancy", mode, achieved_occupancy(inside), "fraction",
               "CUPTI's est. achieved occupancy, duration-weighted over kernels"),
    ]
    split = idle_split_ns(inside, start_ns, end_ns)
    for index, what in enumerate(("waiting on host", "other")):
        figures.append(Figure(f"device idle: {what}", mode, None if split is None else split[index] / wall_ns,
                              "fraction", "gaps between device activity before (waiting on host) / after the "
                              f"queuing host call began, over {span}"))
    return figures
