"""te_lab::rms_norm and its backward (schemas in kernels/rms_norm.py)."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost, nbytes, reading_inputs


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> (y, h or empty, rstd)
    x = arguments.x
    if x is None:
        return None
    with_residual = arguments.residual is not None
    return reading_inputs(
        arguments, x.nbytes * (2 if with_residual else 1) + x.rows * x.stats_itemsize,
        x.numel * (4 + with_residual),
        "inputs read + y like x, h like x (with a residual), rstd per row (float32, float64 for float64) "
        "written; FLOPs: 4 per element of x (square, mean, scale by rstd, by weight), +1 with a residual")


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dx, dw or empty)
    h = arguments.h
    if h is None:
        return None
    return reading_inputs(
        arguments, h.nbytes + nbytes(arguments.weight), h.numel * (8 + (arguments.dh is not None)),
        "inputs read + dx like h, dw like weight (assumed needed when a weight is given) written; FLOPs: 8 per "
        "element of h (x_hat, dy*w, the row dot product, dx, dw's product and sum), +1 with a residual gradient")


COSTS = {"te_lab::rms_norm": forward, "te_lab::rms_norm_backward": backward}
