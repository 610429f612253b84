"""The device layer: MUSA, CUDA and the CPU behind one small API.

Everything that touches a device goes through here, so no other module needs to
know which vendor it runs on. MUSA (Moore Threads, via torch_musa) is registered
by torch as the PrivateUse1 backend with the device string ``"musa"``; the rules
followed here are the ones in docs/design.md: use the per-device module
(``torch.musa`` / ``torch.cuda``) for synchronisation, events and memory stats,
never torch.accelerator's generic synchronize (broken on MUSA with torch 2.7), and
never assume that a GPU is a CUDA GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

DeviceLike = Union[str, torch.device, None]

GPU_TYPES = ("musa", "cuda")  # in order of preference for the default device


def _musa_is_available() -> bool:
    # torch_musa registers torch.musa when imported; it is optional.
    if importlib.util.find_spec("torch_musa") is None:
        return False
    try:
        importlib.import_module("torch_musa")
    except Exception:  # a broken install must not break te_lab on other devices
        return False
    module = getattr(torch, "musa", None)
    return bool(module is not None and module.is_available())


def is_available(device_type: str) -> bool:
    """Whether devices of ``device_type`` ("musa", "cuda", "cpu") can be used here."""
    if device_type == "cpu":
        return True
    if device_type == "cuda":
        return torch.cuda.is_available()
    if device_type == "musa":
        return _musa_is_available()
    return False


def device_module(device: torch.device):
    """The torch module for a device type: ``torch.cuda``, ``torch.musa``, ``torch.cpu``."""
    return getattr(torch, device.type)


def device_count(device_type: str) -> int:
    if device_type == "cpu":
        return 1
    if not is_available(device_type):
        return 0
    return device_module(torch.device(device_type)).device_count()


def available_devices() -> list[torch.device]:
    """Every usable device, GPUs first (MUSA, then CUDA), the CPU last."""
    found = [
        torch.device(kind, index)
        for kind in GPU_TYPES
        for index in range(device_count(kind))
    ]
    return found + [torch.device("cpu")]


def default_device() -> torch.device:
    """The first GPU (MUSA before CUDA) if there is one, else the CPU."""
    for kind in GPU_TYPES:
        if device_count(kind) > 0:
            return torch.device(kind, 0)
    return torch.device("cpu")


def resolve(device: DeviceLike = None) -> torch.device:
    """Turn ``None``, ``"musa"``, ``"cuda:1"``, ``"cpu"`` or a ``torch.device`` into a
    usable ``torch.device`` with an explicit index on GPUs; raise if it is not usable."""
    if device is None:
        return default_device()
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device: expected a str such as 'cpu', 'cuda:0', 'musa' or a torch.device, "
            f"got {type(device).__name__}"
        )
    # torch cannot parse "musa" until torch_musa has registered it, so an absent GPU
    # type is reported as unavailable before torch is asked to parse the string.
    if isinstance(device, str):
        kind = device.split(":", 1)[0]
        if kind in GPU_TYPES and device_count(kind) == 0:
            raise _unavailable_error(device)
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"device: {device!r} is not a device string "
            f"(expected 'cpu', 'cuda', 'cuda:N', 'musa' or 'musa:N')"
        ) from error
    if parsed.type == "privateuseone" or parsed.type not in ("cpu",) + GPU_TYPES:
        raise ValueError(
            f"device: {device!r} has type {parsed.type!r}; te_lab supports 'cpu', 'cuda' and 'musa'"
        )
    if parsed.type == "cpu":
        return torch.device("cpu")
    count = device_count(parsed.type)
    if count == 0:
        raise _unavailable_error(device)
    index = 0 if parsed.index is None else parsed.index
    if index >= count:
        raise ValueError(
            f"device: {device!r} does not exist; this machine has {count} {parsed.type} device(s)"
        )
    return torch.device(parsed.type, index)


def _unavailable_error(device: DeviceLike) -> ValueError:
    return ValueError(
        f"device: {device!r} is not available on this machine "
        f"(available: {', '.join(str(d) for d in available_devices())})"
    )


def is_gpu(device: torch.device) -> bool:
    return device.type in GPU_TYPES


def synchronize(device: DeviceLike = None) -> None:
    """Wait for all queued work on ``device``; a no-op on the CPU."""
    dev = resolve(device)
    if is_gpu(dev):
        device_module(dev).synchronize(dev)


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
        self.device = resolve(device)
        self.elapsed_ms: Optional[float] = None
        if is_gpu(self.device):
            module = device_module(self.device)
            self._start_event = module.Event(enable_timing=True)
            self._end_event = module.Event(enable_timing=True)

    def __enter__(self) -> "Timer":
        if is_gpu(self.device):
            # Read at entry: a ``with torch.cuda.stream(s)`` around the timer selects s.
            self._stream = device_module(self.device).current_stream(self.device)
            self._start_event.record(self._stream)
        else:
            self._start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, *exc) -> None:
        if is_gpu(self.device):
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
    dev = resolve(device)
    if not is_gpu(dev):
        return None
    size = getattr(device_module(dev).get_device_properties(dev), "L2_cache_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def flush_cache(device: DeviceLike = None) -> None:
    """Evict the GPU's L2 cache: overwrite a buffer twice its size (queued on the
    current stream, like the work timed after it), so a timed kernel reads its inputs
    from memory, not from a cache its previous call warmed. A no-op on the CPU."""
    dev = resolve(device)
    if not is_gpu(dev):
        return
    if dev not in _cache_flush_buffers:
        size = cache_size_bytes(dev)
        _cache_flush_buffers[dev] = torch.empty(2 * size if size else DEFAULT_CACHE_FLUSH_BYTES,
                                                dtype=torch.int8, device=dev)
    _cache_flush_buffers[dev].zero_()


@dataclass(frozen=True)
class PhysicalIdentity:
    """What names a GPU outside torch, for libraries that count physical devices (NVML,
    pymtml): torch's index differs from theirs under ``CUDA_VISIBLE_DEVICES`` /
    ``MUSA_VISIBLE_DEVICES`` and under CUDA's default fastest-first order."""

    uuid: Optional[str]  # 32 lowercase hex digits, no dashes or vendor prefix
    pci_bus_id: Optional[str]  # "DDDDDDDD:BB:DD.0", as NVML formats busId


