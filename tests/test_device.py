"""The device layer: detection, resolution and its errors, timing, memory stats, the
peak table, and when the triton backend may run.

GPU detection is exercised by faking device counts, so these tests say the same on a
CPU-only machine as on a MUSA or CUDA one.
"""

import importlib.util
import os
import re
import time
import types
from pathlib import Path

import pytest
import torch

from te_lab import device as devices

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent


def fake_gpus(monkeypatch, **counts):
    """Pretend this machine has ``counts`` devices per GPU type (e.g. ``cuda=2``)."""
    real_device_count = devices.device_count

    def device_count(device_type):
        if device_type in devices.GPU_TYPES:
            return counts.get(device_type, 0)
        return real_device_count(device_type)

    monkeypatch.setattr(devices.selection, "device_count", device_count)


# ---- detection ---------------------------------------------------------------------

def test_cpu_is_always_available_and_listed_last():
    assert devices.is_available("cpu")
    assert devices.available_devices()[-1] == CPU
    assert devices.default_device() == devices.available_devices()[0]


@pytest.mark.skipif(len(devices.available_devices()) > 1, reason="this machine has a GPU")
def test_default_device_is_cpu_without_gpus():
    assert devices.default_device() == CPU
    assert devices.resolve(None) == CPU
    assert not devices.is_available("cuda")
    assert not devices.is_available("musa")


def test_unknown_device_types_are_not_available():
    assert not devices.is_available("mps")
    assert devices.device_count("cpu") == 1


def test_gpus_come_first_and_the_first_gpu_is_the_default(monkeypatch):
    fake_gpus(monkeypatch, cuda=2)
    assert devices.available_devices() == [torch.device("cuda", 0), torch.device("cuda", 1), CPU]
    assert devices.default_device() == torch.device("cuda", 0)


def test_musa_is_preferred_to_cuda():
    # A faked MUSA device cannot be built: torch parses "musa" only once torch_musa is
    # imported. The preference is the order of GPU_TYPES, which detection walks.
    assert devices.GPU_TYPES == ("musa", "cuda")


# ---- resolve -----------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["cpu", "cpu:0", CPU, None], ids=repr)
def test_resolve_accepts_the_cpu(spec, monkeypatch):
    fake_gpus(monkeypatch)
    assert devices.resolve(spec) == CPU


def test_resolve_gives_gpus_an_explicit_index(monkeypatch):
    fake_gpus(monkeypatch, cuda=2)
    assert devices.resolve("cuda") == torch.device("cuda", 0)
    assert devices.resolve("cuda:1") == torch.device("cuda", 1)
    assert devices.resolve(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_resolve_rejects_an_index_past_the_last_gpu(monkeypatch):
    fake_gpus(monkeypatch, cuda=2)
    with pytest.raises(ValueError, match=r"device: 'cuda:2' does not exist; this machine has 2 cuda"):
        devices.resolve("cuda:2")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "musa", "musa:1", torch.device("cuda", 0)], ids=repr)
def test_resolve_rejects_unavailable_gpus_and_lists_what_is_available(spec, monkeypatch):
    fake_gpus(monkeypatch)
    with pytest.raises(ValueError) as raised:
        devices.resolve(spec)
    message = str(raised.value)
    assert message.startswith("device: ")
    assert repr(spec) in message
    assert "not available" in message
    assert "(available: cpu)" in message


@pytest.mark.parametrize("spec", ["", "gpu", "cpu:x", "cpu:-1"])
def test_resolve_rejects_strings_that_are_not_devices(spec):
    with pytest.raises(ValueError, match=r"^device: .* is not a device string \(expected 'cpu', 'cuda'"):
        devices.resolve(spec)


@pytest.mark.parametrize("spec", ["mps", "meta", "privateuseone"])
def test_resolve_rejects_device_types_te_lab_does_not_support(spec):
    with pytest.raises(ValueError, match=rf"device: '{spec}' has type .*te_lab supports 'cpu', 'cuda' and 'musa'"):
        devices.resolve(spec)


