"""Bytes moved and FLOPs of one profiled op, estimated from what torch.profiler records.

With ``record_shapes=True`` the profiler gives each op event its name, the shape and the
dtype string of every argument (``[]`` and ``""`` or ``"Scalar"`` for non-tensors), and, for
a few ops (matmuls, some elementwise ops) with ``with_flops=True``, a FLOP count. It does
not record outputs, so what an op writes is estimated per op from its inputs: te_lab's
ops from their schemas (``kernels/*.py``), matmuls from their shapes, reductions as small,
everything else as one output the size of its largest input. Every :class:`OpCost`
carries the formula it came from, so a report can say how each figure was obtained.

Arguments the profiler shows only as ``"Scalar"`` (``causal``, ``need_dw``, the
activation's name...) are invisible here; where they change the cost the formula says
which case was assumed (the training case: gradients needed, non-causal FLOPs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

BYTES_FORMULA = (
    "bytes an op must move: every tensor input read once + every output written once, "
    "from shapes and dtypes (outputs are not recorded by the profiler: estimated per op, "
    "see each op's formula)")

_ELEMENT_SIZES = {
    "bool": 1, "signed char": 1, "unsigned char": 1, "c10::quint8": 1, "c10::qint8": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1, "c10::Float8_e8m0fnu": 1, "c10::Float4_e2m1fn_x2": 1,
    "short int": 2, "short unsigned int": 2, "c10::Half": 2, "c10::BFloat16": 2,
    "int": 4, "unsigned int": 4, "float": 4, "c10::qint32": 4, "c10::complex<c10::Half>": 4,
    "long int": 8, "long unsigned int": 8, "double": 8, "c10::complex<float>": 8,
    "c10::complex<double>": 16,
}

# Copies and views: they move data (or nothing) but compute nothing.
_DATA_MOVEMENT_OPS = frozenset({
    "aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous", "aten::cat",
    "aten::stack", "aten::index_select", "aten::gather", "aten::scatter", "aten::index",
    "aten::index_put_", "aten::repeat", "aten::repeat_interleave", "aten::fill_", "aten::zero_",
    "aten::zeros", "aten::zeros_like", "aten::ones", "aten::ones_like", "aten::full",
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
    "aten::slice", "aten::select", "aten::narrow", "aten::split", "aten::chunk", "aten::unbind",
    "aten::detach", "aten::alias", "aten::empty", "aten::empty_like", "aten::empty_strided",
})
_REDUCTION_OPS = frozenset({"aten::sum", "aten::mean"})


@dataclass(frozen=True)
class OpCost:
    """What one op moves and computes; estimates, with the ``formula`` they came from."""

    bytes_read: int
    bytes_written: int
    flops: int
    formula: str

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


def element_size(dtype: str) -> Optional[int]:
    """Bytes per element of a profiler dtype string (``"float"``, ``"c10::BFloat16"``...);
    None for non-tensor arguments (``""``, ``"Scalar"``, ``"ScalarList"``) and unknown names."""
    return _ELEMENT_SIZES.get(dtype)


@dataclass(frozen=True)
class _Tensor:
    shape: tuple
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ELEMENT_SIZES[self.dtype]

    @property
    def rows(self) -> int:
        """Elements over the last dim: the number of rows a row-wise kernel walks."""
        return self.numel // self.shape[-1] if self.shape and self.shape[-1] else 0


@dataclass(frozen=True)
class _Estimate:
    """An op's estimated outputs and FLOPs, with how they were estimated; ``bytes_read``
    None means every tensor input is read once."""

    bytes_written: int
    flops: int
    formula: str
    bytes_read: Optional[int] = None


def _tensor_arguments(shapes, dtypes) -> list:
    """One entry per argument, by position: a _Tensor, or None for a non-tensor. A 0-dim
    tensor is recorded as shape ``[]`` like a non-tensor, but with a real dtype (also for a
    Python number wrapped as a tensor): one element."""
    arguments = []
    for shape, dtype in zip(shapes or (), dtypes or ()):
        valid = element_size(dtype) is not None and isinstance(shape, (list, tuple)) \
            and all(isinstance(size, int) and size >= 0 for size in shape)
        arguments.append(_Tensor(tuple(shape), dtype) if valid else None)
    return arguments


def _at(arguments: list, index: int) -> Optional[_Tensor]:
    return arguments[index] if index < len(arguments) else None


def _nbytes(tensor: Optional[_Tensor]) -> int:
    return 0 if tensor is None else tensor.nbytes


def _stats_bytes(x: _Tensor, per_row: int) -> int:
    """Per-row float statistics (rstd, mean, lse, losses): float64 for float64, else float32."""
    return x.rows * per_row * (8 if x.dtype == "double" else 4)


# ---- the default rule and the aten families ----

def _largest_input(name: str, arguments: list) -> _Estimate:
    tensors = [t for t in arguments if t is not None]
    largest = max(tensors, key=lambda t: t.nbytes, default=None)
    written = _nbytes(largest)
    if name in _DATA_MOVEMENT_OPS:
        flops, counted = 0, "0 FLOPs (data movement)"
    elif name.startswith("aten::"):
        flops, counted = (0 if largest is None else largest.numel), "FLOPs: 1 per output element"
    else:
        flops, counted = 0, "FLOPs not estimated (unknown op)"
    return _Estimate(written, flops, "inputs read + output written (output assumed the size of the "
                     f"largest input); {counted}")


def _reduction(arguments: list) -> _Estimate:
    x = _at(arguments, 0)
    return _Estimate(0, 0 if x is None else x.numel,
                     "inputs read; output not counted (the reduced dims are not recorded, and the "
                     "reduced output is small next to the input); FLOPs: 1 per input element")


def _matmul_output(a: _Tensor, b: _Tensor) -> Optional[tuple[tuple, int]]:
    """(output shape, contracted size k) of ``a [..., m, k] @ b [..., k, n]`` with broadcast
    batch dims; None if the shapes do not fit."""
    if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != b.shape[-2]:
        return None
    batch_a, batch_b = a.shape[:-2], b.shape[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a, batch_b = (1,) * (width - len(batch_a)) + batch_a, (1,) * (width - len(batch_b)) + batch_b
    if any(p != q and 1 not in (p, q) for p, q in zip(batch_a, batch_b)):
        return None
    batch = tuple(max(p, q) for p, q in zip(batch_a, batch_b))
    return batch + (a.shape[-2], b.shape[-1]), a.shape[-1]


def _matmul(first_operand: int) -> Callable[[list], Optional[_Estimate]]:
    """aten::mm / bmm (a, b) and addmm / baddbmm (bias, a, b): the product's shape."""
    def estimate(arguments: list) -> Optional[_Estimate]:
        a, b = _at(arguments, first_operand), _at(arguments, first_operand + 1)
        fitted = None if a is None or b is None else _matmul_output(a, b)
        if fitted is None:
            return None
        shape, k = fitted
        out = _Tensor(shape, a.dtype)
        return _Estimate(out.nbytes, 2 * out.numel * k,
                         "inputs read + product written ([..., m, k] @ [..., k, n] -> [..., m, n], "
                         "in the operands' dtype); FLOPs: 2*m*n*k per batch")
    return estimate


