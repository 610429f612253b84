"""The per-op benchmark cases: the baseline model code runs today in eager PyTorch, the
te_lab call that replaces it, Liger-Kernel's equivalent where it has one, shapes from a
:class:`Size` (tokens, hidden), and the bytes (and FLOPs) each pass must move at the
least, from shapes and dtypes.

Shapes at ``Size(tokens=T, hidden=H)``:

- RMSNorm, add + LayerNorm:  [T, H]
- Linear + GELU:             [T, H] @ [4H, H]^T + bias (GPT-2's MLP up-projection)
- Linear:                    [T, H] @ [F, H]^T, F as below (Llama's MLP up-projection)
- SwiGLU / GeGLU:            gate, up [T, F], F = 8H/3 rounded up to 128 (Llama's MLP)
- RoPE:                      q [1, H/128, T, 128], k [1, H/512, T, 128] (GQA 4:1)
- causal attention:          q, k, v [1, H/128, T, 128]
- cross-entropy:             logits [T, 32000]
- LM head + cross-entropy:   hidden [T, H], head [32000, H]
- MoE block:                 x [T, H], 32 experts of width H/2 (gate-up [32, H, H], down
                             [32, H, H/2]), top-4 routing (Qwen3-MoE's block at its shapes)
- AdamW:                     the parameters of a one-layer Llama of width H with a
                             8192-token embedding (see ``adamw_case``)

What each pass moves and computes is not written here: it is what the fused call's ops
cost by te_lab's one cost model (:mod:`te_lab.kernels.costs`, the profiler's too), recorded
once per case: every op the fused forward, then its backward, dispatches (te_lab's ops
whole, ATen's GEMMs and the rest by their rules). Attention is counted non-causal (4 B H
S^2 D forward), as the profiler counts it: the model sees shapes, not flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from te_lab.kernels.attention import attention
from te_lab.kernels.bias_act import bias_act, linear_act
from te_lab.kernels.costs import OpCost, TensorSpec
from te_lab.kernels.cross_entropy import cross_entropy
from te_lab.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from te_lab.kernels.glu import glu
from te_lab.kernels.layer_norm import layer_norm
from te_lab.kernels.rms_norm import rms_norm
from te_lab.kernels.rope import rope
from te_lab.kernels.torch_internals import FakeTensorMode, TorchDispatchMode
from te_lab.profiler.estimates import cost_of

VOCAB = 32000


SIZE_SYNTAX = "TOKENSxHIDDEN with positive integers, e.g. 2048x1024"


@dataclass(frozen=True)
class Size:
    tokens: int
    hidden: int

    def __str__(self) -> str:
        return f"T={self.tokens} H={self.hidden}"

    @classmethod
    def parse(cls, text: str) -> "Size":
        """``"2048x1024"`` as ``Size(2048, 1024)``, the command lines' ``--sizes`` syntax; a
        ValueError for anything else."""
        tokens, _, hidden = text.lower().partition("x")
        if not (tokens.isdigit() and hidden.isdigit()) or int(hidden) < 1:
            raise ValueError(f"size {text!r}: expected {SIZE_SYNTAX}")
        return cls(int(tokens), int(hidden))


@dataclass
class OpCase:
    """``fused`` takes the inputs and ``backend=``; ``liger``, given the module
    ``liger_kernel.transformers.functional``, returns Liger's equivalent of
    ``baseline`` (None where Liger has none)."""

    op: str  # the registered fused op's name
    name: str  # the case: the op's name, or the op and its variant ("glu[silu]")
    title: str
    inputs: tuple  # every tensor the step takes; gradients are taken for all of them
    baseline: Callable
    fused: Callable
    liger: Optional[Callable[[object], Callable]] = None
    _costs: dict = field(default_factory=dict, init=False, repr=False)

    def costs(self) -> dict[str, OpCost]:
        """"forward" and "backward": what the fused call's ops move and compute (recorded once)."""
        if not self._costs:
            self._costs.update(recorded_costs(self.fused, self.inputs))
        return self._costs

    def bytes_for(self, mode: str) -> int:
        return sum(self.costs()[part].bytes_moved for part in mode.split("+"))

    def flops_for(self, mode: str) -> int:
        return sum(self.costs()[part].flops for part in mode.split("+"))


def tensor_spec(value) -> Optional[TensorSpec]:
    """An argument as the cost model sees it: a TensorSpec for a tensor, None for anything else."""
    return TensorSpec(tuple(value.shape), value.element_size()) if isinstance(value, torch.Tensor) else None


