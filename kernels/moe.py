"""Mixture-of-Experts feed-forward: routing, token permutation, grouped GEMMs, un-permutation.

    weights, experts = route(router_logits)              top-k per token (see ROUTINGS)
    h = x[t] @ gate_up[e]^T + gate_up_bias[e]            per token t and each of its experts e
    a = gated(h)                                          act(gate) * up, or gpt-oss's clamped form
    y = a @ down[e]^T + down_bias[e]
    out[t] = sum over t's experts of weight * y

Routing (:func:`moe_routing`, plain PyTorch on every backend: [tokens, experts] of work):
``softmax_topk`` (softmax over all experts in float32, then the top k; ``normalize``
rescales the k weights to sum to 1: Mixtral, Qwen3-MoE, OLMoE), ``topk_softmax`` (the top k
logits, then a softmax over them: gpt-oss), ``sigmoid_topk`` (sigmoid scores, top k,
optionally normalised). DeepSeek-V3's group-limited routing stays in the model's router,
whose top-k weights and indices :func:`moe_experts` takes directly.

The experts (:func:`moe_experts`, the custom op ``te_lab::moe``): the token-expert pairs
are sorted by expert (a stable sort of the flattened top-k indices), so each expert's
rows are one contiguous slice of a permuted copy of ``x``; each projection is then one
grouped GEMM pass over all experts, the gated activation one pass over its output, and
the weighted sum back into token order one scatter-add. The backward runs the same
passes in reverse; it needs the forward's pre-activation ``h`` and expert outputs ``y``
(for the routing weights' gradient), which the forward returns alongside ``out``.

Expert weights come as Hugging Face stores them: ``gate_up`` [E, 2I, H] and ``down``
[E, H, I] (``transposed=False``, the layout of ``nn.Linear`` weights: Mixtral, Qwen3-MoE,
OLMoE, DeepSeek-V3) or [E, H, 2I] and [E, I, H] (``transposed=True``: gpt-oss); the gate
and up halves of ``h`` are its two halves (``interleaved=False``) or its even and odd
columns (``interleaved=True``: gpt-oss). Activations: ``silu`` / ``gelu`` / ``gelu_tanh``
gate ``act(gate) * up``; ``clamped_swiglu`` is gpt-oss's
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``.

Half-precision inputs are computed as Hugging Face's experts compute them, so that a twin
reproduces a bf16 block where expert outputs cancel: GEMMs in the input dtype with float32
accumulation, the gated activation op by op in the input dtype, each weighted expert output
in the dtype of ``y * weight``, the k of a token summed in float32. The backward computes
the activation's gradient in float32 (float64 for float64).
Backends: ``cpp`` (kernels/cpp/moe.cpp: a counting sort, then one pass per expert over its
slice, gather, GEMM, activation and GEMM while the slice is in cache (ATen's GEMMs, the
experts spread over threads), the un-permutation a gather by token; forward and backward
one call each, autograd in C++), ``triton`` (grouped GEMM kernels that find their expert from the per-expert
offsets, with no device-to-host synchronisation), ``inductor`` (``torch.compile`` of the
math, each expert's slice size an unbacked symbolic size, so one graph serves every
routing).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from te_lab import device as devices

from .activations import ACTIVATIONS, activate, activation_grad
from .checks import check_choice, check_tensor
from .costs.moe import COSTS
from .op_declaration import define_op, run_reference
from .precision import compute_dtype, float32_matmul_allows_tf32
from .registry import Call, choose
from .torch_internals import capturing_scalar_outputs, check as check_size
from .triton_support import HAS_TRITON, interpreter_dtypes, tl, triton

NAME = "moe"
ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
CLAMPED_SWIGLU = "clamped_swiglu"
MOE_ACTIVATIONS = ACTIVATIONS + (CLAMPED_SWIGLU,)
# gpt-oss's defaults (GptOssConfig.swiglu_alpha / swiglu_limit).
DEFAULT_ALPHA = 1.702
DEFAULT_LIMIT = 7.0


# ---- routing ----

def moe_routing(router_logits: Tensor, top_k: int, routing: str = "softmax_topk",
                normalize: bool = True) -> tuple[Tensor, Tensor]:
    """(weights [tokens, top_k] in float32, expert indices [tokens, top_k] int64) from
    ``router_logits`` [tokens, experts]; see the module doc for ``routing``.
    ``normalize`` has no effect on ``topk_softmax``, whose weights sum to 1 already."""
    check_tensor(NAME, "router_logits", router_logits, min_dim=2)
    check_choice(NAME, "routing", routing, ROUTINGS)
    experts = router_logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"{NAME}: top_k must be an int in [1, {experts}] (the router's experts), got {top_k!r}")
    logits = router_logits.reshape(-1, experts)
    if routing == "topk_softmax":
        values, indices = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values.float(), dim=-1), indices
    scores = torch.softmax(logits.float(), dim=-1) if routing == "softmax_topk" else torch.sigmoid(logits.float())
    weights, indices = torch.topk(scores, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


# ---- the math shared by every backend ----

def _project(rows: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool) -> Tensor:
    """rows @ weight^T (+ bias) for one expert's [out, in] weight, rows @ weight for [in, out]."""
    out = rows @ (weight if transposed else weight.t())
    return out if bias is None else out + bias


