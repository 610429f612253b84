"""Scaled dot-product attention, computed block by block (flash-attention style).

    out = softmax(q @ k^T * scale + mask) @ v

q is [batch, heads_q, seq_q, head_dim] and k, v are [batch, heads_kv, seq_k, head_dim]
(the layout of ``F.scaled_dot_product_attention``). With fewer key/value heads than
query heads (GQA/MQA) query head ``h`` reads key/value head ``h // (heads_q // heads_kv)``,
as ``repeat_interleave`` of the key/value heads would. ``causal`` masks key ``j`` for
query ``i`` when ``j > i`` (top-left aligned, SDPA's ``is_causal``). ``mask`` is an
additive float mask or a boolean mask (True = attend) broadcastable to
[batch, heads_q, seq_q, seq_k]; it takes no gradient. A query row whose every key is
masked gives zeros (SDPA's convention) on the fused backends, NaN in the explicit formula.

Attention sinks (gpt-oss): ``sinks`` holds one logit per query head that joins every
row's softmax denominator without a value, ``out = sum_j exp(s_j) v_j / (sum_j exp(s_j) +
exp(sink))``. The fused backends apply them around their kernels: with the kernel's
log-sum-exp ``lse``, ``out = out_kernel * sigmoid(lse - sink)`` and the row's true
log-sum-exp is ``logaddexp(lse, sink)``. Handing that output and log-sum-exp to the
unchanged backward kernels gives dq, dk and dv exactly (they recompute P = exp(S - lse)
and delta = rowsum(dO * O)), and ``dsink = -sum_rows exp(sink - lse) * delta``.
Logit soft-capping (Gemma 2), ``scores = softcap * tanh(scores / softcap)``, runs on the
reference only: no fused kernel applies a function to the scores.

Backends: ``triton`` (GPUs) and ``native``, which on the CPU calls ATen's flash-attention
kernels forward and backward (what SDPA runs, the CPU default) and elsewhere calls
``F.scaled_dot_product_attention`` with its own autograd; ``reference`` is the formula.
Dropout (``dropout_p`` > 0) runs on native or reference only.

The Triton forward walks the keys of one block of queries with an online softmax and
never materializes the score matrix; it keeps the log-sum-exp of each query row.
Backward, with P = exp(S - lse) recomputed block by block and delta = rowsum(dO * O):
dV = P^T dO, dS = P * (dO V^T - delta), dQ = dS K * scale, dK = dS^T Q * scale; the
dK/dV of a key/value head sums over its group of query heads inside one program.
head_dim is padded to a power of two inside the kernels; rows of any length are masked.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from te_lab import device as devices

from .autocast import LOWER_PRECISION, AutocastRule, inputs_cast_by
from .checks import check_tensor
from .costs.attention import COSTS
from .op_declaration import define_op, run_reference
from .precision import compute_dtype, float32_matmul_allows_tf32
from .registry import Call, aten_kernel_exists, choose
from .triton_support import HAS_TRITON, interpreter_dtypes, tl, triton

NAME = "attention"


def _repeat_kv(k: Tensor, v: Tensor, heads_q: int) -> tuple[Tensor, Tensor]:
    group = heads_q // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Optional[Tensor],
                        scale: float, dropout_p: float, sinks: Optional[Tensor] = None,
                        softcap: Optional[float] = None) -> Tensor:
    k, v = _repeat_kv(k, v, q.shape[1])
    acc = compute_dtype(q)
    scores = q.to(acc) @ k.to(acc).transpose(-2, -1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.to(acc)
    if causal:
        above_diagonal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above_diagonal, -math.inf)
    if sinks is not None:
        # One more column per row: the sink's logit, whose value is zero.
        sink_column = sinks.to(acc).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return (probs @ v.to(acc)).to(q.dtype)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                        mask: Optional[Tensor] = None, scale: Optional[float] = None,
                        sinks: Optional[Tensor] = None, softcap: Optional[float] = None) -> Tensor:
    """The unfused PyTorch math: the truth every backend is compared against."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _explicit_attention(q, k, v, causal, mask, scale, 0.0, sinks, softcap)


# ---- attention sinks around any backend's kernels (see the module doc) ----

