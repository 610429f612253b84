"""The fused-op registry and the backend dispatcher.

Each fused op registers a :class:`FusedOp`: its name, its reference (the plain,
unfused PyTorch math every test and benchmark compares against) and the backends
that implement it. One dispatcher, :func:`choose`, answers every call of every op with
a backend and why, in this order:

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

``"auto"`` (or ``None``) at any of the first three steps means "choose automatically". A
backend may decline a call it cannot compute (``FusedOp.declines``: the attention
kernels and dropout, oneDNN and float64): the automatic choice then takes the next one;
a forced backend that the op lacks, the device cannot run, or that declines the call
raises a ``ValueError`` naming the op, the backend and who forced it. Selection is plain
Python that torch.compile traces with guards, so a compiled caller never graph-breaks on
it. The environment variable is parsed when its value changes, not per call.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, NamedTuple, Optional

import torch

from te_lab import device as devices

from . import cpu_kernels, measured_choice
from .measured_choice import known, size_class
from .torch_internals import dispatch_modes_active, function_modes_active, has_kernel

BACKENDS = ("triton", "native", "inductor", "cpp", "reference")
ENV_VAR = "TE_LAB_BACKEND"


class Call(NamedTuple):
    """One call of an op as the dispatcher sees it: the ``device`` it runs on, the backend
    the caller asked for (``requested``: a name, ``"auto"`` or ``None``), and what a
    measured choice or a declining backend reads: the ``dtype`` the op computes in,
    ``sizes`` (their power-of-two classes key a measured choice; a call without sizes is
    not measured) and ``extras`` (e.g. the activation; for attention, the options its
    kernels may decline). A call without a dtype (:func:`select_backend`'s question
    about the op in general) is never declined."""

    device: torch.device
    requested: Optional[str] = None
    dtype: Optional[torch.dtype] = None
    sizes: tuple[int, ...] = ()
    extras: tuple = ()


# choose()'s answers say why: a forced backend names who forced it.
AUTOMATIC = "automatic"
MEASURED = "measured fastest here for these sizes"


@dataclass(frozen=True, eq=False)
class FusedOp:
    """A fused op and the backends that implement it.

    ``implementations`` maps a backend name to whatever the op's file uses to run it
    (typically an object with ``forward`` and ``backward``). ``cpu_preference`` is the
    backend chosen automatically where Triton cannot run, picked per op by benchmark.
    ``native_supports`` says on which device types the native backend exists (the
    ATen kernels it calls may be missing on a device or in an older torch). ``declines``,
    given a backend and a :class:`Call`, says why that backend cannot compute the call
    (a phrase completing "cannot run ...") or returns None. ``costs``
    maps each of the op's ``te_lab::`` custom ops (forward, backward...) to its cost
    function (:mod:`te_lab.kernels.costs`): bytes read and written and FLOPs of one call,
    from its arguments' shapes and dtypes, as the profiler and the benchmarks count them.
    Ops compare and hash by identity. The dispatcher's memory lives in this module, not on the op.
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
    declines: Optional[Callable[[str, Call], Optional[str]]] = None
    # backends(), fixed at construction (a twin asks on every call).
    implemented: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "implemented", tuple(
            name for name in BACKENDS if name in self.implementations or name == "reference"))

    def backends(self) -> tuple[str, ...]:
        """Every backend this op implements (whether a device can run it aside)."""
        return self.implemented


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
            found = has_kernel(qualified_name, dispatch_key)
        except (RuntimeError, KeyError):
            found = False
        _aten_kernels[key] = bool(found)
    return _aten_kernels[key]


_REGISTRY: dict[str, FusedOp] = {}
# The stack of active use_backend() overrides; each entry maps op name (or "*") to backend.
_OVERRIDES: list[dict[str, str]] = []
# TE_LAB_BACKEND's value when last parsed, and what it parsed to.
_environment: tuple[str, dict[str, str]] = ("", {})
# os.environ keeps its variables, encoded, in a plain dict (CPython since 3.2; setting or
# deleting through os.environ, as monkeypatch does, updates it): reading the variable from it
# costs one dict lookup per call instead of os.environ.get's four Python calls.
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENVIRON is not None else None
# (op, device type, why Triton cannot run there) -> the automatic backend before any
# call declines it: it depends on nothing else.
_automatic: dict[tuple, str] = {}


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


def _environment_value():
    """TE_LAB_BACKEND's value as os.environ holds it (bytes on POSIX; None where unset):
    a key for what was parsed from it, compared on every call."""
    return _ENVIRON.get(_ENV_KEY) if _ENVIRON is not None else os.environ.get(ENV_VAR)


