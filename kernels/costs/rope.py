"""te_lab::rope and its backward (schemas in kernels/rope.py): the backward rotates the
gradients by the opposite angle; with QK-norm weights, the forward normalizes each head
first and the backward also reads q and k and writes the weights' gradients."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost, TensorSpec, reading_inputs

# Per element of q and k: x*x summed, times rstd, times the weight.
NORM_FLOPS = 4
# Per element backward: x*x summed, x_hat, g*w, g*w*x_hat summed, (g*w - x_hat*mean)*rstd,
# and g*x_hat added into the weight's gradient.
NORM_BACKWARD_FLOPS = 11


def _rotated(q: TensorSpec, k: TensorSpec, cos: TensorSpec) -> int:
    return (q.numel + k.numel) * min(cos.shape[-1], q.shape[-1]) // q.shape[-1]


def _fits(q, k, cos) -> bool:
    return q is not None and k is not None and cos is not None and bool(q.shape) and bool(q.shape[-1]) \
        and bool(cos.shape)


def rotation(arguments: Arguments) -> Optional[OpCost]:
    # -> (q_out like q, k_out like k)
    q, k, cos = arguments.q, arguments.k, arguments.cos
    if not _fits(q, k, cos):
        return None
    norm = 0 if arguments.q_norm_weight is None else NORM_FLOPS * (q.numel + k.numel)
    return reading_inputs(arguments, q.nbytes + k.nbytes, _rotated(q, k, cos) * 3 + norm,
                          "inputs read + outputs like q and k written; FLOPs: 3 per rotated element of q and k "
                          f"(two multiplies, one add; rotary_dim = cos.shape[-1]), with QK-norm weights {NORM_FLOPS} "
                          "more per element")


def rotation_backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dq, dk, and the norm weights' gradients: like the weights, or empty)
    dq, dk, cos = arguments.dq, arguments.dk, arguments.cos
    q_weight, k_weight = arguments.q_norm_weight, arguments.k_norm_weight
    if not _fits(dq, dk, cos):
        return None
    if q_weight is None or k_weight is None:
        return reading_inputs(arguments, dq.nbytes + dk.nbytes, _rotated(dq, dk, cos) * 3,
                              "inputs read + gradients like q and k written; FLOPs: 3 per rotated element")
    return reading_inputs(arguments, dq.nbytes + dk.nbytes + q_weight.nbytes + k_weight.nbytes,
                          _rotated(dq, dk, cos) * 3 + NORM_BACKWARD_FLOPS * (dq.numel + dk.numel),
                          "inputs (q and k too) read + gradients of q, k and the norm weights written; FLOPs: 3 per "
                          f"rotated element, {NORM_BACKWARD_FLOPS} per element for the norm's backward")


COSTS = {"te_lab::rope": rotation, "te_lab::rope_backward": rotation_backward}