class _CostRecorder(TorchDispatchMode):
    """Sums the cost of every ATen and te_lab op dispatched inside it: te_lab's ops as a
    whole (what they run inside is dispatched outside the mode), ATen's as they come;
    views and bare allocations move nothing and are left out, as the profiler leaves
    them out (and ``prim::`` queries such as ``x.device`` are no ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = self.bytes_written = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith(("aten::", "te_lab::")) and not func.is_view and not name.startswith("aten::empty"):
            cost = cost_of(name, [tensor_spec(arg) for arg in args])
            self.bytes_read += cost.bytes_read
            self.bytes_written += cost.bytes_written
            self.flops += cost.flops
        return func(*args, **(kwargs or {}))

    def total(self, what: str) -> OpCost:
        return OpCost(self.bytes_read, self.bytes_written, self.flops, f"the ops of the fused call's {what}")


def recorded_costs(fused: Callable, inputs: tuple) -> dict[str, OpCost]:
    """What ``fused(*inputs)`` costs forward and backward, op by op. It runs on fake
    tensors (shapes and dtypes, no data): te_lab's ops run their registered fake
    implementations, so nothing is computed or compiled."""
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
        fakes = tuple(fake_mode.from_tensor(t) for t in inputs)
        outputs = fused(*fakes, backend=None)
        upstream = [torch.ones_like(out) for out in (outputs if isinstance(outputs, tuple) else (outputs,))]
        with _CostRecorder() as forward:
            outputs = fused(*fakes, backend=None)
        with _CostRecorder() as backward:
            torch.autograd.grad(outputs if isinstance(outputs, tuple) else (outputs,), fakes, upstream)
    return {"forward": forward.total("forward"), "backward": backward.total("backward")}


def hand_written_rms_norm(x, weight, eps=1e-6):
    """What Llama-family model code runs (Hugging Face's LlamaRMSNorm.forward)."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


def add_layer_norm(x, residual, weight, bias):
    h = x + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias), h


def projection(x, weight):
    """A bias-free nn.Linear's forward (Llama's projections)."""
    return F.linear(x, weight)


def linear_gelu(x, weight, bias):
    return F.gelu(F.linear(x, weight, bias))


def bias_gelu(x, bias):
    return F.gelu(x + bias)


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


