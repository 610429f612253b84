"""The fused-op registry and the backend dispatcher.

Each fused op registers a :class:`FusedOp`: its name, its reference (the plain,
unfused PyTorch math every test and benchmark compares against) and the backends
that implement it. :func:`select_backend` picks one per call, in this order:

1. the ``backend=`` argument of the call,
2. the innermost :func:`use_backend` context,
3. the ``TE_LAB_BACKEND`` environment variable (``"inductor"`` for every op that has
   an Inductor backend, or ``"rms_norm=native,glu=inductor"`` per op),
4. automatic: ``triton`` where Triton runs on the device, else the op's preferred
   CPU backend (``native`` when an existing fused ATen kernel does the job well,
   ``cpp`` where te_lab has C++ kernels for it (:mod:`te_lab.kernels.cpu_kernels`),
   ``inductor`` otherwise), and ``reference`` as the last resort. Ops that name
   ``cpu_measured`` backends take, per class of the call's sizes and per kind of call
   (a training call, forward and backward, or one without gradients: a decode step),
   whichever of them measured fastest on this machine; ``reference``, the unfused math,
   is one of them, so an automatic choice is never slower than not fusing.

A forced backend that the op lacks or the device cannot run raises a ``ValueError``
naming the op, the backend and the device. Selection is plain Python that
torch.compile traces with guards, so a compiled caller never graph-breaks on it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional

import torch

from te_lab import device as devices

from . import cpu_kernels
from .measured_choice import choose, known, remember, remembered, size_class

BACKENDS = ("triton", "native", "inductor", "cpp", "reference")
ENV_VAR = "TE_LAB_BACKEND"


@dataclass(frozen=True)
class FusedOp:
    """A fused op and the backends that implement it.

    ``implementations`` maps a backend name to whatever the op's file uses to run it
    (typically an object with ``forward`` and ``backward``). ``cpu_preference`` is the
    backend chosen automatically where Triton cannot run, picked per op by benchmark.
    ``native_supports`` says on which device types the native backend exists (the
    ATen kernels it calls may be missing on a device or in an older torch). ``costs``
    maps each of the op's ``te_lab::`` custom ops (forward, backward...) to its cost
    function (:mod:`te_lab.kernels.costs`): bytes read and written and FLOPs of one call,
    from its arguments' shapes and dtypes, as the profiler and the benchmarks count them.
    """

    name: str
    reference: Callable
    implementations: Mapping[str, object]
    cpu_preference: str = "inductor"
    native_supports: Callable[[str], bool] = field(default=lambda device_type: True)
    # Backends whose automatic CPU choice is measured per class of a call's sizes (with
    # ``reference`` among them), and ``cpu_samples(dtype, *size classes, *extras,
    # training=...)``: name -> one call on inputs of those sizes, forward and backward for
    # training, the forward alone without gradients (see measured_cpu_choice).
    cpu_measured: tuple[str, ...] = ()
    cpu_samples: Optional[Callable[..., Mapping[str, Callable[[], object]]]] = None
    costs: Mapping[str, Callable] = field(default_factory=dict)
    # select_backend's automatic answers, remembered (a few microseconds per call).
    automatic_backends: dict = field(default_factory=dict, compare=False, repr=False)

    def backends(self) -> tuple[str, ...]:
        """Every backend this op implements (whether a device can run it aside)."""
        return tuple(name for name in BACKENDS if name in self.implementations or name == "reference")


# Device type -> its dispatch key (MUSA is torch's PrivateUse1 backend).
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "musa": "PrivateUse1"}
_aten_kernels: dict[tuple[str, str, bool], bool] = {}


@torch.compiler.assume_constant_result
def aten_kernel_exists(qualified_name: str, device_type: str, autocast: bool = False) -> bool:
    """Whether ATen op ``qualified_name`` (e.g. ``"aten::_fused_rms_norm"``) has a kernel
    for ``device_type`` in this torch build (with ``autocast``: an autocast rule there,
    i.e. it is on one of autocast's op lists); a trace-time constant under torch.compile."""
    key = (qualified_name, device_type, autocast)
    if key not in _aten_kernels:
        try:
            dispatch_key = ("Autocast" if autocast else "") + DISPATCH_KEYS[device_type]
            found = torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key)
        except (RuntimeError, KeyError):
            found = False
        _aten_kernels[key] = bool(found)
    return _aten_kernels[key]


