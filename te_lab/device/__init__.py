"""The device layer: MUSA, CUDA and the CPU behind one small API.

Everything that touches a device goes through here, so no other module needs to
know which vendor it runs on. MUSA (Moore Threads, via torch_musa) is registered
by torch as the PrivateUse1 backend with the device string ``"musa"``; the rules
followed here are the ones in docs/design.md: use the per-device module
(``torch.musa`` / ``torch.cuda``) for synchronisation, events and memory stats,
never torch.accelerator's generic synchronize (broken on MUSA with torch 2.7), and
never assume that a GPU is a CUDA GPU.

One concept per module, every name re-exported here (``te_lab.device.X``):
:mod:`.selection` (which devices exist, resolving a ``device`` argument, the device's
torch module, synchronising, the current-device guard), :mod:`.timing` (``Timer``, the
L2 flush), :mod:`.memory` (allocator statistics), :mod:`.properties` (name, dtypes,
parallel units), :mod:`.ceilings` (the roofline peaks), :mod:`.identity` (UUID and PCI
bus id), :mod:`.triton_availability` (whether the triton backend may run) and
:mod:`.subsystems` (the profiler activity and process-group backend of a device).
"""

from .ceilings import PEAK_TABLE, DevicePeak, fusion_bandwidth, lookup_peak, measure_copy_bandwidth, peak
from .identity import PhysicalIdentity, normalized_uuid, physical_identity
from .memory import max_memory_allocated, memory_allocated, reset_peak_memory_stats
from .properties import device_name, multiprocessor_count, supports_dtype
from .selection import (
    GPU_TYPES,
    DeviceLike,
    available_devices,
    default_device,
    device_count,
    device_guard,
    device_module,
    is_available,
    is_gpu,
    resolve,
    synchronize,
)
from .subsystems import distributed_backend, profiler_activities
from .timing import DEFAULT_CACHE_FLUSH_BYTES, Timer, cache_size_bytes, flush_cache
from .triton_availability import triton_available, triton_unavailable_reason

__all__ = [
    "DEFAULT_CACHE_FLUSH_BYTES",
    "GPU_TYPES",
    "PEAK_TABLE",
    "DeviceLike",
    "DevicePeak",
    "PhysicalIdentity",
    "Timer",
    "available_devices",
    "cache_size_bytes",
    "default_device",
    "device_count",
    "device_guard",
    "device_module",
    "device_name",
    "distributed_backend",
    "flush_cache",
    "fusion_bandwidth",
    "is_available",
    "is_gpu",
    "lookup_peak",
    "max_memory_allocated",
    "measure_copy_bandwidth",
    "memory_allocated",
    "multiprocessor_count",
    "normalized_uuid",
    "peak",
    "physical_identity",
    "profiler_activities",
    "reset_peak_memory_stats",
    "resolve",
    "supports_dtype",
    "synchronize",
    "triton_available",
    "triton_unavailable_reason",
]
