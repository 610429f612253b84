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

from .config import ModelConfig, preset_config
from .output import LMOutput, causal_lm_loss

INIT_STD = 0.02


def causal_mask(seq: int, device: torch.device) -> Tensor:
    """True above the diagonal: the future positions a query may not attend to."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)


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
        scores = (q @ k.transpose(-2, -1)) * self.scaling
        if attention_mask is None:
            scores = scores.masked_fill(causal_mask(seq, scores.device), float("-inf"))
        else:
            scores = scores + attention_mask
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        probs = self.attn_dropout(probs)
        out = (probs @ v).transpose(1, 2).reshape(batch, seq, self.hidden_size)
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
        if attention_mask is not None and not attention_mask.is_floating_point():
            raise ValueError(
                f"GPT2Body: attention_mask must be an additive float mask (0 to attend, -inf not to), "
                f"got dtype {attention_mask.dtype}"
            )
        positions = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            x = block(x, attention_mask)
        return self.ln_f(x)


class GPT2LM(nn.Module):
    base_model_prefix = "transformer"

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.transformer = GPT2Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # LayerNorms keep their ones and zeros.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, input_ids: Tensor, labels: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None
    ) -> LMOutput:
        logits = self.lm_head(self.transformer(input_ids, attention_mask))
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return LMOutput(loss=loss, logits=logits)

    def example_batch(self, batch: int = 2, seq: int = 16, *, seed: int = 0) -> dict[str, Tensor]:
        """Random token ids on the model's device; a seed of its own, the global RNG untouched."""
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(self.config.vocab_size, (batch, seq), generator=generator)
        input_ids = input_ids.to(self.lm_head.weight.device)
        return dict(input_ids=input_ids, labels=input_ids.clone())

    def num_parameters(self) -> int:
        # parameters() yields a tied weight once.
        return sum(p.numel() for p in self.parameters())


def gpt2(
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: devices.DeviceLike = None,
    **overrides,
) -> GPT2LM:
    """A randomly initialised GPT-2: ``PRESETS["gpt2"][preset]`` with ``overrides``
    replacing config fields.

    Weights are drawn on the CPU in float32 from ``seed`` alone, so a seed gives the
    same model on every device and in every dtype, and the global RNG is left as it was.
    """
    config = preset_config("gpt2", preset, overrides)
    target = devices.resolve(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LM(config)
    return model.to(device=target, dtype=dtype)