_REGISTRY: dict[str, FusedOp] = {}
# The stack of active use_backend() overrides; each entry maps op name (or "*") to backend.
_OVERRIDES: list[dict[str, str]] = []


def register_op(op: FusedOp) -> FusedOp:
    if op.name in _REGISTRY:
        raise ValueError(f"fused op {op.name!r} is already registered")
    unknown = set(op.implementations) - set(BACKENDS)
    if unknown:
        raise ValueError(f"fused op {op.name!r}: unknown backend(s) {sorted(unknown)}; expected {BACKENDS}")
    _REGISTRY[op.name] = op
    return op


def registered_ops() -> dict[str, FusedOp]:
    """Name -> FusedOp for every registered op."""
    return dict(_REGISTRY)


def _check_backend_name(backend: str, where: str) -> None:
    if backend not in BACKENDS + ("auto",):
        raise ValueError(f"{where}: unknown backend {backend!r}; expected one of {('auto',) + BACKENDS}")


def _parse_overrides(spec: str, where: str) -> dict[str, str]:
    """``"inductor"`` -> {"*": "inductor"}; ``"rms_norm=native,glu=reference"`` -> per op."""
    overrides = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        op_name, _, backend = item.rpartition("=")
        op_name = op_name.strip() or "*"
        backend = backend.strip()
        _check_backend_name(backend, where)
        overrides[op_name] = backend
    return overrides