def normalized_uuid(text: str) -> Optional[str]:
    """The 32 hex digits of a UUID as torch ("6f7b...-...") or NVML ("GPU-6f7b...-...")
    writes it, lowercase (the vendor prefixes hold no hex digit); None when ``text``
    holds no UUID."""
    digits = "".join(ch for ch in text.lower() if ch in "0123456789abcdef")
    return digits if len(digits) == 32 else None


def physical_identity(device: DeviceLike = None) -> PhysicalIdentity:
    """The GPU's UUID and PCI bus id, from ``get_device_properties`` where the torch
    build reports them (CUDA: ``uuid``; PCI fields where present)."""
    dev = resolve(device)
    if not is_gpu(dev):
        raise ValueError(f"physical_identity: device must be a GPU, got {dev}")
    props = device_module(dev).get_device_properties(dev)
    uuid = getattr(props, "uuid", None)
    bus = getattr(props, "pci_bus_id", None)
    pci = None
    if isinstance(bus, int):
        pci = (f"{int(getattr(props, 'pci_domain_id', 0) or 0):08x}:{bus:02x}:"
               f"{int(getattr(props, 'pci_device_id', 0) or 0):02x}.0").upper()
    return PhysicalIdentity(normalized_uuid(str(uuid)) if uuid is not None else None, pci)


def memory_allocated(device: DeviceLike = None) -> Optional[int]:
    """Bytes currently held by torch's allocator on a GPU; ``None`` on the CPU."""
    dev = resolve(device)
    return device_module(dev).memory_allocated(dev) if is_gpu(dev) else None


def max_memory_allocated(device: DeviceLike = None) -> Optional[int]:
    """Peak bytes held since the last reset on a GPU; ``None`` on the CPU."""
    dev = resolve(device)
    return device_module(dev).max_memory_allocated(dev) if is_gpu(dev) else None


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    dev = resolve(device)
    if is_gpu(dev):
        device_module(dev).reset_peak_memory_stats(dev)


def device_name(device: DeviceLike = None) -> str:
    dev = resolve(device)
    if is_gpu(dev):
        return device_module(dev).get_device_name(dev)
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
    dev = resolve(device)
    if dtype == torch.float32 or not is_gpu(dev):
        return dtype in (torch.float32, torch.float16, torch.bfloat16)
    if dtype == torch.bfloat16:
        return bool(device_module(dev).is_bf16_supported())
    return dtype == torch.float16