def _with_sinks(out: Tensor, lse: Tensor, sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The kernel's output and log-sum-exp with each head's sink in the denominator."""
    if sinks is None:
        return out, lse
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    kept = torch.sigmoid(lse - sink)  # exp(lse) / (exp(lse) + exp(sink)); 0 for rows with no key
    return (out * kept.unsqueeze(-1).to(out.dtype)), torch.logaddexp(lse, sink)


def _sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sink: -sum over rows of P(sink) * rowsum(dO * O), per head."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)


# ---- the layout of the fused outputs ----
# The output and the gradients are [batch, heads, seq, head_dim] views of memory laid out
# [batch, seq, heads, head_dim], the log-sum-exp a [batch, heads, seq] view of
# [batch, seq, heads]: the layouts SDPA's CPU flash kernel writes (copying its outputs to
# others costs ~4% of fwd+bwd here), and the one in which model code's
# out.transpose(1, 2).reshape(batch, seq, hidden) is free. Real and fake outputs share
# them exactly: Inductor asserts the strides of a custom op's outputs.

def _seq_major_empty(shape: torch.Size, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A [batch, heads, seq, ...] tensor over [batch, seq, heads, ...] memory, on ``like``'s
    device, in ``dtype`` (``like``'s by default)."""
    batch, heads, seq, *rest = shape
    return like.new_empty((batch, seq, heads, *rest), dtype=dtype or like.dtype).transpose(1, 2)


def _as_seq_major(tensor: Tensor) -> Tensor:
    """``tensor`` in the layout of :func:`_seq_major_empty`; no copy when it is already."""
    return tensor.transpose(1, 2).contiguous().transpose(1, 2)


# ---- the native backend: ATen's fused SDPA kernels ----

def _float_mask_for_sdpa(mask: Tensor, q: Tensor) -> Tensor:
    """SDPA takes float masks in the query's dtype or in float32; float32 keeps an
    fp32 mask exact beside half-precision queries."""
    return mask if mask.dtype in (q.dtype, torch.float32) else mask.to(torch.float32)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool, scale: float,
          dropout_p: float) -> Tensor:
    """``F.scaled_dot_product_attention`` with a causal mask merged into ``mask`` (older
    torch refuses both together) and GQA through ``enable_gqa`` (torch >= 2.5)."""
    if mask is not None:
        if causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, -math.inf)
            causal = False
        if mask.dtype != torch.bool:
            mask = _float_mask_for_sdpa(mask, q)
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                          scale=scale, **gqa)


_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
# The CPU flash kernel reads fewer key/value heads than query heads since torch 2.9
# (pytorch#157893); older builds get the heads repeated.
_CPU_FLASH_TAKES_GQA = _TORCH_VERSION >= (2, 9)


def _cpu_flash(device_type: str) -> bool:
    return device_type == "cpu" and all(
        aten_kernel_exists(f"aten::{name}", "cpu")
        for name in ("_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention_for_cpu_backward"))


