"""Utilization sampled in a background thread while profiled code runs.

``with UtilizationSampler(device) as sampler: ...`` records how busy each CPU core
(psutil) and, where a library for it is installed, the GPU (NVML on CUDA, Moore
Threads' pymtml on MUSA) were, tick by tick, so the dashboard can show the profiled
steps against them. A missing or failing source never stops the profiled code: the
reason lands in ``sampler.unavailable`` and the other sources carry on.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from te_lab import device as devices


@dataclass
class UtilizationSeries:
    """Samples of one source over time."""

    source: str  # "psutil" (per CPU core), "nvml" (CUDA), "pymtml" (MUSA)
    unit: str  # "percent"
    labels: list[str]  # one per channel: "cpu0", "cpu1", ... or "cuda:0"
    times_s: list[float]  # seconds since the sampler started, one per sample
    values: list[list[float]]  # one row per sample, one value per channel, in [0, 100]
    formula: str  # how a value is defined


class _SourceUnavailable(Exception):
    """A source cannot be used here; the message says why, for ``unavailable``."""


class _Source:
    """One library that reports utilization, with the samples taken from it."""

    name: str
    formula: str

    def __init__(self) -> None:
        self.labels: list[str] = []
        self.times_s: list[float] = []
        self.values: list[list[float]] = []

    def open(self) -> None:
        raise NotImplementedError

    def read(self) -> list[float]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def sample(self, time_s: float) -> None:
        row = self.read()
        self.times_s.append(time_s)
        self.values.append(row)

    def series(self) -> UtilizationSeries:
        return UtilizationSeries(
            source=self.name,
            unit="percent",
            labels=self.labels,
            times_s=self.times_s,
            values=self.values,
            formula=self.formula,
        )


class _CpuCores(_Source):
    name = "psutil"
    formula = (
        "psutil.cpu_percent(percpu=True): busy share of each core since the previous sample"
    )

    def open(self) -> None:
        # Imported here, not at module level, so that `import te_lab` stays light (the
        # profiler is imported with te_lab; sampling happens only while profiling).
        import psutil

        self.cpu_percent = psutil.cpu_percent
        # psutil keeps the previous reading per thread, so this priming call must run
        # on the sampling thread; without it the first sample would compare against
        # nothing and read 0.
        self.labels = [f"cpu{i}" for i in range(len(self.read()))]

    def read(self) -> list[float]:
        return [float(v) for v in self.cpu_percent(interval=None, percpu=True)]


class _NvmlStyleGpu(_Source):
    """One GPU through NVML, or through pymtml, which copies NVML's ``nvml*`` API."""

    def __init__(self, name: str, module: str, package: str, device: torch.device) -> None:
        super().__init__()
        self.name = name
        self._module = module
        self._package = package
        self._device = device
        self.labels = [f"{device.type}:{device.index or 0}"]
        self.formula = (
            f"{module}.nvmlDeviceGetUtilizationRates(handle).gpu: percent of the driver's "
            "last sample period in which a kernel ran on the device"
        )

    def open(self) -> None:
        try:
            self._library = importlib.import_module(self._module)
        except ImportError as error:
            raise _SourceUnavailable(f"{self._package} is not installed") from error
        self._library.nvmlInit()
        try:
            self._handle = self._matching_handle(devices.physical_identity(self._device))
        except Exception:
            self._library.nvmlShutdown()
            raise

    def _matching_handle(self, identity: "devices.PhysicalIdentity"):
        """The library's handle for torch's device, found by UUID, else by PCI bus id: the
        library counts physical devices, and torch's index is not theirs where
        CUDA_VISIBLE_DEVICES / MUSA_VISIBLE_DEVICES select or reorder devices (or CUDA
        orders them fastest first)."""
        label = self.labels[0]
        if identity.uuid is None and identity.pci_bus_id is None:
            raise _SourceUnavailable(f"torch reports neither a UUID nor a PCI bus id for {label}, so its "
                                     f"{self._module} device cannot be told apart from the others")
        library = self._library
        for index in range(library.nvmlDeviceGetCount()):
            handle = library.nvmlDeviceGetHandleByIndex(index)
            if identity.uuid is not None and devices.normalized_uuid(_text(library.nvmlDeviceGetUUID(handle))) \
                    == identity.uuid:
                return handle
            if identity.pci_bus_id is not None and _pci_address(_text(library.nvmlDeviceGetPciInfo(handle).busId)) \
                    == _pci_address(identity.pci_bus_id):
                return handle
        raise _SourceUnavailable(f"no {self._module} device has {label}'s UUID {identity.uuid} or PCI bus id "
                                 f"{identity.pci_bus_id}")

    def read(self) -> list[float]:
        return [float(self._library.nvmlDeviceGetUtilizationRates(self._handle).gpu)]

    def close(self) -> None:
        self._library.nvmlShutdown()


