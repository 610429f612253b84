"""Rules for self-attention: ``attention``, and ``rope``, which is carried out inside the
attention twin (excluding ``rope`` keeps the rotation unfused; with ``only=["rope"]`` the
attention itself stays on the reference math).

Two layouts are recognized by their children: separate ``q_proj``/``k_proj``/
``v_proj``/``o_proj`` projections with a forward taking ``position_embeddings``
(Llama-family, RoPE) and one ``c_attn`` projection with a ``c_proj`` (GPT-2). Head
counts come from the projection widths and the module's ``head_dim`` / head-count
attributes; scaling, causality and dropout from its attributes. What the module does
with them is checked by the probe.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from te_lab.inputs import call_with
from te_lab.modules.attention import FusedAttention, FusedQKVAttention
from te_lab.modules.linear_like import in_out_features, is_linear_like

from .inspection import float_attribute, head_count, random_tensor, rotary_tables, takes_argument
from .norm_rules import PROBE_SHAPE
from .probe import quiet_state
from .rules import BuildOptions, FusionRule, Match, MatchResult, ProbeInputs, Skip, Variant, register_builtin_rule

PROJECTION_NAMES = (("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo"))


def _returns_tuple(module: nn.Module, inputs: ProbeInputs) -> bool:
    """Hugging Face attention returns ``(output, weights)``, plain model code the output."""
    with quiet_state([module], next(module.parameters()).device), torch.no_grad():
        return isinstance(call_with(module, inputs), tuple)


def _attention_output(output) -> list:
    """What a probe compares: the attention output. Hugging Face modules return
    ``(output, weights)``; decoder layers discard the weights, which a fused attention
    never forms (it returns ``None`` in their place)."""
    return [output[0] if isinstance(output, tuple) else output]


def _common_options(module: nn.Module, head_dim: int, num_heads: int, num_kv_heads: int, scaling: float,
                    example: ProbeInputs) -> dict:
    dropout = module._modules.get("attn_dropout")
    dropout_p = dropout.p if isinstance(dropout, nn.Dropout) else float_attribute(module, "attention_dropout", 0.0)
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scaling=scaling,
                is_causal=bool(getattr(module, "is_causal", True)), dropout_p=dropout_p,
                returns_tuple=_returns_tuple(module, example))


def _head_dim(module: nn.Module, q_width: int) -> Optional[int]:
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    heads = head_count(module)
    return q_width // heads if heads and q_width % heads == 0 else None


def match_separate_projections(module: nn.Module) -> MatchResult:
    names = next((n for n in PROJECTION_NAMES if all(is_linear_like(module._modules.get(p)) for p in n)), None)
    if names is None or not takes_argument(module, "position_embeddings"):
        return None
    extra = sorted(set(module._modules) - set(names))
    if extra or module._parameters:
        what = ", ".join(extra) if extra else "parameters of its own"
        return Skip(f"has {what} beyond the q/k/v/o projections, which the fused attention does not apply")
    if getattr(module, "sliding_window", None) is not None:
        return Skip("sliding-window attention is not covered")
    hidden, q_width = in_out_features(module._modules[names[0]])
    kv_width = in_out_features(module._modules[names[1]])[1]
    head_dim = _head_dim(module, q_width)
    if head_dim is None or q_width % head_dim or kv_width % head_dim or (q_width // head_dim) % (kv_width // head_dim):
        return Skip("cannot tell its head layout from head_dim and the projection widths")
    num_heads, num_kv_heads = q_width // head_dim, kv_width // head_dim
    scaling = float_attribute(module, "scaling", head_dim ** -0.5)

    def example(batch: int = PROBE_SHAPE[0], seq: int = PROBE_SHAPE[1]) -> ProbeInputs:
        return ProbeInputs((random_tensor((batch, seq, hidden), module),),
                           {"position_embeddings": rotary_tables(batch, seq, head_dim, module)})

    def build(options: BuildOptions) -> FusedAttention:
        return FusedAttention(
            module, projections=names, fused_rope="rope" in options.enabled_rules,
            **_common_options(module, head_dim, num_heads, num_kv_heads, scaling, example(1, 4)),
            fused_attention="attention" in options.enabled_rules, backend=options.backend)

    return Match([Variant(build)], example, probe_outputs=_attention_output)


def match_qkv_projection(module: nn.Module) -> MatchResult:
    qkv, out = module._modules.get("c_attn"), module._modules.get("c_proj")
    if not (is_linear_like(qkv) and is_linear_like(out)) or takes_argument(module, "position_embeddings"):
        return None
    hidden, qkv_width = in_out_features(qkv)
    if getattr(module, "is_cross_attention", False):
        return Skip("cross-attention is not covered")
    extra = sorted(set(module._modules) - {"c_attn", "c_proj", "attn_dropout", "resid_dropout"})
    if extra or module._parameters or qkv_width != 3 * hidden:
        return Skip("its projections are not one [q | k | v] projection and an output projection")
    heads = head_count(module)
    if not heads or hidden % heads:
        return Skip("cannot tell its number of heads")
    head_dim = hidden // heads
    if getattr(module, "scale_attn_weights", True) is False and not hasattr(module, "scaling"):
        scaling = 1.0
    else:
        scaling = float_attribute(module, "scaling", head_dim ** -0.5)
    resid_dropout = "resid_dropout" if isinstance(module._modules.get("resid_dropout"), nn.Dropout) else None

    def example(batch: int = PROBE_SHAPE[0], seq: int = PROBE_SHAPE[1]) -> ProbeInputs:
        return ProbeInputs((random_tensor((batch, seq, hidden), module),))

    def build(options: BuildOptions) -> FusedQKVAttention:
        return FusedQKVAttention(
            module, qkv="c_attn", out="c_proj", resid_dropout=resid_dropout,
            **_common_options(module, head_dim, heads, heads, scaling, example(1, 4)),
            fused_attention="attention" in options.enabled_rules, backend=options.backend)

    return Match([Variant(build)], example, probe_outputs=_attention_output)


def match_attention(module: nn.Module) -> MatchResult:
    return match_separate_projections(module) or match_qkv_projection(module)


ATTENTION = register_builtin_rule(FusionRule(
    "attention", "attention",
    "softmax attention with q/k/v/o or fused qkv projections -> block-wise fused attention (GQA, causal, masks)",
    match_attention))
ROPE = register_builtin_rule(FusionRule(
    "rope", "rope", "rotary embedding of q and k in one pass, inside the fused attention twin",
    lambda module: None, realized_by="attention"))
