"""One declaration per fused op: :func:`define_op` turns what only the op can say into
everything torch and te_lab need from it.

An op's file writes its reference, its backends' kernels, and then the op itself:

- ``forward``: the Python function behind ``te_lab::<name>``, whose annotations are the
  op's schema, written once (its last argument is ``backend: str``, the backend to run);
  ``forward_fake`` gives its outputs' shapes and dtypes to torch.compile and fake tensors;
- ``backward`` and ``backward_fake``: the same for ``te_lab::<name>_backward``, where the
  op has a backward op;
- ``setup_context(ctx, inputs, output)`` and ``gradients(ctx, *output_grads)``: the
  autograd formula, as for ``torch.library.custom_op``; ``ctx.backend`` is the forward's
  backend, and ``gradients`` reaches the backward op as ``ctx.backward_op``;
- ``autocast``: how the forward behaves under ``torch.autocast``
  (:class:`~te_lab.kernels.autocast.AutocastRule`; the backward op never casts), on every
  backend: the op's public function runs its ``reference`` path through
  :func:`run_reference`, which casts and runs as the custom op's autocast kernel does;
- ``cpp=True`` where ``kernels/cpp/<name>.cpp`` registers C++ kernels: the overloads
  ``te_lab::<name>.cpp`` (and ``<name>_backward.cpp`` where the backward op takes a
  ``backend``) are defined here, with the Python
  ops' schemas less ``backend``; the C++ file only registers its kernels against them (the
  dispatcher checks each kernel's C++ signature against the schema when the library
  loads); the ``cpp`` backend is listed and runs there, on every path;
- ``cpp_overloads``: further C++ overloads with schemas of their own (an in-place
  variant), ``{"<op>.<overload>": "(Tensor(a!) x, ...) -> Tensor(a!)"}``, defined here too;
- ``backends``: the other backends' implementations; ``costs``: its
  ``kernels/costs/<name>.py``'s ``COSTS``, whose functions read a call's arguments by the
  schema's names; and the registry's other fields (:class:`~te_lab.kernels.registry.FusedOp`:
  ``cpu_preference``, ``cpu_measured``, ``cpu_samples``, ``native_supports``...).

:func:`define_op` defines the custom ops with :mod:`te_lab.kernels.custom_ops` (their
fakes, the autograd wiring), their autocast kernels, the C++ overloads, and registers the
:class:`~te_lab.kernels.registry.FusedOp`; it returns that and the custom ops the op's
public function calls.
"""

from __future__ import annotations

import inspect
from typing import Callable, Mapping, NamedTuple, Optional

import torch
from torch import Tensor

from .autocast import NO_CAST, AutocastRule, register_autocast_rule, run_as_autocast_kernel
from .custom_ops import CustomOp, define_overload
from .registry import FusedOp, register_op
from .torch_internals import any_autocast_enabled


class DefinedOp(NamedTuple):
    """What :func:`define_op` made: the registered op and its custom ops."""

    fused: FusedOp
    forward: CustomOp
    backward: Optional[CustomOp]


# Each declared op's autocast rule, by the op's name: what run_reference applies.
_AUTOCAST_RULES: dict[str, AutocastRule] = {}


def define_op(name: str, *, reference: Callable, forward: Callable, forward_fake: Callable,
              backward: Optional[Callable] = None, backward_fake: Optional[Callable] = None,
              setup_context: Optional[Callable] = None, gradients: Optional[Callable] = None,
              autocast: AutocastRule = NO_CAST, backends: Mapping[str, object], cpp: bool = False,
              cpp_overloads: Mapping[str, str] = {},  # noqa: B006 - read only
              costs: Mapping[str, Callable], **registration) -> DefinedOp:
    """Define the fused op ``name`` (see the module doc); ``registration`` holds the other
    fields of its :class:`~te_lab.kernels.registry.FusedOp` (``cpu_preference``...)."""
    if (backward is None) != (backward_fake is None) or (setup_context is None) != (gradients is None):
        raise ValueError(f"define_op({name!r}): backward and backward_fake, setup_context and gradients "
                         "come in pairs")
    backward_op = None
    if backward is not None:
        takes_backend = "backend" in inspect.signature(backward).parameters
        backward_op = CustomOp(f"te_lab::{name}_backward", backward, cpp=cpp and takes_backend)
        backward_op.register_fake(backward_fake)
        register_autocast_rule(backward_op.name)
    forward_op = CustomOp(f"te_lab::{name}", forward, cpp=cpp)
    forward_op.register_fake(forward_fake)
    if gradients is not None:
        def setup(ctx, inputs, output):
            ctx.backend, ctx.backward_op = inputs[-1], backward_op
            setup_context(ctx, inputs, output)

        forward_op.register_autograd(gradients, setup_context=setup)
    register_autocast_rule(forward_op.name, autocast)
    _AUTOCAST_RULES[name] = autocast
    for qualified, schema in cpp_overloads.items():
        define_overload(qualified, schema)
    implementations = dict(backends)
    if cpp:
        implementations["cpp"] = forward_op.cpp_overload()
    fused = register_op(FusedOp(name=name, reference=reference, implementations=implementations, costs=costs,
                                **registration))
    return DefinedOp(fused, forward_op, backward_op)


def run_reference(op: FusedOp, function: Callable, x: Tensor, *args, **kwargs):
    """``function(x, *args, **kwargs)``, ``op``'s reference math, where the dispatcher chose
    ``reference`` for a call on ``x``'s device. Outside autocast it runs as it is; under
    autocast as ``op``'s custom op runs there: floating inputs cast by the op's autocast
    rule, then autocast off. So the reference path computes in and returns the dtypes the
    fused backends do (float32 where a norm's ATen op is on autocast's float32 list, the
    region's dtype for attention's q, k and v), and a choice between backends made by
    measurement never changes a result's dtype."""
    if not any_autocast_enabled() or not torch.is_autocast_enabled(x.device.type):
        return function(x, *args, **kwargs)
    return run_as_autocast_kernel(_AUTOCAST_RULES[op.name], x.device.type, function, x, *args, **kwargs)
