"""te_lab::linear and its backward (schemas in kernels/linear.py): the same products ATen's
mm / addmm compute, counted by the same rule (:mod:`.model`)."""

from __future__ import annotations

from typing import Optional

from .model import GEMM_FORMULA, Arguments, OpCost, TensorSpec, gemm_flops, reading_inputs


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> y [..., out_features]
    x, weight = arguments.x, arguments.weight
    if x is None or weight is None or len(weight.shape) != 2 or not x.shape or x.shape[-1] != weight.shape[1]:
        return None
    out_features, in_features = weight.shape
    y = TensorSpec((*x.shape[:-1], out_features), x.itemsize)
    return reading_inputs(arguments, y.nbytes, gemm_flops(x.rows, out_features, in_features),
                          f"inputs read + y [..., out_features] written; x @ weight^T, {GEMM_FORMULA} (the bias add "
                          "not counted, as for aten::addmm)")


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dx, dweight, dbias)
    dy, x, weight = arguments.dy, arguments.x, arguments.weight
    if dy is None or x is None or weight is None or len(weight.shape) != 2 or not x.shape:
        return None
    out_features, in_features = weight.shape
    return reading_inputs(arguments, x.nbytes + weight.nbytes, 2 * gemm_flops(x.rows, out_features, in_features),
                          f"inputs read + dx like x and dweight like weight written (both assumed needed: the "
                          f"training case; dbias, a row sum, not counted); two products dy @ weight and dy^T @ x, "
                          f"{GEMM_FORMULA}")


COSTS = {"te_lab::linear": forward, "te_lab::linear_backward": backward}