def _copy(arguments: list) -> Optional[_Estimate]:
    # copy_(self, src): self is only written; the default rule would count it as read too.
    dst, src = _at(arguments, 0), _at(arguments, 1)
    if dst is None or src is None:
        return None
    return _Estimate(dst.nbytes, 0, "src read + self written (self is not read); 0 FLOPs (data movement)",
                     bytes_read=src.nbytes)


# ---- te_lab's ops: positions and outputs from their custom-op schemas in kernels/ ----

def _rms_norm(arguments: list) -> Optional[_Estimate]:
    # (x, residual, weight, eps, weight_offset, backend) -> (y, h or empty, rstd)
    x, residual = _at(arguments, 0), _at(arguments, 1)
    if x is None:
        return None
    with_residual = residual is not None
    return _Estimate(
        x.nbytes * (2 if with_residual else 1) + _stats_bytes(x, 1),
        x.numel * (4 + with_residual),
        "inputs read + y like x, h like x (with a residual), rstd per row (float32, float64 for "
        "float64) written; FLOPs: 4 per element of x (square, sum, scale by rstd, by weight), "
        "+1 with a residual")


def _rms_norm_backward(arguments: list) -> Optional[_Estimate]:
    # (dy, dh, h, weight, rstd, weight_offset, need_dw, backend) -> (dx, dw or empty)
    h, weight = _at(arguments, 2), _at(arguments, 3)
    if h is None:
        return None
    return _Estimate(
        h.nbytes + _nbytes(weight), h.numel * (8 + (_at(arguments, 1) is not None)),
        "inputs read + dx like h, dw like weight (assumed needed when a weight is given) "
        "written; FLOPs: 8 per element of h (x_hat, dy*w, the row dot product, dx, dw's "
        "product and sum), +1 with a residual gradient")


