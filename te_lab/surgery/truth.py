"""The truth a probe measures errors against: the original module run in float64.

Comparing a twin with its original element by element mistakes rounding for a bug once
activations reach real checkpoints' 1e3-1e4: two correct float32 computations of the same
math then differ by more than any fixed tolerance of the values. So the probe runs the
original a third time with its parameters, buffers and floating inputs in float64 and
measures each side's error against that run (:func:`te_lab.kernels.precision.error_budget`
says how much the twin may have).

:func:`float64_run` holds the module's parameters and buffers in float64 by swapping each
tensor's ``.data`` (the Parameter objects, which a fused twin shares, stay the same and are
put back bit for bit) and, through a ``TorchFunctionMode``, keeps casts that the module's
own code makes to a lower precision (Hugging Face's norms compute in ``.float()``, eager
attention's softmax in ``dtype=torch.float32``) in float64. Autocast is off inside.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_LOWER_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_DOWNCASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _float64(value: Any) -> Any:
    if isinstance(value, torch.dtype) and value in _LOWER_FLOATS:
        return torch.float64
    return value


class _KeepFloat64(TorchFunctionMode):
    """Rewrites requests for float32 / float16 / bfloat16 results into float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DOWNCASTS and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            return args[0]
        if "dtype" in kwargs:
            kwargs = {**kwargs, "dtype": _float64(kwargs["dtype"])}
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(_float64(a) for a in args)
        return func(*args, **kwargs)


def to_float64(value: Any) -> Any:
    """``value`` with every floating tensor in float64 (containers rebuilt, others as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: to_float64(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def float64_run(roots: Sequence[nn.Module]) -> Iterator[None]:
    """Inside the block, ``roots``' floating parameters and buffers are float64 and so is
    every floating result their code asks for; afterwards each tensor is its old self."""
    tensors = {id(t): t for root in roots for t in [*root.parameters(), *root.buffers()] if t.is_floating_point()}
    saved = [(tensor, tensor.data) for tensor in tensors.values()]
    try:
        for tensor, data in saved:
            tensor.data = data.to(torch.float64)
        device_types = {data.device.type for _, data in saved} or {"cpu"}
        with contextlib.ExitStack() as stack:
            for device_type in device_types:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            stack.enter_context(_KeepFloat64())
            yield
    finally:
        for tensor, data in saved:
            tensor.data = data
