"""te_lab::moe and its backward (schemas in kernels/moe.py): the experts' grouped GEMMs
counted by the GEMM rule of :mod:`.model`, over the tokens x top-k rows the routing sends."""

from __future__ import annotations

from typing import Optional

from .model import GEMM_FORMULA, Arguments, OpCost, TensorSpec, gemm_flops, nbytes, reading_inputs


def _sizes(x: TensorSpec, indices: TensorSpec, gate_up: TensorSpec, down: TensorSpec) -> Optional[tuple]:
    """(rows R = tokens x top_k, hidden H, expert width I), or None when the shapes do not fit."""
    if len(x.shape) != 2 or len(gate_up.shape) != 3 or len(down.shape) != 3:
        return None
    hidden = x.shape[1]
    width = down.shape[2] if down.shape[1] == hidden else down.shape[1]
    return indices.numel, hidden, width


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> (out like x, h [R, 2I], y [R, H])
    x, indices, gate_up, down = arguments.x, arguments.indices, arguments.gate_up, arguments.down
    if x is None or indices is None or gate_up is None or down is None or _sizes(x, indices, gate_up, down) is None:
        return None
    rows, hidden, width = _sizes(x, indices, gate_up, down)
    written = x.nbytes + rows * (2 * width + hidden) * x.itemsize
    flops = gemm_flops(rows, 2 * width, hidden) + gemm_flops(rows, hidden, width) + rows * (5 * width + 2 * hidden)
    return reading_inputs(arguments, written, flops,
                          f"inputs read (every expert's weights once) + out like x, h [R, 2I] and y [R, H] written "
                          f"(R = tokens x top_k); the two grouped products x @ gate_up^T and a @ down^T, "
                          f"{GEMM_FORMULA}, + 5 FLOPs per activation output and 2 per weighted output element")


def backward(arguments: Arguments) -> Optional[OpCost]:
    # -> (dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias)
    x, weights, indices = arguments.x, arguments.weights, arguments.indices
    gate_up, down = arguments.gate_up, arguments.down
    if None in (x, weights, indices, gate_up, down) or _sizes(x, indices, gate_up, down) is None:
        return None
    rows, hidden, width = _sizes(x, indices, gate_up, down)
    written = (x.nbytes + weights.nbytes + gate_up.nbytes + down.nbytes + nbytes(arguments.gate_up_bias)
               + nbytes(arguments.down_bias))
    flops = (2 * (gemm_flops(rows, 2 * width, hidden) + gemm_flops(rows, hidden, width))
             + rows * (10 * width + 4 * hidden))
    return reading_inputs(arguments, written, flops,
                          f"inputs read + dx, dweights, dgate_up, ddown (and bias gradients) like their inputs "
                          f"written; four grouped products (the inputs' and the weights' gradients of both "
                          f"projections), {GEMM_FORMULA}, + 10 FLOPs per activation element and 4 per element of "
                          f"the weighted rows (weights' gradient and scaling)")


COSTS = {"te_lab::moe": forward, "te_lab::moe_backward": backward}
