"""How te_lab's custom ops behave under ``torch.autocast``: like the ATen ops they stand for.

Autocast acts at a dispatch key of its own (``AutocastCPU``, ``AutocastCUDA``,
``AutocastPrivateUse1`` for MUSA), where an op on one of its lists casts its floating
inputs and runs with autocast off. A custom op without a kernel there falls through,
and its implementation then runs *inside* the autocast region: the ATen ops it calls
(``F.linear`` in fused_linear_cross_entropy, SDPA's kernels, Inductor graphs) are cast
once more, their results no longer have the dtypes the op's fake function promises,
and every Inductor graph is traced anew under the autocast state. So each te_lab op
gets a kernel at every autocast key that

1. casts its floating inputs as autocast's rule for the ATen op it replaces does on that
   device, looked up in the torch build at run time (``AutocastRule.follows``): to the
   region's low-precision dtype where that op is on the lower-precision list
   (``aten::linear``, ``aten::scaled_dot_product_attention``), to float32 where it is on
   the float32 list (``aten::layer_norm`` on CUDA, on no CPU list), not at all otherwise;
2. runs the op with autocast off, so its math is the op's own on those dtypes.

Backward ops get step 2 alone: they see the dtypes their forward saw. An op's
``reference`` path, run in Python without the custom op, goes through the same two steps
under autocast (:func:`run_as_autocast_kernel`), so that whichever backend the dispatcher
chooses, the op computes in and returns the same dtypes.

``torch.library.register_autocast`` (torch >= 2.5) does not fit: it casts to one dtype
fixed at registration, whereas autocast's low-precision dtype is the region's (bfloat16
or float16), and it cannot leave inputs uncast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .registry import DISPATCH_KEYS, aten_kernel_exists
from .torch_internals import OpOverload

LOWER_PRECISION = "lower_precision"
FLOAT32 = "float32"


@dataclass(frozen=True)
class AutocastRule:
    """Cast floating inputs ``to`` ``LOWER_PRECISION`` (the region's dtype) or ``FLOAT32``
    wherever ATen's ``follows`` has an autocast rule; ``AutocastRule()`` never casts."""

    follows: Optional[str] = None
    to: Optional[str] = None

    def cast_dtype(self, device_type: str) -> Optional[torch.dtype]:
        """The dtype floating inputs on ``device_type`` are cast to right now, or None."""
        if self.to is None or not torch.is_autocast_enabled(device_type):
            return None
        if not aten_kernel_exists(self.follows, device_type, autocast=True):
            return None
        return torch.float32 if self.to == FLOAT32 else torch.get_autocast_dtype(device_type)


NO_CAST = AutocastRule()
# The GEMMs of F.linear: in the region's low-precision dtype.
LIKE_LINEAR = AutocastRule(follows="aten::linear", to=LOWER_PRECISION)

# Registrations live as long as this library object.
_LIBRARY = torch.library.Library("te_lab", "IMPL")


def _cast(value, dtype: torch.dtype, device_type: str):
    # What autocast casts: floating tensors of the region's device, float64 excepted.
    if (isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64
            and value.device.type == device_type):
        return value.to(dtype)
    return value


def run_as_autocast_kernel(rule: AutocastRule, device_type: str, function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` as the autocast kernel of an op with ``rule`` runs the
    op on ``device_type``: floating inputs cast by ``rule``, then autocast off. The custom
    ops' kernels run here, and so does an op's reference path under autocast
    (:func:`te_lab.kernels.op_declaration.run_reference`)."""
    dtype = rule.cast_dtype(device_type)
    if dtype is not None:
        args = tuple(_cast(arg, dtype, device_type) for arg in args)
        kwargs = {name: _cast(value, dtype, device_type) for name, value in kwargs.items()}
    with torch.autocast(device_type, enabled=False):
        return function(*args, **kwargs)


def _autocast_kernel(op: OpOverload, device_type: str, rule: AutocastRule):
    def kernel(*args):
        return run_as_autocast_kernel(rule, device_type, op, *args)

    return kernel


def register_autocast_rule(name: str, rule: AutocastRule = NO_CAST) -> None:
    """Give the custom op ``te_lab::<name>`` its autocast behaviour on every device type."""
    op = getattr(torch.ops.te_lab, name).default
    for device_type, key in DISPATCH_KEYS.items():
        _LIBRARY.impl(name, _autocast_kernel(op, device_type, rule), "Autocast" + key)


def inputs_cast_by(rule: AutocastRule, device: torch.device) -> bool:
    """Whether autocast will give an op with ``rule`` its floating inputs on ``device`` in
    one dtype: then the public op need not insist that they arrive in one (as ATen's ops
    do not under autocast)."""
    return rule.cast_dtype(device.type) is not None

