"""The op calls whose Triton launches the GPU compile check records: every op with a
triton backend, forward and backward, in every dtype it takes, at the sizes of real models.

Sizes: hidden 4096 and 8192 (Llama 3 8B/70B) and 16384 (Llama 3 405B) for the norms;
head_dim 64 and 128 (and 256, Gemma) with Llama 3 8B's 32 query / 8 key-value heads at
sequence 2048 for attention and RoPE; vocabularies of 32000 (Llama 2), 50257 (GPT-2, not a
multiple of 16), 128256 (Llama 3) and 256000 (Gemma); MLP widths 14336 and 11008.
Token counts are small where the count changes no compile (only its divisibility by 16
does), since the ops' own torch math still runs on the CPU while the kernels are skipped.

A scenario is ``realistic`` when every size is one a model uses with that dtype today
(hidden <= 16384, head_dim <= 128, vocab <= 256k): the check fails on any register
spill there. The others (head_dim 256, rows of 65536) are compiled and reported only.
Scenarios ``in_ci`` are the subset CI's test compiles (each op in every dtype, at its
largest realistic sizes and on each code path, within a few minutes of compiling); the
full set, for docs/gpu-kernels.md, takes about half an hour on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Scenario:
    label: str
    run: Callable[[], None]
    realistic: bool = True
    in_ci: bool = False


# The labels CI compiles (see the module's docstring).
CI_SCENARIOS = frozenset([
    *(f"{op} {dtype} hidden={hidden}{residual}" for op in ("rms_norm", "layer_norm")
      for dtype, hidden, residual in (("fp32", 8192, " +residual"), ("bf16", 8192, " +residual"), ("fp16", 4096, ""),
                                      ("bf16", 16384, " +residual"), ("fp32", 16384, ""))),
    "cross_entropy fp32 vocab=128256", "cross_entropy bf16 vocab=256000", "cross_entropy fp16 vocab=50257",
    "fused_linear_cross_entropy bf16 vocab=128256 mean", "cross_entropy fp32 vocab=256000 softcap",
    "fused_linear_cross_entropy bf16 vocab=256000 mean softcap",
    "attention fp32 head_dim=64 causal", "attention fp32 head_dim=128", "attention bf16 head_dim=64 causal",
    "attention bf16 head_dim=128", "attention fp16 head_dim=128 causal", "attention fp32 head_dim=64 causal tf32",
    "attention fp32 head_dim=128 boolean mask", "attention fp32 head_dim=64",
    "rope fp32 head_dim=128", "rope bf16 head_dim=64 interleaved", "rope fp16 head_dim=128",
    "rope bf16 head_dim=128 qk_norm", "rope fp32 head_dim=128 qk_norm", "rope bf16 head_dim=256 qk_norm",
    "glu bf16 silu width=14336", "glu fp32 gelu_tanh width=14336 concatenated", "glu fp16 gelu width=14336",
    "bias_act bf16 gelu cols=16384", "bias_act fp32 silu cols=16384", "bias_act fp16 gelu_tanh cols=16384",
    "bias_act fp32 gelu cols=16384", "bias_act bf16 relu_squared cols=16384", "glu bf16 relu_squared width=14336",
    "adamw fp32", "adamw bf16 amsgrad", "adamw fp16",
    "moe bf16 hidden=2048 width=768", "moe bf16 hidden=2880 width=2880 transposed clamped_swiglu",
    "moe fp32 hidden=2048 width=768", "moe fp16 hidden=2880 width=2880 transposed clamped_swiglu",
])


def _leaf(*shape, dtype) -> torch.Tensor:
    # values never reach a kernel (the recorder skips the launch): no need to fill them
    return torch.empty(*shape, dtype=dtype).requires_grad_(True)


def _backward(outputs, inputs) -> None:
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    wanted = [tensor for tensor in inputs if tensor is not None]
    torch.autograd.grad(outputs, wanted, [torch.zeros_like(out) for out in outputs], allow_unused=True)


def _norm(op: str, dtype, hidden: int, *, rows: int = 256, residual: bool = False, weight: bool = True,
          bias: bool = True, weight_dtype=None) -> Callable[[], None]:
    from te_lab import kernels

    def run():
        x = _leaf(rows, hidden, dtype=dtype)
        r = _leaf(rows, hidden, dtype=dtype) if residual else None
        w = _leaf(hidden, dtype=weight_dtype or dtype) if weight else None
        if op == "rms_norm":
            _backward(kernels.rms_norm(x, w, residual=r, backend="triton"), [x, r, w])
        else:
            b = _leaf(hidden, dtype=weight_dtype or dtype) if bias else None
            _backward(kernels.layer_norm(x, w, b, residual=r, backend="triton"), [x, r, w, b])
    return run


def _norm_scenarios() -> list[Scenario]:
    found = []
    for op in ("rms_norm", "layer_norm"):
        for name, dtype in DTYPES.items():
            for hidden in (4096, 8192, 16384):
                for residual in (False, True):
                    found.append(Scenario(f"{op} {name} hidden={hidden}{' +residual' if residual else ''}",
                                          _norm(op, dtype, hidden, residual=residual)))
        found += [
            Scenario(f"{op} bf16 hidden=4096 fp32 weight", _norm(op, torch.bfloat16, 4096,
                                                                 weight_dtype=torch.float32)),
            Scenario(f"{op} fp32 hidden=4096 no weight", _norm(op, torch.float32, 4096, weight=False)),
            Scenario(f"{op} bf16 hidden=4096 rows=8", _norm(op, torch.bfloat16, 4096, rows=8, residual=True)),
            Scenario(f"{op} bf16 hidden=65536 +residual", _norm(op, torch.bfloat16, 65536, residual=True),
                     realistic=False),
        ]
    found.append(Scenario("layer_norm bf16 hidden=4096 no bias", _norm("layer_norm", torch.bfloat16, 4096,
                                                                       bias=False)))
    return found


def _cross_entropy(dtype, vocab: int, *, grad: bool, softcap: Optional[float] = None) -> Callable[[], None]:
    from te_lab import kernels

    def run():
        logits = _leaf(64, vocab, dtype=dtype)
        labels = torch.zeros(64, dtype=torch.long)
        labels[::5] = -100
        loss = kernels.cross_entropy(logits, labels, label_smoothing=0.1, z_loss=1e-4, softcap=softcap,
                                     backend="triton")
        if grad:
            _backward(loss, [logits])
    return run


def _linear_cross_entropy(dtype, vocab: int, reduction: str, softcap: Optional[float] = None) -> Callable[[], None]:
    from te_lab import kernels

    def run():
        # a small hidden size: the chunks' GEMMs run on the CPU (slowly in half precision)
        hidden, weight = _leaf(16, 16, dtype=dtype), _leaf(vocab, 16, dtype=dtype)
        labels = torch.zeros(16, dtype=torch.long)
        loss = kernels.fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction, softcap=softcap,
                                                  backend="triton")
        _backward(loss, [hidden, weight])
    return run


def _loss_scenarios() -> list[Scenario]:
    found = []
    for name, dtype in DTYPES.items():
        for vocab in (32000, 50257, 128256, 256000):
            found.append(Scenario(f"cross_entropy {name} vocab={vocab}", _cross_entropy(dtype, vocab, grad=True)))
        found.append(Scenario(f"cross_entropy {name} vocab=128256 no grad",
                              _cross_entropy(dtype, 128256, grad=False)))
        for reduction in ("mean", "none"):
            found.append(Scenario(f"fused_linear_cross_entropy {name} vocab=128256 {reduction}",
                                  _linear_cross_entropy(dtype, 128256, reduction)))
        # Gemma 2's final logit soft-capping (cap 30, vocabulary 256000)
        found.append(Scenario(f"cross_entropy {name} vocab=256000 softcap", _cross_entropy(dtype, 256000, grad=True,
                                                                                          softcap=30.0)))
        found.append(Scenario(f"fused_linear_cross_entropy {name} vocab=256000 mean softcap",
                              _linear_cross_entropy(dtype, 256000, "mean", softcap=30.0)))
    return found


@contextlib.contextmanager
def tf32_float32_matmuls() -> Iterator[None]:
    """torch's float32 matmuls allowed TF32 within this block (in the spelling of the torch
    in use: ``fp32_precision`` since 2.9, ``allow_tf32`` before)."""
    matmul = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    saved = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def _attention(dtype, head_dim: int, *, causal: bool, mask: str = "", seq: int = 2048,
               seq_major: bool = False, tf32: bool = False) -> Callable[[], None]:
    from te_lab import kernels

    def run():
        def heads(count):
            if seq_major:  # Hugging Face: proj(x).view(batch, seq, heads, head_dim).transpose(1, 2)
                return _leaf(1, seq, count, head_dim, dtype=dtype).transpose(1, 2)
            return _leaf(1, count, seq, head_dim, dtype=dtype)
        q, k, v = heads(32), heads(8), heads(8)
        masks = {"": None, "additive": lambda: torch.zeros(seq, seq, dtype=dtype),
                 "boolean": lambda: torch.ones(seq, seq, dtype=torch.bool)}
        attn_mask = masks[mask]() if mask else None
        with tf32_float32_matmuls() if tf32 else contextlib.nullcontext():
            _backward(kernels.attention(q, k, v, causal=causal, mask=attn_mask, backend="triton"), [q, k, v])
    return run


def _attention_scenarios() -> list[Scenario]:
    found = []
    for name, dtype in DTYPES.items():
        for head_dim in (64, 128, 256):
            if head_dim == 256 and dtype == torch.float32:
                continue  # the triton backend refuses fp32 rows over 512 bytes
            for causal in (False, True):
                found.append(Scenario(f"attention {name} head_dim={head_dim}{' causal' if causal else ''}",
                                      _attention(dtype, head_dim, causal=causal), realistic=head_dim <= 128))
    for name in ("fp32", "bf16"):
        for mask in ("additive", "boolean"):
            found.append(Scenario(f"attention {name} head_dim=128 {mask} mask",
                                  _attention(DTYPES[name], 128, causal=False, mask=mask)))
    for head_dim in (64, 128):
        found.append(Scenario(f"attention fp32 head_dim={head_dim} causal tf32",
                              _attention(torch.float32, head_dim, causal=True, tf32=True)))
    found += [
        Scenario("attention bf16 head_dim=128 causal seq-major", _attention(torch.bfloat16, 128, causal=True,
                                                                           seq_major=True)),
        Scenario("attention bf16 head_dim=128 causal seq=1000", _attention(torch.bfloat16, 128, causal=True,
                                                                          seq=1000)),
        Scenario("attention fp16 head_dim=96 causal", _attention(torch.float16, 96, causal=True)),
    ]
    return found


def _rope(dtype, head_dim: int, *, interleaved: bool = False, rotary: int = 0, layout: str = "bhsd",
          table_dtype=None, qk_norm: bool = False, weight_dtype=None) -> Callable[[], None]:
    """With ``qk_norm``, q and k are RMS-normalized per head in the same kernels (Qwen3, Gemma 3)."""
    from te_lab import kernels

    def run():
        seq = 2048
        shape = (lambda h: (1, h, seq, head_dim)) if layout == "bhsd" else (lambda h: (1, seq, h, head_dim))
        q, k = _leaf(*shape(32), dtype=dtype), _leaf(*shape(8), dtype=dtype)
        cos = torch.empty(seq, rotary or head_dim, dtype=table_dtype or dtype)
        sin = torch.empty(seq, rotary or head_dim, dtype=table_dtype or dtype)
        weights = [_leaf(head_dim, dtype=weight_dtype or dtype) for _ in range(2)] if qk_norm else [None, None]
        _backward(kernels.rope(q, k, cos, sin, interleaved=interleaved, layout=layout,
                                       q_norm_weight=weights[0], k_norm_weight=weights[1], backend="triton"),
                  [q, k, *weights])
    return run


def _rope_scenarios() -> list[Scenario]:
    found = []
    for name, dtype in DTYPES.items():
        for head_dim in (64, 128):
            for interleaved in (False, True):
                found.append(Scenario(f"rope {name} head_dim={head_dim}{' interleaved' if interleaved else ''}",
                                      _rope(dtype, head_dim, interleaved=interleaved)))
    found += [
        Scenario("rope bf16 head_dim=256", _rope(torch.bfloat16, 256)),
        Scenario("rope bf16 head_dim=128 rotary=32", _rope(torch.bfloat16, 128, rotary=32)),
        Scenario("rope bf16 head_dim=128 bshd", _rope(torch.bfloat16, 128, layout="bshd")),
        Scenario("rope bf16 head_dim=128 fp32 tables", _rope(torch.bfloat16, 128, table_dtype=torch.float32)),
    ]
    for name, dtype in DTYPES.items():
        found.append(Scenario(f"rope {name} head_dim=128 qk_norm", _rope(dtype, 128, qk_norm=True)))
    found += [
        Scenario("rope bf16 head_dim=256 qk_norm", _rope(torch.bfloat16, 256, qk_norm=True)),  # Gemma 3
        Scenario("rope bf16 head_dim=128 qk_norm fp32 weights", _rope(torch.bfloat16, 128, qk_norm=True,
                                                                     weight_dtype=torch.float32)),
        Scenario("rope bf16 head_dim=128 rotary=32 qk_norm interleaved",
                 _rope(torch.bfloat16, 128, rotary=32, qk_norm=True, interleaved=True)),
        Scenario("rope bf16 head_dim=128 bshd qk_norm", _rope(torch.bfloat16, 128, layout="bshd", qk_norm=True)),
    ]
    return found


def _glu(dtype, activation: str, width: int, *, concatenated: bool) -> Callable[[], None]:
    from te_lab import kernels

    def run():
        if concatenated:
            gate_up = _leaf(256, 2 * width, dtype=dtype)
            _backward(kernels.glu(gate_up, None, activation, backend="triton"), [gate_up])
        else:
            gate, up = _leaf(256, width, dtype=dtype), _leaf(256, width, dtype=dtype)
            _backward(kernels.glu(gate, up, activation, backend="triton"), [gate, up])
    return run


def _bias_act(dtype, activation: str, *, bias: bool = True) -> Callable[[], None]:
    from te_lab import kernels

    def run():
        x = _leaf(256, 16384, dtype=dtype)
        b = _leaf(16384, dtype=dtype) if bias else None
        _backward(kernels.bias_act(x, b, activation, backend="triton"), [x, b])
    return run


def _linear_act() -> None:
    from te_lab import kernels

    # 16384 output columns (an MLP up-projection) from a small input width: the GEMM runs on the CPU
    x, w, b = _leaf(64, 16, dtype=torch.bfloat16), _leaf(16384, 16, dtype=torch.bfloat16), \
        _leaf(16384, dtype=torch.bfloat16)
    _backward(kernels.linear_act(x, w, b, "gelu_tanh", backend="triton"), [x, w, b])


def _elementwise_scenarios() -> list[Scenario]:
    found = []
    for name, dtype in DTYPES.items():
        for activation in ("silu", "gelu", "gelu_tanh", "relu_squared"):
            for concatenated in (False, True):
                found.append(Scenario(f"glu {name} {activation} width=14336{' concatenated' if concatenated else ''}",
                                      _glu(dtype, activation, 14336, concatenated=concatenated)))
            found.append(Scenario(f"bias_act {name} {activation} cols=16384", _bias_act(dtype, activation)))
    found += [
        Scenario("glu bf16 silu width=11008", _glu(torch.bfloat16, "silu", 11008, concatenated=False)),
        Scenario("bias_act bf16 gelu cols=16384 no bias", _bias_act(torch.bfloat16, "gelu", bias=False)),
        Scenario("linear_act bf16 gelu_tanh cols=16384", _linear_act),
    ]
    return found


def _moe(dtype, hidden: int, width: int, *, transposed: bool) -> Callable[[], None]:
    """Qwen3-MoE's expert sizes (hidden 2048, width 768: gate-up and down as Linear weights)
    or gpt-oss's (2880 and 2880: transposed, interleaved, biases, the clamped SwiGLU), with 8
    experts: the kernels compile alike for any number of experts."""
    from te_lab import kernels

    def run():
        experts, tokens, top_k = 8, 256, 2
        x = _leaf(tokens, hidden, dtype=dtype)
        weights = _leaf(tokens, top_k, dtype=torch.float32)
        # real indices: the permutation around the kernels runs on the CPU
        indices = torch.randint(0, experts, (tokens, top_k))
        shapes = ((experts, hidden, 2 * width), (experts, width, hidden)) if transposed else \
            ((experts, 2 * width, hidden), (experts, hidden, width))
        gate_up, down = _leaf(*shapes[0], dtype=dtype), _leaf(*shapes[1], dtype=dtype)
        biases = (_leaf(experts, 2 * width, dtype=dtype), _leaf(experts, hidden, dtype=dtype)) if transposed else \
            (None, None)
        out = kernels.moe_experts(x, weights, indices, gate_up, down, *biases, transposed=transposed,
                                  interleaved=transposed, activation="clamped_swiglu" if transposed else "silu",
                                  backend="triton")
        _backward(out, [x, weights, gate_up, down, *biases])
    return run


def _moe_scenarios() -> list[Scenario]:
    return [Scenario(f"moe {name} hidden={hidden} width={width}{' transposed clamped_swiglu' if transposed else ''}",
                     _moe(dtype, hidden, width, transposed=transposed))
            for name, dtype in DTYPES.items() for hidden, width, transposed in ((2048, 768, False),
                                                                                (2880, 2880, True))]


def _adamw(dtype, *, amsgrad: bool, offset_parameter: bool = False) -> Callable[[], None]:
    from te_lab import kernels

    def run():
        params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in ((1024, 1024), (1024,), (3, 5))]
        if offset_parameter:  # a view one element into its buffer: not 16-byte aligned
            params.append(torch.nn.Parameter(torch.zeros(4097, dtype=dtype)[1:]))
        for param in params:
            param.grad = torch.zeros_like(param)
        kernels.FusedAdamW(params, lr=1e-3, amsgrad=amsgrad, backend="triton").step()
    return run


def _optimizer_scenarios() -> list[Scenario]:
    found = [Scenario(f"adamw {name}{' amsgrad' if amsgrad else ''}", _adamw(dtype, amsgrad=amsgrad))
             for name, dtype in DTYPES.items() for amsgrad in (False, True)]
    found += [Scenario(f"adamw {name} unaligned parameter", _adamw(DTYPES[name], amsgrad=False, offset_parameter=True))
              for name in ("fp32", "bf16")]
    return found


def scenarios() -> list[Scenario]:
    """Every scenario, grouped by op, those CI compiles marked ``in_ci``."""
    found = (_norm_scenarios() + _loss_scenarios() + _attention_scenarios() + _rope_scenarios()
             + _elementwise_scenarios() + _moe_scenarios() + _optimizer_scenarios())
    missing = CI_SCENARIOS - {scenario.label for scenario in found}
    if missing:
        raise AssertionError(f"scenarios: CI_SCENARIOS names scenarios that do not exist: {sorted(missing)}")
    return [dataclasses.replace(scenario, in_ci=scenario.label in CI_SCENARIOS) for scenario in found]
