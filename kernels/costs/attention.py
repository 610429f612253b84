"""te_lab::attention and its backward (schemas in kernels/attention.py), counted as ATen's
attention kernels are (:mod:`.aten`)."""

from __future__ import annotations

from typing import Optional

from .aten import attention_backward_cost, attention_forward_cost
from .model import Arguments, OpCost, at


def backward(arguments: Arguments) -> Optional[OpCost]:
    # (dout, q, k, v, mask, out, lse, causal, scale, backend) -> (dq, dk, dv)
    return attention_backward_cost(arguments, at(arguments, 1), at(arguments, 2), at(arguments, 3))


# forward: (q, k, v, mask, causal, scale, backend) -> (out like q, lse [b, h, s_q] float32/64)
COSTS = {"te_lab::attention": attention_forward_cost, "te_lab::attention_backward": backward}
