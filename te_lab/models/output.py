"""What a demo language model returns, and how its loss is counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


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
