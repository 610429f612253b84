"""Hugging Face transformers models built from a config, randomly initialised (nothing is
downloaded), at the sizes of the demo presets.

``huggingface("llama", "small")`` is a ``LlamaForCausalLM`` shaped like the demo
``llama-small``, so te_lab can be measured on the model code researchers run (SDPA
attention, Hugging Face's own norms) beside the demo's hand-written layers.
``build_model("hf:llama-small")`` is the same model.

``hf:qwen3_moe-<preset>`` is a ``Qwen3MoeForCausalLM`` with the Llama preset's widths, 2
layers and an MoE block in each: 32 experts of width hidden / 2, top-4, the top-4 weights
normalised (issue 26's measured model: ``hf:qwen3_moe-mini`` at 4 x 256 is its whole
training step, hidden 256, expert width 128).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from te_lab import device as devices

from .config import ModelConfig, preset_config

# architecture -> (the preset family whose sizes it takes, config class, model class)
ARCHITECTURES: dict[str, tuple[str, str, str]] = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("llama", "MistralConfig", "MistralForCausalLM"),
    "qwen2": ("llama", "Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("gpt2", "GPT2Config", "GPT2LMHeadModel"),
    "qwen3_moe": ("llama", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# architecture -> ModelConfig fields it sets whatever the preset (``overrides`` still win)
PRESET_CHANGES: dict[str, dict] = {"qwen3_moe": {"num_layers": 2}}
MOE_EXPERTS, MOE_TOP_K = 32, 4


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(
            "te_lab.models.huggingface needs the transformers package: pip install 'te_lab[hf]'"
        ) from error


def _config_kwargs(architecture: str, family: str, shape: ModelConfig) -> dict:
    """The Hugging Face config fields that give ``shape``; dropout off, as in the demo
    models, so fused and unfused runs are comparable step for step."""
    if family == "gpt2":
        # GPT-2's default bos/eos id (50256) lies outside the small vocabularies.
        return dict(vocab_size=shape.vocab_size, n_embd=shape.hidden_size, n_inner=shape.intermediate_size,
                    n_layer=shape.num_layers, n_head=shape.num_heads, n_positions=shape.max_seq_len,
                    layer_norm_epsilon=shape.norm_eps, tie_word_embeddings=shape.tie_embeddings,
                    bos_token_id=shape.vocab_size - 1, eos_token_id=shape.vocab_size - 1,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                  intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                  num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                  max_position_embeddings=shape.max_seq_len, rms_norm_eps=shape.norm_eps,
                  rope_theta=shape.rope_theta, tie_word_embeddings=shape.tie_embeddings, attention_dropout=0.0)
    if architecture == "qwen3_moe":
        # Every layer sparse; head_dim given, since Qwen3's default (128) ignores the width.
        return dict(common, head_dim=shape.head_dim, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                    moe_intermediate_size=shape.hidden_size // 2, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[])
    return common


def huggingface(architecture: str = "llama", preset: str = "tiny", *, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: devices.DeviceLike = None, **overrides) -> nn.Module:
    """A randomly initialised Hugging Face causal LM of ``architecture`` (see
    ``ARCHITECTURES``) with the sizes of the demo preset, changed by the architecture's
    ``PRESET_CHANGES`` (``overrides`` replace ``ModelConfig`` fields after them). Weights
    are drawn on the CPU from ``seed`` alone; the global RNG is left as it was."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"huggingface(architecture={architecture!r}): expected one of {', '.join(map(repr, ARCHITECTURES))}"
        )
    family, config_name, model_name = ARCHITECTURES[architecture]
    shape = preset_config(family, preset, {**PRESET_CHANGES.get(architecture, {}), **overrides})
    transformers = _transformers()
    config = getattr(transformers, config_name)(**_config_kwargs(architecture, family, shape))
    target = devices.resolve(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
    return model.to(device=target, dtype=dtype)

