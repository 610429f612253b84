"""The per-op benchmark cases: the baseline model code runs today in eager PyTorch, the
te_lab call that replaces it, realistic shapes, and the bytes (and FLOPs) the fused
forward + backward must move at the least, from shapes and dtypes.

Bytes moved, forward + backward (N = elements of the activation, s = its element size):
- RMSNorm:            read x, w; write y, rstd | read dy, x, w, rstd; write dx, dw   ~ 5 N s
- add + LayerNorm:    read x, r; write h, y    | read dy, dh, h; write dx            ~ 8 N s
- Linear + GELU:      the three GEMMs' operands and results; compute-bound, so FLOP/s matter
- SwiGLU / GeGLU:     read g, u; write y       | read dy, g, u; write dg, du         ~ 8 N s
- RoPE on q and k:     read q, k; write q', k' | read dq', dk'; write dq, dk         ~ 4 (Q + K) s
- attention:          read q, k, v; write o    | read do, q, k, v, o; write dq, dk, dv ~ 9 N s
- cross-entropy:      read logits; write grad  | read grad; write dlogits              ~ 4 N s
- linear + CE:        the GEMMs' operands and results, never the logits; compute-bound
- AdamW step:         read p, g, m, v; write p, m, v                              ~ 7 P s
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from te_lab.kernels.adamw import FusedAdamW
from te_lab.kernels.attention import attention
from te_lab.kernels.bias_act import linear_act
from te_lab.kernels.cross_entropy import cross_entropy
from te_lab.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from te_lab.kernels.glu import glu
from te_lab.kernels.layer_norm import layer_norm
from te_lab.kernels.rms_norm import rms_norm
from te_lab.kernels.rope import apply_rotary


@dataclass
class OpCase:
    op: str  # the registered fused op's name
    title: str
    inputs: tuple  # every tensor the step takes; gradients are taken for all of them
    baseline: Callable
    fused: Callable  # takes the inputs and backend=
    bytes_moved: int
    flops: Optional[int] = None
    measure_memory: bool = False  # also report each contender's peak memory


def _bytes(*tensors_or_counts) -> int:
    total = 0
    for item in tensors_or_counts:
        total += item.numel() * item.element_size() if isinstance(item, torch.Tensor) else int(item)
    return total


def hand_written_rms_norm(x, weight, eps=1e-6):
    """What Llama-family model code runs (Hugging Face's LlamaRMSNorm.forward)."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


def add_layer_norm(x, residual, weight, bias):
    h = x + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias), h


def linear_gelu(x, weight, bias):
    return F.gelu(F.linear(x, weight, bias))


def silu_gate(gate, up):
    return F.silu(gate) * up