def _cpu_flash_mask(mask: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """The CPU flash kernel takes an additive 2-D or 4-D mask in float32 or q's dtype."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, -math.inf)
    else:
        mask = _float_mask_for_sdpa(mask, q)
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() != 4 else mask


class _Native:
    """On the CPU, ATen's flash-attention kernels called directly, forward and backward:
    the kernels SDPA's autograd runs, the log-sum-exp kept between them. (On other
    devices :func:`attention` calls SDPA with its own autograd instead; see there.)"""

    @staticmethod
    def forward(q, k, v, mask, causal, scale):
        if not _CPU_FLASH_TAKES_GQA:
            k, v = _repeat_kv(k, v, q.shape[1])
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_cpu_flash_mask(mask, q), scale=scale)

    @staticmethod
    def backward(dout, q, k, v, mask, out, lse, causal, scale):
        heads_kv = k.shape[1]
        if not _CPU_FLASH_TAKES_GQA:
            k, v = _repeat_kv(k, v, q.shape[1])
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_cpu_flash_mask(mask, q), scale=scale)
        if dk.shape[1] != heads_kv:
            batch, _, seq_k, head_dim = dk.shape
            dk = dk.view(batch, heads_kv, -1, seq_k, head_dim).sum(2)
            dv = dv.view(batch, heads_kv, -1, seq_k, head_dim).sum(2)
        return dq, dk, dv


# ---- the triton backend ----

# tl.dot takes these (Triton 3.2 has no float64 dot).
_TRITON_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Rows of head_dim (padded to a power of two) up to 512 bytes: 256 in fp16/bf16, 128 in
# fp32. Wider float32 heads would need ~140 KB of shared memory (see _forward_blocks).
MAX_TRITON_ROW_BYTES = 512
# Masks handed to the kernels: none, additive (float) or boolean (True = attend).
_NO_MASK, _ADDITIVE_MASK, _BOOLEAN_MASK = 0, 1, 2

if HAS_TRITON:

    @triton.jit
    def _mask_scores(s, rows, cols, seq_q, seq_k, MASK, mask_offset, mask_row_stride, mask_col_stride,
                     CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):
        """Apply the mask, causality and the sequence bounds to scaled scores ``s``;
        ``rows``/``cols`` broadcast to ``s``'s shape, so either orientation works.
        ``MASK`` is None without a mask, so it is touched only under MASK_KIND."""
        inside = (rows < seq_q) & (cols < seq_k)
        if MASK_KIND == 1:  # _ADDITIVE_MASK (jit code reads no Python globals)
            s += tl.load(MASK + mask_offset + rows * mask_row_stride + cols * mask_col_stride,
                         mask=inside, other=0.0).to(tl.float32)
        if MASK_KIND == 2:  # _BOOLEAN_MASK
            keep = tl.load(MASK + mask_offset + rows * mask_row_stride + cols * mask_col_stride,
                           mask=inside, other=1)
            s = tl.where(keep != 0, s, float("-inf"))
        valid = inside
        if CAUSAL:
            valid = valid & (cols <= rows)
        return tl.where(valid, s, float("-inf"))

    @triton.jit
    def _attention_forward_kernel(
            Q, K, V, MASK, OUT, LSE,
            q_sb, q_sh, q_sm, q_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
            mask_sb, mask_sh, mask_sm, mask_sn,
            heads_q, group, seq_q, seq_k, head_dim, scale,
            CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        start_m = tl.program_id(0)
        batch_head = tl.program_id(1).to(tl.int64)
        batch = batch_head // heads_q
        head = batch_head % heads_q
        kv_head = head // group
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_in = rows < seq_q
        dim_in = dims < head_dim
        q = tl.load(Q + batch * q_sb + head * q_sh + rows[:, None] * q_sm + dims[None, :] * q_sd,
                    mask=row_in[:, None] & dim_in[None, :], other=0.0).to(DOT)
        k_base = K + batch * k_sb + kv_head * k_sh
        v_base = V + batch * v_sb + kv_head * v_sh
        mask_offset = batch * mask_sb + head * mask_sh

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        end_n = seq_k
        if CAUSAL:  # key blocks wholly above the diagonal are skipped
            end_n = tl.minimum(seq_k, (start_m + 1) * BLOCK_M)
        for start_n in range(0, end_n, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            col_in = cols < seq_k
            kt = tl.load(k_base + cols[None, :] * k_sn + dims[:, None] * k_sd,
                         mask=dim_in[:, None] & col_in[None, :], other=0.0).to(DOT)
            s = tl.dot(q, kt, input_precision=PRECISION) * scale
            s = _mask_scores(s, rows[:, None], cols[None, :], seq_q, seq_k, MASK, mask_offset, mask_sm, mask_sn,
                             CAUSAL, MASK_KIND)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row with no unmasked key so far keeps m = -inf; exp(-inf - 0) = 0 avoids NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vb = tl.load(v_base + cols[:, None] * v_sn + dims[None, :] * v_sd,
                         mask=col_in[:, None] & dim_in[None, :], other=0.0).to(DOT)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vb, input_precision=PRECISION)
            m_i = m_new
        attended = l_i > 0.0
        out = acc / tl.where(attended, l_i, 1.0)[:, None]
        # +inf for rows with nothing to attend makes the backward's P = exp(S - lse) zero
        lse = tl.where(attended, m_i + tl.log(tl.where(attended, l_i, 1.0)), float("inf"))
        # OUT is laid out [batch, seq_q, heads_q, head_dim] (see _seq_major_empty)
        tl.store(OUT + ((batch * seq_q + rows[:, None]) * heads_q + head) * head_dim + dims[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_in[:, None] & dim_in[None, :])
        tl.store(LSE + (batch * seq_q + rows) * heads_q + head, lse, mask=row_in)

    @triton.jit
    def _attention_delta_kernel(OUT, DOUT, DELTA, o_sb, o_sh, o_sm, o_sd, do_sb, do_sh, do_sm, do_sd,
                                heads_q, seq_q, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        start_m = tl.program_id(0)
        batch_head = tl.program_id(1).to(tl.int64)
        batch = batch_head // heads_q
        head = batch_head % heads_q
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        inside = (rows < seq_q)[:, None] & (dims < head_dim)[None, :]
        # convert right after loading: Triton's interpreter computes wrongly in bf16
        out = tl.load(OUT + batch * o_sb + head * o_sh + rows[:, None] * o_sm + dims[None, :] * o_sd,
                      mask=inside, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + batch * do_sb + head * do_sh + rows[:, None] * do_sm + dims[None, :] * do_sd,
                       mask=inside, other=0.0).to(tl.float32)
        tl.store(DELTA + (batch * seq_q + rows) * heads_q + head, tl.sum(out * dout, axis=1), mask=rows < seq_q)

    @triton.jit
    def _attention_dkdv_kernel(
            Q, K, V, MASK, DOUT, LSE, DELTA, DK, DV,
            q_sb, q_sh, q_sm, q_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
            mask_sb, mask_sh, mask_sm, mask_sn, do_sb, do_sh, do_sm, do_sd,
            heads_kv, group, seq_q, seq_k, head_dim, scale,
            CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """One block of keys of one key/value head; walks every query of its head group."""
        start_n = tl.program_id(0)
        batch_head = tl.program_id(1).to(tl.int64)
        batch = batch_head // heads_kv
        kv_head = batch_head % heads_kv
        cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        col_in = cols < seq_k
        dim_in = dims < head_dim
        kv_inside = col_in[:, None] & dim_in[None, :]
        kb = tl.load(K + batch * k_sb + kv_head * k_sh + cols[:, None] * k_sn + dims[None, :] * k_sd,
                     mask=kv_inside, other=0.0).to(DOT)
        vb = tl.load(V + batch * v_sb + kv_head * v_sh + cols[:, None] * v_sn + dims[None, :] * v_sd,
                     mask=kv_inside, other=0.0).to(DOT)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        start_m = 0
        if CAUSAL:  # queries before this key block never see it
            start_m = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        for member in range(0, group):
            head = kv_head * group + member
            q_base = Q + batch * q_sb + head * q_sh
            do_base = DOUT + batch * do_sb + head * do_sh
            mask_offset = batch * mask_sb + head * mask_sh
            for first_row in range(start_m, seq_q, BLOCK_M):
                rows = first_row + tl.arange(0, BLOCK_M)
                row_in = rows < seq_q
                qt = tl.load(q_base + rows[None, :] * q_sm + dims[:, None] * q_sd,
                             mask=dim_in[:, None] & row_in[None, :], other=0.0).to(DOT)
                st = tl.dot(kb, qt, input_precision=PRECISION) * scale
                st = _mask_scores(st, rows[None, :], cols[:, None], seq_q, seq_k, MASK, mask_offset, mask_sm, mask_sn,
                                  CAUSAL, MASK_KIND)
                # clamped, not masked: Triton 3.2 miscompiles a masked load here (fp32 inputs:
                # 'arith.select' layout mismatch). Rows past seq_q read another row's statistics
                # and add nothing: their q and dO are zero and _mask_scores sets their S to -inf.
                stats = (batch * seq_q + tl.minimum(rows, seq_q - 1)) * (heads_kv * group) + head
                lse = tl.load(LSE + stats)
                pt = tl.exp(st - lse[None, :])
                dout = tl.load(do_base + rows[:, None] * do_sm + dims[None, :] * do_sd,
                               mask=row_in[:, None] & dim_in[None, :], other=0.0).to(DOT)
                dv += tl.dot(pt.to(DOT), dout, input_precision=PRECISION)
                dpt = tl.dot(vb, tl.trans(dout), input_precision=PRECISION)
                delta = tl.load(DELTA + stats)
                dst = pt * (dpt - delta[None, :])
                dk += tl.dot(dst.to(DOT), tl.trans(qt), input_precision=PRECISION)
        out_offsets = ((batch * seq_k + cols[:, None]) * heads_kv + kv_head) * head_dim + dims[None, :]
        tl.store(DK + out_offsets, (dk * scale).to(DK.dtype.element_ty), mask=kv_inside)
        tl.store(DV + out_offsets, dv.to(DV.dtype.element_ty), mask=kv_inside)

    @triton.jit
    def _attention_dq_kernel(
            Q, K, V, MASK, DOUT, LSE, DELTA, DQ,
            q_sb, q_sh, q_sm, q_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
            mask_sb, mask_sh, mask_sm, mask_sn, do_sb, do_sh, do_sm, do_sd,
            heads_q, group, seq_q, seq_k, head_dim, scale,
            CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        start_m = tl.program_id(0)
        batch_head = tl.program_id(1).to(tl.int64)
        batch = batch_head // heads_q
        head = batch_head % heads_q
        kv_head = head // group
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_in = rows < seq_q
        dim_in = dims < head_dim
        q_inside = row_in[:, None] & dim_in[None, :]
        q = tl.load(Q + batch * q_sb + head * q_sh + rows[:, None] * q_sm + dims[None, :] * q_sd,
                    mask=q_inside, other=0.0).to(DOT)
        dout = tl.load(DOUT + batch * do_sb + head * do_sh + rows[:, None] * do_sm + dims[None, :] * do_sd,
                       mask=q_inside, other=0.0).to(DOT)
        stats = (batch * seq_q + rows) * heads_q + head
        lse = tl.load(LSE + stats, mask=row_in, other=float("inf"))
        delta = tl.load(DELTA + stats, mask=row_in, other=0.0)
        k_base = K + batch * k_sb + kv_head * k_sh
        v_base = V + batch * v_sb + kv_head * v_sh
        mask_offset = batch * mask_sb + head * mask_sh
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        end_n = seq_k
        if CAUSAL:
            end_n = tl.minimum(seq_k, (start_m + 1) * BLOCK_M)
        for start_n in range(0, end_n, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            col_in = cols < seq_k
            kt = tl.load(k_base + cols[None, :] * k_sn + dims[:, None] * k_sd,
                         mask=dim_in[:, None] & col_in[None, :], other=0.0).to(DOT)
            vt = tl.load(v_base + cols[None, :] * v_sn + dims[:, None] * v_sd,
                         mask=dim_in[:, None] & col_in[None, :], other=0.0).to(DOT)
            s = tl.dot(q, kt, input_precision=PRECISION) * scale
            s = _mask_scores(s, rows[:, None], cols[None, :], seq_q, seq_k, MASK, mask_offset, mask_sm, mask_sn,
                             CAUSAL, MASK_KIND)
            p = tl.exp(s - lse[:, None])
            dp = tl.dot(dout, vt, input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(DOT), tl.trans(kt), input_precision=PRECISION)
        tl.store(DQ + ((batch * seq_q + rows[:, None]) * heads_q + head) * head_dim + dims[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=q_inside)


def _triton_refusal(dtype: torch.dtype, head_dim: int, dropout_p: float) -> Optional[str]:
    """Why the triton kernels cannot run a call of q's ``dtype`` and ``head_dim``, or None when they can."""
    if dropout_p > 0:
        return f"dropout_p={dropout_p} is not supported (expected 0.0; backend='native' applies dropout)"
    if dtype not in _TRITON_DTYPES:
        return f"q has dtype {dtype} (expected float32, float16 or bfloat16: Triton 3.2's tl.dot has no float64)"
    most = MAX_TRITON_ROW_BYTES // dtype.itemsize
    if head_dim > most:
        return f"head_dim {head_dim} is too large (expected at most {most} for {dtype})"
    return None