def _layer_norm(arguments: list) -> Optional[_Estimate]:
    # (x, residual, weight, bias, eps, backend) -> (y, h or empty, mean, rstd)
    x, residual = _at(arguments, 0), _at(arguments, 1)
    if x is None:
        return None
    with_residual = residual is not None
    return _Estimate(
        x.nbytes * (2 if with_residual else 1) + _stats_bytes(x, 2),
        x.numel * (7 + with_residual),
        "inputs read + y like x, h like x (with a residual), mean and rstd per row (float32, "
        "float64 for float64) written; FLOPs: 7 per element of x (sum, centre, square, sum, "
        "scale by rstd, by weight, add bias), +1 with a residual")


def _layer_norm_backward(arguments: list) -> Optional[_Estimate]:
    # (dy, dh, h, weight, bias, mean, rstd, need_dw, need_db, backend) -> (dx, dw, db)
    h = _at(arguments, 2)
    if h is None:
        return None
    return _Estimate(
        h.nbytes + _nbytes(_at(arguments, 3)) + _nbytes(_at(arguments, 4)),
        h.numel * (11 + (_at(arguments, 1) is not None)),
        "inputs read + dx like h, dweight like weight, dbias like bias (assumed needed when "
        "given) written; FLOPs: 11 per element of h (x_hat, dy*w, two row means, dx, dw's "
        "product and sum, db's sum), +1 with a residual gradient")


def _glu(arguments: list) -> Optional[_Estimate]:
    # (gate, up, activation, backend) -> y like gate, or half of a concatenated gate-up
    gate, up = _at(arguments, 0), _at(arguments, 1)
    if gate is None:
        return None
    out_numel = gate.numel if up is not None else gate.numel // 2
    return _Estimate(out_numel * _ELEMENT_SIZES[gate.dtype], out_numel * 5,
                     "inputs read + y like gate (half of a concatenated gate-up) written; FLOPs: 5 "
                     "per output element (the activation ~4, the gating multiply 1)")


def _glu_backward(arguments: list) -> Optional[_Estimate]:
    # (dy, gate, up, activation, backend) -> (dgate like gate, dup like up or empty)
    dy, gate, up = _at(arguments, 0), _at(arguments, 1), _at(arguments, 2)
    if dy is None or gate is None:
        return None
    return _Estimate(gate.nbytes + _nbytes(up), dy.numel * 10,
                     "inputs read + dgate like gate, dup like up written (one gradient like a "
                     "concatenated gate-up); FLOPs: 10 per element of dy (activation and its "
                     "derivative ~7, three multiplies)")


def _bias_act(arguments: list) -> Optional[_Estimate]:
    # (x, bias, activation, backend) -> y like x
    x = _at(arguments, 0)
    if x is None:
        return None
    return _Estimate(x.nbytes, x.numel * 5,
                     "inputs read + y like x written; FLOPs: 5 per element (bias add, activation ~4)")


def _bias_act_backward(arguments: list) -> Optional[_Estimate]:
    # (dy, x, bias, activation, need_dbias, backend) -> (dx like x, dbias like bias or empty)
    x, bias = _at(arguments, 1), _at(arguments, 2)
    if x is None:
        return None
    return _Estimate(x.nbytes + _nbytes(bias), x.numel * 8,
                     "inputs read + dx like x, dbias like bias (assumed needed when a bias is "
                     "given) written; FLOPs: 8 per element (bias add, derivative ~5, multiply, "
                     "dbias sum)")


