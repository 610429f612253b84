"""Plain eager demo Transformers: the unfused baselines te_lab's surgery swaps layers of.

``build_model("llama-tiny")`` or ``llama("tiny", seed=0)`` gives a randomly initialised
model; nothing is downloaded. The models use no te_lab kernel, so every layer in them is
the reference a fused twin is checked against.
"""

from __future__ import annotations

from torch import nn

from .batches import example_batch
from .causal_lm import LMOutput
from .checkpoint import CheckpointError, is_checkpoint_path, load_checkpoint
from .config import PRESETS, ModelConfig
from .gpt2 import GPT2LM, GPT2MLP, GPT2Attention, GPT2Block, GPT2Body, gpt2
from .huggingface import ARCHITECTURES, huggingface
from .llama import LlamaAttention, LlamaBody, LlamaDecoderLayer, LlamaLM, LlamaMLP, RMSNorm, RotaryEmbedding, llama

_CONSTRUCTORS = {"llama": llama, "gpt2": gpt2}

MODEL_NAMES = tuple(f"{family}-{preset}" for family, presets in PRESETS.items() for preset in presets)
HUGGINGFACE_MODEL_NAMES = tuple(f"hf:{architecture}-{preset}" for architecture, (family, _, _) in ARCHITECTURES.items()
                                for preset in PRESETS[family])


def canonical_model_name(name: str) -> str:
    """The full name of a model ``build_model`` knows ("hf:llama" is "hf:llama-tiny");
    a ``ValueError`` listing the names for any other."""
    if name.startswith("hf:"):
        full_name = name if "-" in name else f"{name}-tiny"
        if full_name not in HUGGINGFACE_MODEL_NAMES:
            raise ValueError(f"build_model(name={name!r}): expected one of {', '.join(HUGGINGFACE_MODEL_NAMES)}")
        return full_name
    if name not in MODEL_NAMES:
        raise ValueError(f"build_model(name={name!r}): expected one of {', '.join(MODEL_NAMES)}"
                         f" or a Hugging Face model (hf:<architecture>[-<preset>], e.g. hf:llama-small)")
    return name


def build_model(name: str, **kwargs) -> nn.Module:
    """The model called ``name``: a demo model ("llama-tiny", "gpt2-small", ...; ``kwargs``
    go to :func:`llama` or :func:`gpt2`: seed, dtype, device, config overrides) or a
    Hugging Face one ("hf:llama-tiny", "hf:qwen2-small", ...; "hf:llama" is
    "hf:llama-tiny"; ``kwargs`` go to :func:`huggingface`), or a checkpoint on disk (a
    folder that ``save_pretrained`` wrote, a ``.gguf`` file: :func:`load_checkpoint`,
    which takes ``dtype`` and ``device`` of ``kwargs``)."""
    if is_checkpoint_path(name):
        return load_checkpoint(name, **{k: v for k, v in kwargs.items() if k in ("dtype", "device")})
    full_name = canonical_model_name(name)
    if full_name.startswith("hf:"):
        architecture, preset = full_name[len("hf:"):].split("-", 1)
        return huggingface(architecture, preset, **kwargs)
    family, preset = full_name.split("-", 1)
    return _CONSTRUCTORS[family](preset, **kwargs)


__all__ = [
    "ARCHITECTURES",
    "CheckpointError",
    "GPT2Attention",
    "GPT2Block",
    "GPT2Body",
    "GPT2LM",
    "GPT2MLP",
    "HUGGINGFACE_MODEL_NAMES",
    "LMOutput",
    "LlamaAttention",
    "LlamaBody",
    "LlamaDecoderLayer",
    "LlamaLM",
    "LlamaMLP",
    "MODEL_NAMES",
    "ModelConfig",
    "PRESETS",
    "RMSNorm",
    "RotaryEmbedding",
    "build_model",
    "canonical_model_name",
    "example_batch",
    "load_checkpoint",
    "gpt2",
    "huggingface",
    "llama",
]
