"""The op registry and the backend dispatcher: precedence of the ways to force a
backend, the errors for backends that cannot run, and automatic choice on the CPU.

Most tests use a small FusedOp that is never registered (select_backend takes the op
itself), so the registry the other tests see is left as it was; the tests that do
register work on a copy of it.
"""

import pytest
import torch

from te_lab import device as devices
from te_lab.kernels import registry, rms_norm, rms_norm_reference, select_backend, use_backend
from te_lab.kernels.registry import BACKENDS, ENV_VAR, FusedOp, available_backends, register_op
from te_lab.kernels.rms_norm import RMS_NORM
from te_lab.kernels.triton_support import HAS_TRITON

CPU = torch.device("cpu")


def probe_op(name="probe", backends=("native", "inductor"), cpu_preference="native",
             native_supports=lambda device_type: True):
    """An op whose implementations are placeholders: selection never calls them."""
    return FusedOp(name=name, reference=lambda x: x,
                   implementations={backend: object() for backend in backends},
                   cpu_preference=cpu_preference, native_supports=native_supports)


PROBE = probe_op()


@pytest.fixture(autouse=True)
def no_backend_from_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def triton_interpreter(monkeypatch):
    """The triton backend allowed on the CPU, as the interpreter tests run it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(devices.triton_availability, "_triton_reasons", {})


@pytest.fixture
def no_triton_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(devices.triton_availability, "_triton_reasons", {})


@pytest.fixture
def registry_copy(monkeypatch):
    """Registrations made by the test vanish with it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


# ---- automatic choice on the CPU ---------------------------------------------------

@pytest.mark.parametrize("preference", ["native", "inductor"])
def test_auto_on_cpu_picks_the_ops_cpu_preference(preference):
    assert select_backend(probe_op(cpu_preference=preference), CPU) == preference
    assert select_backend(probe_op(cpu_preference=preference), CPU, "auto") == preference


def test_auto_on_cpu_falls_back_when_the_preference_cannot_run():
    op = probe_op(cpu_preference="native", native_supports=lambda device_type: False)
    assert select_backend(op, CPU) == "inductor"


def test_auto_falls_back_to_the_reference():
    assert select_backend(probe_op(backends=()), CPU) == "reference"


def test_auto_on_cpu_never_picks_triton_even_under_the_interpreter(triton_interpreter):
    op = probe_op(backends=("triton", "inductor"), cpu_preference="inductor")
    assert devices.triton_available(CPU) == HAS_TRITON
    assert select_backend(op, CPU) == "inductor"
    assert select_backend(RMS_NORM, CPU) == RMS_NORM.cpu_preference


def test_available_backends_on_cpu_list_what_can_run(no_triton_interpreter):
    assert available_backends(PROBE, CPU) == ["native", "inductor", "reference"]
    assert "triton" not in available_backends(RMS_NORM, CPU)


def test_triton_is_available_on_cpu_only_under_the_interpreter(triton_interpreter):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    assert "triton" in available_backends(RMS_NORM, CPU)
    assert select_backend(RMS_NORM, CPU, "triton") == "triton"


# ---- precedence: per call > innermost use_backend() > TE_LAB_BACKEND -----------------

def test_environment_forces_every_op(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "inductor")
    assert select_backend(PROBE, CPU) == "inductor"
    assert select_backend(RMS_NORM, CPU) == "inductor"


def test_environment_per_op_form(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "probe=inductor, other=native")
    assert select_backend(PROBE, CPU) == "inductor"
    assert select_backend(probe_op(name="other"), CPU) == "native"
    # ops the variable does not name are chosen automatically
    assert select_backend(probe_op(name="unnamed"), CPU) == "native"


def test_environment_per_op_entry_beats_its_catch_all(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference,probe=inductor")
    assert select_backend(PROBE, CPU) == "inductor"
    assert select_backend(probe_op(name="other"), CPU) == "reference"


def test_context_beats_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "inductor")
    with use_backend("reference"):
        assert select_backend(PROBE, CPU) == "reference"
    assert select_backend(PROBE, CPU) == "inductor"


def test_innermost_context_wins_and_outer_returns_on_exit():
    with use_backend("inductor"):
        with use_backend("reference"):
            assert select_backend(PROBE, CPU) == "reference"
        assert select_backend(PROBE, CPU) == "inductor"
    assert select_backend(PROBE, CPU) == "native"


def test_innermost_catch_all_beats_an_outer_per_op_override():
    with use_backend(probe="inductor"):
        with use_backend("reference"):
            assert select_backend(PROBE, CPU) == "reference"


def test_context_per_op_form():
    with use_backend("reference", probe="inductor"):
        assert select_backend(PROBE, CPU) == "inductor"
        assert select_backend(probe_op(name="other"), CPU) == "reference"
    with use_backend(probe="inductor"):
        assert select_backend(probe_op(name="other"), CPU) == "native"


def test_context_is_left_when_its_block_raises():
    with pytest.raises(RuntimeError):
        with use_backend("reference"):
            raise RuntimeError("boom")
    assert select_backend(PROBE, CPU) == "native"


def test_per_call_beats_context_and_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "probe=reference")
    with use_backend(probe="reference"):
        assert select_backend(PROBE, CPU, "inductor") == "inductor"


def test_per_call_auto_defers_to_context_and_environment(monkeypatch):
    with use_backend("inductor"):
        assert select_backend(PROBE, CPU, "auto") == "inductor"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert select_backend(PROBE, CPU, "auto") == "reference"


