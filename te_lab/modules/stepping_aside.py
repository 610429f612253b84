"""When a twin hands a call back to the module it replaces: where the original measured faster.

A twin whose forward has no side effects (``FusedModule.measured_against_original``: the
norms and MLPs) is timed against the original once per class of call, on that call's
inputs, and the original runs every call of the class from then on where it was faster
by more than :data:`MARGIN` (medians of interleaved rounds: near-equal timings never flip
a verified twin). A class is the twin's structure (its type, description and parameter
shapes, so the 30 layers of a model share one measurement), the input's dtype, its rows
rounded up to a power of two, and the kind of call:

- a *training* call (gradients on, and the input or a parameter requires them) is timed
  forward and backward (``torch.autograd.grad`` of the input and the trainable
  parameters, so no ``.grad`` is touched), as a training step runs it;
- any other call (a decode step, an evaluation) forward alone without gradients.

At one row, what the fused ops cost around their kernels can exceed what they save; at a
training step's rows a fused kernel can still lose to the library's, on some machines and
sizes: stepping aside then costs one lookup. :func:`te_lab.fuse` decides the training class
of the sample's sizes when it swaps (``keep="faster"``, the default) so its report says
which twins step aside; ``keep="all"`` marks each twin to run fused at every size
(:func:`keep_fused`). Nothing steps aside where a backend is forced (``backend=``,
``te_lab.use_backend``, ``TE_LAB_BACKEND``), under torch.compile, autocast or dispatch and
function modes, off the CPU, with hooks inside the original (they would fire in every
sample), with ``TE_LAB_CHOICES=off``, or inside :func:`running_fused` (``fuse``'s probes
and checks, which judge the fused kernels). Decisions live for the process (the original's
code is not te_lab's to cache on disk).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from te_lab.kernels import measured_choice, registry
from te_lab.kernels.torch_internals import any_autocast_enabled, dispatch_modes_active, function_modes_active

# The original must be faster than the twin by more than this fraction to take its calls.
MARGIN = 0.05


@dataclass(frozen=True)
class Decision:
    """One class of call: whether the original runs it, and the medians it was decided on
    (NaN where nothing was measured: measuring off, hooks inside)."""

    aside: bool
    training: bool
    rows: int  # the class's rows (a power of two)
    original_us: float = math.nan
    fused_us: float = math.nan

    @property
    def speedup(self) -> Optional[float]:
        """Original time / twin time; None where nothing was measured."""
        if math.isnan(self.original_us) or not self.fused_us > 0:
            return None
        return self.original_us / self.fused_us


# (structure, dtype, rows class, training) -> Decision
_DECISIONS: dict[tuple, Decision] = {}
_running_fused = 0  # inside running_fused(): every twin runs its fused forward


@contextlib.contextmanager
def running_fused():
    """Every twin runs its fused forward inside: ``fuse``'s probes and whole-model check
    judge the fused kernels, never the original a twin would hand the call to."""
    global _running_fused
    _running_fused += 1
    try:
        yield
    finally:
        _running_fused -= 1


def first_argument(args: tuple, kwargs: dict):
    """A call's input: its first positional argument, else its first keyword's value."""
    return args[0] if args else next(iter(kwargs.values()), None)


def keep_fused(twin: nn.Module) -> None:
    """Mark ``twin`` to run its fused forward at every size (``fuse(keep="all")``)."""
    twin.__dict__["keeps_fused"] = True


def steps_aside(twin: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``twin`` runs the original (see the module doc)."""
    if not _may_step_aside(twin):
        return False
    decision = decide(twin, args, kwargs)
    return decision is not None and decision.aside


def decide(twin: nn.Module, args: tuple, kwargs: dict, training: Optional[bool] = None) -> Optional[Decision]:
    """The decision for this call's class, measured now where it is not known yet; None
    for a call no decision covers (a first argument that is not a floating CPU tensor).
    ``training`` forces the kind of call (``fuse`` decides the training class of the
    sample's sizes on its captured, gradient-free inputs)."""
    x = first_argument(args, kwargs)
    if not isinstance(x, Tensor) or x.dim() == 0 or x.device.type != "cpu" or not x.is_floating_point():
        return None
    if training is None:
        training = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in twin.parameters()))
    rows = measured_choice.size_class(x.numel() // max(x.shape[-1], 1))
    key = (_structure(twin), x.dtype, rows, training)
    found = _DECISIONS.get(key)
    if found is None:
        found = _DECISIONS[key] = _measure(twin, args, kwargs, training, rows)
    return found


def _may_step_aside(twin: nn.Module) -> bool:
    """Outside :func:`running_fused`, ``twin`` not kept fused, every op of it choosing its
    backend itself, outside torch.compile, autocast and dispatch or function modes."""
    return not (_running_fused or "pinned_backends" in twin.__dict__ or twin.__dict__.get("keeps_fused")
                or twin.backend is not None or registry.backends_forced() or torch.compiler.is_compiling()
                or any_autocast_enabled() or dispatch_modes_active() or function_modes_active())


def _structure(twin: nn.Module) -> tuple:
    structure = twin.__dict__.get("_structure")
    if structure is None:
        structure = twin.__dict__["_structure"] = (
            type(twin), twin.extra_repr(), tuple(tuple(p.shape) for p in twin.parameters()))
    return structure


def _measure(twin: nn.Module, args: tuple, kwargs: dict, training: bool, rows: int) -> Decision:
    original = twin.restore_original()  # with the twin's current children (PEFT's adapters) and tensors
    inside = [module for module in original.modules() if module is not original]
    if not measured_choice.measuring_enabled() or any(
            module._forward_hooks or module._forward_pre_hooks for module in inside):
        return Decision(False, training, rows)
    with torch.random.fork_rng(devices=[]):  # a dropout child draws in every sample
        times = measured_choice.median_times_now({
            "fused": _sample(twin, twin.fused_forward, args, kwargs, training),
            "original": _sample(twin, original.forward, args, kwargs, training)})
    return Decision(times["original"] < (1 - MARGIN) * times["fused"], training, rows, times["original"],
                    times["fused"])


def _sample(twin: nn.Module, run, args: tuple, kwargs: dict, training: bool):
    """One sample of ``run`` on the call's inputs: forward alone without gradients, or for
    a training call forward and backward to the input and the trainable parameters, on
    detached copies of the call's tensors (the caller's graph is left alone)."""
    if not training:
        def forward():
            with torch.no_grad():
                run(*args, **kwargs)
        return forward
    detached_args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    detached_kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    x = first_argument(detached_args, detached_kwargs).requires_grad_()
    wanted = [x] + [p for p in twin.parameters() if p.requires_grad]

    def forward_and_backward():
        with torch.inference_mode(False), torch.enable_grad():
            out = run(*detached_args, **detached_kwargs)
            out = out if isinstance(out, Tensor) else first_argument(tuple(out), {})
            torch.autograd.grad(out, wanted, torch.ones_like(out), allow_unused=True)
    return forward_and_backward
