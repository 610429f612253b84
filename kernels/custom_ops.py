"""te_lab's operators (``te_lab::<name>``), defined with few Python layers per call.

``torch.library.custom_op`` gives an op its schema, fake function and autograd formula,
and torch.compile traces through it; but every eager call runs through several Python
wrappers (the op object, a generated autograd kernel that re-fills defaults and
re-dispatches, the backend wrapper, a Dynamo-disabling decorator), which on a 2-core
CPU cost more than a fused RMSNorm over 64 x 64 computes. :func:`custom_op` here is a
drop-in for the functional ops: the same decorator, ``register_fake`` and
``register_autograd``, on an op defined with ``torch.library.Library`` directly. An eager
call on plain tensors goes straight to the implementation:

- with gradients needed, through one ``torch.autograd.Function`` named after the op
  (``te_lab::<name>``: a profile shows the op's name, its inputs' shapes and the sequence
  number that links it to its backward, as it does for a dispatched op), whose forward
  runs the implementation;
- without, the implementation itself; while a profiler runs, the op through the
  dispatcher instead, so that the profile records it.

An op whose ``backend`` argument is ``"cpp"`` goes, on that same eager path, to its C++
overload ``te_lab::<name>.cpp``, which carries its autograd formula in C++. An op defined
with ``cpp=True`` defines that overload itself, with its own schema less ``backend`` (the
C++ files only register kernels against it), and sends its ``cpp`` calls there on every
path.

Everything else goes through the dispatcher, to an autograd kernel that applies an
equivalent Function: torch.compile's tracing (the op stays one node), autocast regions
(autocast casts before autograd records), ``TorchDispatchMode``s (selective
checkpointing policies, fake tensors, FLOP counters see ``te_lab::<name>``) and tensor
subclasses. Ops that mutate their arguments keep ``torch.library.custom_op``: they need
its version-counter bookkeeping.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from .torch_internals import (
    AFTER_AUTOGRAD_KEYS,
    OpOverload,
    any_autocast_enabled,
    below_autograd,
    dispatch_modes_active,
    profiler_enabled,
)

# Definitions live as long as this library object.
_LIBRARY = torch.library.Library("te_lab", "FRAGMENT")


def _needs_grad(args) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


_PLAIN = (Tensor, torch.nn.Parameter)


def _runs_directly(args) -> bool:
    """Whether an eager call may skip the dispatcher (see the module doc)."""
    return not (torch.compiler.is_compiling() or any_autocast_enabled() or dispatch_modes_active()
                or any(isinstance(a, Tensor) and type(a) not in _PLAIN for a in args))


def _function(name: str, forward: Callable, backward: Callable) -> type:
    function = type(name, (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    # Its autograd node is not an op: profiles attribute the backward's ops under it.
    function._backward_cls.__name__ = f"{name.replace('te_lab::', 'TeLab_')}_backward_node"
    return function


_BACKEND = ", str backend"


def cpp_schema(schema: str) -> str:
    """The schema of an op's C++ overload: the op's own, ``"(..., str backend) -> ..."``,
    less its last argument ``backend``."""
    arguments, arrow, returns = schema.partition(") -> ")
    if not arguments.endswith(_BACKEND):
        raise ValueError(f"an op with a C++ overload takes `backend: str` last; its schema is {schema!r}")
    return arguments.removesuffix(_BACKEND) + arrow + returns


class CustomOp:
    """``te_lab::<name>``: call it like the function it was defined from. With ``cpp``, it
    also defines ``te_lab::<name>.cpp`` (see the module doc)."""

    def __init__(self, qualname: str, fn: Callable, *, cpp: bool = False):
        namespace, _, self.name = qualname.partition("::")
        if namespace != "te_lab" or not self.name:
            raise ValueError(f"te_lab.kernels.custom_op: expected a name 'te_lab::<op>', got {qualname!r}")
        self.schema = torch.library.infer_schema(fn, mutates_args=())
        _LIBRARY.define(self.name + self.schema)
        kernel = fn
        self._cpp = None  # the C++ overload, False where there is none (cpp_overload)
        if cpp:
            _LIBRARY.define(f"{self.name}.cpp{cpp_schema(self.schema)}")
            self._cpp = cpp_op = getattr(torch.ops.te_lab, self.name).cpp

            @functools.wraps(fn)
            def kernel(*args):
                return cpp_op(*args[:-1]) if args[-1] == "cpp" else fn(*args)

        _LIBRARY.impl(self.name, kernel, "CompositeExplicitAutograd")
        self.op: OpOverload = getattr(torch.ops.te_lab, self.name).default
        self._impl = fn
        self._direct_function: Optional[type] = None
        self.__wrapped__ = kernel  # what the op runs for each backend, cpp included

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.op, fn, lib=_LIBRARY)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)``, as for
        ``torch.library.custom_op``."""
        op, impl = self.op, self._impl

        def direct_forward(ctx, *args):
            output = impl(*args)
            setup_context(ctx, args, output)
            return output

        def dispatched_forward(ctx, *args):
            with below_autograd():
                output = op(*args)
            setup_context(ctx, args, output)
            return output

        self._direct_function = _function(f"te_lab::{self.name}", direct_forward, backward)
        # Reached through the dispatcher, whose record of the op already bears its name.
        dispatched = _function(f"TeLab_{self.name}", dispatched_forward, backward)

        def autograd_kernel(keyset, *args):
            if _needs_grad(args):
                return dispatched.apply(*args)
            with below_autograd():
                return op.redispatch(keyset & AFTER_AUTOGRAD_KEYS, *args)

        _LIBRARY.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)

    def cpp_overload(self) -> Optional[OpOverload]:
        """``te_lab::<name>.cpp``: the op's C++ kernels, autograd included
        (:mod:`te_lab.kernels.cpu_kernels`), taking the op's arguments but ``backend``; None
        for an op whose ``cpp`` backend is Python around C++ kernels (the LM head's chunks)."""
        if self._cpp is None:
            self._cpp = getattr(getattr(torch.ops.te_lab, self.name), "cpp", False)
        return self._cpp or None

    def __call__(self, *args):
        if _runs_directly(args):
            if args[-1] == "cpp" and self.cpp_overload() is not None:
                # One crossing into C++: the forward, and the backward inside autograd's engine.
                return self.cpp_overload()(*args[:-1])
            if self._direct_function is not None and _needs_grad(args):
                return self._direct_function.apply(*args)
            if not profiler_enabled():
                return self._impl(*args)
        return self.op(*args)


def define_overload(qualified: str, schema: str) -> None:
    """Define ``te_lab::<qualified>`` (``"<op>.<overload>"``) with ``schema``: a C++
    overload whose kernels the C++ files register (:mod:`te_lab.kernels.cpu_kernels`)."""
    _LIBRARY.define(qualified + schema)


def custom_op(qualname: str, *, mutates_args: tuple = (), cpp: bool = False) -> Callable[[Callable], CustomOp]:
    """Define the functional op ``qualname`` from ``fn``'s annotations, and with ``cpp`` its
    C++ overload (see the module doc)."""
    if mutates_args:
        raise ValueError(f"te_lab.kernels.custom_op({qualname!r}): ops that mutate their arguments "
                         "are defined with torch.library.custom_op")
    return lambda fn: CustomOp(qualname, fn, cpp=cpp)