@contextlib.contextmanager
def use_backend(backend: Optional[str] = None, **per_op: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block: ``use_backend("reference")`` for every
    op, or ``use_backend(rms_norm="native")`` for some; the innermost block wins."""
    overrides = {}
    if backend is not None:
        _check_backend_name(backend, "use_backend(backend)")
        overrides["*"] = backend
    for op_name, op_backend in per_op.items():
        _check_backend_name(op_backend, f"use_backend({op_name}=...)")
        overrides[op_name] = op_backend
    _OVERRIDES.append(overrides)
    try:
        yield
    finally:
        _OVERRIDES.remove(overrides)


def forced_backend(op: FusedOp) -> tuple[Optional[str], str]:
    """The backend forced by a context or the environment, and who forced it.

    A catch-all (``use_backend("inductor")``, ``TE_LAB_BACKEND=inductor``) forces only
    the ops that implement that backend; the others keep choosing automatically, so
    "use Inductor" does not break the optimizer, which has no Inductor backend. An
    override naming the op is strict.
    """
    def pick(overrides: dict[str, str]) -> Optional[str]:
        if op.name in overrides:
            return overrides[op.name]
        catch_all = overrides.get("*")
        return catch_all if catch_all in op.backends() + ("auto",) else None

    for overrides in reversed(_OVERRIDES):
        if pick(overrides) is not None:
            return pick(overrides), "use_backend()"
    spec = os.environ.get(ENV_VAR, "")
    if spec and pick(_parse_overrides(spec, ENV_VAR)) is not None:
        return pick(_parse_overrides(spec, ENV_VAR)), f"{ENV_VAR}={spec!r}"
    return None, ""


def unavailable_reason(op: FusedOp, backend: str, device: torch.device) -> Optional[str]:
    """Why ``backend`` cannot run ``op`` on ``device``, or None when it can."""
    if backend not in op.backends():
        return f"{op.name} has no {backend!r} backend here (it has: {', '.join(op.backends())})"
    if backend == "native" and not op.native_supports(device.type):
        return f"this torch build has no fused ATen kernels for it on {device.type}"
    if backend == "triton":
        return devices.triton_unavailable_reason(device.type)
    if backend == "inductor" and devices.is_gpu(device) and devices.triton_unavailable_reason(device.type):
        return "Inductor generates Triton code on GPUs, and " + devices.triton_unavailable_reason(device.type)
    if backend == "cpp":
        return "te_lab's C++ kernels run on the CPU only" if device.type != "cpu" else cpu_kernels.unavailable_reason()
    return None


def available_backends(op: FusedOp, device: torch.device) -> list[str]:
    """The backends that can run ``op`` on ``device``, in the order auto-selection tries them."""
    return [name for name in op.backends() if unavailable_reason(op, name, device) is None]


def describe_backend(op: FusedOp, device: torch.device, requested: Optional[str] = None) -> str:
    """:func:`select_backend`'s answer as a report should state it: an automatic choice
    that is measured per call's sizes says so."""
    chosen, automatic = _select(op, device, requested)
    if automatic and not devices.is_gpu(device) and chosen in op.cpu_measured:
        return f"{' or '.join(op.cpu_measured)}, whichever measured faster here for the sizes"
    return chosen


def training_call() -> bool:
    """Whether an op called now is measured as a training call (forward and backward) rather
    than a forward alone: gradients are on. Generation (``model.generate`` runs under
    ``torch.no_grad``) and ``torch.inference_mode`` are forward-only calls."""
    return torch.is_grad_enabled()


def measured_cpu_choice(op: FusedOp, dtype: torch.dtype, sizes: tuple[int, ...], extras: tuple = (),
                        default: Optional[str] = None, *, training: bool = True) -> str:
    """The fastest of ``op.cpu_measured`` on this machine for a call of ``dtype`` whose sizes
    fall in the class of ``sizes`` (each rounded up to a power of two), with ``extras``
    (e.g. the activation), as a training call (forward and backward) or, with
    ``training=False``, a forward alone: measured once, interleaved, among the candidates
    this process can run, then cached per machine (:mod:`te_lab.kernels.measured_choice`);
    ``default`` (the first runnable candidate unless given) where measuring is off."""
    return _measured_cpu_choice(op, dtype, sizes, extras, default, training)[0]


def _measured_cpu_choice(op: FusedOp, dtype: torch.dtype, sizes: tuple[int, ...], extras: tuple,
                         default: Optional[str], training: bool) -> tuple[str, bool]:
    """:func:`measured_cpu_choice`, and whether that answer is settled (decided, not a
    default taken because measuring is off or impossible here)."""
    decision = f"{op.name}: CPU backend"
    classes = tuple(size_class(size) for size in sizes)
    # A forward-only call's class says so; a training call's keeps the key it always had.
    shape_class = (str(dtype).removeprefix("torch."), *classes, *extras) + (() if training else ("inference",))
    choice = known(decision, shape_class)  # the per-call path: one dict lookup
    if choice is not None:
        return choice, True
    cpu = torch.device("cpu")
    runnable = tuple(name for name in op.cpu_measured if unavailable_reason(op, name, cpu) is None)

    def candidates():
        samples = op.cpu_samples(dtype, *classes, *extras, training=training)
        return {name: samples[name] for name in runnable}

    choice = choose(decision, shape_class, candidates, default if default in runnable else runnable[0], runnable)
    return choice, known(decision, shape_class) is not None


def select_measured_backend(op: FusedOp, device: torch.device, requested: Optional[str], dtype: torch.dtype,
                            sizes: tuple[int, ...], extras: tuple = ()) -> str:
    """:func:`select_backend`, except that where the choice is automatic on the CPU and the
    op measures its CPU backends, the one that measured fastest for these sizes and this
    kind of call (:func:`measured_cpu_choice`, :func:`training_call`).

    This runs on every call of a fused op, so a settled answer is remembered for the
    call's exact arguments (op, device type, ``requested``, ``TE_LAB_BACKEND``'s value,
    dtype, sizes, extras, kind of call) outside ``use_backend`` blocks, torch.compile's
    tracing and dispatch or function modes (whose sizes may be symbolic): a decode step's
    ops then pay one dict lookup each."""
    chosen = _select_measured_per_call(op, device, requested, dtype, sizes, extras)
    for recorder in _CHOICE_RECORDERS:
        recorder.setdefault(op.name, set()).add(chosen)
    return chosen


# Open recorders of :func:`recording_choices`: op name -> the backends its calls ran on.
_CHOICE_RECORDERS: list[dict[str, set]] = []


@contextlib.contextmanager
def recording_choices() -> Iterator[dict[str, set]]:
    """Inside the block, every call whose backend is a measured choice adds it to the dict
    yielded (op name -> the backends chosen), so a report can say what ran (``fuse`` records
    its probes)."""
    recorder: dict[str, set] = {}
    _CHOICE_RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _CHOICE_RECORDERS.remove(recorder)


def _select_measured_per_call(op: FusedOp, device: torch.device, requested: Optional[str], dtype: torch.dtype,
                              sizes: tuple[int, ...], extras: tuple) -> str:
    training = training_call()
    if (_OVERRIDES or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()):
        return _select_measured(op, device, requested, dtype, sizes, extras, training)[0]
    call = (op.name, device.type, requested, os.environ.get(ENV_VAR), dtype, sizes, extras, training)
    chosen = remembered(call)
    if chosen is None:
        chosen, settled = _select_measured(op, device, requested, dtype, sizes, extras, training)
        if settled:
            remember(call, chosen)
    return chosen


def _select_measured(op: FusedOp, device: torch.device, requested: Optional[str], dtype: torch.dtype,
                     sizes: tuple[int, ...], extras: tuple, training: bool) -> tuple[str, bool]:
    chosen, automatic = _select(op, device, requested)
    if not automatic or chosen not in op.cpu_measured or devices.is_gpu(device):
        return chosen, True
    return _measured_cpu_choice(op, dtype, sizes, extras, chosen, training)


def select_backend(op: FusedOp, device: torch.device, requested: Optional[str] = None) -> str:
    """The backend that runs ``op`` on ``device`` for this call (see the module doc)."""
    return _select(op, device, requested)[0]


def _select(op: FusedOp, device: torch.device, requested: Optional[str]) -> tuple[str, bool]:
    """:func:`select_backend`'s answer, and whether it was chosen automatically."""
    source = "backend="
    if requested is not None:
        _check_backend_name(requested, f"{op.name}(backend)")
    if requested in (None, "auto"):
        requested, source = forced_backend(op)
    if requested not in (None, "auto"):
        reason = unavailable_reason(op, requested, device)
        if reason is not None:
            raise ValueError(
                f"{op.name}: backend {requested!r} (from {source}) cannot run on device {device}: {reason}"
            )
        return requested, False
    if torch.compiler.is_compiling():  # a dict read there would be guarded on: decide afresh
        return _automatic_backend(op, device), True
    # The automatic choice depends only on the device type and whether Triton runs there.
    key = (device.type, devices.triton_unavailable_reason(device.type))
    chosen = op.automatic_backends.get(key)
    if chosen is None:
        chosen = op.automatic_backends[key] = _automatic_backend(op, device)
    return chosen, True


def _automatic_backend(op: FusedOp, device: torch.device) -> str:
    # Triton is chosen automatically only on GPUs: the CPU interpreter is for tests.
    order = ("triton", "native", "inductor") if devices.is_gpu(device) else (op.cpu_preference, "native", "inductor")
    for candidate in order:
        if unavailable_reason(op, candidate, device) is None:
            return candidate
    return "reference"