def _environment_overrides(spec: str) -> dict[str, str]:
    """``TE_LAB_BACKEND``'s value ``spec`` parsed, once per value it takes (a value that
    does not parse raises on every call, and is not kept)."""
    global _environment
    if spec != _environment[0]:
        _environment = (spec, _parse_overrides(spec, ENV_VAR))
    return _environment[1]


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


def _named_for(op: FusedOp, overrides: dict[str, str]) -> Optional[str]:
    """What ``overrides`` says for ``op``: its own entry (strict), else a catch-all the op
    implements (or ``"auto"``), else None (the overrides do not speak to it)."""
    if op.name in overrides:
        return overrides[op.name]
    catch_all = overrides.get("*")
    return catch_all if catch_all in op.backends() + ("auto",) else None


def _forced(op: FusedOp, requested: Optional[str], spec: str) -> tuple[Optional[str], str]:
    """The backend forced for this call and who forced it, ``spec`` being TE_LAB_BACKEND's
    value; ``(None, who)`` where the first that speaks says "auto", ``(None, "")`` where
    none does. The one place where ``"auto"`` and ``None`` become the same."""
    if requested is not None:
        _check_backend_name(requested, f"{op.name}(backend)")
        if requested != "auto":
            return requested, "backend="
    for overrides in reversed(_OVERRIDES):
        named = _named_for(op, overrides)
        if named is not None:
            return (None if named == "auto" else named), "use_backend()"
    named = _named_for(op, _environment_overrides(spec)) if spec else None
    if named is not None:
        return (None if named == "auto" else named), f"{ENV_VAR}={spec!r}"
    return None, ""


def backends_forced() -> bool:
    """Whether a :func:`use_backend` block is open or ``TE_LAB_BACKEND`` is set: some op may
    then be forced (a twin measured against its original steps aside only where none is)."""
    return bool(_OVERRIDES) or bool(_environment_value())


def forced_backend(op: FusedOp) -> tuple[Optional[str], str]:
    """The backend forced by a context or the environment (None: chosen automatically),
    and who forced it.

    A catch-all (``use_backend("inductor")``, ``TE_LAB_BACKEND=inductor``) forces only
    the ops that implement that backend; the others keep choosing automatically, so
    "use Inductor" does not break the optimizer, which has no Inductor backend. An
    override naming the op is strict.
    """
    return _forced(op, None, os.environ.get(ENV_VAR, ""))


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


def training_call() -> bool:
    """Whether an op called now is measured as a training call (forward and backward) rather
    than a forward alone: gradients are on. Generation (``model.generate`` runs under
    ``torch.no_grad``) and ``torch.inference_mode`` are forward-only calls."""
    return torch.is_grad_enabled()


# ---- the dispatcher ----

def choose(op: FusedOp, call: Call) -> tuple[str, str]:
    """The backend that runs ``op`` for ``call``, and why: ``"forced by <who>"``,
    :data:`AUTOMATIC` (with what declined the call, if anything did) or :data:`MEASURED`
    (see the module doc).

    This runs on every call of a fused op, so an automatic answer that measuring settled
    is remembered for the call's exact arguments (op, device type, ``requested``,
    ``TE_LAB_BACKEND``'s value, dtype, sizes, extras, kind of call) outside
    ``use_backend`` blocks, torch.compile's tracing and dispatch or function modes (whose
    sizes may be symbolic): a decode step's ops then pay one dict lookup each."""
    training = torch.is_grad_enabled()
    direct = not (_OVERRIDES or torch.compiler.is_compiling() or dispatch_modes_active()
                  or function_modes_active())
    if direct:
        # The op by name: torch.compile reads the same dict (measured_choice.known) and
        # cannot hash a FusedOp key there (its fields hold dicts), which broke the graph.
        key = (op.name, call.device.type, call.requested, _environment_value(), call.dtype, call.sizes, call.extras,
               training)
        answer = measured_choice.remembered(key)
        if answer is None:
            answer, settled = _decide(op, call, os.environ.get(ENV_VAR, ""), training)
            if settled:
                measured_choice.remember(key, answer)
    else:
        answer = _decide(op, call, os.environ.get(ENV_VAR, ""), training)[0]
    for recorder in _CHOICE_RECORDERS:
        if op.cpu_measured:
            recorder.setdefault(op.name, set()).add(answer[0])
    return answer