def _dot_dtype(x: Tensor):
    """The dtype the kernels feed tl.dot: the input's own, except bf16 under Triton's
    interpreter, whose dot multiplies bf16 bit patterns as integers; fp32 there is exact."""
    if x.dtype == torch.bfloat16 and interpreter_dtypes():
        return tl.float32
    return getattr(tl, _TRITON_DTYPES[x.dtype])


def _dot_precision(x: Tensor) -> str:
    """tl.dot's input_precision: float32 inputs multiply in TF32 on tensor cores where
    torch's float32 matmul precision allows it (as SDPA's kernels do), in IEEE float32
    otherwise; half-precision inputs multiply exactly either way."""
    return "tf32" if x.dtype == torch.float32 and float32_matmul_allows_tf32() else "ieee"


def _padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())  # tl.dot needs every dim >= 16


def _row_bytes(block_d: int, dtype: torch.dtype) -> int:
    return block_d * torch.finfo(dtype).bits // 8


def _forward_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(queries a program owns, keys it walks per step, padded head_dim, num_warps). Both
    shrink for wide rows: compiled for sm_80 with two pipeline stages, every kernel then stays
    under 80 KB of shared memory (MUSA and consumer GPUs have less than A100). Float32 at
    512-byte rows (head_dim 128) owns 16 queries: 32 spilled 8-16 B per thread with a mask or
    in TF32 (sm_80 under Triton 3.2, sm_90 under 3.9; te_lab.gpu_checks.gpu_kernels)."""
    block_d = _padded_head_dim(head_dim)
    row_bytes = _row_bytes(block_d, dtype)
    queries = 64 if row_bytes <= 256 else (16 if dtype == torch.float32 else 32)
    return queries, (64 if row_bytes <= 128 else 32), block_d, (4 if row_bytes <= 128 else 8)


class _BackwardBlocks(NamedTuple):
    queries: int  # the query rows a dQ (and delta) program owns
    keys: int  # the keys dQ walks per step
    dkdv_keys: int  # the keys a dK/dV program owns
    dkdv_queries: int  # the query rows dK/dV walks per step
    block_d: int
    num_warps: int


def _backward_blocks(head_dim: int, dtype: torch.dtype, precision: str, masked: bool,
                     causal: bool) -> _BackwardBlocks:
    """The backward, which holds two accumulators and more tiles per step, walks 32-row
    blocks on 8 warps, and float32 (whose IEEE dots run on FMA, not tensor cores) owns 32-row
    blocks: the sizes at which nothing spills on sm_80 and sm_90 at head_dim 64 and 128
    (te_lab.gpu_checks.gpu_kernels; 64-row blocks on 4 warps spilled up to 640 bytes per
    thread at 255 registers). In TF32, whose operand tiles are twice bf16's, dK/dV spills on
    8 warps (ptxas caps it at 128 registers) and on 4 (Triton 3.2, up to 80 B): it owns 16
    keys. A mask tile is one more load per step: float32 at 512-byte rows then takes 16-row
    query blocks in both kernels (32 spilled up to 368 B in dK/dV on sm_90, 72 B in dK/dV and
    16 B in dQ on sm_80 under Triton 3.2), and half precision owns 32 keys in dK/dV (64
    spilled 8-40 B at 255 registers on sm_80). Float32 IEEE at 256-byte rows (head_dim 64)
    without causality or a mask: dK/dV owns 16 keys and dQ walks 16 (32 spilled 16 B in
    dK/dV on sm_80 and in dQ on sm_90 under Triton 3.9 at 63-80 registers; the causal
    kernels do not spill, and dK/dV over 16 causal keys would, 32 B on sm_80). Half precision
    at 512-byte rows (head_dim 256): dQ owns 16 queries and dK/dV 16 keys (32 spilled 16 B
    in dQ and, causal, 32 B in dK/dV at 255 registers on sm_80 under Triton 3.2)."""
    block_d = _padded_head_dim(head_dim)
    row_bytes = _row_bytes(block_d, dtype)
    queries = 64 if row_bytes <= 256 and dtype != torch.float32 else 32
    keys = dkdv_queries = 32
    dkdv_keys = 16 if precision == "tf32" else queries
    if dtype != torch.float32 and row_bytes > 256:
        queries = dkdv_keys = 16
    elif dtype == torch.float32 and precision == "ieee" and row_bytes == 256 and not (causal or masked):
        keys = dkdv_keys = 16
    if masked and dtype == torch.float32 and row_bytes > 256:
        queries = dkdv_queries = 16
    elif masked:
        dkdv_keys = min(dkdv_keys, 32)
    return _BackwardBlocks(queries, keys, dkdv_keys, dkdv_queries, block_d, 4 if block_d <= 32 else 8)


# Pipeline stages for the K/V (or Q/dO) tiles a program walks: two overlap loads with math
# and keep shared memory within the budget above.
_NUM_STAGES = 2


def _kernel_mask(mask: Optional[Tensor], shape: tuple[int, int, int, int]):
    """(tensor, strides, kind) for the kernels: broadcast dims read with stride 0."""
    if mask is None:
        return None, (0, 0, 0, 0), _NO_MASK
    full = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(shape)
    if mask.dtype == torch.bool:
        return full.view(torch.uint8), full.stride(), _BOOLEAN_MASK
    return full, full.stride(), _ADDITIVE_MASK


class _Triton:
    @staticmethod
    def forward(q, k, v, mask, causal, scale):
        batch, heads_q, seq_q, head_dim = q.shape
        seq_k = k.shape[2]
        queries, keys, block_d, num_warps = _forward_blocks(head_dim, q.dtype)
        mask, mask_strides, mask_kind = _kernel_mask(mask, (batch, heads_q, seq_q, seq_k))
        out = _seq_major_empty(q.shape, q)
        lse = _seq_major_empty(q.shape[:-1], q, torch.float32)
        with devices.device_guard(q.device):
            _attention_forward_kernel[(triton.cdiv(seq_q, queries), batch * heads_q)](
                q, k, v, mask, out, lse, *q.stride(), *k.stride(), *v.stride(), *mask_strides,
                heads_q, heads_q // k.shape[1], seq_q, seq_k, head_dim, scale,
                CAUSAL=causal, MASK_KIND=mask_kind, DOT=_dot_dtype(q), PRECISION=_dot_precision(q),
                BLOCK_M=queries, BLOCK_N=keys, BLOCK_D=block_d, num_warps=num_warps,
                num_stages=_NUM_STAGES)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, mask, out, lse, causal, scale):
        batch, heads_q, seq_q, head_dim = q.shape
        heads_kv, seq_k = k.shape[1], k.shape[2]
        precision = _dot_precision(q)
        blocks = _backward_blocks(head_dim, q.dtype, precision, masked=mask is not None, causal=causal)
        mask, mask_strides, mask_kind = _kernel_mask(mask, (batch, heads_q, seq_q, seq_k))
        delta = torch.empty_like(lse)
        dq, dk, dv = _seq_major_empty(q.shape, q), _seq_major_empty(k.shape, k), _seq_major_empty(v.shape, v)
        strides = (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *dout.stride())
        # float32 tiles with two pipeline stages spill (dK/dV at head_dim 64 with a causal
        # mask, 24 B per thread on sm_80): one stage there
        options = dict(CAUSAL=causal, MASK_KIND=mask_kind, DOT=_dot_dtype(q), PRECISION=precision,
                       BLOCK_D=blocks.block_d, num_warps=blocks.num_warps,
                       num_stages=1 if q.dtype == torch.float32 else _NUM_STAGES)
        with devices.device_guard(q.device):
            _attention_delta_kernel[(triton.cdiv(seq_q, blocks.queries), batch * heads_q)](
                out, dout, delta, *out.stride(), *dout.stride(), heads_q, seq_q, head_dim,
                BLOCK_M=blocks.queries, BLOCK_D=blocks.block_d)
            _attention_dkdv_kernel[(triton.cdiv(seq_k, blocks.dkdv_keys), batch * heads_kv)](
                q, k, v, mask, dout, lse, delta, dk, dv, *strides,
                heads_kv, heads_q // heads_kv, seq_q, seq_k, head_dim, scale,
                BLOCK_M=blocks.dkdv_queries, BLOCK_N=blocks.dkdv_keys, **options)
            _attention_dq_kernel[(triton.cdiv(seq_q, blocks.queries), batch * heads_q)](
                q, k, v, mask, dout, lse, delta, dq, *strides,
                heads_q, heads_q // heads_kv, seq_q, seq_k, head_dim, scale,
                BLOCK_M=blocks.queries, BLOCK_N=blocks.keys, **options)
        return dq, dk, dv


_IMPLEMENTATIONS = {"native": _Native}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton

def _call(q: Tensor, dropout_p: float, sinks: Optional[Tensor], softcap: Optional[float],
          requested: Optional[str]) -> Call:
    """The dispatcher's view of a call: what a backend may decline it for."""
    return Call(q.device, requested, q.dtype, (), (float(dropout_p), sinks is not None, softcap is not None,
                                                   q.shape[-1]))