def _halves(h: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    if interleaved:
        return h[..., 0::2], h[..., 1::2]
    return h.chunk(2, dim=-1)


def _gated(h: Tensor, interleaved: bool, activation: str, alpha: float, limit: float) -> Tensor:
    """The gated activation of pre-activations ``h`` [rows, 2I], op by op in h's dtype as
    Hugging Face's experts compute it (in bfloat16, each step rounded: a probe of a bf16 block
    against a single rounding in float32 misses where the expert outputs cancel)."""
    gate, up = _halves(h, interleaved)
    if activation == CLAMPED_SWIGLU:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return activate(activation, gate) * up


def _gated_backward(da: Tensor, h: Tensor, interleaved: bool, activation: str, alpha: float,
                    limit: float) -> Tensor:
    """d h [rows, 2I] (the layout of ``h``) from d a [rows, I]."""
    acc = compute_dtype(h)
    gate, up = (half.to(acc) for half in _halves(h, interleaved))
    da = da.to(acc)
    if activation == CLAMPED_SWIGLU:
        # clamp passes the gradient where its input lies within the bounds, ends included.
        clamped_gate, clamped_up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        sig = torch.sigmoid(clamped_gate * alpha)
        dup = da * (clamped_gate * sig) * ((up >= -limit) & (up <= limit))
        dgate = da * (clamped_up + 1) * (sig + alpha * clamped_gate * sig * (1 - sig)) * (gate <= limit)
    else:
        dgate = da * up * activation_grad(activation, gate)
        dup = da * activate(activation, gate)
    dh = torch.stack((dgate, dup), -1) if interleaved else torch.cat((dgate, dup), -1)
    return dh.reshape(h.shape).to(h.dtype)


def _permutation(indices: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order, tokens, counts): the flattened token-expert pairs sorted by expert (stable),
    the token of each sorted row, and the rows of each expert."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return order, order // indices.shape[-1], counts


def _weighted(y: Tensor, weights: Tensor) -> Tensor:
    """Each expert output times its routing weight, in the dtype ``y * weights`` has (bfloat16
    for bfloat16 weights, float32 for float32 ones), as Hugging Face's experts compute it
    before summing; returned in the compute dtype, where the k of a token are summed."""
    acc = compute_dtype(y)
    return (y.to(acc) * weights.to(acc)[:, None]).to(torch.promote_types(y.dtype, weights.dtype)).to(acc)


def _unpermute(y: Tensor, row_weights: Tensor, tokens: Tensor, n_tokens: int, dtype: torch.dtype) -> Tensor:
    out = torch.zeros((n_tokens, y.shape[-1]), dtype=compute_dtype(y), device=y.device)
    return out.index_add_(0, tokens, _weighted(y, row_weights)).to(dtype)


def moe_experts_reference(x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, down: Tensor,
                          gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None, *,
                          transposed: bool = False, interleaved: bool = False, activation: str = "silu",
                          alpha: float = DEFAULT_ALPHA, limit: float = DEFAULT_LIMIT) -> Tensor:
    """The experts' unfused math, expert by expert as Hugging Face's eager loop runs it
    (autograd takes its backward): the truth :func:`moe_experts` is tested against."""
    out = torch.zeros(x.shape, dtype=compute_dtype(x), device=x.device)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.where(indices == expert)
        bias = None if gate_up_bias is None else gate_up_bias[expert]
        a = _gated(_project(x[token], gate_up[expert], bias, transposed), interleaved, activation, alpha, limit)
        y = _project(a, down[expert], None if down_bias is None else down_bias[expert], transposed)
        out = out.index_add(0, token, _weighted(y, weights[token, slot]))
    return out.to(x.dtype)


def moe_reference(x: Tensor, router_logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
                  routing: str = "softmax_topk", normalize: bool = True, gate_up_bias: Optional[Tensor] = None,
                  down_bias: Optional[Tensor] = None, *, transposed: bool = False, interleaved: bool = False,
                  activation: str = "silu", alpha: float = DEFAULT_ALPHA, limit: float = DEFAULT_LIMIT) -> Tensor:
    """The whole block's unfused math: :func:`moe_routing`, then :func:`moe_experts_reference`."""
    weights, indices = moe_routing(router_logits, top_k, routing, normalize)
    return moe_experts_reference(x, weights, indices, gate_up, down, gate_up_bias, down_bias, transposed=transposed,
                                 interleaved=interleaved, activation=activation, alpha=alpha, limit=limit)


# ---- the grouped passes, with the GEMMs of one backend ----

class _SlicedGemms:
    """Grouped GEMMs as a loop over experts on contiguous row slices (the inductor backend
    compiles this loop: each slice's size is an unbacked symbolic size)."""

    @staticmethod
    def grouped_mm(rows: Tensor, weight: Tensor, counts: Tensor, transpose: bool) -> Tensor:
        """rows [R, K] sorted by expert -> [R, N]: each expert's slice times ``weight[e]``
        ([K, N]) or, with ``transpose``, ``weight[e]^T`` (``weight[e]`` [N, K])."""
        pieces, start = [], 0
        counts = counts.tolist()
        for expert, count in enumerate(counts):
            # The last slice as what the others leave: the result then has rows' size symbolically.
            count = rows.shape[0] - start if expert == len(counts) - 1 else count
            check_size(count >= 0)
            w = weight[expert]
            pieces.append(rows.narrow(0, start, count) @ (w.t() if transpose else w))
            start = start + count
        return torch.cat(pieces)

    @staticmethod
    def grouped_outer(left: Tensor, right: Tensor, counts: Tensor) -> Tensor:
        """[E, M, N]: each expert's slice of ``left`` [R, M] transposed times its slice of
        ``right`` [R, N] (a weight gradient)."""
        pieces, start = [], 0
        for count in counts.tolist():
            check_size(count >= 0)
            pieces.append(left.narrow(0, start, count).t() @ right.narrow(0, start, count))
            start = start + count
        return torch.stack(pieces)


def _segment_sums(rows: Tensor, counts: Tensor, dtype: torch.dtype) -> Tensor:
    """[E, N]: the sum of each expert's rows (a bias gradient), in the compute dtype, cast to ``dtype``."""
    experts = torch.repeat_interleave(torch.arange(counts.shape[0], device=rows.device), counts,
                                      output_size=rows.shape[0])
    acc = compute_dtype(rows)
    sums = torch.zeros((counts.shape[0], rows.shape[-1]), dtype=acc, device=rows.device)
    return sums.index_add_(0, experts, rows.to(acc)).to(dtype)


def _forward_math(gemms, x, weights, indices, gate_up, down, gate_up_bias, down_bias, transposed, interleaved,
                  activation, alpha, limit):
    """(out [T, H], h [T*k, 2I], y [T*k, H]) in expert order; see the module doc."""
    order, tokens, counts = _permutation(indices, gate_up.shape[0])
    xs = x.index_select(0, tokens)
    h = gemms.grouped_mm(xs, gate_up, counts, not transposed)
    if gate_up_bias is not None:
        h = h + gate_up_bias.index_select(0, indices.reshape(-1)[order])
    y = gemms.grouped_mm(_gated(h, interleaved, activation, alpha, limit), down, counts, not transposed)
    if down_bias is not None:
        y = y + down_bias.index_select(0, indices.reshape(-1)[order])
    out = _unpermute(y, weights.reshape(-1)[order], tokens, x.shape[0], x.dtype)
    return out, h, y


def _backward_math(gemms, dout, x, weights, indices, gate_up, down, gate_up_bias, down_bias, h, y, transposed,
                   interleaved, activation, alpha, limit):
    """(dx, dweights, dgate_up, ddown, dgate_up_bias or None, ddown_bias or None)."""
    order, tokens, counts = _permutation(indices, gate_up.shape[0])
    acc = compute_dtype(x)
    dy_token = dout.index_select(0, tokens).to(acc)
    row_weights = weights.reshape(-1)[order].to(acc)
    dweights = torch.empty(order.shape, dtype=weights.dtype, device=weights.device).index_copy_(
        0, order, (dy_token * y.to(acc)).sum(-1).to(weights.dtype)).view(weights.shape)
    dy = (dy_token * row_weights[:, None]).to(x.dtype)
    da = gemms.grouped_mm(dy, down, counts, transposed)
    a = _gated(h, interleaved, activation, alpha, limit)
    ddown = gemms.grouped_outer(a, dy, counts) if transposed else gemms.grouped_outer(dy, a, counts)
    dh = _gated_backward(da, h, interleaved, activation, alpha, limit)
    xs = x.index_select(0, tokens)
    dxs = gemms.grouped_mm(dh, gate_up, counts, transposed)
    dgate_up = gemms.grouped_outer(xs, dh, counts) if transposed else gemms.grouped_outer(dh, xs, counts)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device).index_add_(0, tokens, dxs.to(acc)).to(x.dtype)
    dgate_up_bias = None if gate_up_bias is None else _segment_sums(dh, counts, gate_up_bias.dtype)
    ddown_bias = None if down_bias is None else _segment_sums(dy, counts, down_bias.dtype)
    return dx, dweights, dgate_up.to(gate_up.dtype), ddown.to(down.dtype), dgate_up_bias, ddown_bias


