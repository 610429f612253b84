"""Rotary position embedding, applied to q and k in one pass.

Over the first ``rotary_dim = cos.shape[-1]`` dims of every head (the rest pass
through unchanged, as in GPT-NeoX's partial rotary):

    out = x * cos + rotate(x) * sin

``rotate`` pairs up the rotary dims and turns each pair (a, b) into (-b, a). The pairs
are (i, i + rotary_dim/2) in the rotate-half layout (Llama, Mistral, Qwen:
``rotate_half(x) = cat(-x2, x1)``) and (2i, 2i + 1) with ``interleaved=True`` (GPT-J).
``cos`` and ``sin`` follow Hugging Face's convention, one value per rotary dim:
``cat(freqs, freqs).cos()`` for rotate-half, ``freqs.repeat_interleave(2).cos()`` for
interleaved. They are given per position, so position ids, scaling schemes and packed
sequences are the caller's business. Math runs in float32 (float64 for float64
inputs); outputs have q's and k's dtype.

The fused backends compute each pair (a, b) at dims (i, j) on its own:

    out_i = a * cos_i - b * sin_i        out_j = b * cos_j + a * sin_j

Backward is the transposed rotation: da = dout_i * cos_i + dout_j * sin_j and
db = dout_j * cos_j - dout_i * sin_i, the same formula with (sin_i, sin_j) replaced by
(-sin_j, -sin_i) (with HF's tables, where sin_i = sin_j, a rotation by -sin). The
backward therefore runs the forward's kernel (or compiled graph) once more, for q and
k together. cos and sin are treated as constants and receive no gradient.

QK-norm (Qwen3, Gemma 3): with ``q_norm_weight`` and ``k_norm_weight`` every head of q
and k is first RMS-normalized over its head_dim, in the same pass, and the rotation
applies to the result:

    y = x * rstd * (weight + weight_offset),  rstd = 1 / sqrt(mean(x**2) + eps)
    out = rotate(y)

``weight_offset=1.0`` is Gemma's ``(1 + weight)``. The backward rotates the gradient
back (g = dL/dy, as above), then runs RMSNorm's backward on the same row:
dx = rstd * (g * w - x_hat * mean(g * w * x_hat)) with x_hat = x * rstd and
w = weight + weight_offset, and dweight = the sum over every row (head and position)
of g * x_hat. q and k themselves, not the normalized rows, are kept for it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import Tensor

from te_lab import device as devices

from .checks import check_choice, check_parameter, check_positive, check_tensor
from .costs.rope import COSTS
from .inductor_compiled import inductor_compiled
from .measured_choice import op_sample
from .op_declaration import define_op, run_reference
from .precision import compute_dtype, triton_compute_dtype
from .registry import select_measured_backend
from .rms_norm import rms_norm_reference
from .triton_support import HAS_TRITON, num_warps_for, tl, triton

NAME = "rope"
LAYOUTS = ("bhsd", "bshd")
# Where the heads and the sequence sit in q and k, per layout.
_DIMS = {"bhsd": "[batch, heads, seq, head_dim]", "bshd": "[batch, seq, heads, head_dim]"}
_SEQ_DIM = {"bhsd": 2, "bshd": 1}
_HEAD_DIM = {"bhsd": 1, "bshd": 2}
_OTHER_LAYOUT = {"bhsd": "bshd", "bshd": "bhsd"}


def _broadcastable(table: Tensor, layout: str) -> Tensor:
    """``cos``/``sin`` of shape [seq, rotary_dim] or [batch, seq, rotary_dim] with a size-1
    heads dim inserted where ``layout`` has it (Hugging Face's ``unsqueeze_dim``)."""
    return table.unsqueeze(-3 if layout == "bhsd" else -2)


def rotate_pairs(x: Tensor, interleaved: bool) -> Tensor:
    """(a, b) -> (-b, a) for every rotary pair of the last dim: Hugging Face's
    ``rotate_half`` or, interleaved, GPT-J's ``rotate_every_two``."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, norm_weight: Optional[Tensor],
                      norm_eps: float, norm_weight_offset: float) -> Tensor:
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, norm_eps, weight_offset=norm_weight_offset)
    acc = compute_dtype(x)
    rotary_dim = cos.shape[-1]
    rotary = x[..., :rotary_dim].to(acc)
    rotated = rotary * cos.to(acc) + rotate_pairs(rotary, interleaved) * sin.to(acc)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *,
                           interleaved: bool = False, layout: str = "bhsd", q_norm_weight: Optional[Tensor] = None,
                           k_norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-6,
                           norm_weight_offset: float = 0.0):
    """The unfused PyTorch math (Hugging Face's ``apply_rotary_pos_emb``, in float32,
    after ``rms_norm_reference`` of each head where norm weights are given, rounded to
    q's dtype in between as the unfused norm's output is): the truth every backend is
    compared against.

    Unlike the fused backends it is plain autograd, so cos and sin get gradients
    here if they require them.
    """
    cos, sin = _broadcastable(cos, layout), _broadcastable(sin, layout)
    return (_rotate_reference(q, cos, sin, interleaved, q_norm_weight, norm_eps, norm_weight_offset),
            _rotate_reference(k, cos, sin, interleaved, k_norm_weight, norm_eps, norm_weight_offset))


def transposed_sin(sin: Tensor, interleaved: bool) -> Tensor:
    """The sin table that makes the forward formula compute the backward: each rotary
    pair's two entries swapped and negated (see the module doc)."""
    if interleaved:
        return -sin.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    first, second = sin.chunk(2, dim=-1)
    return -torch.cat((second, first), dim=-1)


# ---- the inductor backend: one compiled graph rotates q and k, forward and backward ----

def _pair_halves(t: Tensor, rotary_dim: int, interleaved: bool) -> tuple[Tensor, Tensor]:
    """The first and the second member of every rotary pair of ``t``'s last dim."""
    if interleaved:
        return t[..., 0:rotary_dim:2], t[..., 1:rotary_dim:2]
    half = rotary_dim // 2
    return t[..., :half], t[..., half:rotary_dim]


def _rotate_by_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, dtype: torch.dtype) -> Tensor:
    # Inductor on the CPU lowers every cat to a buffer of its own; here the only cat
    # builds the output itself, so each piece is written once, straight into it.
    # (HF's formula, compiled, materializes rotate_half(x) as a full-size temporary.)
    acc = compute_dtype(x)
    rotary_dim = cos.shape[-1]
    x_first, x_second = (half.to(acc) for half in _pair_halves(x, rotary_dim, interleaved))
    cos_first, cos_second = (half.to(acc) for half in _pair_halves(cos, rotary_dim, interleaved))
    sin_first, sin_second = (half.to(acc) for half in _pair_halves(sin, rotary_dim, interleaved))
    out_first = (x_first * cos_first - x_second * sin_first).to(dtype)
    out_second = (x_second * cos_second + x_first * sin_second).to(dtype)
    if interleaved:
        rotated = torch.stack((out_first, out_second), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((out_first, out_second), dim=-1)
    return torch.cat((rotated, x[..., rotary_dim:].to(dtype)), dim=-1)


def _normalized(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    """Each row of ``x`` RMS-normalized and scaled by ``weight + offset``, in the compute dtype."""
    xf = x.to(compute_dtype(x))
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.to(xf.dtype) + offset)


def _rotate_both(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, layout: str,
                 q_weight: Optional[Tensor], k_weight: Optional[Tensor], eps: float, offset: float):
    cos, sin = _broadcastable(cos, layout), _broadcastable(sin, layout)
    return tuple(_rotate_by_pairs(x if weight is None else _normalized(x, weight, eps, offset), cos, sin,
                                  interleaved, x.dtype)
                 for x, weight in ((q, q_weight), (k, k_weight)))


def _rotate_back_normalized(dq: Tensor, dk: Tensor, cos: Tensor, transposed: Tensor, interleaved: bool, layout: str,
                            q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, offset: float):
    """dq, dk and the two norm weights' gradients (see the module doc)."""
    cos, transposed = _broadcastable(cos, layout), _broadcastable(transposed, layout)
    grads = []
    for dout, x, weight in ((dq, q, q_weight), (dk, k, k_weight)):
        acc = compute_dtype(x)
        g = _rotate_by_pairs(dout, cos, transposed, interleaved, acc)
        xf = x.to(acc)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        x_hat = xf * rstd
        scaled = g * (weight.to(acc) + offset)
        dx = rstd * (scaled - x_hat * (scaled * x_hat).mean(-1, keepdim=True))
        grads.append((dx.to(x.dtype), (g * x_hat).flatten(0, -2).sum(0).to(weight.dtype)))
    (dq, dq_weight), (dk, dk_weight) = grads
    return dq, dk, dq_weight, dk_weight


# Layout, interleaving, the rank of cos/sin and whether norm weights come are part of the
# compiled copy's key (see kernels/inductor_compiled.py), so each combination has its own
# recompile budget.
_rotate_both_compiled = inductor_compiled(_rotate_both)
_rotate_back_normalized_compiled = inductor_compiled(_rotate_back_normalized)


def _no_weight_gradients(x: Tensor) -> tuple[Tensor, Tensor]:
    """What the backward returns for norm weights that were not given: two distinct empty tensors."""
    return x.new_empty(0), x.new_empty(0)


def _detached(*tensors):
    return tuple(None if t is None else t.detach() for t in tensors)


class _Inductor:
    @staticmethod
    def forward(q, k, cos, sin, interleaved, layout, q_weight, k_weight, eps, offset):
        # Detached so that forward (whose inputs require grad) and backward share a graph:
        # torch.compile guards on requires_grad.
        return _rotate_both_compiled(*_detached(q, k, cos, sin), interleaved, layout,
                                     *_detached(q_weight, k_weight), eps, offset)

    @staticmethod
    def backward(dq, dk, cos, sin, interleaved, layout, q, k, q_weight, k_weight, eps, offset):
        # Incoming gradients are usually dense already; an odd stride pattern (the
        # expanded gradient of a sum) is made contiguous rather than compiled for.
        transposed = transposed_sin(sin.detach(), interleaved)
        if q_weight is None:
            return (*_rotate_both_compiled(dq.contiguous(), dk.contiguous(), cos.detach(), transposed, interleaved,
                                           layout, None, None, eps, offset), *_no_weight_gradients(dq))
        return _rotate_back_normalized_compiled(dq.contiguous(), dk.contiguous(), cos.detach(), transposed,
                                                interleaved, layout, *_detached(q, k, q_weight, k_weight), eps, offset)


if HAS_TRITON:

    @triton.jit
    def _rotate(x_first, x_second, cos_first, cos_second, sin_first, sin_second):
        """A block of heads' pairs (x_first, x_second) rotated by their angles; the backward
        rotates back by passing the sin tables transposed."""
        return (x_first * cos_first[None, :] - x_second * sin_first[None, :],
                x_second * cos_second[None, :] + x_first * sin_second[None, :])

    @triton.jit
    def _head_block(head, n_heads, X, x_position, x_head_stride, OUT, out_position, out_head_stride, pair_mask):
        """A block of heads of one position: which exist, where they are read and written,
        and the mask of their rotated pairs."""
        head_mask = head < n_heads
        x_heads = X + x_position + head[:, None] * x_head_stride
        out_heads = OUT + out_position + head[:, None] * out_head_stride
        return head_mask, x_heads, out_heads, head_mask[:, None] & pair_mask[None, :]

    @triton.jit
    def _rotate_heads(X, OUT, x_position, out_position, n_heads, x_head_stride, out_head_stride,
                      rotary_dim, head_dim, first, second, pair_mask,
                      cos_first, cos_second, sin_first, sin_second,
                      HAS_PASS: tl.constexpr, ACC: tl.constexpr,
                      HEAD_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr):
        """Rotate every head of one (batch, seq) position, HEAD_BLOCK heads at a time."""
        # int64: head * head stride can pass 2**31 for long sequences in the "bhsd" layout
        heads = tl.arange(0, HEAD_BLOCK).to(tl.int64)
        pass_cols = rotary_dim + tl.arange(0, PASS_BLOCK)
        for head_start in range(0, n_heads, HEAD_BLOCK):
            head_mask, x_heads, out_heads, mask = _head_block(head_start + heads, n_heads, X, x_position, x_head_stride,
                                                              OUT, out_position, out_head_stride, pair_mask)
            x_first = tl.load(x_heads + first[None, :], mask=mask, other=0.0).to(ACC)
            x_second = tl.load(x_heads + second[None, :], mask=mask, other=0.0).to(ACC)
            out_first, out_second = _rotate(x_first, x_second, cos_first, cos_second, sin_first, sin_second)
            tl.store(out_heads + first[None, :], out_first.to(OUT.dtype.element_ty), mask=mask)
            tl.store(out_heads + second[None, :], out_second.to(OUT.dtype.element_ty), mask=mask)
            if HAS_PASS:
                pass_mask = head_mask[:, None] & (pass_cols < head_dim)[None, :]
                passed = tl.load(x_heads + pass_cols[None, :], mask=pass_mask, other=0.0)
                tl.store(out_heads + pass_cols[None, :], passed, mask=pass_mask)

    @triton.jit
    def _norm_weights(W, first, second, pair_mask, pass_cols, pass_col_mask, offset, ACC: tl.constexpr):
        """QK-norm's weight (plus ``offset``) at a head's rotated pairs and its pass-through
        columns, in ACC."""
        w_first = tl.load(W + first, mask=pair_mask, other=0.0).to(ACC) + offset
        w_second = tl.load(W + second, mask=pair_mask, other=0.0).to(ACC) + offset
        w_pass = tl.load(W + pass_cols, mask=pass_col_mask, other=0.0).to(ACC) + offset
        return w_first, w_second, w_pass

    @triton.jit
    def _load_heads_and_rstd(x_heads, first, second, pass_cols, mask, pass_mask, head_dim, eps,
                             ACC: tl.constexpr):
        """A block of heads of one position, in ACC (rotated pairs and pass-through columns),
        and each head's 1 / rms, RMSNorm's rstd over the whole head."""
        x_first = tl.load(x_heads + first[None, :], mask=mask, other=0.0).to(ACC)
        x_second = tl.load(x_heads + second[None, :], mask=mask, other=0.0).to(ACC)
        x_pass = tl.load(x_heads + pass_cols[None, :], mask=pass_mask, other=0.0).to(ACC)
        squares = tl.sum(x_first * x_first + x_second * x_second, axis=1) + tl.sum(x_pass * x_pass, axis=1)
        rstd = (1.0 / tl.sqrt(squares / head_dim + eps))[:, None]
        return x_first, x_second, x_pass, rstd

    @triton.jit
    def _normalize_rotate_heads(X, OUT, W, x_position, out_position, n_heads, x_head_stride, out_head_stride,
                                rotary_dim, head_dim, first, second, pair_mask,
                                cos_first, cos_second, sin_first, sin_second, eps, offset,
                                ACC: tl.constexpr, HEAD_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr):
        """RMSNorm over each head of one position, then its rotation (QK-norm). The
        pass-through columns are loaded masked whether or not there are any: their
        squares belong to the norm."""
        heads = tl.arange(0, HEAD_BLOCK).to(tl.int64)
        pass_cols = rotary_dim + tl.arange(0, PASS_BLOCK)
        pass_col_mask = pass_cols < head_dim
        w_first, w_second, w_pass = _norm_weights(W, first, second, pair_mask, pass_cols, pass_col_mask, offset, ACC)
        for head_start in range(0, n_heads, HEAD_BLOCK):
            head_mask, x_heads, out_heads, mask = _head_block(head_start + heads, n_heads, X, x_position, x_head_stride,
                                                              OUT, out_position, out_head_stride, pair_mask)
            pass_mask = head_mask[:, None] & pass_col_mask[None, :]
            x_first, x_second, x_pass, rstd = _load_heads_and_rstd(x_heads, first, second, pass_cols, mask, pass_mask,
                                                                   head_dim, eps, ACC)
            y_first = x_first * rstd * w_first[None, :]
            y_second = x_second * rstd * w_second[None, :]
            out_first, out_second = _rotate(y_first, y_second, cos_first, cos_second, sin_first, sin_second)
            tl.store(out_heads + first[None, :], out_first.to(OUT.dtype.element_ty), mask=mask)
            tl.store(out_heads + second[None, :], out_second.to(OUT.dtype.element_ty), mask=mask)
            y_pass = x_pass * rstd * w_pass[None, :]
            tl.store(out_heads + pass_cols[None, :], y_pass.to(OUT.dtype.element_ty), mask=pass_mask)

    @triton.jit
    def _rotate_back_normalized_heads(DOUT, X, DX, W, DW, dout_position, x_position, dx_position, dw_row, n_heads,
                                      dout_head_stride, x_head_stride, dx_head_stride, rotary_dim, head_dim,
                                      first, second, pair_mask, cos_first, cos_second, sin_first, sin_second,
                                      eps, offset, ACC: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                                      PASS_BLOCK: tl.constexpr):
        """The backward of :func:`_normalize_rotate_heads` for one position (sin tables
        transposed by the caller): the rotated-back gradient g, RMSNorm's backward from
        the saved input, and this position's row of the weight's gradient (its heads'
        sum of g * x_hat) into DW."""
        heads = tl.arange(0, HEAD_BLOCK).to(tl.int64)
        pass_cols = rotary_dim + tl.arange(0, PASS_BLOCK)
        pass_col_mask = pass_cols < head_dim
        w_first, w_second, w_pass = _norm_weights(W, first, second, pair_mask, pass_cols, pass_col_mask, offset, ACC)
        dw_first = w_first * 0.0
        dw_second = w_second * 0.0
        dw_pass = w_pass * 0.0
        for head_start in range(0, n_heads, HEAD_BLOCK):
            head = head_start + heads
            head_mask = head < n_heads
            dout_heads = DOUT + dout_position + head[:, None] * dout_head_stride
            x_heads = X + x_position + head[:, None] * x_head_stride
            dx_heads = DX + dx_position + head[:, None] * dx_head_stride
            mask = head_mask[:, None] & pair_mask[None, :]
            pass_mask = head_mask[:, None] & pass_col_mask[None, :]
            d_first = tl.load(dout_heads + first[None, :], mask=mask, other=0.0).to(ACC)
            d_second = tl.load(dout_heads + second[None, :], mask=mask, other=0.0).to(ACC)
            g_first, g_second = _rotate(d_first, d_second, cos_first, cos_second, sin_first, sin_second)
            g_pass = tl.load(dout_heads + pass_cols[None, :], mask=pass_mask, other=0.0).to(ACC)
            x_first, x_second, x_pass, rstd = _load_heads_and_rstd(x_heads, first, second, pass_cols, mask, pass_mask,
                                                                   head_dim, eps, ACC)
            xh_first = x_first * rstd
            xh_second = x_second * rstd
            xh_pass = x_pass * rstd
            gw_first = g_first * w_first[None, :]
            gw_second = g_second * w_second[None, :]
            gw_pass = g_pass * w_pass[None, :]
            mean = (tl.sum(gw_first * xh_first + gw_second * xh_second, axis=1)
                    + tl.sum(gw_pass * xh_pass, axis=1))[:, None] / head_dim
            dx_first = (gw_first - xh_first * mean) * rstd
            dx_second = (gw_second - xh_second * mean) * rstd
            dx_pass = (gw_pass - xh_pass * mean) * rstd
            tl.store(dx_heads + first[None, :], dx_first.to(DX.dtype.element_ty), mask=mask)
            tl.store(dx_heads + second[None, :], dx_second.to(DX.dtype.element_ty), mask=mask)
            tl.store(dx_heads + pass_cols[None, :], dx_pass.to(DX.dtype.element_ty), mask=pass_mask)
            dw_first += tl.sum(g_first * xh_first, axis=0)
            dw_second += tl.sum(g_second * xh_second, axis=0)
            dw_pass += tl.sum(g_pass * xh_pass, axis=0)
        tl.store(DW + dw_row + first, dw_first, mask=pair_mask)
        tl.store(DW + dw_row + second, dw_second, mask=pair_mask)
        tl.store(DW + dw_row + pass_cols, dw_pass, mask=pass_col_mask)

    @triton.jit
    def _rope_kernel(Q, K, COS, SIN, Q_OUT, K_OUT, Q_IN, K_IN, QW, KW, DQW, DKW,
                     seq_len, heads_q, heads_k, head_dim, rotary_dim,
                     q_batch_stride, q_seq_stride, q_head_stride,
                     k_batch_stride, k_seq_stride, k_head_stride,
                     q_out_batch_stride, q_out_seq_stride, q_out_head_stride,
                     k_out_batch_stride, k_out_seq_stride, k_out_head_stride,
                     q_in_batch_stride, q_in_seq_stride, q_in_head_stride,
                     k_in_batch_stride, k_in_seq_stride, k_in_head_stride,
                     table_batch_stride, table_seq_stride, eps, offset,
                     INTERLEAVED: tl.constexpr, TRANSPOSE: tl.constexpr, NORM: tl.constexpr,
                     HAS_PASS: tl.constexpr, ACC: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                     HEAD_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr):
        """One program per (batch, seq) position: cos/sin are loaded once, then every head
        of q and of k is rotated. TRANSPOSE runs the backward: each pair's sin entries
        swapped and negated (see the module doc). NORM adds QK-norm: forward, Q and K are
        normalized with QW and KW before the rotation; backward (Q and K the outputs'
        gradients, Q_IN and K_IN the saved inputs), the norm's backward follows and each
        position's rows of the weights' gradients go to DQW and DKW ([positions, head_dim]).
        Without NORM, Q_IN ... DKW and their strides are not read."""
        position = tl.program_id(0).to(tl.int64)
        batch = position // seq_len
        seq = position % seq_len
        pairs = tl.arange(0, PAIR_BLOCK)
        pair_mask = pairs < rotary_dim // 2
        if INTERLEAVED:
            first = 2 * pairs
            second = first + 1
        else:
            first = pairs
            second = pairs + rotary_dim // 2
        table = batch * table_batch_stride + seq * table_seq_stride
        cos_first = tl.load(COS + table + first, mask=pair_mask, other=0.0).to(ACC)
        cos_second = tl.load(COS + table + second, mask=pair_mask, other=0.0).to(ACC)
        if TRANSPOSE:
            sin_first = -tl.load(SIN + table + second, mask=pair_mask, other=0.0).to(ACC)
            sin_second = -tl.load(SIN + table + first, mask=pair_mask, other=0.0).to(ACC)
        else:
            sin_first = tl.load(SIN + table + first, mask=pair_mask, other=0.0).to(ACC)
            sin_second = tl.load(SIN + table + second, mask=pair_mask, other=0.0).to(ACC)
        q_position = batch * q_batch_stride + seq * q_seq_stride
        k_position = batch * k_batch_stride + seq * k_seq_stride
        q_out_position = batch * q_out_batch_stride + seq * q_out_seq_stride
        k_out_position = batch * k_out_batch_stride + seq * k_out_seq_stride
        if NORM:
            if TRANSPOSE:
                q_in_position = batch * q_in_batch_stride + seq * q_in_seq_stride
                k_in_position = batch * k_in_batch_stride + seq * k_in_seq_stride
                _rotate_back_normalized_heads(Q, Q_IN, Q_OUT, QW, DQW, q_position, q_in_position, q_out_position,
                                              position * head_dim, heads_q, q_head_stride, q_in_head_stride,
                                              q_out_head_stride, rotary_dim, head_dim, first, second, pair_mask,
                                              cos_first, cos_second, sin_first, sin_second, eps, offset,
                                              ACC, HEAD_BLOCK, PASS_BLOCK)
                _rotate_back_normalized_heads(K, K_IN, K_OUT, KW, DKW, k_position, k_in_position, k_out_position,
                                              position * head_dim, heads_k, k_head_stride, k_in_head_stride,
                                              k_out_head_stride, rotary_dim, head_dim, first, second, pair_mask,
                                              cos_first, cos_second, sin_first, sin_second, eps, offset,
                                              ACC, HEAD_BLOCK, PASS_BLOCK)
            else:
                _normalize_rotate_heads(Q, Q_OUT, QW, q_position, q_out_position, heads_q, q_head_stride,
                                        q_out_head_stride, rotary_dim, head_dim, first, second, pair_mask,
                                        cos_first, cos_second, sin_first, sin_second, eps, offset,
                                        ACC, HEAD_BLOCK, PASS_BLOCK)
                _normalize_rotate_heads(K, K_OUT, KW, k_position, k_out_position, heads_k, k_head_stride,
                                        k_out_head_stride, rotary_dim, head_dim, first, second, pair_mask,
                                        cos_first, cos_second, sin_first, sin_second, eps, offset,
                                        ACC, HEAD_BLOCK, PASS_BLOCK)
        else:
            _rotate_heads(Q, Q_OUT, q_position, q_out_position, heads_q, q_head_stride, q_out_head_stride,
                          rotary_dim, head_dim, first, second, pair_mask, cos_first, cos_second, sin_first,
                          sin_second, HAS_PASS, ACC, HEAD_BLOCK, PASS_BLOCK)
            _rotate_heads(K, K_OUT, k_position, k_out_position, heads_k, k_head_stride, k_out_head_stride,
                          rotary_dim, head_dim, first, second, pair_mask, cos_first, cos_second, sin_first,
                          sin_second, HAS_PASS, ACC, HEAD_BLOCK, PASS_BLOCK)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# A program's tile holds this many (head, pair) elements at most; larger head counts loop.
_TILE_ELEMENTS = 2048


def _dense_rows(x: Optional[Tensor]) -> Optional[Tensor]:
    """The kernel walks heads, positions and batches by stride; only the last dim must be dense."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _launch_triton(q, k, cos, sin, interleaved, layout, transpose, weights=None, eps=0.0, offset=0.0, inputs=None):
    """Rotated q and k (``transpose``: the backward's, of the gradients q and k); with norm
    ``weights``, normalized first (backward: from the saved ``inputs``), and then also the
    weights' gradients."""
    seq_dim, head_dim_index = _SEQ_DIM[layout], _HEAD_DIM[layout]
    q, k = _dense_rows(q), _dense_rows(k)
    q_in, k_in = (_dense_rows(x) for x in inputs) if inputs is not None else (q, k)
    q_weight, k_weight = (w.contiguous() for w in weights) if weights is not None else (q, k)
    table_shape = cos.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_dim], q.shape[-1]
    heads_q, heads_k = q.shape[head_dim_index], k.shape[head_dim_index]
    positions = batch * seq_len
    weight_grads = weights is not None and transpose
    # Each position's row of the weights' gradients (its heads' sum), added up after.
    dq_weight, dk_weight = (torch.empty((positions, head_dim), dtype=compute_dtype(q), device=q.device)
                            for _ in range(2)) if weight_grads else (q, k)

    def results():
        return (q_out, k_out, *_weight_sums(dq_weight, dk_weight, weights)) if weight_grads else (q_out, k_out)

    if positions == 0:
        return results()
    rotary_dim = table_shape[-1]
    pair_block = _power_of_two_at_least(rotary_dim // 2)
    pass_block = _power_of_two_at_least(head_dim - rotary_dim)
    # QK-norm keeps every column of a head live through its row's reduction (both members
    # of each pair and the pass-through dims), the plain rotation one pair at a time.
    columns = pair_block if weights is None else 2 * pair_block + pass_block
    head_block = min(_power_of_two_at_least(max(heads_q, heads_k)),
                     1 << (max(1, _TILE_ELEMENTS // columns).bit_length() - 1))
    # cos/sin are [seq, rotary_dim] or [1 or batch, seq, rotary_dim]; a batch of one broadcasts.
    table_batch_stride = cos.stride(0) if len(table_shape) == 3 and table_shape[0] == batch else 0

    def strides(x):
        return x.stride(0), x.stride(seq_dim), x.stride(head_dim_index)

    with devices.device_guard(q.device):
        _rope_kernel[(positions,)](
            q, k, cos, sin, q_out, k_out, q_in, k_in, q_weight, k_weight, dq_weight, dk_weight,
            seq_len, heads_q, heads_k, head_dim, rotary_dim,
            *strides(q), *strides(k), *strides(q_out), *strides(k_out), *strides(q_in), *strides(k_in),
            table_batch_stride, cos.stride(-2), eps, offset,
            INTERLEAVED=interleaved, TRANSPOSE=transpose, NORM=weights is not None, HAS_PASS=rotary_dim < head_dim,
            ACC=triton_compute_dtype(q), PAIR_BLOCK=pair_block, HEAD_BLOCK=head_block,
            PASS_BLOCK=pass_block, num_warps=num_warps_for(head_block * _power_of_two_at_least(columns)))
    return results()


def _weight_sums(dq_weight: Tensor, dk_weight: Tensor, weights) -> tuple[Tensor, Tensor]:
    """The norm weights' gradients from the kernel's per-position rows, in the weights' dtypes."""
    return tuple(rows.sum(0).to(weight.dtype) for rows, weight in zip((dq_weight, dk_weight), weights))


class _Triton:
    @staticmethod
    def forward(q, k, cos, sin, interleaved, layout, q_weight, k_weight, eps, offset):
        weights = None if q_weight is None else (q_weight, k_weight)
        return _launch_triton(q, k, cos, sin, interleaved, layout, False, weights, eps, offset)

    @staticmethod
    def backward(dq, dk, cos, sin, interleaved, layout, q, k, q_weight, k_weight, eps, offset):
        if q_weight is None:
            return (*_launch_triton(dq, dk, cos, sin, interleaved, layout, True), *_no_weight_gradients(dq))
        return _launch_triton(dq, dk, cos, sin, interleaved, layout, True, (q_weight, k_weight), eps, offset, (q, k))


def _cpu_samples(dtype: torch.dtype, rows: int, head_dim: int, interleaved: bool, normalized: bool, *,
                 training: bool = True):
    """One call (a training call, forward and backward, or a forward alone; through the
    public op) per CPU backend rotating ``rows`` rows of ``head_dim``, half of them q's and
    half k's (one batch, one head, the full head rotated; QK-norm first where
    ``normalized``), on constant inputs (the caller's RNG is left alone)."""
    rows = max(rows // 2, 1)
    with torch.inference_mode(False), torch.enable_grad():
        q = torch.linspace(-1, 1, rows * head_dim, dtype=dtype).view(1, 1, rows, head_dim).requires_grad_()
        k = torch.linspace(1, -1, rows * head_dim, dtype=dtype).view(1, 1, rows, head_dim).requires_grad_()
        angles = torch.linspace(0, 3, rows * head_dim, dtype=dtype).view(rows, head_dim)
        cos, sin = angles.cos(), angles.sin()
        dq = torch.full(q.shape, 0.01, dtype=dtype)
        weight = torch.linspace(0.5, 1.5, head_dim, dtype=dtype).requires_grad_() if normalized else None

    return {name: op_sample(lambda name=name: rope(q, k, cos, sin, interleaved=interleaved,
                                                           q_norm_weight=weight, k_norm_weight=weight, backend=name),
                            (q, k), (dq, dq), training=training)
            for name in ROPE.cpu_measured}


# ---- the op: te_lab::rope and its backward, what torch.compile and the profiler see ----

_IMPLEMENTATIONS = {"inductor": _Inductor}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton


def _memory_layout(q: Tensor, k: Tensor, layout: str) -> str:
    """The layout the backends work in: the other one when q and k are both transposed
    views of memory in it (Hugging Face's ``q_proj(x).view(b, s, h, d).transpose(1, 2)``),
    else ``layout``. Outputs are laid out the same way, as eager PyTorch would lay them
    out, so no transposing copy happens here or in the projections' backward."""
    if not (q.is_contiguous() and k.is_contiguous()) and \
            q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous():
        return _OTHER_LAYOUT[layout]
    return layout


def _as_layout(x: Tensor, layout: str, memory_layout: str) -> Tensor:
    """``x`` viewed with its dims in ``memory_layout``'s order, or back (its own inverse)."""
    return x if memory_layout == layout else x.transpose(1, 2)


def _rotate_in_memory_layout(direction: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                             interleaved: bool, layout: str, backend: str, *norm):
    """The backend's ``forward`` or ``backward`` run in :func:`_memory_layout` (of ``q``
    and ``k``: the backward's are the gradients, and the saved inputs among ``norm`` are
    viewed in the same order of dims)."""
    memory = _memory_layout(q, k, layout)
    rotate = getattr(_IMPLEMENTATIONS[backend], direction)
    if direction == "backward":
        inputs, norm = norm[:2], norm[2:]
        norm = (*(None if x is None else _as_layout(x, layout, memory) for x in inputs), *norm)
    outputs = rotate(_as_layout(q, layout, memory), _as_layout(k, layout, memory), cos, sin, interleaved, memory,
                     *norm)
    return (*(_as_layout(out.contiguous(), layout, memory) for out in outputs[:2]), *outputs[2:])


def _empty_outputs(q: Tensor, k: Tensor, layout: str):
    """Outputs laid out as :func:`_rotate_in_memory_layout` lays them out, for tracing."""
    memory = _memory_layout(q, k, layout)
    outputs = []
    for x in (q, k):
        in_memory = _as_layout(x, layout, memory)
        outputs.append(_as_layout(in_memory.new_empty(in_memory.shape), layout, memory))
    return tuple(outputs)


def _forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, layout: str,
             q_norm_weight: Optional[Tensor], k_norm_weight: Optional[Tensor], norm_eps: float,
             norm_weight_offset: float, backend: str) -> tuple[Tensor, Tensor]:
    return _rotate_in_memory_layout("forward", q, k, cos, sin, interleaved, layout, backend, q_norm_weight,
                                    k_norm_weight, norm_eps, norm_weight_offset)


def _forward_fake(q, k, cos, sin, interleaved, layout, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset,
                  backend):
    return _empty_outputs(q, k, layout)


def _backward(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, layout: str,
                      q: Optional[Tensor], k: Optional[Tensor], q_norm_weight: Optional[Tensor],
                      k_norm_weight: Optional[Tensor], norm_eps: float, norm_weight_offset: float,
                      backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk and the norm weights' gradients (empty without norm weights; q and k, the
    forward's inputs, are needed with them only)."""
    return _rotate_in_memory_layout("backward", dq, dk, cos, sin, interleaved, layout, backend, q, k,
                                    q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset)


def _backward_fake(dq, dk, cos, sin, interleaved, layout, q, k, q_norm_weight, k_norm_weight, norm_eps,
                   norm_weight_offset, backend):
    weight_grads = _no_weight_gradients(dq) if q_norm_weight is None else (
        torch.empty_like(q_norm_weight, memory_format=torch.contiguous_format),
        torch.empty_like(k_norm_weight, memory_format=torch.contiguous_format))
    return (*_empty_outputs(dq, dk, layout), *weight_grads)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved, layout, q_norm_weight, k_norm_weight, eps, offset, backend = inputs
    # QK-norm's backward recomputes each row's rstd from q and k themselves.
    norm = () if q_norm_weight is None else (q, k, q_norm_weight, k_norm_weight)
    ctx.save_for_backward(cos, sin, *norm)
    ctx.interleaved, ctx.layout, ctx.eps, ctx.offset = interleaved, layout, eps, offset


def _gradients(ctx, dq_out, dk_out):
    cos, sin, *norm = ctx.saved_tensors
    dq, dk, dq_weight, dk_weight = ctx.backward_op(dq_out, dk_out, cos, sin, ctx.interleaved, ctx.layout,
                                                   *(norm or (None,) * 4), ctx.eps, ctx.offset, ctx.backend)
    weight_grads = (dq_weight, dk_weight) if norm else (None, None)
    # cos and sin are constants of the model (functions of positions), never trained.
    return dq, dk, None, None, None, None, *weight_grads, None, None, None


ROPE, _rope_op, _ = define_op(
    NAME, reference=rope_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    # The rotation's multiplies and adds are on no autocast list: q's and k's dtypes stay.
    backends=_IMPLEMENTATIONS,
    # cpp: q and k rotated in one call, any strides, in the layout _memory_layout picks (kernels/cpp/rope.cpp).
    cpp=True, cpu_preference="cpp", cpu_measured=("cpp", "inductor", "reference"), cpu_samples=_cpu_samples,
    costs=COSTS)


# ---- input checks ----

def _check_inputs(q, k, cos, sin, interleaved, layout) -> None:
    if not isinstance(interleaved, bool):
        raise TypeError(f"{NAME}: interleaved must be a bool, got {interleaved!r}")
    check_choice(NAME, "layout", layout, LAYOUTS)
    dims = _DIMS[layout]
    for name, x in (("q", q), ("k", k)):
        check_tensor(NAME, name, x)
        if x.dim() != 4:
            raise ValueError(
                f"{NAME}: {name} has shape {tuple(x.shape)}; expected 4 dims {dims} (layout={layout!r})")
    if k.dtype != q.dtype:
        raise TypeError(f"{NAME}: k has dtype {k.dtype}; expected {q.dtype} like q")
    if k.device != q.device:
        raise ValueError(f"{NAME}: k is on {k.device}; expected {q.device} like q")
    seq_dim = _SEQ_DIM[layout]
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_dim], q.shape[-1]
    for what, index in (("batch", 0), ("seq", seq_dim), ("head_dim", 3)):
        if k.shape[index] != q.shape[index]:
            raise ValueError(
                f"{NAME}: k has shape {tuple(k.shape)}; expected {what} {q.shape[index]} like q "
                f"{tuple(q.shape)} (layout {layout!r}: {dims})")
    check_tensor(NAME, "cos", cos)
    if cos.dim() not in (2, 3):
        raise ValueError(
            f"{NAME}: cos has shape {tuple(cos.shape)}; expected [seq, rotary_dim] or "
            f"[batch, seq, rotary_dim]")
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"{NAME}: cos has rotary_dim (last dim) {rotary_dim}; expected an even number "
            f"from 2 to head_dim {head_dim}")
    if cos.shape[-2] != seq_len:
        raise ValueError(
            f"{NAME}: cos has shape {tuple(cos.shape)}; expected seq {seq_len} in dim -2, like q's seq")
    if cos.dim() == 3 and cos.shape[0] not in (1, batch):
        raise ValueError(
            f"{NAME}: cos has shape {tuple(cos.shape)}; expected batch 1 or {batch} in dim 0, like q's batch")
    if cos.device != q.device:
        raise ValueError(f"{NAME}: cos is on {cos.device}; expected {q.device} like q")
    check_tensor(NAME, "sin", sin)
    if sin.shape != cos.shape:
        raise ValueError(f"{NAME}: sin has shape {tuple(sin.shape)}; expected {tuple(cos.shape)} like cos")
    if sin.dtype != cos.dtype:
        raise TypeError(f"{NAME}: sin has dtype {sin.dtype}; expected {cos.dtype} like cos")
    if sin.device != cos.device:
        raise ValueError(f"{NAME}: sin is on {sin.device}; expected {cos.device} like cos")


def _check_norm(q, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset) -> None:
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{NAME}: q_norm_weight and k_norm_weight come together (QK-norm normalizes both); "
                         f"got only {'q' if k_norm_weight is None else 'k'}_norm_weight")
    if q_norm_weight is None:
        return
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_parameter(NAME, name, weight, q, "q (head_dim: the norm is over each head)", q.shape[-1])
    check_positive(NAME, "norm_eps", norm_eps)
    if not isinstance(norm_weight_offset, (int, float)) or isinstance(norm_weight_offset, bool):
        raise TypeError(f"{NAME}: norm_weight_offset must be a number, got {norm_weight_offset!r}")


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
                 layout: str = "bhsd", q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                 norm_eps: float = 1e-6, norm_weight_offset: float = 0.0, backend: Optional[str] = None):
    """Rotary position embedding of ``q`` and ``k`` in one pass; returns ``(q_out, k_out)``.

    ``layout="bhsd"``: q [batch, heads_q, seq, head_dim] and k [batch, heads_k, seq,
    head_dim] (Hugging Face); ``"bshd"``: [batch, seq, heads, head_dim] (flash-attn).
    Head counts may differ (GQA/MQA); any strides work. Outputs are contiguous in
    ``layout``, or, when q and k are transposed views of memory in the other layout
    (as Hugging Face's projections give them), laid out like q and k.

    ``cos``, ``sin``: [seq, rotary_dim] or [batch, seq, rotary_dim] (a batch of 1
    broadcasts), Hugging Face's convention (see the module doc); their dtype may differ
    from q's (fp32 tables with bf16 activations). Dims past ``rotary_dim`` pass
    through unchanged. ``interleaved=True`` rotates the pairs (x0, x1), (x2, x3), ...
    (GPT-J) instead of (x_i, x_{i + rotary_dim/2}).

    QK-norm: with ``q_norm_weight`` and ``k_norm_weight`` ([head_dim] each, given
    together) every head of q and k is RMS-normalized first, in the same pass, as
    ``rms_norm(x, weight, norm_eps, weight_offset=norm_weight_offset)`` would (Qwen3;
    Gemma 3 with ``norm_weight_offset=1.0``); the weights get gradients.

    cos and sin are treated as constants: the fused backends give them no gradient
    (they are functions of the positions, not trained). ``backend`` forces
    ``"triton"``, ``"cpp"``, ``"inductor"`` or ``"reference"`` (see :mod:`te_lab.kernels.registry`).
    """
    _check_inputs(q, k, cos, sin, interleaved, layout)
    _check_norm(q, q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset)
    normalized = q_norm_weight is not None
    # Rows of q and k rotated: what the backends' costs scale with.
    rows = (q.numel() + k.numel()) // max(q.shape[-1], 1)
    chosen = select_measured_backend(ROPE, q.device, backend, q.dtype, (rows, q.shape[-1]),
                                     (interleaved, normalized))
    if chosen == "reference":
        return run_reference(ROPE, rope_reference, q, k, cos, sin, interleaved=interleaved, layout=layout,
                             q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps,
                             norm_weight_offset=norm_weight_offset)
    # The kernels read the tables as dense rows: broadcast (expanded) or strided tables
    # are copied once here (the C++ kernels took a float32 expanded table as is and read
    # past its memory).
    cos, sin = (table if table.is_contiguous() else table.contiguous() for table in (cos, sin))
    return _rope_op(q, k, cos, sin, interleaved, layout, q_norm_weight, k_norm_weight, float(norm_eps),
                    float(norm_weight_offset), chosen)


def _renamed(function, old_name: str):
    """``function`` under the name it had before, warning that the old name is deprecated."""
    @functools.wraps(function)
    def alias(*args, **kwargs):
        warnings.warn(f"te_lab.kernels.{old_name} is now te_lab.kernels.{function.__name__} (the op's own name); "
                      f"the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return function(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old_name
    return alias


# The names before the op and its function were given one name; for one release.
apply_rotary = _renamed(rope, "apply_rotary")
apply_rotary_reference = _renamed(rope_reference, "apply_rotary_reference")