def multiprocessor_count(device: DeviceLike = None) -> int:
    """Parallel units: streaming multiprocessors (CUDA), MUSA cores' clusters as torch_musa
    reports them, or the CPU cores this process may run on."""
    dev = resolve(device)
    if is_gpu(dev):
        return int(device_module(dev).get_device_properties(dev).multi_processor_count)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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


_measured_bandwidth: dict[torch.device, float] = {}


def measure_copy_bandwidth(device: DeviceLike = None, megabytes: int = 64, repeats: int = 7) -> float:
    """Achieved GB/s of a device-to-device copy (bytes read + bytes written) / median time.

    Measured once per device and cached: it is the bandwidth ceiling for devices the
    peak table does not know, the CPU included. The destination is written once before
    timing so page faults on fresh memory are not counted.
    """
    dev = resolve(device)
    if dev in _measured_bandwidth:
        return _measured_bandwidth[dev]
    numel = megabytes * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        synchronize(dev)
        with Timer(dev) as timer:
            dst.copy_(src)
        times.append(timer.elapsed_ms)
    median_ms = sorted(times)[len(times) // 2]
    bandwidth = 2 * src.numel() * src.element_size() / (median_ms * 1e-3) / 1e9
    _measured_bandwidth[dev] = bandwidth
    return bandwidth


def peak(device: DeviceLike = None) -> DevicePeak:
    """The device's bandwidth and compute ceilings: the vendor table when the device is
    listed, else the measured copy bandwidth (compute ceilings unknown)."""
    dev = resolve(device)
    name = device_name(dev)
    listed = lookup_peak(name) if is_gpu(dev) else None
    if listed is not None:
        return listed
    return DevicePeak(name, measure_copy_bandwidth(dev), None, None, "measured copy bandwidth")


def _triton_backend_for(device_type: str) -> Optional[str]:
    """Why the triton backend cannot run on ``device_type``, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'te_lab[triton]', or Moore Threads' triton on MUSA)"
    if device_type == "cuda":
        return None
    if device_type == "musa":
        for backend in ("triton.backends.mthreads", "triton.backends.mtgpu"):
            try:
                if importlib.util.find_spec(backend) is not None:
                    return None
            except ModuleNotFoundError:
                continue
        return "the installed triton has no Moore Threads backend (install Moore Threads' triton build)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        "Triton kernels do not run on the CPU "
        "(TRITON_INTERPRET=1 runs them through Triton's interpreter, for tests only)"
    )


_triton_reasons: dict[str, Optional[str]] = {}


@torch.compiler.assume_constant_result
def triton_unavailable_reason(device_type: str) -> Optional[str]:
    """``None`` when the triton backend can run on devices of this type, else why not.

    Checked once per process and device type. Under torch.compile the answer is a
    trace-time constant, so selecting a backend never breaks the graph.
    """
    if device_type not in _triton_reasons:
        _triton_reasons[device_type] = _triton_backend_for(device_type)
    return _triton_reasons[device_type]


def triton_available(device: DeviceLike = None) -> bool:
    return triton_unavailable_reason(resolve(device).type) is None


def profiler_activities(device: DeviceLike = None) -> list:
    """torch.profiler activities that record work on ``device``."""
    from torch.profiler import ProfilerActivity

    # MUSA's kernels are recorded under PrivateUse1, where the torch build has it.
    device_activity = getattr(ProfilerActivity, _PROFILER_ACTIVITY.get(resolve(device).type, ""), None)
    activities = [ProfilerActivity.CPU]
    if device_activity is not None and device_activity in torch.profiler.supported_activities():
        activities.append(device_activity)
    return activities


_PROFILER_ACTIVITY = {"cuda": "CUDA", "musa": "PrivateUse1"}


def distributed_backend(device: DeviceLike = None) -> str:
    """The torch.distributed process-group backend for a device."""
    return {"cuda": "nccl", "musa": "mccl", "cpu": "gloo"}[resolve(device).type]


def device_guard(device: torch.device):
    """A context that makes ``device`` current, so kernels launch on the right GPU."""
    return device_module(device).device(device) if is_gpu(device) else contextlib.nullcontext()