def _declines(backend: str, call: Call) -> Optional[str]:
    """Why ``backend`` cannot run ``call`` (triton: dropout, float64, very wide heads; any
    fused backend: soft-capping; native: sinks through SDPA), or None."""
    dropout_p, has_sinks, softcapped, head_dim = call.extras
    reason = None
    if backend != "reference" and softcapped:
        reason = "logit soft-capping (softcap) runs on the reference only"
    elif backend == "triton":
        reason = _triton_refusal(call.dtype, head_dim, dropout_p)
    elif backend == "native" and has_sinks and (dropout_p > 0 or not _cpu_flash(call.device.type)):
        reason = "attention sinks need the kernels' log-sum-exp, which SDPA (with dropout or off the CPU) does not give"
    return None if reason is None else f"this call: {reason}"


# No inductor backend: on this 2-core CPU torch.compile of the explicit formula runs
# fwd+bwd 1.7x faster than the formula, SDPA's flash kernel 4.8x (fp32, causal, batch 4,
# 16 heads, seq 1024, head_dim 64), so the CPU prefers native.
# ---- the op: te_lab::attention and its backward, what torch.compile and the profiler see ----

def _forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], sinks: Optional[Tensor], causal: bool,
             scale: float, backend: str) -> tuple[Tensor, Tensor]:
    out, lse = _with_sinks(*_IMPLEMENTATIONS[backend].forward(q, k, v, mask, causal, scale), sinks)
    return _as_seq_major(out), _as_seq_major(lse)


