"""A Llama-family decoder written the plain eager way: te_lab's unfused baseline.

Every op is explicit PyTorch — RMSNorm by hand, rotate-half RoPE, softmax attention
spelled out — so each layer is the reference its fused twin is checked against, and no
te_lab kernel is used here. Module and attribute names mirror Hugging Face's
``LlamaForCausalLM`` because te_lab's fusion rules match on them; a state_dict of one
loads into the other.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_lab import device as devices

from .causal_lm import CausalLM, build_seeded, check_additive_mask, explicit_attention
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # float32 statistics whatever the activations' dtype, as Llama does.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def inverse_frequencies(head_dim: int, theta: float) -> Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's rotation angles, Hugging Face's layout: the
    frequencies repeated twice along the head dimension, to pair with rotate_half."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even to rotate pairs, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta), persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(bfloat16) casts every floating buffer; bf16 frequencies would put
        # position 1000's angles off by radians, so they are recomputed in float32.
        super()._apply(fn, recurse)
        self.inv_freq = inverse_frequencies(self.head_dim, self.theta).to(self.inv_freq.device)
        return self

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [batch, heads, seq, head_dim] by float32 ``cos``/``sin`` [batch, seq, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions.

    ``attention_mask``, when given, is an additive float mask broadcastable to
    [batch, heads, seq, seq] that replaces the causal mask, so it carries causality
    itself (as Hugging Face's 4-D masks do).
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.attention_dropout = config.dropout
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Optional[Tensor] = None,
    ) -> Tensor:
        batch, seq, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Each kv head serves a run of consecutive query heads.
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = explicit_attention(q, k, v, self.scaling, attention_mask,
                                 lambda probs: F.dropout(probs, p=self.attention_dropout, training=self.training))
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Optional[Tensor] = None,
    ) -> Tensor:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        check_additive_mask("LlamaBody", attention_mask)
        batch, seq = input_ids.shape
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        position_embeddings = self.rotary_emb(position_ids)
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask)
        return self.norm(hidden_states)


class LlamaLM(CausalLM):
    base_model_prefix = "model"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)


def llama(
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: devices.DeviceLike = None,
    **overrides,
) -> LlamaLM:
    """A randomly initialised Llama: ``PRESETS["llama"][preset]`` with ``overrides``
    replacing config fields (see :func:`build_seeded`)."""
    return build_seeded(LlamaLM, "llama", preset, seed=seed, dtype=dtype, device=device, overrides=overrides)