# ---- the inductor backend ----

def _compiled_forward(*args):
    return _forward_math(_SlicedGemms, *args)


def _compiled_backward(*args):
    return _backward_math(_SlicedGemms, *args)


class _Inductor:
    """torch.compile (fullgraph, dynamic) of the math: the loop over experts unrolls into
    one GEMM per expert on a slice whose size is read from the routing (an unbacked size,
    so one graph serves every routing). Its per-call overhead (Dynamo's guards, ~0.1 ms)
    is small beside an MoE block's GEMMs, so the direct lowering the other ops use
    (kernels/inductor_compiled.py), which cannot trace data-dependent sizes, is not needed."""

    _forward = None
    _backward = None

    @classmethod
    def _compiled(cls, name: str, fn):
        if getattr(cls, name) is None:
            setattr(cls, name, torch.compile(fn, fullgraph=True, dynamic=True))
        return getattr(cls, name)

    @classmethod
    def forward(cls, *args):
        with capturing_scalar_outputs(), torch.no_grad():
            return cls._compiled("_forward", _compiled_forward)(*args)

    @classmethod
    def backward(cls, *args):
        with capturing_scalar_outputs(), torch.no_grad():
            return cls._compiled("_backward", _compiled_backward)(*args)


# ---- the triton backend ----

