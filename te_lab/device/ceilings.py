"""A device's roofline ceilings (bandwidth, fp32 and bf16 compute): public vendor figures
for known GPUs, else a measured copy bandwidth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import properties, selection, timing
from .selection import DeviceLike


@dataclass(frozen=True)
class DevicePeak:
    """Roofline ceilings of a device. ``source`` says where the figures come from."""

    name: str
    memory_bandwidth_gbs: float
    fp32_tflops: Optional[float]
    bf16_tflops: Optional[float]
    source: str


# Public vendor figures (dense, no sparsity). Matched against the device name in order:
# every substring of an entry must appear in the name, most specific entries first.
PEAK_TABLE: tuple[tuple[tuple[str, ...], DevicePeak], ...] = (
    (("GH200",), DevicePeak("NVIDIA GH200 96GB", 4000.0, 67.0, 989.0, "NVIDIA GH200 datasheet (HBM3)")),
    (("H200",), DevicePeak("NVIDIA H200", 4800.0, 67.0, 989.0, "NVIDIA H200 datasheet (SXM)")),
    (("H100", "PCIe"), DevicePeak("NVIDIA H100 PCIe", 2000.0, 51.0, 756.0, "NVIDIA H100 datasheet")),
    (("H100", "NVL"), DevicePeak("NVIDIA H100 NVL", 3900.0, 60.0, 835.0, "NVIDIA H100 datasheet")),
    (("H100",), DevicePeak("NVIDIA H100 SXM", 3350.0, 67.0, 989.0, "NVIDIA H100 datasheet")),
    (("A100", "80GB", "PCIe"), DevicePeak("NVIDIA A100 80GB PCIe", 1935.0, 19.5, 312.0, "NVIDIA A100 datasheet")),
    (("A100", "80GB"), DevicePeak("NVIDIA A100 80GB SXM", 2039.0, 19.5, 312.0, "NVIDIA A100 datasheet")),
    (("A100",), DevicePeak("NVIDIA A100 40GB", 1555.0, 19.5, 312.0, "NVIDIA A100 datasheet")),
    (("S4000",), DevicePeak("Moore Threads MTT S4000", 768.0, 25.0, 100.0, "Moore Threads MTT S4000 product page")),
)


def lookup_peak(name: str) -> Optional[DevicePeak]:
    """The table entry whose substrings all occur in ``name`` (case-insensitive), if any."""
    lowered = name.lower()
    for needles, peak in PEAK_TABLE:
        if all(needle.lower() in lowered for needle in needles):
            return peak
    return None


_measured_bandwidth: dict[tuple[torch.device, int], float] = {}  # (device, MiB copied) -> GB/s


def measure_copy_bandwidth(device: DeviceLike = None, megabytes: int = 64, repeats: int = 7) -> float:
    """Achieved GB/s of a device-to-device copy (bytes read + bytes written) / median time.

    Measured once per device and size and cached: it is the bandwidth ceiling for devices the
    peak table does not know, the CPU included. The destination is written once before
    timing so page faults on fresh memory are not counted.
    """
    dev = selection.resolve(device)
    if (dev, megabytes) not in _measured_bandwidth:
        _measured_bandwidth[dev, megabytes] = _time_copy(dev, megabytes, repeats)
    return _measured_bandwidth[dev, megabytes]


def _time_copy(dev: torch.device, megabytes: int, repeats: int) -> float:
    """GB/s of copying ``megabytes`` of float32: (read + written) / the median of ``repeats``."""
    numel = megabytes * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        selection.synchronize(dev)
        with timing.Timer(dev) as timer:
            dst.copy_(src)
        times.append(timer.elapsed_ms)
    median_ms = sorted(times)[len(times) // 2]
    return 2 * src.numel() * src.element_size() / (median_ms * 1e-3) / 1e9


# Copy sizes the fusion ceiling's bandwidth is measured at on the CPU: a layer's activations
# sit in the caches (2 and 8 MiB) or in DRAM (64 MiB) by their size; on the 2-core EPYC
# here 140-165 GB/s against 45 GB/s.
CPU_CEILING_COPY_MIB = (2, 8, 64)


def fusion_bandwidth(device: DeviceLike = None) -> tuple[float, str]:
    """(GB/s, where it comes from) at which the fusion ceiling costs the bytes that are not
    GEMMs' (:mod:`te_lab.profiler.ceiling`): a listed GPU's vendor bandwidth, else the
    fastest measured copy over :data:`CPU_CEILING_COPY_MIB` (the ceiling is an upper bound,
    so it takes the caches' speed where activations fit them)."""
    dev = selection.resolve(device)
    listed = lookup_peak(properties.device_name(dev)) if selection.is_gpu(dev) else None
    if listed is not None:
        return listed.memory_bandwidth_gbs, listed.source
    sizes = CPU_CEILING_COPY_MIB if not selection.is_gpu(dev) else (CPU_CEILING_COPY_MIB[-1],)
    measured = {size: measure_copy_bandwidth(dev, size) for size in sizes}
    size = max(measured, key=measured.get)
    return measured[size], f"fastest measured copy of {', '.join(map(str, sizes))} MiB: {size} MiB"


def peak(device: DeviceLike = None) -> DevicePeak:
    """The device's bandwidth and compute ceilings: the vendor table when the device is
    listed, else the measured copy bandwidth (compute ceilings unknown)."""
    dev = selection.resolve(device)
    name = properties.device_name(dev)
    listed = lookup_peak(name) if selection.is_gpu(dev) else None
    if listed is not None:
        return listed
    return DevicePeak(name, measure_copy_bandwidth(dev), None, None, "measured copy bandwidth")