def _decide(op: FusedOp, call: Call, spec: str, training: bool) -> tuple[tuple[str, str], bool]:
    """:func:`choose`'s answer, and whether it may be remembered for the exact call (an
    automatic answer that measuring settled)."""
    forced, source = _forced(op, call.requested, spec)
    if forced is not None:
        reason = unavailable_reason(op, forced, call.device)
        if reason is None:
            declined = _declined(op, forced, call)
            if declined:
                raise ValueError(f"{op.name}: backend {forced!r} (from {source}) cannot run {declined}")
            return (forced, f"forced by {source}"), False
        raise ValueError(f"{op.name}: backend {forced!r} (from {source}) cannot run on device {call.device}: {reason}")
    chosen = _automatic_backend(op, call.device)
    declined = _declined(op, chosen, call)
    if declined:
        order = _automatic_order(op, call.device)
        fallback = next((name for name in order[order.index(chosen) + 1:]
                         if unavailable_reason(op, name, call.device) is None and not _declined(op, name, call)),
                        "reference")
        return (fallback, f"{AUTOMATIC}: {chosen} cannot run {declined}"), False
    if chosen not in op.cpu_measured or not call.sizes or devices.is_gpu(call.device):
        return (chosen, AUTOMATIC), False
    measured, settled = _measured_cpu_choice(op, call.dtype, call.sizes, call.extras, chosen, training)
    return (measured, MEASURED), settled


def _declined(op: FusedOp, backend: str, call: Call) -> Optional[str]:
    return op.declines(backend, call) if op.declines is not None and call.dtype is not None else None


def _automatic_order(op: FusedOp, device: torch.device) -> tuple[str, ...]:
    # Triton is chosen automatically only on GPUs: the CPU interpreter is for tests.
    if devices.is_gpu(device):
        return ("triton", "native", "inductor", "reference")
    return (op.cpu_preference, "native", "inductor", "reference")


def _automatic_backend(op: FusedOp, device: torch.device) -> str:
    """The first of the automatic order that can run ``op`` on ``device`` (remembered: it
    depends only on the device type and whether Triton runs there)."""
    if torch.compiler.is_compiling():  # a dict read there would be guarded on: decide afresh
        return next(name for name in _automatic_order(op, device) if unavailable_reason(op, name, device) is None)
    key = (op, device.type, devices.triton_unavailable_reason(device.type))
    chosen = _automatic.get(key)
    if chosen is None:
        chosen = _automatic[key] = next(name for name in _automatic_order(op, device)
                                        if unavailable_reason(op, name, device) is None)
    return chosen


def select_backend(op: FusedOp, device: torch.device, requested: Optional[str] = None) -> str:
    """The backend that runs ``op`` on ``device`` for a call whose sizes are not measured
    (``choose`` for a :class:`Call` without sizes)."""
    return choose(op, Call(device, requested))[0]


def select_measured_backend(op: FusedOp, device: torch.device, requested: Optional[str], dtype: torch.dtype,
                            sizes: tuple[int, ...], extras: tuple = ()) -> str:
    """``choose`` for a call of ``dtype`` with ``sizes`` and ``extras``: where the choice is
    automatic on the CPU and the op measures its CPU backends, the one that measured
    fastest for these sizes and this kind of call (:func:`measured_cpu_choice`,
    :func:`training_call`)."""
    return choose(op, Call(device, requested, dtype, sizes, extras))[0]


def describe_backend(op: FusedOp, device: torch.device, requested: Optional[str] = None) -> str:
    """:func:`select_backend`'s answer as a report should state it: an automatic choice
    that is measured per call's sizes says so."""
    (chosen, why), _ = _decide(op, Call(device, requested), os.environ.get(ENV_VAR, ""), torch.is_grad_enabled())
    if why == AUTOMATIC and not devices.is_gpu(device) and chosen in op.cpu_measured:
        return f"{' or '.join(op.cpu_measured)}, whichever measured faster here for the sizes"
    return chosen


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
    choice = known(decision, shape_class)
    if choice is not None:
        return choice, True
    cpu = torch.device("cpu")
    runnable = tuple(name for name in op.cpu_measured if unavailable_reason(op, name, cpu) is None)

    def candidates():
        samples = op.cpu_samples(dtype, *classes, *extras, training=training)
        return {name: samples[name] for name in runnable}

    choice = measured_choice.choose(decision, shape_class, candidates,
                                    default if default in runnable else runnable[0], runnable)
    return choice, known(decision, shape_class) is not None


# Open recorders of :func:`recording_choices`: op name -> the backends its calls ran on.
_CHOICE_RECORDERS: list[dict[str, set]] = []


@contextlib.contextmanager
def recording_choices() -> Iterator[dict[str, set]]:
    """Inside the block, every call of an op that measures its CPU backends adds the backend
    chosen to the dict yielded (op name -> the backends chosen), so a report can say what
    ran (``fuse`` records its probes)."""
    recorder: dict[str, set] = {}
    _CHOICE_RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _CHOICE_RECORDERS.remove(recorder)