@pytest.mark.parametrize("spec", [0, 1.5, b"cpu", ["cpu"]], ids=repr)
def test_resolve_rejects_other_types(spec):
    with pytest.raises(TypeError, match=rf"device: expected a str .* got {type(spec).__name__}"):
        devices.resolve(spec)


# ---- per-device services on the CPU ------------------------------------------------

def test_cpu_timer_measures_wall_time():
    sleep_s = 0.05
    with devices.Timer("cpu") as timer:
        assert timer.elapsed_ms is None
        time.sleep(sleep_s)
    # structure, not speed: at least the sleep, and not absurdly more on a busy machine
    assert sleep_s * 1e3 <= timer.elapsed_ms < sleep_s * 1e3 + 5_000


def test_memory_stats_are_none_on_the_cpu():
    assert devices.memory_allocated("cpu") is None
    assert devices.max_memory_allocated("cpu") is None
    assert devices.reset_peak_memory_stats("cpu") is None
    assert devices.synchronize("cpu") is None


def test_cpu_has_a_name():
    name = devices.device_name("cpu")
    assert isinstance(name, str) and name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cpu_supports_the_float_dtypes(dtype):
    assert devices.supports_dtype(dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64], ids=str)
def test_non_float_dtypes_are_not_supported(dtype):
    assert not devices.supports_dtype(dtype, "cpu")


def test_cpu_multiprocessor_count_is_the_cores_this_process_may_use():
    assert devices.multiprocessor_count("cpu") == len(os.sched_getaffinity(0))


def test_cpu_profiler_activities_and_distributed_backend():
    from torch.profiler import ProfilerActivity

    assert devices.profiler_activities("cpu") == [ProfilerActivity.CPU]
    assert devices.distributed_backend("cpu") == "gloo"


def test_device_guard_on_the_cpu_is_a_no_op(monkeypatch):
    """On the CPU the guard touches no device module: a GPU's guard would need one."""
    def no_module(device):
        raise AssertionError(f"device_guard asked for the device module of {device}")

    monkeypatch.setattr(devices.selection, "device_module", no_module)
    ran = []
    with devices.device_guard(CPU) as entered:
        ran.append(torch.ones(2).sum().item())
    assert entered is None and ran == [2.0]


# ---- peak table --------------------------------------------------------------------

@pytest.mark.parametrize("name, entry", [
    ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM"),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
    ("MTT S4000", "Moore Threads MTT S4000"),
    ("mtt s4000", "Moore Threads MTT S4000"),
])
def test_lookup_peak_matches_known_devices(name, entry):
    peak = devices.lookup_peak(name)
    assert peak is not None and peak.name == entry
    assert peak.memory_bandwidth_gbs > 0 and peak.source


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "MTT S80", "Intel(R) Xeon(R) CPU", ""])
def test_lookup_peak_does_not_guess_unknown_devices(name):
    assert devices.lookup_peak(name) is None


def test_cpu_peak_is_the_measured_copy_bandwidth_measured_once(monkeypatch):
    monkeypatch.setattr(devices.ceilings, "_measured_bandwidth", {})
    timers_started = []

    class CountingTimer(devices.Timer):
        def __enter__(self):
            timers_started.append(self)
            return super().__enter__()

    monkeypatch.setattr(devices.timing, "Timer", CountingTimer)
    first = devices.peak("cpu")
    measurements = len(timers_started)
    second = devices.peak("cpu")
    assert measurements > 0
    assert len(timers_started) == measurements, "the second call measured again"
    assert first == second
    assert first.source == "measured copy bandwidth"
    assert first.memory_bandwidth_gbs > 0
    assert first.fp32_tflops is None and first.bf16_tflops is None
    assert first.name == devices.device_name("cpu")


# ---- when the triton backend may run -----------------------------------------------

