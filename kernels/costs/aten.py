"""The costs of the ATen ops eager PyTorch runs, by the rules of :mod:`.model`, so the
eager side of a profile is counted like te_lab's ops: matrix products and attention by
their shapes, LayerNorm by te_lab's LayerNorm rule, copies and views as data movement,
everything else as one output the size of its largest input with one FLOP per output
element."""

from __future__ import annotations

from typing import Optional

from . import layer_norm
from .model import (
    ATTENTION_FORMULA,
    GEMM_FORMULA,
    Arguments,
    CostFunction,
    OpCost,
    TensorSpec,
    at,
    attention_flops,
    matmul_output,
    reading_inputs,
)

# Copies and views: they move data (or nothing) but compute nothing.
DATA_MOVEMENT_OPS = frozenset({
    "aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous", "aten::cat",
    "aten::stack", "aten::index_select", "aten::gather", "aten::scatter", "aten::index",
    "aten::index_put_", "aten::repeat", "aten::repeat_interleave", "aten::fill_", "aten::zero_",
    "aten::zeros", "aten::zeros_like", "aten::ones", "aten::ones_like", "aten::full",
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
    "aten::slice", "aten::select", "aten::narrow", "aten::split", "aten::chunk", "aten::unbind",
    "aten::detach", "aten::alias", "aten::empty", "aten::empty_like", "aten::empty_strided",
})
_REDUCTION_OPS = ("aten::sum", "aten::mean")
# Attention kernels behind F.scaled_dot_product_attention (CPU, CUDA/MUSA flash, memory-efficient, cuDNN).
_ATTENTION_KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
                      "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention")


def largest_input(name: str, arguments: list) -> OpCost:
    """The rule for every op without its own: output the size of the largest input."""
    tensors = [t for t in arguments if t is not None]
    largest = max(tensors, key=lambda t: t.nbytes, default=None)
    written = 0 if largest is None else largest.nbytes
    if name in DATA_MOVEMENT_OPS:
        flops, counted = 0, "0 FLOPs (data movement)"
    elif name.startswith("aten::"):
        flops, counted = (0 if largest is None else largest.numel), "FLOPs: 1 per output element"
    else:
        flops, counted = 0, "FLOPs not estimated (unknown op)"
    return reading_inputs(arguments, written, flops, "inputs read + output written (output assumed the size of "
                          f"the largest input); {counted}")


def _reduction(arguments: list) -> Optional[OpCost]:
    x = at(arguments, 0)
    return reading_inputs(arguments, 0, 0 if x is None else x.numel,
                          "inputs read; output not counted (the reduced dims are not recorded, and the reduced "
                          "output is small next to the input); FLOPs: 1 per input element")


def matmul_cost(a: Optional[TensorSpec], b: Optional[TensorSpec], arguments: list) -> Optional[OpCost]:
    """``a @ b``: the product written in a's dtype, every tensor of ``arguments`` read."""
    fitted = None if a is None or b is None else matmul_output(a, b)
    if fitted is None:
        return None
    shape, k = fitted
    out = TensorSpec(shape, a.itemsize)
    return reading_inputs(arguments, out.nbytes, 2 * out.numel * k,
                          f"inputs read + product written ([..., m, k] @ [..., k, n] -> [..., m, n]); {GEMM_FORMULA}")


def _matmul(first_operand: int) -> CostFunction:
    """aten::mm / bmm (a, b) and addmm / baddbmm (bias, a, b)."""
    return lambda arguments: matmul_cost(at(arguments, first_operand), at(arguments, first_operand + 1), arguments)


def _copy(arguments: list) -> Optional[OpCost]:
    # copy_(self, src): self is only written; the default rule would count it as read too.
    dst, src = at(arguments, 0), at(arguments, 1)
    if dst is None or src is None:
        return None
    return OpCost(src.nbytes, dst.nbytes, 0, "src read + self written (self is not read); 0 FLOPs (data movement)")


def attention_forward_cost(arguments: list, q: Optional[TensorSpec], k: Optional[TensorSpec]) -> Optional[OpCost]:
    """Whatever the argument order: out like q and a log-sum-exp per query row written."""
    flops = None if q is None or k is None else attention_flops(q, k)
    if flops is None:
        return None
    return reading_inputs(arguments, q.nbytes + q.rows * q.stats_itemsize, flops,
                          "inputs read + out like q, log-sum-exp per query row (float32, float64 for float64) "
                          f"written; {ATTENTION_FORMULA}")


def attention_backward_cost(arguments: list, q: Optional[TensorSpec], k: Optional[TensorSpec],
                            v: Optional[TensorSpec]) -> Optional[OpCost]:
    """Whatever the argument order: dq, dk, dv like q, k, v written."""
    flops = None if q is None or k is None or v is None else attention_flops(q, k)
    if flops is None:
        return None
    return reading_inputs(arguments, q.nbytes + k.nbytes + v.nbytes, flops * 5 // 2,
                          f"inputs read + dq like q, dk like k, dv like v written; {ATTENTION_FORMULA}")


def _aten_attention_forward(arguments: list) -> Optional[OpCost]:
    # ATen's attention kernels take (query, key, value, ...).
    return attention_forward_cost(arguments, at(arguments, 0), at(arguments, 1))


def _aten_attention_backward(arguments: list) -> Optional[OpCost]:
    # ATen's attention backward kernels take (grad_out, query, key, value, ...).
    return attention_backward_cost(arguments, at(arguments, 1), at(arguments, 2), at(arguments, 3))


def _native_layer_norm(arguments: list) -> Optional[OpCost]:
    # (input, normalized_shape, weight, bias, eps) -> (out, mean, rstd): te_lab::layer_norm's
    # outputs without a residual, so it is counted by te_lab's rule
    return layer_norm.forward(Arguments.named(x=at(arguments, 0), residual=None, weight=at(arguments, 2),
                                              bias=at(arguments, 3)))


def _native_layer_norm_backward(arguments: list) -> Optional[OpCost]:
    # (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask) -> (dx, dw, db)
    return layer_norm.backward(Arguments.named(dy=at(arguments, 0), dh=None, h=at(arguments, 1),
                                               weight=at(arguments, 5), bias=at(arguments, 6),
                                               mean=at(arguments, 3), rstd=at(arguments, 4)))


ATEN_COSTS: dict[str, CostFunction] = {
    "aten::native_layer_norm": _native_layer_norm, "aten::native_layer_norm_backward": _native_layer_norm_backward,
    "aten::mm": _matmul(0), "aten::bmm": _matmul(0),
    "aten::addmm": _matmul(1), "aten::baddbmm": _matmul(1),
    "aten::copy_": _copy,
    **{name: _reduction for name in _REDUCTION_OPS},
    **{name: _aten_attention_forward for name in _ATTENTION_KERNELS},
    **{f"{name}_backward": _aten_attention_backward for name in _ATTENTION_KERNELS},
}