def _forward_fake(q, k, v, mask, sinks, causal, scale, backend):
    return _seq_major_empty(q.shape, q), _seq_major_empty(q.shape[:-1], q, compute_dtype(q))


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], sinks: Optional[Tensor],
              out: Tensor, lse: Tensor, causal: bool, scale: float,
              backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = _IMPLEMENTATIONS[backend].backward(dout, q, k, v, mask, out, lse, causal, scale)
    dsinks = q.new_empty(0) if sinks is None else _sinks_grad(dout, out, lse, sinks)
    return (*(_as_seq_major(grad) for grad in grads), dsinks)


def _backward_fake(dout, q, k, v, mask, sinks, out, lse, causal, scale, backend):
    return (_seq_major_empty(q.shape, q), _seq_major_empty(k.shape, k), _seq_major_empty(v.shape, v),
            q.new_empty(0) if sinks is None else torch.empty_like(sinks))


def _setup_context(ctx, inputs, output):
    q, k, v, mask, sinks, causal, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, sinks, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)  # the log-sum-exp takes no gradient: no zeros for it


def _gradients(ctx, dout, _dlse):
    if dout is None:
        return None, None, None, None, None, None, None, None
    q, k, v, mask, sinks, out, lse = ctx.saved_tensors
    dq, dk, dv, dsinks = ctx.backward_op(dout, q, k, v, mask, sinks, out, lse, ctx.causal, ctx.scale, ctx.backend)
    return dq, dk, dv, None, (None if sinks is None else dsinks), None, None, None