def gelu_gate(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rotary(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb (Llama), cos/sin [seq, head_dim]."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rotary_tables(seq, dim, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), -1)
    return angles.cos(), angles.sin()


def explicit_causal_attention(q, k, v):
    """softmax(Q K^T / sqrt(d) + causal mask) V, as model code without SDPA writes it."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def _param(n, device, dtype):
    return (1 + 0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_()


def _act(shape, device, dtype):
    return torch.randn(shape, device=device, dtype=dtype).requires_grad_()


def op_cases(device: torch.device, dtype: torch.dtype, rows: int = 4096) -> list[OpCase]:
    """The issue's shapes at ``rows`` rows: norms rows x 2048, gated activations
    rows x 4096, Linear (rows / 4) x 1024 -> 4096."""
    torch.manual_seed(0)
    cases = []

    x, w = _act((rows, 2048), device, dtype), _param(2048, device, dtype)
    cases.append(OpCase(
        "rms_norm", f"RMSNorm {rows}x2048", (x, w),
        baseline=hand_written_rms_norm,
        fused=lambda x, w, backend: rms_norm(x, w, 1e-6, backend=backend),
        bytes_moved=_bytes(x, w, x, rows * 4, x, x, w, rows * 4, x, w)))

    x, r = _act((rows, 2048), device, dtype), _act((rows, 2048), device, dtype)
    w, b = _param(2048, device, dtype), _param(2048, device, dtype)
    cases.append(OpCase(
        "layer_norm", f"add + LayerNorm {rows}x2048", (x, r, w, b),
        baseline=add_layer_norm,
        fused=lambda x, r, w, b, backend: layer_norm(x, w, b, 1e-5, residual=r, backend=backend),
        bytes_moved=_bytes(x, r, x, x, x, x, x, x, w, b)))

    tokens = max(rows // 4, 1)
    x = _act((tokens, 1024), device, dtype)
    # initialised like nn.Linear (scale 1/sqrt(fan_in)), so pre-activations are O(1) as in real models
    weight = (torch.randn(4096, 1024, device=device) / 32).to(dtype).requires_grad_()
    bias = _param(4096, device, dtype)
    out_elements = tokens * 4096
    cases.append(OpCase(
        "bias_act", f"Linear {tokens}x1024->4096 + GELU", (x, weight, bias),
        baseline=linear_gelu,
        fused=lambda x, weight, bias, backend: linear_act(x, weight, bias, "gelu", backend=backend),
        bytes_moved=_bytes(x, weight, out_elements * x.element_size() * 3, x, weight, x, weight, bias),
        flops=3 * 2 * tokens * 1024 * 4096))

    seq = max(rows // 4, 1)
    q, k = _act((4, 32, seq, 128), device, dtype), _act((4, 8, seq, 128), device, dtype)
    cos, sin = (t.to(dtype) for t in _rotary_tables(seq, 128, device))
    cases.append(OpCase(
        "rope", f"RoPE q 4x32x{seq}x128, k 4x8x{seq}x128", (q, k),
        baseline=lambda q, k: hf_rotary(q, k, cos, sin),
        fused=lambda q, k, backend: apply_rotary(q, k, cos, sin, backend=backend),
        bytes_moved=_bytes(q, k) * 4 + _bytes(cos, sin)))

    q, k, v = (_act((4, 16, seq, 64), device, dtype) for _ in range(3))
    cases.append(OpCase(
        "attention", f"causal attention 4x16x{seq}x64", (q, k, v),
        baseline=explicit_causal_attention,
        fused=lambda q, k, v, backend: attention(q, k, v, causal=True, backend=backend),
        bytes_moved=_bytes(q) * 9, flops=int(3.5 * 2 * 2 * 4 * 16 * seq * seq * 64 / 2)))

    logits = _act((max(rows // 2, 1), 32000), device, dtype)
    labels = torch.randint(0, 32000, (logits.shape[0],), device=device)
    cases.append(OpCase(
        "cross_entropy", f"cross-entropy {logits.shape[0]}x32000", (logits,),
        baseline=lambda logits: F.cross_entropy(logits, labels),
        fused=lambda logits, backend: cross_entropy(logits, labels, backend=backend),
        bytes_moved=_bytes(logits) * 4))

    tokens = max(rows // 2, 1)
    hidden, head = _act((tokens, 2048), device, dtype), _act((32000, 2048), device, dtype)
    head.data.mul_(2048 ** -0.5)
    labels = torch.randint(0, 32000, (tokens,), device=device)
    cases.append(OpCase(
        "fused_linear_cross_entropy", f"LM head + cross-entropy {tokens}x2048 -> 32000", (hidden, head),
        baseline=lambda hidden, head: F.cross_entropy(F.linear(hidden, head), labels),
        fused=lambda hidden, head, backend: fused_linear_cross_entropy(hidden, head, labels, backend=backend),
        bytes_moved=_bytes(hidden, head) * 3, flops=3 * 2 * tokens * 2048 * 32000, measure_memory=True))

    for name, baseline, activation in (("SwiGLU", silu_gate, "silu"), ("GeGLU", gelu_gate, "gelu_tanh")):
        gate, up = _act((rows, 4096), device, dtype), _act((rows, 4096), device, dtype)
        cases.append(OpCase(
            "glu", f"{name} {rows}x4096", (gate, up),
            baseline=baseline,
            fused=(lambda activation: lambda g, u, backend: glu(g, u, activation, backend=backend))(activation),
            bytes_moved=_bytes(gate) * 8))
    return cases


@dataclass
class OptimizerCase:
    """One optimizer step over a transformer-shaped parameter set; ``steps`` maps a
    contender's name to its zero-argument step (state already allocated)."""

    op: str
    title: str
    steps: dict
    bytes_moved: int
    flops: Optional[int] = None
    measure_memory: bool = False


def _transformer_parameter_shapes(hidden: int, layers: int, vocab: int, mlp: int) -> list[tuple]:
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(mlp, hidden)] * 2 + [(hidden, mlp)] + [(hidden,)] * 2
    return shapes + [(hidden,)]


def adamw_case(device: torch.device, dtype: torch.dtype, scale: int = 1) -> OptimizerCase:
    """AdamW over ~21M parameters (scale 1; ~100M at scale 5 on GPUs): te_lab's FusedAdamW
    against torch.optim.AdamW's default (foreach) step and torch.compile of that step."""
    shapes = _transformer_parameter_shapes(512, 5 * scale, 8192, 1536)

    def prepared_step(make_optimizer):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(0.02 * torch.randn(shape, device=device).to(dtype)) for shape in shapes]
        for param in params:
            param.grad = 1e-3 * torch.randn_like(param)
        optimizer = make_optimizer(params)
        optimizer.step()  # allocates the state outside the timed steps
        return optimizer.step

    steps = {
        "eager": prepared_step(torch.optim.AdamW),
        "torch.compile": torch.compile(prepared_step(torch.optim.AdamW)),
        "torch AdamW(fused=True)": prepared_step(lambda p: torch.optim.AdamW(p, fused=True)),
        "te_lab FusedAdamW": prepared_step(FusedAdamW),
    }
    count = sum(torch.Size(shape).numel() for shape in shapes)
    element = torch.empty((), dtype=dtype).element_size()
    return OptimizerCase("adamw", f"AdamW step, {count / 1e6:.0f}M {str(dtype).split('.')[-1]} parameters "
                         f"in {len(shapes)} tensors", steps, bytes_moved=7 * count * element)
