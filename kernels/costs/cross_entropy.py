"""te_lab::cross_entropy and its backward (schemas in kernels/cross_entropy.py)."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost, reading_inputs

# A soft-cap (a scalar argument) adds about 5 FLOPs per logit (divide, tanh, scale; the
# gradient's 1 - t^2 factor), but a recorded call carries no scalar values to tell.
SOFTCAP_NOTE = "; a soft-cap's ~5 more per logit (tanh and its derivative) not counted: calls record no scalars"


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> (losses [tokens] float32/64, grad like logits or empty)
    logits = arguments.logits
    if logits is None:
        return None
    return reading_inputs(arguments, logits.rows * logits.stats_itemsize + logits.nbytes, logits.numel * 8,
                          "inputs read + per-token losses (float32, float64 for float64) and the gradient like "
                          "logits (assumed computed: the training case) written; FLOPs: 8 per logit (online max, "
                          "subtract, exp, sum; then subtract, exp, scale, subtract for the gradient)" + SOFTCAP_NOTE)


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> grad_logits scaled per token
    grad = arguments.grad_logits
    if grad is None:
        return None
    return reading_inputs(arguments, grad.nbytes, grad.numel,
                          "inputs read + a gradient like grad_logits written; FLOPs: 1 per element")


COSTS = {"te_lab::cross_entropy": forward, "te_lab::cross_entropy_backward": backward}
