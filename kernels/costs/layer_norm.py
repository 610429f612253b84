"""te_lab::layer_norm and its backward (schemas in kernels/layer_norm.py)."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost, nbytes, reading_inputs


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> (y, h or empty, mean, rstd)
    x = arguments.x
    if x is None:
        return None
    with_residual = arguments.residual is not None
    return reading_inputs(
        arguments, x.nbytes * (2 if with_residual else 1) + 2 * x.rows * x.stats_itemsize,
        x.numel * (7 + with_residual),
        "inputs read + y like x, h like x (with a residual), mean and rstd per row (float32, float64 for "
        "float64) written; FLOPs: 7 per element of x (sum, centre, square, sum, scale by rstd, by weight, add "
        "bias), +1 with a residual")


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dx, dw, db)
    h = arguments.h
    if h is None:
        return None
    return reading_inputs(
        arguments, h.nbytes + nbytes(arguments.weight) + nbytes(arguments.bias),
        h.numel * (11 + (arguments.dh is not None)),
        "inputs read + dx like h, dweight like weight, dbias like bias (assumed needed when given) written; "
        "FLOPs: 11 per element of h (x_hat, dy*w, two row means, dx, dw's product and sum, db's sum), +1 with a "
        "residual gradient")


COSTS = {"te_lab::layer_norm": forward, "te_lab::layer_norm_backward": backward}