def fake_modules(monkeypatch, present=(), raising=()):
    """Make find_spec see exactly ``present`` among triton's modules; names in
    ``raising`` raise ModuleNotFoundError as a submodule of a missing package does."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in raising:
            raise ModuleNotFoundError(name)
        if name == "triton" or name.startswith("triton."):
            return object() if name in present else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture
def fresh_triton_reasons(monkeypatch):
    """The reasons are cached per process; give each test an empty cache."""
    monkeypatch.setattr(devices.triton_availability, "_triton_reasons", {})


@pytest.mark.parametrize("device_type", ["cuda", "musa", "cpu"])
def test_triton_needs_triton_installed(device_type, monkeypatch):
    fake_modules(monkeypatch, present=())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "Triton is not installed" in devices.triton_availability._triton_backend_for(device_type)


def test_triton_runs_on_cuda_when_installed(monkeypatch):
    fake_modules(monkeypatch, present=("triton",))
    assert devices.triton_availability._triton_backend_for("cuda") is None


@pytest.mark.parametrize("backend", ["triton.backends.mtgpu", "triton.backends.mthreads"])
def test_triton_runs_on_musa_with_a_moore_threads_backend(backend, monkeypatch):
    fake_modules(monkeypatch, present=("triton", "triton.backends", backend))
    assert devices.triton_availability._triton_backend_for("musa") is None


def test_triton_on_musa_tolerates_a_missing_backends_package(monkeypatch):
    fake_modules(monkeypatch, present=("triton", "triton.backends.mtgpu"), raising=("triton.backends.mthreads",))
    assert devices.triton_availability._triton_backend_for("musa") is None


def test_upstream_triton_does_not_run_on_musa(monkeypatch):
    fake_modules(monkeypatch, present=("triton", "triton.backends", "triton.backends.nvidia"))
    assert "no Moore Threads backend" in devices.triton_availability._triton_backend_for("musa")


@pytest.mark.parametrize("interpret", [None, "0", ""])
def test_triton_is_refused_on_the_cpu(interpret, monkeypatch):
    fake_modules(monkeypatch, present=("triton",))
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert "do not run on the CPU" in devices.triton_availability._triton_backend_for("cpu")


def test_triton_interpreter_is_allowed_on_the_cpu(monkeypatch):
    fake_modules(monkeypatch, present=("triton",))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert devices.triton_availability._triton_backend_for("cpu") is None


def test_triton_reason_is_computed_once_per_device_type(monkeypatch, fresh_triton_reasons):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    refused = devices.triton_unavailable_reason("cpu")
    assert refused is not None and not devices.triton_available("cpu")
    # the environment changes, the cached answer does not
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert devices.triton_unavailable_reason("cpu") == refused


# ---- no code path assumes a GPU is a CUDA GPU -----------------------------------------

# Only the device layer may name a device type's module or compare against "cuda"; the
# rest of te_lab asks it (docs/design.md: MUSA is a first-class target).
CUDA_ASSUMPTIONS = re.compile(
    r"""\.type\s*[!=]=\s*["']cuda|["']cuda["']\s*[!=]=|\.is_cuda\b|torch\.cuda\.|accelerator\.synchronize\s*\("""
)


def shipped_sources():
    for folder in ("te_lab", "kernels", "extensions", "benchmarks"):
        yield from sorted((REPO / folder).rglob("*.py"))


def test_only_the_device_layer_knows_about_cuda():
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in shipped_sources()
        if not path.is_relative_to(REPO / "te_lab" / "device")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if CUDA_ASSUMPTIONS.search(line)
    ]
    assert not offenders, "use te_lab.device instead:\n" + "\n".join(offenders)


def test_the_device_layer_does_not_call_torch_accelerator_synchronize():
    for path in (REPO / "te_lab" / "device").rglob("*.py"):
        assert not re.search(r"accelerator\.synchronize\s*\(", path.read_text(encoding="utf-8")), path


# ---- GPU services, against a stand-in device module (this machine has no GPU) ------------

class FakeEvent:
    def __init__(self, log, enable_timing):
        self.log, self.recorded_on = log, None

    def record(self, stream=None):
        self.recorded_on = stream
        self.log.append(("record", stream))

    def synchronize(self):
        self.log.append(("synchronize",))

    def elapsed_time(self, end):
        return 2.5


class FakeGpuModule:
    """``torch.cuda`` as te_lab's device layer calls it, for two GPUs; cuda:0 is current."""

    def __init__(self, properties=None):
        self.log, self.properties = [], properties or {}
        self.Event = lambda enable_timing=False: FakeEvent(self.log, enable_timing)

    def current_stream(self, device=None):
        # torch's current_stream(None) is the *current device's* stream
        return f"current stream of {device if device is not None else 'cuda:0'}"

    def get_device_properties(self, device):
        return types.SimpleNamespace(**self.properties)


@pytest.fixture
def gpu(monkeypatch):
    """cuda:1 on a stand-in module; returns the module."""
    module = FakeGpuModule()
    monkeypatch.setattr(devices.selection, "resolve", lambda device=None: torch.device("cuda", 1))
    monkeypatch.setattr(devices.selection, "device_module", lambda device: module)
    return module


def test_gpu_timer_records_on_the_timed_devices_current_stream(gpu):
    with devices.Timer("cuda:1") as timer:
        pass
    cuda1 = torch.device("cuda", 1)
    assert gpu.log == [("record", f"current stream of {cuda1}"), ("record", f"current stream of {cuda1}"),
                       ("synchronize",)]
    assert timer.elapsed_ms == 2.5


@pytest.mark.parametrize("properties, expected", [
    ({"L2_cache_size": 60 * 2**20}, 120 * 2**20),  # twice the L2 (H200: 60 MB)
    ({}, devices.DEFAULT_CACHE_FLUSH_BYTES),  # a build whose properties do not say
])
def test_flush_cache_overwrites_a_buffer_larger_than_the_l2(gpu, monkeypatch, properties, expected):
    gpu.properties = properties
    monkeypatch.setattr(devices.timing, "_cache_flush_buffers", {})
    allocated = []

    def empty(size, dtype, device):
        allocated.append((size, dtype, device))
        return torch.ones(4, dtype=dtype)  # a stand-in for the device buffer

    monkeypatch.setattr(torch, "empty", empty)
    devices.flush_cache("cuda:1")
    devices.flush_cache("cuda:1")  # the buffer is kept and overwritten again
    assert allocated == [(expected, torch.int8, torch.device("cuda", 1))]
    assert devices.timing._cache_flush_buffers[torch.device("cuda", 1)].eq(0).all()


def test_flush_cache_and_cache_size_on_the_cpu():
    assert devices.cache_size_bytes("cpu") is None
    assert devices.flush_cache("cpu") is None


@pytest.mark.parametrize("torch_uuid, nvml_uuid", [
    ("6f7b3f1e-1d2c-4b5a-9e8f-0a1b2c3d4e5f", "GPU-6f7b3f1e-1d2c-4b5a-9e8f-0a1b2c3d4e5f"),
    ("6F7B3F1E-1D2C-4B5A-9E8F-0A1B2C3D4E5F", "MIG-GPU-6f7b3f1e-1d2c-4b5a-9e8f-0a1b2c3d4e5f"),
])
def test_torch_and_nvml_spellings_of_a_uuid_normalize_alike(torch_uuid, nvml_uuid):
    assert devices.normalized_uuid(torch_uuid) == devices.normalized_uuid(nvml_uuid) == \
        "6f7b3f1e1d2c4b5a9e8f0a1b2c3d4e5f"
    assert devices.normalized_uuid("not a uuid") is None


def test_physical_identity_reads_uuid_and_pci_bus_id_from_the_device_properties(gpu):
    gpu.properties = {"uuid": "6f7b3f1e-1d2c-4b5a-9e8f-0a1b2c3d4e5f", "pci_bus_id": 0x17, "pci_device_id": 0,
                      "pci_domain_id": 0}
    assert devices.physical_identity("cuda:1") == devices.PhysicalIdentity(
        "6f7b3f1e1d2c4b5a9e8f0a1b2c3d4e5f", "00000000:17:00.0")
    gpu.properties = {}
    assert devices.physical_identity("cuda:1") == devices.PhysicalIdentity(None, None)


def test_physical_identity_refuses_the_cpu():
    with pytest.raises(ValueError, match="physical_identity: device must be a GPU, got cpu"):
        devices.physical_identity("cpu")
