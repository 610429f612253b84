"""te_lab::rope and its backward (schemas in kernels/rope.py): the same arguments and cost
both ways (the backward rotates the gradients by the opposite angle)."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost, at, reading_inputs


def rotation(arguments: Arguments) -> Optional[OpCost]:
    # (q, k, cos, sin, interleaved, layout, backend) -> (q_out like q, k_out like k)
    q, k, cos = at(arguments, 0), at(arguments, 1), at(arguments, 2)
    if q is None or k is None or cos is None or not q.shape or not q.shape[-1] or not cos.shape:
        return None
    rotated = (q.numel + k.numel) * min(cos.shape[-1], q.shape[-1]) // q.shape[-1]
    return reading_inputs(arguments, q.nbytes + k.nbytes, rotated * 3,
                          "inputs read + outputs like q and k written; FLOPs: 3 per rotated element of q and k "
                          "(two multiplies, one add; rotary_dim = cos.shape[-1])")


COSTS = {"te_lab::rope": rotation, "te_lab::rope_backward": rotation}
