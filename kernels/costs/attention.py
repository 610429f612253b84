"""te_lab::attention and its backward (schemas in kernels/attention.py), counted as ATen's
attention kernels are (:mod:`.aten`)."""

from __future__ import annotations

from typing import Optional

from .aten import attention_backward_cost, attention_forward_cost
from .model import Arguments, OpCost


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> (out like q, lse [b, h, s_q] float32/64)
    return attention_forward_cost(arguments, arguments.q, arguments.k)


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dq, dk, dv, dsinks)
    return attention_backward_cost(arguments, arguments.q, arguments.k, arguments.v)


COSTS = {"te_lab::attention": forward, "te_lab::attention_backward": backward}
