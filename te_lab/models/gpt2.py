"""A GPT-2 decoder written the plain eager way: te_lab's unfused baseline.

LayerNorm, tanh-GELU MLP and softmax attention spelled out in plain PyTorch, no te_lab
kernel used. Module and attribute names mirror Hugging Face's ``GPT2LMHeadModel``
because te_lab's fusion rules match on them; the projections are ``nn.Linear`` rather
than Hugging Face's transposed ``Conv1D``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from te_lab import device as devices

from .causal_lm import CausalLM, build_seeded, check_additive_mask, explicit_attention
from .config import ModelConfig


class GPT2Attention(nn.Module):
    """Multi-head attention from one fused q/k/v projection.

    ``attention_mask``, when given, is an additive float mask broadcastable to
    [batch, heads, seq, seq] that replaces the causal mask, so it carries causality
    itself (as Hugging Face's 4-D masks do).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_kv_heads != config.num_heads:
            raise ValueError(
                f"GPT2Attention: num_kv_heads must equal num_heads ({config.num_heads}); "
                f"GPT-2 has no grouped-query attention, got {config.num_kv_heads}"
            )
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.attention_dropout = config.dropout
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        batch, seq, _ = hidden_states.shape
        q, k, v = (
            t.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
            for t in self.c_attn(hidden_states).split(self.hidden_size, dim=-1)
        )
        out = explicit_attention(q, k, v, self.scaling, attention_mask, self.attn_dropout)
        out = out.transpose(1, 2).reshape(batch, seq, self.hidden_size)
        return self.resid_dropout(self.c_proj(out))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class GPT2Body(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        seq = input_ids.size(1)
        if seq > self.wpe.num_embeddings:
            raise ValueError(
                f"GPT2Body: input_ids has {seq} positions, more than max_seq_len {self.wpe.num_embeddings}"
            )
        check_additive_mask("GPT2Body", attention_mask)
        positions = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            x = block(x, attention_mask)
        return self.ln_f(x)


class GPT2LM(CausalLM):
    base_model_prefix = "transformer"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.transformer = GPT2Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)


def gpt2(
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: devices.DeviceLike = None,
    **overrides,
) -> GPT2LM:
    """A randomly initialised GPT-2: ``PRESETS["gpt2"][preset]`` with ``overrides``
    replacing config fields (see :func:`build_seeded`)."""
    return build_seeded(GPT2LM, "gpt2", preset, seed=seed, dtype=dtype, device=device, overrides=overrides)
