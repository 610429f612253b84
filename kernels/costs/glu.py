"""te_lab::glu and its backward (schemas in kernels/glu.py)."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost, nbytes, reading_inputs


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> y like gate, or half of a concatenated gate-up
    gate, up = arguments.gate, arguments.up
    if gate is None:
        return None
    out_numel = gate.numel if up is not None else gate.numel // 2
    return reading_inputs(arguments, out_numel * gate.itemsize, out_numel * 5,
                          "inputs read + y like gate (half of a concatenated gate-up) written; FLOPs: 5 per "
                          "output element (the activation ~4, the gating multiply 1)")


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dgate like gate, dup like up or empty)
    dy, gate, up = arguments.dy, arguments.gate, arguments.up
    if dy is None or gate is None:
        return None
    return reading_inputs(arguments, gate.nbytes + nbytes(up), dy.numel * 10,
                          "inputs read + dgate like gate, dup like up written (one gradient like a concatenated "
                          "gate-up); FLOPs: 10 per element of dy (activation and its derivative ~7, three "
                          "multiplies)")


COSTS = {"te_lab::glu": forward, "te_lab::glu_backward": backward}
