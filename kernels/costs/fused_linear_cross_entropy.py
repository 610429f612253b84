"""te_lab::fused_linear_cross_entropy, its backward and the in-place scaling of its stored
gradients (schemas in kernels/fused_linear_cross_entropy.py). Its three GEMMs are counted
as three ATen products of the same shapes would be (:mod:`.model`)."""

from __future__ import annotations

from typing import Optional

from .cross_entropy import SOFTCAP_NOTE
from .model import GEMM_FORMULA, Arguments, OpCost, TensorSpec, gemm_flops, nbytes, reading_inputs


def _head_and_loss_flops(hidden: TensorSpec, weight: TensorSpec) -> int:
    """The logits, grad_hidden and grad_weight products (2*tokens*in*vocab each), plus the
    cross-entropy's 8 per logit."""
    tokens, vocab = hidden.rows, weight.shape[0] if weight.shape else 0
    in_features = hidden.shape[-1] if hidden.shape else 0
    return 3 * gemm_flops(tokens, vocab, in_features) + 8 * tokens * vocab


_FORMULA = (f"FLOPs: three products (logits, grad_hidden, grad_weight), {GEMM_FORMULA}, + 8 per logit "
            f"(cross-entropy){SOFTCAP_NOTE}")


def forward(arguments: Arguments) -> Optional[OpCost]:
    # -> (loss, grad_hidden like hidden, grad_weight and grad_bias like weight and bias, in
    #   float32 (float64 for float64))
    hidden, weight, bias = arguments.hidden, arguments.weight, arguments.bias
    if hidden is None or weight is None:
        return None
    gradients = hidden.nbytes + (weight.numel + (0 if bias is None else bias.numel)) * hidden.stats_itemsize
    return reading_inputs(arguments, hidden.rows * hidden.stats_itemsize + gradients,
                          _head_and_loss_flops(hidden, weight),
                          "inputs read + per-token losses, grad_hidden like hidden, grad_weight and grad_bias like "
                          "weight and bias in float32 (float64 for float64) written (assumed: a summed loss with "
                          f"every gradient needed, the training case; the logits are chunked and never written); "
                          f"{_FORMULA}")


def backward(arguments: Arguments) -> Optional[OpCost]:
    # a 0-d dloss scales the stored gradients; a per-token dloss runs the chunks again.
    dloss = arguments.dloss
    if dloss is None:
        return None
    if not dloss.shape:
        return scale_stored(arguments)
    hidden, weight, bias = arguments.hidden, arguments.weight, arguments.bias
    if hidden is None or weight is None:
        return None
    return reading_inputs(arguments, hidden.nbytes + weight.nbytes + nbytes(bias), _head_and_loss_flops(hidden, weight),
                          "inputs read + grad_hidden, grad_weight, grad_bias like hidden, weight, bias written "
                          f"(per-token losses: the chunks run again); {_FORMULA}")


def scale_stored(arguments: Arguments) -> Optional[OpCost]:
    # each stored gradient times dloss
    stored = [t for t in (arguments.grad_hidden, arguments.grad_weight, arguments.grad_bias) if t is not None]
    return reading_inputs(arguments, sum(t.nbytes for t in stored), sum(t.numel for t in stored),
                          "inputs read + the stored gradients written (in place, or like them); FLOPs: 1 per "
                          "gradient element")


COSTS = {"te_lab::fused_linear_cross_entropy": forward, "te_lab::fused_linear_cross_entropy_backward": backward,
         "te_lab::fused_linear_cross_entropy_scale_": scale_stored}
