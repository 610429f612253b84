"""Timing device work: a region's wall time from device events on GPUs (the clock on the
CPU), and the L2 flush that keeps a timed kernel from reading a cache its previous call
warmed."""

from __future__ import annotations

import time
from typing import Optional

import torch

from . import selection
from .selection import DeviceLike


class Timer:
    """Wall time of a region of device work, in milliseconds.

    On GPUs it records device events (so queued kernels are timed, not their
    launch) on ``device``'s current stream, the one its work is queued on, whichever
    device is current (an event recorded without a stream goes to the current device's
    stream: on ``cuda:1`` without ``set_device`` that would time an idle stream of
    ``cuda:0``). On the CPU it reads ``time.perf_counter_ns``. Use as a context
    manager; ``elapsed_ms`` is valid after the block exits.
    """

    def __init__(self, device: DeviceLike = None):
        self.device = selection.resolve(device)
        self.elapsed_ms: Optional[float] = None
        if selection.is_gpu(self.device):
            module = selection.device_module(self.device)
            self._start_event = module.Event(enable_timing=True)
            self._end_event = module.Event(enable_timing=True)

    def __enter__(self) -> "Timer":
        if selection.is_gpu(self.device):
            # Read at entry: a ``with torch.cuda.stream(s)`` around the timer selects s.
            self._stream = selection.device_module(self.device).current_stream(self.device)
            self._start_event.record(self._stream)
        else:
            self._start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        if selection.is_gpu(self.device):
            self._end_event.record(self._stream)
            self._end_event.synchronize()
            self.elapsed_ms = self._start_event.elapsed_time(self._end_event)
        else:
            self.elapsed_ms = (time.perf_counter_ns() - self._start_ns) / 1e6


# Where the device properties do not say how large the last-level cache is: larger than
# any GPU's L2 today (H100/H200: 50/60 MB, B200: 126 MB).
DEFAULT_CACHE_FLUSH_BYTES = 256 * 2**20
_cache_flush_buffers: dict[torch.device, torch.Tensor] = {}


def cache_size_bytes(device: DeviceLike = None) -> Optional[int]:
    """The GPU's L2 cache in bytes as its properties report it (``L2_cache_size``);
    ``None`` on the CPU or where the properties do not say."""
    dev = selection.resolve(device)
    if not selection.is_gpu(dev):
        return None
    size = getattr(selection.device_module(dev).get_device_properties(dev), "L2_cache_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def flush_cache(device: DeviceLike = None) -> None:
    """Evict the GPU's L2 cache: overwrite a buffer twice its size (queued on the
    current stream, like the work timed after it), so a timed kernel reads its inputs
    from memory, not from a cache its previous call warmed. A no-op on the CPU."""
    dev = selection.resolve(device)
    if not selection.is_gpu(dev):
        return
    if dev not in _cache_flush_buffers:
        size = cache_size_bytes(dev)
        _cache_flush_buffers[dev] = torch.empty(2 * size if size else DEFAULT_CACHE_FLUSH_BYTES,
                                                dtype=torch.int8, device=dev)
    _cache_flush_buffers[dev].zero_()
