"""Memory held by torch's allocator on a GPU: now and at its peak (``None`` on the CPU,
where the allocator keeps no statistics)."""

from __future__ import annotations

from typing import Optional

from . import selection
from .selection import DeviceLike


def memory_allocated(device: DeviceLike = None) -> Optional[int]:
    """Bytes currently held by torch's allocator on a GPU; ``None`` on the CPU."""
    dev = selection.resolve(device)
    return selection.device_module(dev).memory_allocated(dev) if selection.is_gpu(dev) else None


def max_memory_allocated(device: DeviceLike = None) -> Optional[int]:
    """Peak bytes held since the last reset on a GPU; ``None`` on the CPU."""
    dev = selection.resolve(device)
    return selection.device_module(dev).max_memory_allocated(dev) if selection.is_gpu(dev) else None


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    dev = selection.resolve(device)
    if selection.is_gpu(dev):
        selection.device_module(dev).reset_peak_memory_stats(dev)
