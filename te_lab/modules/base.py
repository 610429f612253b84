"""What every fused twin has in common: it adopts the module it replaces.

A twin registers the original's own Parameter, buffer and child-module objects under
the original's names, so ``state_dict()`` keys and values are unchanged by a swap, an
optimizer built before the swap keeps training the same tensors, and a checkpoint
saved fused loads unfused and back. The original module is kept (unregistered, so it
adds nothing to ``state_dict`` or ``parameters()``) for :func:`te_lab.unfuse` and for
the calls a twin hands back to it (e.g. a KV-cache decode step).

A twin whose forward has no side effects (``measured_against_original``: the norms and
MLPs) may also hand a call back when fusing does not pay for it: in eval mode, for a call
without gradients (a decode step), the twin's fused forward and the original's are timed
against each other once per class of the call (the rows of its first tensor, rounded up
to a power of two, its dtype and the twin's structure) on that call's inputs, and the
faster runs every such call from then on. At one row, what the fused ops cost around
their kernels can exceed what they save; stepping aside then costs one lookup. Under
torch.compile, a decode step without gradients is the original's for every twin
(:func:`te_lab.modules.direct.compiled_decode`): Inductor fuses the original's math itself.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from te_lab.kernels import measured_choice
from te_lab.kernels.registry import FusedOp, describe_backend

from .direct import compiled_decode, direct_calls_allowed

# ((twin class, its description, its parameters' shapes), dtype, rows class) -> whether such
# a call runs the original: measured once per process (the original's code is not te_lab's to cache).
_STEPS_ASIDE: dict[tuple, bool] = {}


def _first_argument(args: tuple, kwargs: dict):
    """A call's input: its first positional argument, else its first keyword's value."""
    return args[0] if args else next(iter(kwargs.values()), None)


class FusedModule(nn.Module):
    """Base class of te_lab's fused twins; ``original`` is the module replaced.

    ``backend`` is what :func:`te_lab.fuse` was asked for: ``None`` lets each op
    choose automatically; a name forces it on the ops that implement it (the others
    choose automatically, as with ``te_lab.use_backend``). Subclasses list the fused
    ops they call in ``ops``.
    """

    ops: Sequence[FusedOp] = ()
    # The original's children the twin calls as modules: hooks on them (and inside them)
    # fire as before, so they do not stop a swap (te_lab.surgery.hooks).
    called_children: Sequence[str] = ()
    # Whether the fused forward (``fused_forward``) has no side effects, so that a call
    # without gradients may be measured against the original's (see the module doc).
    measured_against_original = False

    def __init__(self, original: nn.Module, backend: Optional[str] = None):
        super().__init__()
        self.__dict__["original"] = original  # not a submodule: it owns the same tensors
        self.backend = backend
        self.adopt_original()

    def adopt_original(self) -> None:
        """Take the original's current Parameters, buffers, children and mode as the
        twin's own (at construction, and when a temporary unfuse ends)."""
        original = self.original
        self._parameters.update(original._parameters)
        self._buffers.update(original._buffers)
        self._non_persistent_buffers_set.update(original._non_persistent_buffers_set)
        self._modules.update(original._modules)
        self.train(original.training)

    def forward(self, *args, **kwargs):
        if self.measured_against_original and not self.training and self._steps_aside(args, kwargs):
            return self.original.forward(*args, **kwargs)
        if compiled_decode(self, _first_argument(args, kwargs)):
            return self.original.forward(*args, **kwargs)
        return self.fused_forward(*args, **kwargs)

    def fused_forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} defines neither forward nor fused_forward")

    def _steps_aside(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call runs the original: only without gradients, with every op
        choosing automatically, outside torch.compile, autocast and dispatch or function
        modes (where the twin's ops may also run their kernels directly)."""
        if "pinned_backends" in self.__dict__ or not direct_calls_allowed(self):
            return False
        x = _first_argument(args, kwargs)
        if not isinstance(x, Tensor) or x.dim() == 0 or x.device.type != "cpu":
            return False
        structure = self.__dict__.get("_structure")
        if structure is None:
            structure = self.__dict__["_structure"] = (
                type(self), self.extra_repr(), tuple(tuple(p.shape) for p in self.parameters()))
        key = (structure, x.dtype, measured_choice.size_class(x.numel() // max(x.shape[-1], 1)))
        aside = _STEPS_ASIDE.get(key)
        if aside is None:
            aside = _STEPS_ASIDE[key] = self._measure_against_original(args, kwargs)
        return aside

    def _measure_against_original(self, args: tuple, kwargs: dict) -> bool:
        inside = [module for module in self.original.modules() if module is not self.original]
        if not measured_choice.measuring_enabled() or any(
                module._forward_hooks or module._forward_pre_hooks for module in inside):
            return False  # hooks inside would fire in every sample (the twin's own fire once, around it)
        with torch.no_grad():
            faster = measured_choice.fastest_now({
                "fused": lambda: self.fused_forward(*args, **kwargs),
                "original": lambda: self.original.forward(*args, **kwargs)})
        return faster == "original"

    def backend_for(self, op: FusedOp) -> Optional[str]:
        """The backend to pass to ``op``: one pinned for it (:meth:`pin_backend`), else the
        requested one where ``op`` implements it."""
        pinned = self.__dict__.get("pinned_backends", {}).get(op.name)
        if pinned is not None:
            return pinned
        return self.backend if self.backend in op.backends() else None

    def pin_backend(self, op: FusedOp, backend: str) -> None:
        """Run ``op`` on ``backend`` in this twin whatever was requested (``fuse`` pins
        ``linear`` to ``reference`` where oneDNN's rounding missed the probe's bar)."""
        self.__dict__.setdefault("pinned_backends", {})[op.name] = backend

    def resolved_backends(self, device: torch.device) -> dict[str, str]:
        """Op name -> the backend each op runs on ``device`` (for the report)."""
        return {op.name: describe_backend(op, device, self.backend_for(op)) for op in self.ops}

    def kernel_names(self) -> list[str]:
        return [f"te_lab::{op.name}" for op in self.ops]

    def restore_original(self) -> nn.Module:
        """Hand the twin's current tensors and mode back to the original and return it.

        Parameters are shared objects already; this also carries over anything replaced
        while fused (``load_state_dict(assign=True)``, buffers moved by ``.to()``).
        """
        original = self.original
        for store in ("_parameters", "_buffers", "_modules"):
            theirs = getattr(original, store)
            for name, value in getattr(self, store).items():
                if name in theirs:
                    theirs[name] = value
        original.train(self.training)
        return original

    def extra_repr(self) -> str:
        fused_from = type(self.original).__name__
        return f"fused from {fused_from}" + ("" if self.backend is None else f", backend={self.backend!r}")