# As F.scaled_dot_product_attention under autocast: q, k, v (and a float mask) in the
# region's low-precision dtype.
AUTOCAST = AutocastRule(follows="aten::scaled_dot_product_attention", to=LOWER_PRECISION)
ATTENTION, _attention_op, _ = define_op(
    NAME, reference=attention_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    autocast=AUTOCAST, backends=_IMPLEMENTATIONS, cpu_preference="native", costs=COSTS, declines=_declines)


# ---- the public op ----

def _check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_tensor(NAME, name, tensor)
        if tensor.dim() != 4:
            raise ValueError(f"{NAME}: {name} has shape {tuple(tensor.shape)}; "
                             f"expected 4 dimensions [batch, heads, seq, head_dim]")
    same_dtype = not inputs_cast_by(AUTOCAST, q.device)  # else autocast casts them to one
    for name, tensor in (("k", k), ("v", v)):
        if same_dtype and tensor.dtype != q.dtype:
            raise TypeError(f"{NAME}: {name} has dtype {tensor.dtype}; expected {q.dtype} like q")
        if tensor.device != q.device:
            raise ValueError(f"{NAME}: {name} is on {tensor.device}; expected {q.device} like q")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{NAME}: v has shape {tuple(v.shape)}; expected {tuple(k.shape)} like k")
    batch, heads_q, seq_q, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"{NAME}: k has shape {tuple(k.shape)}; expected [{batch}, heads_kv, seq_k, {head_dim}] "
                         f"(batch and head_dim of q)")
    if k.shape[1] == 0 or heads_q % k.shape[1] != 0:
        raise ValueError(f"{NAME}: k and v have {k.shape[1]} heads; expected a divisor of q's {heads_q} heads "
                         f"(each key/value head serves a whole group of query heads)")
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{NAME}: mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{NAME}: mask has dtype {mask.dtype}; expected torch.bool (True = attend) "
                        f"or a floating dtype (added to the scores)")
    if mask.device != q.device:
        raise ValueError(f"{NAME}: mask is on {mask.device}; expected {q.device} like q")
    full = (batch, heads_q, seq_q, k.shape[2])
    trailing = full[4 - mask.dim():] if mask.dim() <= 4 else None
    if trailing is None or any(size not in (1, want) for size, want in zip(mask.shape, trailing)):
        raise ValueError(f"{NAME}: mask has shape {tuple(mask.shape)}; expected a shape broadcastable to "
                         f"[batch, heads_q, seq_q, seq_k] = {list(full)}")