def _rope(arguments: list) -> Optional[_Estimate]:
    # (q, k, cos, sin, interleaved, layout, backend) -> (q_out like q, k_out like k); the
    # backward op has the same arguments with dq, dk and the same cost.
    q, k, cos = _at(arguments, 0), _at(arguments, 1), _at(arguments, 2)
    if q is None or k is None or cos is None or not q.shape or not q.shape[-1] or not cos.shape:
        return None
    rotated = (q.numel + k.numel) * min(cos.shape[-1], q.shape[-1]) // q.shape[-1]
    return _Estimate(q.nbytes + k.nbytes, rotated * 3,
                     "inputs read + outputs like q and k written; FLOPs: 3 per rotated element "
                     "of q and k (two multiplies, one add; rotary_dim = cos.shape[-1])")


def _attention_flops(q: _Tensor, k: _Tensor) -> Optional[int]:
    """4*b*h*s_q*s_k*d: the two matmuls q@k^T and p@v of q [b, h, s_q, d], k [b, h_kv, s_k, d]."""
    if len(q.shape) != 4 or len(k.shape) != 4:
        return None
    batch, heads, seq_q, head_dim = q.shape
    return 4 * batch * heads * seq_q * k.shape[2] * head_dim


def _attention(arguments: list) -> Optional[_Estimate]:
    # (q, k, v, mask, causal, scale, backend) -> (out like q, lse [b, h, s_q] float32/64)
    q, k = _at(arguments, 0), _at(arguments, 1)
    flops = None if q is None or k is None else _attention_flops(q, k)
    if flops is None:
        return None
    return _Estimate(q.nbytes + _stats_bytes(q, 1), flops,
                     "inputs read + out like q, log-sum-exp per query row (float32, float64 for "
                     "float64) written; FLOPs: 4*b*h*s_q*s_k*d (q@k^T and p@v; causal does about "
                     "half, but causal is not recorded)")


def _attention_backward(arguments: list) -> Optional[_Estimate]:
    # (dout, q, k, v, mask, out, lse, causal, scale, backend) -> (dq, dk, dv)
    q, k, v = _at(arguments, 1), _at(arguments, 2), _at(arguments, 3)
    flops = None if q is None or k is None or v is None else _attention_flops(q, k)
    if flops is None:
        return None
    return _Estimate(q.nbytes + k.nbytes + v.nbytes, flops * 5 // 2,
                     "inputs read + dq like q, dk like k, dv like v written; FLOPs: 2.5 x the "
                     "forward's 4*b*h*s_q*s_k*d (five matmuls: s recomputed, dv, dp, dq, dk; "
                     "non-causal)")


def _cross_entropy(arguments: list) -> Optional[_Estimate]:
    # (logits, labels, ignore_index, label_smoothing, z_loss, compute_grad, backend)
    #   -> (losses [tokens] float32/64, grad like logits or empty)
    logits = _at(arguments, 0)
    if logits is None:
        return None
    return _Estimate(_stats_bytes(logits, 1) + logits.nbytes, logits.numel * 8,
                     "inputs read + per-token losses (float32, float64 for float64) and the "
                     "gradient like logits (assumed computed: the training case) written; FLOPs: 8 "
                     "per logit (online max, subtract, exp, sum; then subtract, exp, scale, "
                     "subtract for the gradient)")


def _cross_entropy_backward(arguments: list) -> Optional[_Estimate]:
    # (grad_logits, dloss) -> grad_logits scaled per token
    grad = _at(arguments, 0)
    if grad is None:
        return None
    return _Estimate(grad.nbytes, grad.numel,
                     "inputs read + a gradient like grad_logits written; FLOPs: 1 per element")


def _head_and_loss_flops(hidden: _Tensor, weight: _Tensor) -> int:
    """Three matmuls (logits, grad_hidden, grad_weight) of 2*tokens*in*vocab each, plus the
    cross-entropy's 8 per logit."""
    tokens, vocab = hidden.rows, weight.shape[0] if weight.shape else 0
    return 6 * hidden.numel * vocab + 8 * tokens * vocab


_HEAD_AND_LOSS_FORMULA = ("FLOPs: 6*tokens*in*vocab (the logits, grad_hidden and grad_weight "
                          "matmuls) + 8 per logit (cross-entropy)")