def _text(value) -> str:
    """NVML's strings: ``str`` in nvidia-ml-py, ``bytes`` in older bindings."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _pci_address(text: str) -> Optional[tuple[int, ...]]:
    """(domain, bus, device, function) of "0000:17:00.0" or "00000000:17:00.0"."""
    try:
        domain, bus, rest = text.strip().split(":")
        slot, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16)
    except ValueError:
        return None


# device type -> (source name, module to import, package that provides it)
_GPU_LIBRARIES = {
    "cuda": ("nvml", "pynvml", "nvidia-ml-py"),
    "musa": ("pymtml", "pymtml", "mthreads-ml-py"),
}


class UtilizationSampler:
    """Samples utilization every ``interval_s`` seconds while its ``with`` block runs.

    After the block: ``series`` holds the psutil per-core series and, where available,
    the device's; ``marks`` the ``(label, seconds)`` pairs given to ``mark``;
    ``unavailable`` why a source is missing or stopped early.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.02) -> None:
        if interval_s <= 0:
            raise ValueError(f"UtilizationSampler: interval_s must be > 0, got {interval_s}")
        self.device = device
        self.interval_s = interval_s
        self.series: list[UtilizationSeries] = []
        self.marks: list[tuple[str, float]] = []
        self.unavailable: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_s = 0.0

    def __enter__(self) -> "UtilizationSampler":
        sources: list[_Source] = [_CpuCores()]
        if self.device.type in _GPU_LIBRARIES:
            sources.append(_NvmlStyleGpu(*_GPU_LIBRARIES[self.device.type], self.device))
        elif self.device.type == "cpu":
            self.unavailable.append("device: the device is the CPU (see the psutil series)")
        else:
            self.unavailable.append(f"device: no utilization library for {self.device.type!r}")
        self._start_s = time.perf_counter()
        self._thread = threading.Thread(
            target=self._run, args=(sources,), name="te_lab-utilization-sampler", daemon=True
        )
        self._thread.start()
        # The block must not start before the sources are primed, or its first
        # moments would fall outside every sample.
        self._ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self, label: str) -> None:
        """Records ``label`` at the current time, e.g. ``"eager step 1 start"``."""
        self.marks.append((label, self._elapsed_s()))

    def _elapsed_s(self) -> float:
        return time.perf_counter() - self._start_s

    def _run(self, sources: list[_Source]) -> None:
        # Every library call happens on this thread: psutil's per-thread state needs
        # it, and a library's init, reads and shutdown then never interleave.
        try:
            active = [source for source in sources if self._attempt(source, source.open)]
        finally:
            self._ready.set()
        stopped = False
        while active and not stopped:
            stopped = self._stop.wait(self.interval_s)
            # Sampling once more after the stop covers the end of the block and
            # gives even a very short block one sample.
            now_s = self._elapsed_s()
            for source in list(active):
                if not self._attempt(source, lambda: source.sample(now_s)):
                    active.remove(source)
                    self._attempt(source, source.close)
        for source in active:
            self._attempt(source, source.close)
        self.series = [source.series() for source in sources if source.times_s]

    def _attempt(self, source: _Source, step) -> bool:
        """Runs ``step``; a failure is recorded in ``unavailable`` instead of lost."""
        try:
            step()
        except _SourceUnavailable as reason:
            self.unavailable.append(f"{source.name}: {reason}")
            return False
        except Exception as error:
            self.unavailable.append(f"{source.name}: {type(error).__name__}: {error}")
            return False
        return True