def test_context_auto_returns_to_automatic_choice(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    with use_backend("auto"):
        assert select_backend(PROBE, CPU) == "native"
    with use_backend("inductor"), use_backend(probe="auto"):
        assert select_backend(PROBE, CPU) == "native"


def test_the_public_op_follows_the_context():
    x = torch.randn(3, 8)
    weight = torch.rand(8)
    with use_backend(rms_norm="reference"):
        torch.testing.assert_close(rms_norm(x, weight), rms_norm_reference(x, weight), rtol=0, atol=0)


# ---- forcing a backend that cannot run ---------------------------------------------

def native_rms_norm_runs_on_cpu():
    return "native" in available_backends(RMS_NORM, CPU)


def assert_names_op_backend_device(raised, op, backend, source):
    message = str(raised.value)
    assert message.startswith(f"{op}: backend '{backend}' (from {source}")
    assert "cannot run on device cpu" in message


@pytest.mark.skipif(native_rms_norm_runs_on_cpu(), reason="this torch has fused RMSNorm kernels for the CPU")
def test_forcing_native_rms_norm_on_a_cpu_without_its_aten_kernels(monkeypatch):
    with pytest.raises(ValueError) as raised:
        select_backend(RMS_NORM, CPU, "native")
    assert_names_op_backend_device(raised, "rms_norm", "native", "backend=")
    assert "no fused ATen kernels" in str(raised.value)

    with use_backend("native"), pytest.raises(ValueError) as raised:
        rms_norm(torch.randn(2, 4))
    assert_names_op_backend_device(raised, "rms_norm", "native", "use_backend()")

    monkeypatch.setenv(ENV_VAR, "rms_norm=native")
    with pytest.raises(ValueError) as raised:
        rms_norm(torch.randn(2, 4))
    assert_names_op_backend_device(raised, "rms_norm", "native", f"{ENV_VAR}='rms_norm=native'")


def test_forcing_triton_on_the_cpu_without_the_interpreter(no_triton_interpreter):
    with pytest.raises(ValueError) as raised:
        select_backend(RMS_NORM, CPU, "triton")
    assert_names_op_backend_device(raised, "rms_norm", "triton", "backend=")


def test_forcing_a_backend_the_op_lacks():
    with pytest.raises(ValueError) as raised:
        select_backend(PROBE, CPU, "triton")
    assert_names_op_backend_device(raised, "probe", "triton", "backend=")
    assert "has no 'triton' backend" in str(raised.value)


def test_a_catch_all_skips_ops_that_lack_the_backend(monkeypatch):
    native_only = probe_op("native_only", backends=("native",))
    with use_backend("inductor"):
        assert select_backend(PROBE, CPU) == "inductor"
        assert select_backend(native_only, CPU) == "native"  # automatic, not an error
    monkeypatch.setenv(ENV_VAR, "inductor")
    assert select_backend(native_only, CPU) == "native"


def test_a_per_op_override_is_strict_even_for_a_backend_the_op_lacks():
    native_only = probe_op("native_only", backends=("native",))
    with use_backend(native_only="inductor"), pytest.raises(ValueError) as raised:
        select_backend(native_only, CPU)
    assert_names_op_backend_device(raised, "native_only", "inductor", "use_backend()")


# ---- unknown backend names ---------------------------------------------------------

@pytest.mark.parametrize("name", ["fast", "cuda", "Triton", ""])
def test_unknown_backend_per_call(name):
    with pytest.raises(ValueError, match=rf"probe\(backend\): unknown backend '{name}'"):
        select_backend(PROBE, CPU, name)


def test_unknown_backend_through_the_public_op():
    with pytest.raises(ValueError, match=r"rms_norm\(backend\): unknown backend 'fast'"):
        rms_norm(torch.randn(2, 4), backend="fast")


def test_unknown_backend_in_a_context():
    with pytest.raises(ValueError, match=r"use_backend\(backend\): unknown backend 'fast'"):
        with use_backend("fast"):
            pass
    with pytest.raises(ValueError, match=r"use_backend\(probe=...\): unknown backend 'fast'"):
        with use_backend(probe="fast"):
            pass
    # a rejected context leaves nothing behind
    assert select_backend(PROBE, CPU) == "native"


@pytest.mark.parametrize("spec", ["fast", "probe=fast", "other=fast"])
def test_unknown_backend_in_the_environment(spec, monkeypatch):
    monkeypatch.setenv(ENV_VAR, spec)
    with pytest.raises(ValueError, match=rf"{ENV_VAR}: unknown backend 'fast'"):
        select_backend(PROBE, CPU)


def test_known_backend_names():
    assert BACKENDS == ("triton", "native", "inductor", "cpp", "reference")


# ---- registration ------------------------------------------------------------------

def test_rms_norm_is_registered():
    ops = registry.registered_ops()
    assert ops["rms_norm"] is RMS_NORM
    ops.clear()  # a copy: the registry itself is untouched
    assert "rms_norm" in registry.registered_ops()


def test_registering_a_name_twice_raises(registry_copy):
    register_op(probe_op(name="probe_registered_once"))
    with pytest.raises(ValueError, match="fused op 'probe_registered_once' is already registered"):
        register_op(probe_op(name="probe_registered_once"))
    with pytest.raises(ValueError, match="fused op 'rms_norm' is already registered"):
        register_op(probe_op(name="rms_norm"))


def test_registering_an_unknown_backend_raises(registry_copy):
    with pytest.raises(ValueError, match=r"fused op 'probe_bad': unknown backend\(s\) \['fast'\]"):
        register_op(probe_op(name="probe_bad", backends=("fast",)))
    assert "probe_bad" not in registry.registered_ops()