def llama_ffn(hidden: int) -> int:
    return -(-8 * hidden // 3 // 128) * 128


HEAD_DIM = 128


def _heads(hidden: int, per: int = 1) -> int:
    if hidden % (HEAD_DIM * per):
        raise ValueError(f"op cases: hidden {hidden} must be a multiple of {HEAD_DIM * per} "
                         f"(heads of {HEAD_DIM}{', grouped 4:1' if per > 1 else ''})")
    return hidden // (HEAD_DIM * per)


def rms_norm_case(device, dtype, size: Size) -> OpCase:
    t, h = size.tokens, size.hidden
    x, w = _act((t, h), device, dtype), _param(h, device, dtype)
    return OpCase(
        "rms_norm", "rms_norm", f"RMSNorm {t}x{h}", (x, w),
        baseline=hand_written_rms_norm,
        fused=lambda x, w, backend: rms_norm(x, w, 1e-6, backend=backend),
        liger=lambda functional: lambda x, w: functional.liger_rms_norm(x, w, 1e-6, in_place=False))


def layer_norm_case(device, dtype, size: Size) -> OpCase:
    t, h = size.tokens, size.hidden
    x, r = _act((t, h), device, dtype), _act((t, h), device, dtype)
    w, b = _param(h, device, dtype), _param(h, device, dtype)

    def liger(functional):
        def residual_layer_norm(x, r, w, b):  # Liger's LayerNorm has no residual input
            h = x + r
            return functional.liger_layer_norm(h, w, b, 1e-5), h
        return residual_layer_norm

    return OpCase(
        "layer_norm", "layer_norm", f"add + LayerNorm {t}x{h}", (x, r, w, b),
        baseline=add_layer_norm,
        fused=lambda x, r, w, b, backend: layer_norm(x, w, b, 1e-5, residual=r, backend=backend),
        liger=liger)


def bias_act_case(device, dtype, size: Size) -> OpCase:
    t, h = size.tokens, size.hidden
    x = _act((t, h), device, dtype)
    # initialised like nn.Linear (scale 1/sqrt(fan_in)), so pre-activations are O(1) as in real models
    weight = (torch.randn(4 * h, h, device=device) / math.sqrt(h)).to(dtype).requires_grad_()
    bias = _param(4 * h, device, dtype)
    return OpCase(
        "bias_act", "bias_act", f"Linear {t}x{h}->{4 * h} + GELU", (x, weight, bias),
        baseline=linear_gelu,
        fused=lambda x, weight, bias, backend: linear_act(x, weight, bias, "gelu", backend=backend))


def bias_act_alone_case(device, dtype, size: Size) -> OpCase:
    """bias + GELU on pre-activations of the case's size, without linear_act's GEMM: what
    the dispatch benchmark times, since the GEMM is not a te_lab op (its kernels-alone
    replay would leave it out and count it as the op's overhead)."""
    t, h = size.tokens, size.hidden
    x, bias = _act((t, h), device, dtype), _param(h, device, dtype)
    return OpCase(
        "bias_act", "bias_act", f"bias + GELU {t}x{h}", (x, bias),
        baseline=bias_gelu,
        fused=lambda x, bias, backend: bias_act(x, bias, "gelu", backend=backend))


def glu_case(activation: str) -> Callable:
    baseline, title, liger_name = {"silu": (silu_gate, "SwiGLU", "liger_swiglu"),
                                   "gelu_tanh": (gelu_gate, "GeGLU", "liger_geglu")}[activation]

    def build(device, dtype, size: Size) -> OpCase:
        ffn = llama_ffn(size.hidden)
        gate, up = _act((size.tokens, ffn), device, dtype), _act((size.tokens, ffn), device, dtype)
        return OpCase(
            "glu", f"glu[{activation}]", f"{title} {size.tokens}x{ffn}", (gate, up),
            baseline=baseline,
            fused=lambda g, u, backend: glu(g, u, activation, backend=backend),
            liger=lambda functional: getattr(functional, liger_name))
    return build


def rope_case(device, dtype, size: Size) -> OpCase:
    t = size.tokens
    q = _act((1, _heads(size.hidden), t, HEAD_DIM), device, dtype)
    k = _act((1, _heads(size.hidden, 4), t, HEAD_DIM), device, dtype)
    cos, sin = (table.to(dtype) for table in _rotary_tables(t, HEAD_DIM, device))
    return OpCase(
        "rope", "rope", f"RoPE q {tuple(q.shape)}, k {tuple(k.shape)}", (q, k),
        baseline=lambda q, k: hf_rotary(q, k, cos, sin),
        fused=lambda q, k, backend: rope(q, k, cos, sin, backend=backend),
        liger=lambda functional: lambda q, k: functional.liger_rope(q, k, cos[None], sin[None]))


def attention_case(device, dtype, size: Size) -> OpCase:
    heads, seq = _heads(size.hidden), size.tokens
    q, k, v = (_act((1, heads, seq, HEAD_DIM), device, dtype) for _ in range(3))
    return OpCase(
        "attention", "attention", f"causal attention {tuple(q.shape)}", (q, k, v),
        baseline=explicit_causal_attention,
        fused=lambda q, k, v, backend: attention(q, k, v, causal=True, backend=backend))


def cross_entropy_case(device, dtype, size: Size) -> OpCase:
    logits = _act((size.tokens, VOCAB), device, dtype)
    labels = torch.randint(0, VOCAB, (size.tokens,), device=device)
    return OpCase(
        "cross_entropy", "cross_entropy", f"cross-entropy {size.tokens}x{VOCAB}", (logits,),
        baseline=lambda logits: F.cross_entropy(logits, labels),
        fused=lambda logits, backend: cross_entropy(logits, labels, backend=backend),
        liger=lambda functional: lambda logits: functional.liger_cross_entropy(logits, labels))


def fused_linear_cross_entropy_case(device, dtype, size: Size) -> OpCase:
    t, h = size.tokens, size.hidden
    hidden, head = _act((t, h), device, dtype), _act((VOCAB, h), device, dtype)
    head.data.mul_(h ** -0.5)
    labels = torch.randint(0, VOCAB, (t,), device=device)
    return OpCase(
        "fused_linear_cross_entropy", "fused_linear_cross_entropy", f"LM head + cross-entropy {t}x{h} -> {VOCAB}",
        (hidden, head),
        baseline=lambda hidden, head: F.cross_entropy(F.linear(hidden, head), labels),
        fused=lambda hidden, head, backend: fused_linear_cross_entropy(hidden, head, labels, backend=backend),
        liger=lambda functional: lambda hidden, head: functional.liger_fused_linear_cross_entropy(hidden, head, labels))


def linear_case(device, dtype, size: Size) -> OpCase:
    # Imported here: the op file is newer than some checkouts this suite runs in, and only
    # a registered op's cases are ever built.
    from te_lab.kernels.linear import linear

    t, h, f = size.tokens, size.hidden, llama_ffn(size.hidden)
    x = _act((t, h), device, dtype)
    weight = (torch.randn(f, h, device=device) / math.sqrt(h)).to(dtype).requires_grad_()
    return OpCase(
        "linear", "linear", f"Linear {t}x{h}->{f} (no bias)", (x, weight),
        baseline=projection,
        fused=lambda x, weight, backend: linear(x, weight, backend=backend))


MOE_EXPERTS, MOE_TOP_K = 32, 4


def eager_moe_block(x, router, gate_up, down, top_k=MOE_TOP_K):
    """Hugging Face's Qwen3-MoE block with its ``"eager"`` experts implementation (its
    router, then a Python loop over the experts that received tokens), written out: the
    baseline of ``moe``. It was the default through transformers 5.24; from 5.25 the
    default is ``"grouped_mm"`` (one ``torch._grouped_mm`` per projection over all experts),
    which this case does not time: the 2-layer Qwen3-MoE model benchmark runs the library's
    default."""
    logits = F.linear(x, router)
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    with torch.no_grad():
        hit = torch.nn.functional.one_hot(chosen, gate_up.shape[0]).permute(2, 1, 0)
    for expert in hit.sum(dim=(-1, -2)).nonzero()[:, 0].tolist():
        slot, token = torch.where(hit[expert])
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


def moe_case(device, dtype, size: Size) -> OpCase:
    """An MoE block of 32 experts of width H/2, top-4 (Qwen3-MoE's layout), over T tokens."""
    from te_lab.kernels.moe import moe

    t, h, width = size.tokens, size.hidden, size.hidden // 2
    x = _act((t, h), device, dtype)
    router = (torch.randn(MOE_EXPERTS, h, device=device) / math.sqrt(h)).to(dtype).requires_grad_()
    gate_up = (torch.randn(MOE_EXPERTS, 2 * width, h, device=device) / math.sqrt(h)).to(dtype).requires_grad_()
    down = (torch.randn(MOE_EXPERTS, h, width, device=device) / math.sqrt(width)).to(dtype).requires_grad_()
    return OpCase(
        "moe", "moe", f"MoE block {t}x{h}, {MOE_EXPERTS} experts of width {width}, top-{MOE_TOP_K}",
        (x, router, gate_up, down),
        baseline=eager_moe_block,
        fused=lambda x, router, gate_up, down, backend: moe(x, F.linear(x, router), gate_up, down, MOE_TOP_K,
                                                            backend=backend))


# Every registered op but the optimizer, by name; an op missing here fails the suite
# loudly, so a new kernel cannot go unmeasured.
OP_CASES: dict[str, tuple[Callable, ...]] = {
    "rms_norm": (rms_norm_case,),
    "layer_norm": (layer_norm_case,),
    "bias_act": (bias_act_case,),
    "linear": (linear_case,),
    "glu": (glu_case("silu"), glu_case("gelu_tanh")),
    "rope": (rope_case,),
    "attention": (attention_case,),
    "cross_entropy": (cross_entropy_case,),
    "fused_linear_cross_entropy": (fused_linear_cross_entropy_case,),
    "moe": (moe_case,),
}
OPTIMIZER_OPS = ("adamw",)


# The dispatch benchmark's cases where they differ from OP_CASES' (te_lab ops alone).
DISPATCH_CASES: dict[str, tuple[Callable, ...]] = {"bias_act": (bias_act_alone_case,)}


def op_cases(op: str, device: torch.device, dtype: torch.dtype, size: Size, *,
             dispatch: bool = False) -> list[OpCase]:
    """The cases of ``op`` at ``size``, inputs drawn from seed 0; with ``dispatch``, the
    dispatch benchmark's (DISPATCH_CASES where the op has them)."""
    if op not in OP_CASES:
        raise ValueError(f"op_cases(op={op!r}): no benchmark case; expected one of {', '.join(OP_CASES)}")
    torch.manual_seed(0)
    builds = DISPATCH_CASES.get(op, OP_CASES[op]) if dispatch else OP_CASES[op]
    return [build(device, dtype, size) for build in builds]


def transformer_parameter_shapes(hidden: int, layers: int, vocab: int, mlp: int) -> list[tuple]:
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(mlp, hidden)] * 2 + [(hidden, mlp)] + [(hidden,)] * 2
    return shapes + [(hidden,)]


def adamw_parameters(device: torch.device, dtype: torch.dtype, hidden: int) -> list[torch.nn.Parameter]:
    """The parameters (with gradients) of a one-layer Llama of width ``hidden``."""
    torch.manual_seed(0)
    shapes = transformer_parameter_shapes(hidden, 1, 8192, llama_ffn(hidden))
    params = [torch.nn.Parameter(0.02 * torch.randn(shape, device=device).to(dtype)) for shape in shapes]
    for param in params:
        param.grad = 1e-3 * torch.randn_like(param)
    return params


def adamw_bytes(params: list[torch.Tensor]) -> int:
    """What one AdamW step over ``params`` moves, by te_lab's cost model."""
    return cost_of("te_lab::adamw_step", [tensor_spec(p) for p in params]).bytes_moved
