"""UtilizationSampler: real psutil samples from a real background thread."""

import sys
import threading
import time
import types

import pytest
import torch

psutil = pytest.importorskip("psutil")  # the Triton 3.2 test environment has only what kernels need

from te_lab import device as devices  # noqa: E402
from te_lab.profiler.sampler import UtilizationSampler  # noqa: E402

THREAD_NAME = "te_lab-utilization-sampler"


def busy_for(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def cpu_series(sampler):
    (series,) = [s for s in sampler.series if s.source == "psutil"]
    return series


def test_samples_every_core_while_the_block_runs():
    with UtilizationSampler(torch.device("cpu"), interval_s=0.02) as sampler:
        busy_for(0.2)
    series = cpu_series(sampler)
    assert series.unit == "percent"
    assert "cpu_percent" in series.formula
    assert series.labels == [f"cpu{i}" for i in range(psutil.cpu_count())]
    # 0.2 s at 0.02 s a tick; a loaded machine may tick late, not this late
    assert len(series.times_s) >= 3
    assert len(series.values) == len(series.times_s)
    assert all(len(row) == psutil.cpu_count() for row in series.values)
    assert all(0.0 <= v <= 100.0 for row in series.values for v in row)
    assert all(a < b for a, b in zip(series.times_s, series.times_s[1:]))
    assert series.times_s[0] > 0
    # the busy loop keeps one core busy for the whole block
    assert max(v for row in series.values for v in row) > 0


def test_thread_is_stopped_after_the_block():
    with UtilizationSampler(torch.device("cpu")):
        assert len(sampler_threads()) == 1
        busy_for(0.05)
    assert sampler_threads() == []


def test_thread_is_stopped_and_the_error_propagates_when_the_block_raises():
    with pytest.raises(RuntimeError, match="from the profiled block"):
        with UtilizationSampler(torch.device("cpu")) as sampler:
            raise RuntimeError("from the profiled block")
    assert sampler_threads() == []
    assert len(cpu_series(sampler).times_s) >= 1


def test_marks_are_recorded_in_order_within_the_run():
    started = time.perf_counter()
    with UtilizationSampler(torch.device("cpu")) as sampler:
        for step in (1, 2):
            sampler.mark(f"eager step {step} start")
            busy_for(0.02)
            sampler.mark(f"eager step {step} end")
    run_s = time.perf_counter() - started
    labels = [label for label, _ in sampler.marks]
    assert labels == ["eager step 1 start", "eager step 1 end", "eager step 2 start", "eager step 2 end"]
    times = [t for _, t in sampler.marks]
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert 0 <= times[0] and times[-1] <= run_s


def test_cpu_device_says_the_device_source_does_not_apply():
    with UtilizationSampler(torch.device("cpu")) as sampler:
        pass
    assert [s.source for s in sampler.series] == ["psutil"]
    assert any("the device is the CPU" in reason for reason in sampler.unavailable)


def test_a_very_short_block_still_yields_a_sample():
    started = time.perf_counter()
    with UtilizationSampler(torch.device("cpu"), interval_s=10.0) as sampler:
        pass
    # the stop interrupts the 10 s tick instead of waiting it out
    assert time.perf_counter() - started < 2.0
    series = cpu_series(sampler)
    assert len(series.times_s) == 1
    assert len(series.values[0]) == psutil.cpu_count()


def test_rejects_a_non_positive_interval():
    with pytest.raises(ValueError, match="interval_s"):
        UtilizationSampler(torch.device("cpu"), interval_s=0)


# Four physical GPUs as NVML lists them: (UUID as NVML writes it, PCI bus id).
PHYSICAL_GPUS = [(f"GPU-{index}0000000-1111-2222-3333-44444444444{index}", f"00000000:{0x17 + index:02X}:00.0")
                 for index in range(4)]


def fake_nvml_library(fail_after_reads):
    """An NVML-shaped module over PHYSICAL_GPUS: a stand-in for the GPUs this test
    machine lacks. A handle is the physical index."""
    library = types.ModuleType("fake_nvml")
    library.calls = []
    library.reads = 0

    def nvmlDeviceGetUtilizationRates(handle):
        library.reads += 1
        if library.reads > fail_after_reads:
            raise OSError("driver went away")
        return types.SimpleNamespace(gpu=37 + handle, memory=5)

    library.nvmlInit = lambda: library.calls.append("init")
    library.nvmlShutdown = lambda: library.calls.append("shutdown")
    library.nvmlDeviceGetCount = lambda: len(PHYSICAL_GPUS)
    library.nvmlDeviceGetHandleByIndex = lambda index: index
    library.nvmlDeviceGetUUID = lambda handle: PHYSICAL_GPUS[handle][0]
    # older bindings return bytes
    library.nvmlDeviceGetPciInfo = lambda handle: types.SimpleNamespace(busId=PHYSICAL_GPUS[handle][1].encode())
    library.nvmlDeviceGetUtilizationRates = nvmlDeviceGetUtilizationRates
    return library


def torch_sees(monkeypatch, uuid=None, pci_bus_id=None):
    """What torch's device properties report for the sampled device."""
    identity = devices.PhysicalIdentity(devices.normalized_uuid(uuid) if uuid else None, pci_bus_id)
    monkeypatch.setattr(devices, "physical_identity", lambda device: identity)


@pytest.mark.parametrize(
    "device, module, source, label",
    [
        (torch.device("cuda", 1), "pynvml", "nvml", "cuda:1"),
        # torch parses "musa" only once torch_musa is imported; the sampler reads
        # nothing but .type and .index
        (types.SimpleNamespace(type="musa", index=None), "pymtml", "pymtml", "musa:0"),
    ],
)
def test_gpu_library_is_sampled_beside_the_cores(monkeypatch, device, module, source, label):
    library = fake_nvml_library(fail_after_reads=10**6)
    monkeypatch.setitem(sys.modules, module, library)
    # torch's device is physical GPU 3 (CUDA_VISIBLE_DEVICES=3,...): its UUID as torch writes it
    torch_sees(monkeypatch, uuid="30000000-1111-2222-3333-444444444443")
    with UtilizationSampler(device) as sampler:
        busy_for(0.05)
    (gpu,) = [s for s in sampler.series if s.source == source]
    assert gpu.labels == [label]
    assert gpu.values[0] == [37.0 + 3]
    assert library.calls == ["init", "shutdown"]
    assert sampler.unavailable == []


def test_gpu_handle_is_found_by_pci_bus_id_where_torch_reports_no_uuid(monkeypatch):
    library = fake_nvml_library(fail_after_reads=10**6)
    monkeypatch.setitem(sys.modules, "pynvml", library)
    torch_sees(monkeypatch, pci_bus_id="00000000:19:00.0")  # physical GPU 2, whatever torch's index
    with UtilizationSampler(torch.device("cuda", 0)) as sampler:
        busy_for(0.02)
    (gpu,) = [s for s in sampler.series if s.source == "nvml"]
    assert gpu.values[0] == [37.0 + 2]


@pytest.mark.parametrize("identity, reason", [
    ({}, "nvml: torch reports neither a UUID nor a PCI bus id for cuda:1, so its pynvml device cannot be told "
         "apart from the others"),
    ({"uuid": "ffffffff-1111-2222-3333-444444444444"},
     "nvml: no pynvml device has cuda:1's UUID ffffffff111122223333444444444444 or PCI bus id None"),
])
def test_gpu_library_is_not_sampled_when_the_device_cannot_be_matched(monkeypatch, identity, reason):
    library = fake_nvml_library(fail_after_reads=10**6)
    monkeypatch.setitem(sys.modules, "pynvml", library)
    torch_sees(monkeypatch, **identity)
    with UtilizationSampler(torch.device("cuda", 1)) as sampler:
        pass
    assert sampler.unavailable == [reason]
    assert [s.source for s in sampler.series] == ["psutil"]
    assert library.calls == ["init", "shutdown"]


def test_a_failing_gpu_library_is_reported_and_the_cores_carry_on(monkeypatch):
    library = fake_nvml_library(fail_after_reads=1)
    monkeypatch.setitem(sys.modules, "pynvml", library)
    torch_sees(monkeypatch, uuid=PHYSICAL_GPUS[0][0])
    with UtilizationSampler(torch.device("cuda"), interval_s=0.01) as sampler:
        busy_for(0.1)
    (gpu,) = [s for s in sampler.series if s.source == "nvml"]
    assert gpu.values == [[37.0]]
    assert sampler.unavailable == ["nvml: OSError: driver went away"]
    assert library.calls[-1] == "shutdown"
    assert len(cpu_series(sampler).times_s) >= 3


def test_a_missing_gpu_library_is_reported(monkeypatch):
    # None in sys.modules makes the import fail, as when the package is not installed
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with UtilizationSampler(torch.device("cuda")) as sampler:
        pass
    assert sampler.unavailable == ["nvml: nvidia-ml-py is not installed"]
    assert [s.source for s in sampler.series] == ["psutil"]
