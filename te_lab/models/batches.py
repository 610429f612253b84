"""Random token batches for any causal LM with a ``config.vocab_size``: te_lab's demo
models and Hugging Face's alike."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def example_batch(model: nn.Module, batch: int = 2, seq: int = 16, *, seed: int = 0) -> dict[str, Tensor]:
    """Random token ids (and the same ids as labels) on the model's device; a seed of
    its own, the global RNG untouched."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"example_batch(batch={batch!r}): expected a positive int")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"example_batch(seq={seq!r}): expected a positive int")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(model.config.vocab_size, (batch, seq), generator=generator)
    input_ids = input_ids.to(next(model.parameters()).device)
    return dict(input_ids=input_ids, labels=input_ids.clone())
