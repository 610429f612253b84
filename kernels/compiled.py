"""The ``inductor`` backend's building block: a reference function compiled by
torch.compile (Inductor), compiled on first use so importing te_lab stays cheap."""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch


def _specialization(value):
    """What a compiled graph is specialised on: tensors by dtype, device type and rank
    (shapes stay dynamic), ``None`` by absence, flags and strings by value."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device.type, value.dim())
    if value is None or isinstance(value, (bool, str)):
        return value
    return type(value)


def inductor_compiled(fn: Callable) -> Callable:
    """``fn`` compiled with Inductor, one graph per specialisation of its arguments.

    Shapes are dynamic from the start, so one graph serves every batch size. Each
    specialisation (dtypes, optional tensors present or not, flags) compiles its own
    copy of ``fn``: torch.compile caps recompiles per code object (8 by default), and
    an op used with several dtypes and options would otherwise hit that cap.

    The graph is always called the same way: under no_grad, with detached, contiguous
    tensors. Fused ops call it below autograd, yet grad mode, the inputs'
    ``requires_grad`` and their being views vary with the caller; each enters the
    graph's guards and would force a recompile.
    """
    compiled: dict[tuple, Callable] = {}

    @functools.wraps(fn)
    def run(*args):
        key = tuple(_specialization(arg) for arg in args)
        if key not in compiled:
            # A fresh code object gives this specialisation its own compile cache.
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                      fn.__defaults__, fn.__closure__)
            compiled[key] = torch.compile(copy, dynamic=True, fullgraph=True)
        with torch.no_grad():
            return compiled[key](*(arg.detach().contiguous() if isinstance(arg, torch.Tensor) else arg
                                   for arg in args))

    return run