# tl.dot's dtypes (Triton 3.2 has no float64 dot).
_TRITON_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

if HAS_TRITON:

    @triton.jit
    def _tile_of(program, offsets, experts, BLOCK_M: tl.constexpr):
        """The expert and first row of row tile ``program`` when each expert's rows
        (offsets[e]..offsets[e + 1]) are cut into BLOCK_M tiles; expert -1 past the last tile."""
        found = -1
        first = 0
        seen = 0
        for expert in range(experts):
            start = tl.load(offsets + expert)
            end = tl.load(offsets + expert + 1)
            tiles = (end - start + BLOCK_M - 1) // BLOCK_M
            inside = (program >= seen) & (program < seen + tiles) & (found < 0)
            first = tl.where(inside, start + (program - seen) * BLOCK_M, first)
            found = tl.where(inside, expert, found)
            seen += tiles
        return found, first

    @triton.jit
    def _grouped_mm_kernel(A, B, C, OFFSETS, experts, n_cols, k_dim, a_stride, b_stride_e, b_stride_k,
                           b_stride_n, c_stride, DOT: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """C[r, :] = A[r, :] @ B[e] for the rows r of expert e; B[e] is read as [K, N]
        through its strides (either orientation of a stored weight)."""
        expert, first = _tile_of(tl.program_id(0), OFFSETS, experts, BLOCK_M)
        if expert >= 0:
            end = tl.load(OFFSETS + expert + 1)
            rows = first + tl.arange(0, BLOCK_M)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_in = rows < end
            col_in = cols < n_cols
            b_base = B + expert.to(tl.int64) * b_stride_e
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for start_k in range(0, k_dim, BLOCK_K):
                ks = start_k + tl.arange(0, BLOCK_K)
                k_in = ks < k_dim
                a = tl.load(A + rows[:, None].to(tl.int64) * a_stride + ks[None, :],
                            mask=row_in[:, None] & k_in[None, :], other=0.0).to(DOT)
                b = tl.load(b_base + ks[:, None] * b_stride_k + cols[None, :] * b_stride_n,
                            mask=k_in[:, None] & col_in[None, :], other=0.0).to(DOT)
                acc += tl.dot(a, b, input_precision=PRECISION)
            tl.store(C + rows[:, None].to(tl.int64) * c_stride + cols[None, :], acc.to(C.dtype.element_ty),
                     mask=row_in[:, None] & col_in[None, :])

    @triton.jit
    def _grouped_outer_kernel(L, R, D, OFFSETS, m_dim, n_dim, l_stride, r_stride, d_stride_e, d_stride_m,
                              d_stride_n, DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        """D[e] = L[rows of e]^T @ R[rows of e] ([M, N], written through D's strides)."""
        expert = tl.program_id(0)
        start = tl.load(OFFSETS + expert)
        end = tl.load(OFFSETS + expert + 1)
        ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_in = ms < m_dim
        n_in = ns < n_dim
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for row in range(start, end, BLOCK_R):
            rows = row + tl.arange(0, BLOCK_R)
            row_in = rows < end
            left = tl.load(L + rows[None, :].to(tl.int64) * l_stride + ms[:, None],
                           mask=m_in[:, None] & row_in[None, :], other=0.0).to(DOT)
            right = tl.load(R + rows[:, None].to(tl.int64) * r_stride + ns[None, :],
                            mask=row_in[:, None] & n_in[None, :], other=0.0).to(DOT)
            acc += tl.dot(left, right, input_precision=PRECISION)
        tl.store(D + expert.to(tl.int64) * d_stride_e + ms[:, None] * d_stride_m + ns[None, :] * d_stride_n,
                 acc.to(D.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def _blocks(x: Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 64 x 64 tiles in half precision; 32 x 64 in float32, whose
    64 x 64 tiles spill on sm_80 (compiled by te_lab.gpu_checks.gpu_kernels)."""
    return (32 if x.dtype == torch.float32 else 64), 64, 32



def _dot_dtype(x: Tensor):
    """tl.dot's input dtype: the input's own, except bf16 under Triton's interpreter, whose
    dot multiplies bf16 bit patterns as integers (float32 is exact there)."""
    if x.dtype == torch.bfloat16 and interpreter_dtypes():
        return tl.float32
    return getattr(tl, _TRITON_DTYPES[x.dtype])


def _dot_precision(x: Tensor) -> str:
    """TF32 for float32 where torch's float32 matmul precision allows it, IEEE otherwise."""
    return "tf32" if x.dtype == torch.float32 and float32_matmul_allows_tf32() else "ieee"


def _offsets(counts: Tensor) -> Tensor:
    return torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)


class _TritonGemms:
    """Grouped GEMMs as Triton kernels: one launch per pass over every expert. Row tiles
    find their expert from the offsets, so nothing waits for the routing on the host."""

    @staticmethod
    def grouped_mm(rows: Tensor, weight: Tensor, counts: Tensor, transpose: bool) -> Tensor:
        experts = weight.shape[0]
        # weight[e] read as [K, N]: transposed views of [N, K] storage are strides only.
        w = weight.transpose(1, 2) if transpose else weight
        k_dim, n_cols = w.shape[1], w.shape[2]
        rows = rows.contiguous()
        out = torch.empty((rows.shape[0], n_cols), dtype=rows.dtype, device=rows.device)
        if out.numel():
            block_m, block_n, block_k = _blocks(rows)
            # A tile never spans two experts: at most one partial tile per expert beyond R / BLOCK_M.
            tiles = triton.cdiv(rows.shape[0], block_m) + experts
            grid = (tiles, triton.cdiv(n_cols, block_n))
            with devices.device_guard(rows.device):
                _grouped_mm_kernel[grid](rows, w, out, _offsets(counts), experts, n_cols, k_dim, rows.stride(0),
                                         w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                                         DOT=_dot_dtype(rows), PRECISION=_dot_precision(rows),
                                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
        return out

    @staticmethod
    def grouped_outer(left: Tensor, right: Tensor, counts: Tensor) -> Tensor:
        experts, m_dim, n_dim = counts.shape[0], left.shape[1], right.shape[1]
        left, right = left.contiguous(), right.contiguous()
        out = torch.empty((experts, m_dim, n_dim), dtype=left.dtype, device=left.device)
        if out.numel():
            block_m, block_n, block_r = _blocks(left)
            grid = (experts, triton.cdiv(m_dim, block_m), triton.cdiv(n_dim, block_n))
            with devices.device_guard(left.device):
                _grouped_outer_kernel[grid](left, right, out, _offsets(counts), m_dim, n_dim, left.stride(0),
                                            right.stride(0), *out.stride(), DOT=_dot_dtype(left),
                                            PRECISION=_dot_precision(left), BLOCK_M=block_m, BLOCK_N=block_n,
                                            BLOCK_R=block_r, num_warps=4)
        return out


class _Triton:
    @staticmethod
    def forward(*args):
        return _forward_math(_TritonGemms, *args)

    @staticmethod
    def backward(*args):
        return _backward_math(_TritonGemms, *args)


# ---- the cpp backend ----

def _declines(backend: str, call: Call) -> Optional[str]:
    """Triton 3.2's tl.dot has no float64: the triton backend declines it (an automatic
    choice then takes ``inductor``)."""
    if backend == "triton" and call.dtype not in _TRITON_DTYPES:
        return (f"this call: x has dtype {call.dtype} (expected float32, float16 or bfloat16: Triton 3.2's tl.dot "
                f"has no float64)")
    return None


# ---- the op: te_lab::moe and its backward ----

_IMPLEMENTATIONS = {"inductor": _Inductor}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton
_EMPTY = (0,)


def _forward(x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, down: Tensor,
             gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], transposed: bool, interleaved: bool,
             activation: str, alpha: float, limit: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(out [T, H], h [T*k, 2I], y [T*k, H]): h and y, in expert order, are for the backward."""
    return _IMPLEMENTATIONS[backend].forward(x, weights, indices, gate_up, down, gate_up_bias, down_bias,
                                             transposed, interleaved, activation, alpha, limit)


def _gate_up_width(gate_up: Tensor, transposed: bool) -> int:
    """2I: the width of the pre-activations h."""
    return gate_up.shape[2] if transposed else gate_up.shape[1]


def _forward_fake(x, weights, indices, gate_up, down, gate_up_bias, down_bias, transposed, interleaved, activation,
                  alpha, limit, backend):
    rows = indices.numel()
    return (x.new_empty(x.shape), x.new_empty((rows, _gate_up_width(gate_up, transposed))),
            x.new_empty((rows, x.shape[1])))


def _backward(dout: Tensor, x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, down: Tensor,
              gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], h: Tensor, y: Tensor, transposed: bool,
              interleaved: bool, activation: str, alpha: float, limit: float,
              backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias); a bias's gradient is
    empty where the bias is None."""
    grads = _IMPLEMENTATIONS[backend].backward(dout.contiguous(), x, weights, indices, gate_up, down, gate_up_bias,
                                               down_bias, h, y, transposed, interleaved, activation, alpha, limit)
    return tuple(x.new_empty(_EMPTY) if grad is None else grad for grad in grads)


def _backward_fake(dout, x, weights, indices, gate_up, down, gate_up_bias, down_bias, h, y, transposed, interleaved,
                   activation, alpha, limit, backend):
    def like(t):
        return x.new_empty(_EMPTY) if t is None else t.new_empty(t.shape)
    return like(x), like(weights), like(gate_up), like(down), like(gate_up_bias), like(down_bias)


def _setup_context(ctx, inputs, output):
    x, weights, indices, gate_up, down, gate_up_bias, down_bias, *options, backend = inputs
    _, h, y = output
    ctx.mark_non_differentiable(h, y)
    ctx.save_for_backward(x, weights, indices, gate_up, down, gate_up_bias, down_bias, h, y)
    ctx.options = tuple(options)


def _gradients(ctx, dout, _dh, _dy):
    x, weights, indices, gate_up, down, gate_up_bias, down_bias, h, y = ctx.saved_tensors
    dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias = ctx.backward_op(
        dout, x, weights, indices, gate_up, down, gate_up_bias, down_bias, h, y, *ctx.options, ctx.backend)
    return (dx, dweights, None, dgate_up, ddown, None if gate_up_bias is None else dgate_up_bias,
            None if down_bias is None else ddown_bias, None, None, None, None, None, None)


MOE, _moe_op, _ = define_op(
    NAME, reference=moe_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    # Hugging Face's default experts (grouped_mm) are on no autocast list: under autocast they
    # compute in the weights' dtype, and so does this op (in its inputs' dtypes).
    backends=_IMPLEMENTATIONS, cpp=True, cpu_preference="cpp", costs=COSTS, declines=_declines)


# ---- the public functions ----

def _check_experts(x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, down: Tensor,
                   gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], transposed: bool,
                   interleaved: bool, activation: str, alpha: float, limit: float) -> None:
    check_tensor(NAME, "x", x, min_dim=2)
    check_tensor(NAME, "weights", weights, min_dim=2)
    check_tensor(NAME, "gate_up", gate_up, min_dim=3)
    check_tensor(NAME, "down", down, min_dim=3)
    if x.dim() != 2:
        raise ValueError(f"{NAME}: x has shape {tuple(x.shape)}; expected [tokens, hidden]")
    tokens, hidden = x.shape
    if not isinstance(indices, Tensor) or indices.dtype != torch.int64:
        raise TypeError(f"{NAME}: indices must be an int64 tensor of expert indices, got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.dim() != 2 or indices.shape[0] != tokens or tuple(weights.shape) != tuple(indices.shape):
        raise ValueError(f"{NAME}: weights {tuple(weights.shape)} and indices {tuple(indices.shape)} must both be "
                         f"[tokens, top_k] with tokens = {tokens} (x's first dimension)")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"{NAME}: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} must be "
                         f"[experts, ., .] with the same number of experts")
    experts = gate_up.shape[0]
    width = down.shape[1] if transposed else down.shape[2]
    expected_gate_up = (experts, hidden, 2 * width) if transposed else (experts, 2 * width, hidden)
    expected_down = (experts, width, hidden) if transposed else (experts, hidden, width)
    layout = "transposed=True: [experts, in, out]" if transposed else "transposed=False: [experts, out, in]"
    if tuple(gate_up.shape) != expected_gate_up or tuple(down.shape) != expected_down:
        raise ValueError(f"{NAME}: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit x's "
                         f"hidden size {hidden} ({layout}); expected {expected_gate_up} and {expected_down}")
    for name, tensor in (("gate_up", gate_up), ("down", down)):
        if tensor.dtype != x.dtype or tensor.device != x.device:
            raise TypeError(f"{NAME}: {name} is {tensor.dtype} on {tensor.device}; expected {x.dtype} on "
                            f"{x.device} like x")
    for name, bias, length in (("gate_up_bias", gate_up_bias, 2 * width), ("down_bias", down_bias, hidden)):
        if bias is None:
            continue
        check_tensor(NAME, name, bias, min_dim=2)
        if tuple(bias.shape) != (experts, length) or bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"{NAME}: {name} is {tuple(bias.shape)} {bias.dtype} on {bias.device}; expected "
                             f"{(experts, length)} {x.dtype} on {x.device}")
    check_choice(NAME, "activation", activation, MOE_ACTIVATIONS)
    if activation == CLAMPED_SWIGLU:
        for name, value in (("alpha", alpha), ("limit", limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{NAME}: {name} must be a positive number for {CLAMPED_SWIGLU}, got {value!r}")
    if not (isinstance(transposed, bool) and isinstance(interleaved, bool)):
        raise TypeError(f"{NAME}: transposed and interleaved must be bools, got {transposed!r}, {interleaved!r}")


def moe_experts(x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, down: Tensor,
                gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None, *,
                transposed: bool = False, interleaved: bool = False, activation: str = "silu",
                alpha: float = DEFAULT_ALPHA, limit: float = DEFAULT_LIMIT, backend: Optional[str] = None) -> Tensor:
    """The experts of an MoE block, fused: ``x`` [tokens, hidden], each token's top-k routing
    ``weights`` and expert ``indices`` [tokens, top_k] (int64), expert weights ``gate_up``
    and ``down`` (layouts, biases and activations in the module doc) -> [tokens, hidden].
    Under autocast it computes in its inputs' dtypes, as Hugging Face's grouped_mm experts do.
    Gradients flow to ``x``, ``weights``, the expert weights and biases. ``backend`` forces
    ``"cpp"``, ``"inductor"``, ``"triton"`` or ``"reference"``."""
    _check_experts(x, weights, indices, gate_up, down, gate_up_bias, down_bias, transposed, interleaved,
                   activation, alpha, limit)
    chosen = choose(MOE, Call(x.device, backend, x.dtype))[0]
    if chosen == "reference":
        return run_reference(MOE, moe_experts_reference, x, weights, indices, gate_up, down, gate_up_bias,
                             down_bias, transposed=transposed, interleaved=interleaved, activation=activation,
                             alpha=alpha, limit=limit)
    out, _, _ = _moe_op(x, weights, indices, gate_up, down, gate_up_bias, down_bias, transposed,
                        interleaved, activation, float(alpha), float(limit), chosen)
    return out


def moe(x: Tensor, router_logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int, routing: str = "softmax_topk",
        normalize: bool = True, gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None, *,
        transposed: bool = False, interleaved: bool = False, activation: str = "silu", alpha: float = DEFAULT_ALPHA,
        limit: float = DEFAULT_LIMIT, backend: Optional[str] = None) -> Tensor:
    """An MoE block's routed experts from its router's logits: :func:`moe_routing`
    (``routing``, ``top_k``, ``normalize``), then :func:`moe_experts`. Gradients reach the
    router logits through the top-k weights."""
    weights, indices = moe_routing(router_logits, top_k, routing, normalize)
    return moe_experts(x, weights, indices, gate_up, down, gate_up_bias, down_bias, transposed=transposed,
                       interleaved=interleaved, activation=activation, alpha=alpha, limit=limit, backend=backend)
