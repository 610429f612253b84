"""te_lab::bias_act and its backward (schemas in kernels/bias_act.py); the GEMM before it
is an ATen op, costed by :mod:`.aten`."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost, nbytes, reading_inputs


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> y like x
    x = arguments.x
    if x is None:
        return None
    return reading_inputs(arguments, x.nbytes, x.numel * 5,
                          "inputs read + y like x written; FLOPs: 5 per element (bias add, activation ~4)")


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dx like x, dbias like bias or empty)
    x, bias = arguments.x, arguments.bias
    if x is None:
        return None
    return reading_inputs(arguments, x.nbytes + nbytes(bias), x.numel * 8,
                          "inputs read + dx like x, dbias like bias (assumed needed when a bias is given) written; "
                          "FLOPs: 8 per element (bias add, derivative ~5, multiply, dbias sum)")


COSTS = {"te_lab::bias_act": forward, "te_lab::bias_act_backward": backward}