def _fused_linear_cross_entropy(arguments: list) -> Optional[_Estimate]:
    # (hidden, weight, bias, labels, ...) -> (loss, grad_hidden like hidden,
    #   grad_weight like weight and grad_bias like bias in float32/64)
    hidden, weight, bias = _at(arguments, 0), _at(arguments, 1), _at(arguments, 2)
    if hidden is None or weight is None:
        return None
    compute_size = 8 if hidden.dtype == "double" else 4
    gradients = hidden.nbytes + (weight.numel + (0 if bias is None else bias.numel)) * compute_size
    return _Estimate(_stats_bytes(hidden, 1) + gradients, _head_and_loss_flops(hidden, weight),
                     "inputs read + per-token losses, grad_hidden like hidden, grad_weight and "
                     "grad_bias like weight and bias in float32 (float64 for float64) written "
                     "(assumed: a summed loss with every gradient needed, the training case; the "
                     f"logits are chunked and never written); {_HEAD_AND_LOSS_FORMULA}")


def _fused_linear_cross_entropy_backward(arguments: list) -> Optional[_Estimate]:
    # (dloss, grad_hidden, grad_weight, grad_bias, hidden, weight, bias, labels, ...):
    # a 0-d dloss scales the stored gradients; a per-token dloss runs the chunks again.
    dloss = _at(arguments, 0)
    if dloss is None:
        return None
    if not dloss.shape:
        stored = [t for t in arguments[1:4] if t is not None]
        return _Estimate(sum(t.nbytes for t in stored), sum(t.numel for t in stored),
                         "inputs read + gradients like the stored ones written (their dtype "
                         "assumed; they take the inputs' dtype); FLOPs: 1 per gradient element")
    hidden, weight, bias = _at(arguments, 4), _at(arguments, 5), _at(arguments, 6)
    if hidden is None or weight is None:
        return None
    return _Estimate(hidden.nbytes + weight.nbytes + _nbytes(bias), _head_and_loss_flops(hidden, weight),
                     "inputs read + grad_hidden, grad_weight, grad_bias like hidden, weight, bias "
                     "written (per-token losses: the chunks run again); " + _HEAD_AND_LOSS_FORMULA)


_ESTIMATES: dict[str, Callable[[list], Optional[_Estimate]]] = {
    "aten::mm": _matmul(0), "aten::bmm": _matmul(0),
    "aten::addmm": _matmul(1), "aten::baddbmm": _matmul(1),
    "aten::copy_": _copy,
    **{name: _reduction for name in _REDUCTION_OPS},
    "te_lab::rms_norm": _rms_norm, "te_lab::rms_norm_backward": _rms_norm_backward,
    "te_lab::layer_norm": _layer_norm, "te_lab::layer_norm_backward": _layer_norm_backward,
    "te_lab::glu": _glu, "te_lab::glu_backward": _glu_backward,
    "te_lab::bias_act": _bias_act, "te_lab::bias_act_backward": _bias_act_backward,
    "te_lab::rope": _rope, "te_lab::rope_backward": _rope,
    "te_lab::attention": _attention, "te_lab::attention_backward": _attention_backward,
    "te_lab::cross_entropy": _cross_entropy, "te_lab::cross_entropy_backward": _cross_entropy_backward,
    "te_lab::fused_linear_cross_entropy": _fused_linear_cross_entropy,
    "te_lab::fused_linear_cross_entropy_backward": _fused_linear_cross_entropy_backward,
}


def has_rule(name: str) -> bool:
    """Whether ``name`` has a cost rule of its own (a GEMM, a copy, a reduction, te_lab's
    ops), so its cost is not the sum of the ops it calls."""
    return name in _ESTIMATES


def op_cost(name: str, shapes: list[list[int]], dtypes: list[str], profiler_flops: int = 0) -> OpCost:
    """Estimated bytes read and written and FLOPs of one op event, from its recorded name,
    input shapes and dtypes; ``profiler_flops`` (torch's count, where > 0) wins over ours.
    Unknown ops and inputs an op's rule cannot read fall back to the default rule."""
    arguments = _tensor_arguments(shapes, dtypes)
    estimate = _ESTIMATES.get(name)
    estimated = estimate(arguments) if estimate is not None else None
    if estimated is None:
        estimated = _largest_input(name, arguments)
    flops, formula = estimated.flops, estimated.formula
    if profiler_flops > 0:
        flops, formula = int(profiler_flops), f"{formula} (FLOPs: torch.profiler's count used instead)"
    bytes_read = estimated.bytes_read
    if bytes_read is None:
        bytes_read = sum(t.nbytes for t in arguments if t is not None)
    return OpCost(bytes_read, estimated.bytes_written, flops, formula)
