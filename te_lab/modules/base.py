"""What every fused twin has in common: it adopts the module it replaces.

A twin registers the original's own Parameter, buffer and child-module objects under
the original's names, so ``state_dict()`` keys and values are unchanged by a swap, an
optimizer built before the swap keeps training the same tensors, and a checkpoint
saved fused loads unfused and back. The original module is kept (unregistered, so it
adds nothing to ``state_dict`` or ``parameters()``) for :func:`te_lab.unfuse` and for
the calls a twin hands back to it (e.g. a KV-cache decode step).

A twin whose forward has no side effects (``measured_against_original``: the norms and
MLPs) may also hand a call back where fusing does not pay for it: timed against the
original once per class of call, training calls forward and backward, others forward
alone, the original runs every call of a class it was measurably faster for
(:mod:`.stepping_aside`). Under torch.compile, a decode step without gradients is the
original's for every twin (:func:`te_lab.modules.direct.compiled_decode`): Inductor fuses
the original's math itself.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from te_lab.kernels.registry import FusedOp, describe_backend

from . import stepping_aside
from .direct import compiled_decode


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
        if self.measured_against_original and stepping_aside.steps_aside(self, args, kwargs):
            # The twin's current children and tensors first: a LoRA layer PEFT put in the
            # twin's place, a Parameter replaced by load_state_dict(assign=True).
            return self.restore_original().forward(*args, **kwargs)
        if compiled_decode(self, stepping_aside.first_argument(args, kwargs)):
            return self.original.forward(*args, **kwargs)
        return self.fused_forward(*args, **kwargs)

    def fused_forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} defines neither forward nor fused_forward")

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
                if name in theirs and theirs[name] is not value:
                    theirs[name] = value
        if original.training != self.training:  # train() walks every child: not on each call stepping aside
            original.train(self.training)
        return original

    def extra_repr(self) -> str:
        fused_from = type(self.original).__name__
        return f"fused from {fused_from}" + ("" if self.backend is None else f", backend={self.backend!r}")
