"""te_lab's operators (``te_lab::<name>``), defined with few Python layers per call.

``torch.library.custom_op`` gives an op its schema, fake function and autograd formula,
and torch.compile traces through it; but every eager call runs through several Python
wrappers (the op object, a generated autograd kernel that re-fills defaults and
re-dispatches, the backend wrapper, a Dynamo-disabling decorator), which on a 2-core
CPU cost more than a fused RMSNorm over 64 x 64 computes. :func:`custom_op` here is a
drop-in for the functional ops: the same decorator, ``register_fake`` and
``register_autograd``, on an op defined with ``torch.library.Library`` directly, whose
eager calls go straight to the implementation:

- with gradients needed, through one ``torch.autograd.Function`` named after the op
  (``te_lab::<name>``, so a profile shows the op's name, inputs and sequence number on
  it, and its backward's ops under its autograd node), whose forward calls the op below
  autograd;
- without, the op itself, below autograd.

Where the dispatcher must order things (an autocast region casts before autograd
records; torch.compile traces the op as a unit), the call goes through the dispatcher
instead, to an autograd kernel that applies the same Function. Ops that mutate their
arguments keep ``torch.library.custom_op``: they need its version-counter bookkeeping.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

# Definitions live as long as this library object.
_LIBRARY = torch.library.Library("te_lab", "FRAGMENT")

_any_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(device_type) for device_type in ("cpu", "cuda")))


def _needs_grad(args) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


class CustomOp:
    """``te_lab::<name>``: call it like the function it was defined from."""

    def __init__(self, qualname: str, fn: Callable):
        namespace, _, self.name = qualname.partition("::")
        if namespace != "te_lab" or not self.name:
            raise ValueError(f"te_lab.kernels.custom_op: expected a name 'te_lab::<op>', got {qualname!r}")
        _LIBRARY.define(self.name + torch.library.infer_schema(fn, mutates_args=()))
        _LIBRARY.impl(self.name, fn, "CompositeExplicitAutograd")
        self.op: torch._ops.OpOverload = getattr(torch.ops.te_lab, self.name).default
        self._function: Optional[type] = None
        self.__wrapped__ = fn

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.op, fn, lib=_LIBRARY)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)``, as for
        ``torch.library.custom_op``."""
        op = self.op

        def forward(ctx, *args):
            with torch._C._AutoDispatchBelowAutograd():
                output = op(*args)
            setup_context(ctx, args, output)
            return output

        # The class name is what profiles show for the forward: the op's own name.
        function = type(f"te_lab::{self.name}", (torch.autograd.Function,),
                        {"forward": staticmethod(forward), "backward": staticmethod(backward)})
        # Its autograd node is not an op (profiles attribute the backward ops under it).
        function._backward_cls.__name__ = f"TeLab_{self.name}_backward_node"
        self._function = function

        def autograd_kernel(keyset, *args):
            if _needs_grad(args):
                return function.apply(*args)
            with torch._C._AutoDispatchBelowAutograd():
                return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

        _LIBRARY.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)

    def __call__(self, *args):
        if torch.compiler.is_compiling() or _any_autocast_enabled():
            return self.op(*args)
        if self._function is not None and _needs_grad(args):
            return self._function.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return self.op(*args)


def custom_op(qualname: str, *, mutates_args: tuple = ()) -> Callable[[Callable], CustomOp]:
    """Define the functional op ``qualname`` from ``fn``'s annotations (see the module doc)."""
    if mutates_args:
        raise ValueError(f"te_lab.kernels.custom_op({qualname!r}): ops that mutate their arguments "
                         "are defined with torch.library.custom_op")
    return lambda fn: CustomOp(qualname, fn)
