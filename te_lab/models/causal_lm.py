"""What the demo language models share: the output, the loss, the explicit attention
formula, and the language-model shell around a body (embeddings + blocks + final norm).

The shell mirrors Hugging Face's causal LMs where te_lab's rules look: an ``lm_head``,
a body child named by ``base_model_prefix``, ``forward(input_ids, labels=None, ...)``
returning an output with ``loss`` and ``logits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_lab import device as devices

from .batches import example_batch
from .config import preset_config

IGNORE_INDEX = -100
INIT_STD = 0.02


@dataclass
class LMOutput:
    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of predicting token t+1 from position t.

    Hugging Face's causal-LM convention: ``labels`` are aligned with the inputs (usually
    the input ids themselves) and shifted here, label -100 is not counted, and the
    logits are upcast so a bf16 model's loss is as exact as a float32 one's.
    """
    vocab_size = logits.size(-1)
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab_size),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


def causal_mask(seq: int, device: torch.device) -> Tensor:
    """True above the diagonal: the future positions a query may not attend to."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, scaling: float, attention_mask: Optional[Tensor],
                       dropout: Callable[[Tensor], Tensor]) -> Tensor:
    """softmax(q k^T * scaling + mask) v over [batch, heads, seq, head_dim], written out.

    Without ``attention_mask`` the mask is causal; a given additive float mask replaces
    it, so it carries causality itself (as Hugging Face's 4-D masks do). Softmax runs in
    float32; ``dropout`` is applied to the probabilities.
    """
    scores = (q @ k.transpose(-2, -1)) * scaling
    if attention_mask is None:
        scores = scores.masked_fill(causal_mask(q.shape[-2], scores.device), float("-inf"))
    else:
        scores = scores + attention_mask
    probs = dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype))
    return probs @ v


def check_additive_mask(owner: str, attention_mask: Optional[Tensor]) -> None:
    if attention_mask is not None and not attention_mask.is_floating_point():
        raise ValueError(
            f"{owner}: attention_mask must be an additive float mask (0 to attend, -inf not to), "
            f"got dtype {attention_mask.dtype}"
        )


class CausalLM(nn.Module):
    """An ``lm_head`` over the body named by ``base_model_prefix``; subclasses build both."""

    base_model_prefix = ""

    def _init_weights(self, module: nn.Module) -> None:
        # Norms keep their ones (and zeros).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, input_ids: Tensor, labels: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None
    ) -> LMOutput:
        body = getattr(self, self.base_model_prefix)
        logits = self.lm_head(body(input_ids, attention_mask))
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return LMOutput(loss=loss, logits=logits)

    def example_batch(self, batch: int = 2, seq: int = 16, *, seed: int = 0) -> dict[str, Tensor]:
        """Random token ids on the model's device; a seed of its own, the global RNG untouched."""
        return example_batch(self, batch, seq, seed=seed)

    def num_parameters(self) -> int:
        # parameters() yields a tied weight once.
        return sum(p.numel() for p in self.parameters())


def build_seeded(model_class: type, family: str, preset: str, *, seed: int, dtype: torch.dtype,
                 device: devices.DeviceLike, overrides: dict) -> CausalLM:
    """``model_class(PRESETS[family][preset] with overrides)``, randomly initialised.

    Weights are drawn on the CPU in float32 from ``seed`` alone, so a seed gives the
    same model on every device and in every dtype, and the global RNG is left as it was.
    """
    config = preset_config(family, preset, overrides)
    target = devices.resolve(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(device=target, dtype=dtype)
