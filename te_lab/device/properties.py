"""What a device is: its name, the dtypes fused ops compute in there, and its parallel
units."""

from __future__ import annotations

import os

import torch

from . import selection
from .selection import DeviceLike


def device_name(device: DeviceLike = None) -> str:
    dev = selection.resolve(device)
    if selection.is_gpu(dev):
        return selection.device_module(dev).get_device_name(dev)
    return _cpu_name()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


def supports_dtype(dtype: torch.dtype, device: DeviceLike = None) -> bool:
    """Whether fused ops can compute in ``dtype`` on ``device``."""
    dev = selection.resolve(device)
    if dtype == torch.float32 or not selection.is_gpu(dev):
        return dtype in (torch.float32, torch.float16, torch.bfloat16)
    if dtype == torch.bfloat16:
        return bool(selection.device_module(dev).is_bf16_supported())
    return dtype == torch.float16


def multiprocessor_count(device: DeviceLike = None) -> int:
    """Parallel units: streaming multiprocessors (CUDA), MUSA cores' clusters as torch_musa
    reports them, or the CPU cores this process may run on."""
    dev = selection.resolve(device)
    if selection.is_gpu(dev):
        return int(selection.device_module(dev).get_device_properties(dev).multi_processor_count)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
