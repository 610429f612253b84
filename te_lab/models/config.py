"""The shape of a demo model, and the named presets it comes in.

One dataclass serves both families: GPT-2 ignores what it has no use for
(``num_kv_heads`` equals ``num_heads`` there, ``rope_theta`` is unused), so a preset and
an override read the same way whichever family they are for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# Parameter counts in the comments are what num_parameters() reports (tied weights once).
PRESETS: dict[str, dict[str, ModelConfig]] = {
    "llama": {
        # 125,248 parameters: CPU tests in seconds.
        "tiny": ModelConfig(
            vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=176, max_seq_len=128,
        ),
        # 4,999,424 parameters
        "mini": ModelConfig(
            vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
            intermediate_size=688, max_seq_len=512,
        ),
        # 100,092,672 parameters
        "small": ModelConfig(
            vocab_size=16000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
            intermediate_size=2048, max_seq_len=1024,
        ),
    },
    "gpt2": {
        # 124,672 parameters
        "tiny": ModelConfig(
            vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
            intermediate_size=256, max_seq_len=128, norm_eps=1e-5, tie_embeddings=True,
        ),
        # 4,339,200 parameters
        "mini": ModelConfig(
            vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
            intermediate_size=1024, max_seq_len=512, norm_eps=1e-5, tie_embeddings=True,
        ),
        # 98,130,432 parameters
        "small": ModelConfig(
            vocab_size=16000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
            intermediate_size=3072, max_seq_len=1024, norm_eps=1e-5, tie_embeddings=True,
        ),
    },
}


def preset_config(family: str, preset: str, overrides: dict) -> ModelConfig:
    """``PRESETS[family][preset]`` with ``overrides`` replacing its fields."""
    presets = PRESETS[family]
    if preset not in presets:
        raise ValueError(f"{family}(preset={preset!r}): expected one of {', '.join(map(repr, presets))}")
    fields = [field.name for field in dataclasses.fields(ModelConfig)]
    unknown = [name for name in overrides if name not in fields]
    if unknown:
        raise ValueError(
            f"{family}({unknown[0]}=...): not a ModelConfig field; expected one of {', '.join(fields)}"
        )
    return dataclasses.replace(presets[preset], **overrides)