def _check_options(causal, scale, dropout_p, softcap) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"{NAME}: causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"{NAME}: scale must be a positive finite number or None (1/sqrt(head_dim)), "
                         f"got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"{NAME}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"{NAME}: softcap must be a positive finite number or None (no capping), got {softcap!r}")


def _check_sinks(sinks: Optional[Tensor], q: Tensor) -> None:
    if sinks is None:
        return
    check_tensor(NAME, "sinks", sinks)
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"{NAME}: sinks has shape {tuple(sinks.shape)}; expected [{q.shape[1]}], one logit "
                         f"per query head")
    if sinks.device != q.device:
        raise ValueError(f"{NAME}: sinks is on {sinks.device}; expected {q.device} like q")


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, mask: Optional[Tensor] = None,
              scale: Optional[float] = None, dropout_p: float = 0.0, sinks: Optional[Tensor] = None,
              softcap: Optional[float] = None, backend: Optional[str] = None) -> Tensor:
    """softmax(q @ k^T * scale + mask) @ v over [batch, heads, seq, head_dim] tensors.

    k and v may have fewer heads than q (GQA/MQA; heads_q must be a multiple of
    heads_kv). ``causal`` is SDPA's ``is_causal`` (top-left aligned). ``mask`` is an
    additive float mask or a boolean mask (True = attend) broadcastable to
    [batch, heads_q, seq_q, seq_k]; it takes no gradient. ``scale`` defaults to
    1/sqrt(head_dim). ``dropout_p`` > 0 runs on ``native`` (SDPA) or ``reference``;
    the triton kernels refuse it. ``sinks`` ([heads_q], trainable) are attention-sink
    logits in every row's softmax denominator (gpt-oss); ``softcap`` caps the scores at
    ``softcap * tanh(scores / softcap)`` (Gemma 2), on the reference only. ``backend``
    forces ``"triton"``, ``"native"`` or ``"reference"`` (see :mod:`te_lab.kernels.registry`).
    """
    _check_inputs(q, k, v, mask)
    _check_options(causal, scale, dropout_p, softcap)
    _check_sinks(sinks, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    mask = None if mask is None else mask.detach()
    chosen = choose(ATTENTION, _call(q, dropout_p, sinks, softcap, backend))[0]
    if chosen == "reference":
        return run_reference(ATTENTION, _explicit_attention, q, k, v, causal, mask, scale, dropout_p, sinks, softcap)
    if chosen == "native" and (dropout_p > 0 or not _cpu_flash(q.device.type)
                               or (sinks is None and not torch.is_grad_enabled())):
        # SDPA with its own autograd: its backward replays the dropout pattern it drew,
        # and on CUDA/MUSA it pairs each kernel SDPA picks with that kernel's backward
        # (a custom op's backward runs below autograd and could only recompute the forward).
        # A call without gradients (a decode step) keeps no log-sum-exp for a backward:
        # SDPA itself costs less around the same kernel than the custom op (14 against
        # 62 us for one query over 96 keys, the 2-core CPU).
        return _sdpa(q, k, v, mask, causal, scale, float(dropout_p))
    out, _ = _attention_op(q, k, v, mask, sinks, causal, scale, chosen)
    return out
