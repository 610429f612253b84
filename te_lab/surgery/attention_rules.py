"""Rules for self-attention: ``attention``, and ``rope``, which is carried out inside the
attention twin (excluding ``rope`` keeps the rotation unfused; with ``only=["rope"]`` the
attention itself stays on the reference math).

Two layouts are recognized by their children: q/k/v projections (separate, or one
``qkv_proj`` with grouped-query widths) and an output projection, with a forward taking
``position_embeddings`` (RoPE: Llama, Mistral, Qwen, Gemma, OLMo, Phi-3, GLM-4, gpt-oss,
Falcon, GPT-NeoX, Persimmon, ...), and one ``c_attn`` projection with a
``c_proj`` (GPT-2). Head counts come from the
projection widths and the module's ``head_dim`` / head-count attributes; scaling,
causality, dropout, soft-capping (``attn_logit_softcapping``), output dropout
(``residual_dropout``) and q/k/v clipping (``config.clip_qkv``) from its attributes;
q/k norms (QK-norm) and attention sinks from its children and parameters. Sliding windows
need nothing of the rule: they are in the masks the model passes each layer. How the
module rotates q and k (rotate-half, interleaved, or not at all) is left to the probe,
which keeps the first rotation that reproduces it; so is everything else it does, and so
is how a fused projection with several key-value heads lays out q, k and v
(:data:`~te_lab.modules.attention.QKV_LAYOUTS`): ``[q | k | v]`` blocks (Phi-3), or
interleaved per key-value group (Falcon's ``new_decoder_architecture``) or per head
(GPT-NeoX, Persimmon, Falcon's ``multi_query=False``), each tried with each rotation, no
class or attribute named.
Llama 4's layers are covered by the same reading: its rotary tables are complex
frequencies (tried when the module takes no ``(cos, sin)``), its one weightless
``qk_norm`` serves q and k (a weightless RMSNorm commutes with the rotation, so it runs
inside the rope kernel's pass like the others), and on its no-RoPE layers
(``use_rope`` false, ``attn_temperature_tuning``) q gets its position's temperature from
``floor_scale`` and ``attn_scale``; that layer's probe is handed a stand-in cache
reporting past tokens, so that its positions cross a multiple of ``floor_scale`` and a
wrong temperature shows even on a short sample.
Recognized and skipped, each row saying why: multi-head latent attention (DeepSeek-V3's
MLA: ``kv_a_proj_with_mqa``, ``kv_b_proj``); ALiBi biases (``config.alibi``).
"""

from __future__ import annotations

import inspect
from typing import Optional, Union

import torch
from torch import nn

from te_lab.inputs import call_with
from te_lab.modules.attention import (
    CACHE_ARGUMENTS,
    COMPLEX_TABLE_STYLES,
    QKV_LAYOUTS,
    ROTARY_STYLES,
    FusedAttention,
    FusedQKVAttention,
)
from te_lab.modules.call_arguments import forward_signature
from te_lab.modules.linear_like import in_out_features, is_linear_like

from .inspection import (
    complex_rotary_tables,
    float_attribute,
    head_count,
    identify_rms_norm,
    identify_weightless_rms_norm,
    random_tensor,
    rotary_tables,
    takes_argument,
)
from .norm_rules import PROBE_SHAPE
from .probe import quiet_state
from .rules import BuildOptions, FusionRule, Match, MatchResult, ProbeInputs, Skip, Variant

# Child names of the q/k/v and output projections: separate, or one [q | k | v] projection.
PROJECTION_NAMES = (("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo"),
                    ("q_proj", "k_proj", "v_proj", "dense"), ("qkv_proj", "o_proj"), ("query_key_value", "dense"))
# Child names of q/k norms (QK-norm), called by the twin as the original calls them; Llama 4
# has one weightless qk_norm for both.
QK_NORM_NAMES = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("qk_norm", "qk_norm"))
# Parameters of the module's own the twin applies: per-head attention-sink logits (gpt-oss).
SINK_NAMES = ("sinks",)
# Dropout children on the attention probabilities, whose p the twin applies.
DROPOUT_NAMES = ("attn_dropout", "attention_dropout")


def _returned_container(module: nn.Module, inputs: ProbeInputs) -> Optional[tuple[type, int]]:
    """How the module returns its output: Hugging Face attention as ``(output, weights)``,
    GPT-1's as ``[output]``, plain model code bare (None)."""
    with quiet_state([module], next(module.parameters()).device), torch.no_grad():
        returned = call_with(module, inputs)
    return (type(returned), len(returned)) if isinstance(returned, (tuple, list)) else None


def _attention_output(output) -> list:
    """What a probe compares: the attention output. Hugging Face modules return
    ``(output, weights)``; decoder layers discard the weights, which a fused attention
    never forms (it returns ``None`` in their place)."""
    return [output[0] if isinstance(output, (tuple, list)) else output]


def _common_options(module: nn.Module, head_dim: int, num_heads: int, num_kv_heads: int, scaling: float,
                    example: ProbeInputs) -> dict:
    dropout = next((module._modules[name] for name in DROPOUT_NAMES if name in module._modules), None)
    dropout_p = dropout.p if isinstance(dropout, nn.Dropout) else float_attribute(module, "attention_dropout", 0.0)
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scaling=scaling,
                is_causal=bool(getattr(module, "is_causal", True)), dropout_p=dropout_p,
                returns=_returned_container(module, example))


def _head_dim(module: nn.Module, q_width: int) -> Optional[int]:
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    heads = head_count(module)
    return q_width // heads if heads and q_width % heads == 0 else None


def _missing_arguments(module: nn.Module, given: set) -> dict:
    """``None`` for every parameter of the forward after its first (the hidden states,
    passed by position) that has no default and is not in ``given`` (Mistral's and Qwen2's
    ``attention_mask`` is required, yet ``None`` is what the model passes under SDPA without
    padding)."""
    parameters = list(forward_signature(module.forward).parameters.values())[1:]
    return {p.name: None for p in parameters
            if p.default is inspect.Parameter.empty and p.name not in given
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def _qk_norm_scope(module: nn.Module, names: tuple[str, str], head_dim: int, widths: tuple[int, int]):
    """Whether the q/k norms normalize each head ("head") or the whole projection output
    ("projection", OLMo 2), read off their weights; None when neither fits. Norms without
    parameters (Llama 4's ``qk_norm``) are taken to normalize each head, the probe judging."""
    norms = [module._modules[name] for name in names]
    if all(not norm._parameters and not norm._modules for norm in norms):
        return "head"
    weights = [norm._parameters.get("weight") for norm in norms]
    if any(weight is None for weight in weights):
        return None
    if all(weight.shape[-1] == head_dim for weight in weights):
        return "head"
    if all(weight.dim() == 1 and weight.numel() == width for weight, width in zip(weights, widths)):
        return "projection"
    return None


def _table_widths(module: nn.Module, head_dim: int) -> list[int]:
    """The rotary table widths to try: a value per head dim (Hugging Face's convention) or
    per rotary pair (gpt-oss), of the whole head or of its rotated part where the module or
    its config names one (``rotary_ndims``, ``partial_rotary_factor``: StableLM, Persimmon)."""
    config = getattr(module, "config", None)
    rotated = [head_dim]
    ndims = getattr(module, "rotary_ndims", None)
    if isinstance(ndims, int) and 0 < ndims < head_dim:
        rotated.append(ndims)
    for owner in (module, config):
        factor = getattr(owner, "partial_rotary_factor", None)
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor < 1:
            rotated.append(int(head_dim * factor))
    widths = [width for rotated_dim in rotated for width in (rotated_dim, rotated_dim // 2)]
    return [width for width in dict.fromkeys(widths) if width > 0]


# The forms rotary tables take: Hugging Face's (cos, sin), or one complex tensor of
# frequencies (Llama 4's freqs_cis), tried in this order.
TABLE_KINDS = ("cos_sin", "complex")


def _rotary_inputs(kind: str, batch: int, seq: int, width: int, module: nn.Module):
    if kind == "complex":
        return complex_rotary_tables(batch, seq, width, module)
    return rotary_tables(batch, seq, width, module)


def _table_width(module: nn.Module, inputs, head_dim: int) -> Optional[tuple[str, int]]:
    """The kind (:data:`TABLE_KINDS`) and width (:func:`_table_widths`) of the rotary tables
    the module takes, found by calling it."""
    for kind in TABLE_KINDS:
        for width in _table_widths(module, head_dim):
            try:
                _returned_container(module, inputs(kind, width))
            except Exception:  # noqa: BLE001 - the module refused tables of this kind or width
                continue
            return kind, width
    return None


def _rotary_styles(module: nn.Module, table_kind: str) -> tuple[str, ...]:
    """The rotations to try, most common first; the probe keeps the one the module computes."""
    if not getattr(module, "use_rope", True):  # SmolLM3's and Llama 4's no-RoPE layers
        return ("none",)
    complex_tables = table_kind == "complex"
    return tuple(style for style in ROTARY_STYLES
                 if style == "none" or (style in COMPLEX_TABLE_STYLES) == complex_tables)


def _input_name(module: nn.Module) -> str:
    """The name of the forward's first parameter, the hidden states."""
    return next(iter(forward_signature(module.forward).parameters), "hidden_states")


def _rms_norm_of(norm: nn.Module, head_dim: int) -> Optional[tuple[float, float]]:
    """``(eps, weight_offset)`` of a q/k norm that is an RMSNorm, with a weight or without
    one (then over each head: Llama 4's ``qk_norm``), else None."""
    found = identify_rms_norm(norm)
    if found is not None:
        return found
    eps = identify_weightless_rms_norm(norm, head_dim)
    return None if eps is None else (eps, 0.0)


def _optional_float(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _unsupported_positions(module: nn.Module) -> Optional[Skip]:
    """Position schemes the twin does not apply, read off the module's attributes: ALiBi."""
    if getattr(getattr(module, "config", None), "alibi", False) is True:
        return Skip("ALiBi position biases (config.alibi) are not covered")
    return None


def _temperature(module: nn.Module) -> Union[tuple[float, float], Skip, None]:
    """``(floor_scale, attn_scale)`` of a no-RoPE layer that scales q by a position-dependent
    temperature (Llama 4's ``attn_temperature_tuning``), None for any other layer."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    floor_scale, attn_scale = (_optional_float(getattr(module, name, None)) for name in ("floor_scale", "attn_scale"))
    if floor_scale is None or attn_scale is None:
        return Skip("its no-RoPE layer scales q by a position-dependent temperature (attn_temperature_tuning) "
                    "without a positive floor_scale and attn_scale to compute it from")
    return floor_scale, attn_scale


class PastTokens:
    """A stand-in KV cache for a probe: it says ``length`` tokens were seen before the call
    and hands back the keys and values it is given, so a module that counts its positions
    from the cache (Llama 4's temperature on q) computes them from ``length`` on, while
    attending only over the call's own tokens, as the captured mask says. Stateless: the
    probe's three runs see the same."""

    def __init__(self, length: int):
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states


def _past_for_temperature(floor_scale: float, seq: int) -> int:
    """How many past tokens put the first multiple of ``floor_scale`` in the middle of a
    probe's ``seq`` positions (none where they already reach one): the temperature
    changes inside the probe instead of being 1 at every position of a short sample."""
    return max(int(floor_scale) - 1 - seq // 2, 0)


def match_projections(module: nn.Module) -> MatchResult:
    names = next((n for n in PROJECTION_NAMES if all(is_linear_like(module._modules.get(p)) for p in n)), None)
    if names is None or not takes_argument(module, "position_embeddings"):
        return None
    unsupported = _unsupported_positions(module)
    if unsupported is not None:
        return unsupported
    temperature = _temperature(module)
    if isinstance(temperature, Skip):
        return temperature
    norms = next((n for n in QK_NORM_NAMES if all(name in module._modules for name in n)), None)
    dropouts = {name for name in DROPOUT_NAMES if isinstance(module._modules.get(name), nn.Dropout)}
    extra = sorted(set(module._modules) - set(names) - set(norms or ()) - dropouts)
    own = sorted(set(module._parameters) - set(SINK_NAMES))
    if extra or own:
        what = ", ".join(extra) if extra else f"parameters of its own ({', '.join(own)})"
        return Skip(f"has {what} beyond the q/k/v/o projections, q/k norms and sinks, which the fused attention "
                    f"does not apply")
    fused_qkv = len(names) == 2
    hidden, qkv_width = in_out_features(module._modules[names[0]])
    q_width = in_out_features(module._modules[names[-1]])[0]
    head_dim = _head_dim(module, q_width)
    kv_width = (qkv_width - q_width) // 2 if fused_qkv else in_out_features(module._modules[names[1]])[1]
    if (head_dim is None or q_width % head_dim or kv_width <= 0 or kv_width % head_dim
            or (q_width // head_dim) % (kv_width // head_dim) or (fused_qkv and qkv_width != q_width + 2 * kv_width)):
        return Skip("cannot tell its head layout from head_dim and the projection widths")
    num_heads, num_kv_heads = q_width // head_dim, kv_width // head_dim
    if not fused_qkv:
        q_out, v_out = (in_out_features(module._modules[name])[1] for name in (names[0], names[2]))
        if q_out != q_width or v_out != kv_width:
            return Skip(f"its {names[2]} gives {v_out} values and its {names[0]} {q_out} where {names[1]} gives "
                        f"{kv_width} and {names[-1]} takes {q_width}: value heads of another width than the "
                        f"query and key heads are not covered yet")
    scope = None if norms is None else _qk_norm_scope(module, norms, head_dim, (q_width, kv_width))
    if norms is not None and scope is None:
        return Skip(f"cannot tell what its q/k norms ({', '.join(norms)}) normalize over from their weights")
    sinks = next((name for name in SINK_NAMES if name in module._parameters), None)
    if sinks is not None and tuple(module._parameters[sinks].shape) != (num_heads,):
        return Skip(f"its {sinks} parameter has shape {tuple(module._parameters[sinks].shape)}; attention sinks "
                    f"are one logit per query head ({num_heads})")
    scaling = float_attribute(module, "scaling", head_dim ** -0.5)
    config = getattr(module, "config", None)
    rms_norms = None if norms is None else tuple(_rms_norm_of(module._modules[name], head_dim) for name in norms)
    features = dict(qk_norms=norms, qk_norm_scope=scope or "head", sinks=sinks,
                    softcap=_optional_float(getattr(module, "attn_logit_softcapping", None)),
                    clip_qkv=_optional_float(getattr(config, "clip_qkv", None)),
                    output_dropout=float_attribute(module, "residual_dropout", 0.0), temperature=temperature)
    # A temperature counts positions from the KV cache: its probe gets a stand-in cache.
    cache_name = None if temperature is None else next(
        (name for name in CACHE_ARGUMENTS if takes_argument(module, name)), None)
    if temperature is not None and cache_name is None:
        return Skip("its no-RoPE layer scales q by a position-dependent temperature (attn_temperature_tuning) "
                    "but takes no KV cache argument to count positions from")

    def with_past_tokens(probe_inputs: ProbeInputs) -> ProbeInputs:
        """``probe_inputs`` with a stand-in cache (:class:`PastTokens`) that makes the
        temperature change inside the probe."""
        hidden_states = probe_inputs.kwargs.get(_input_name(module),
                                                probe_inputs.args[0] if probe_inputs.args else None)
        seq = hidden_states.shape[-2] if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() >= 2 else 1
        past = PastTokens(_past_for_temperature(temperature[0], seq))
        return ProbeInputs(probe_inputs.args, {**probe_inputs.kwargs, cache_name: past})

    def inputs(batch: int, seq: int, table: tuple[str, int]) -> ProbeInputs:
        kind, width = table
        kwargs = {"position_embeddings": _rotary_inputs(kind, batch, seq, width, module)}
        return ProbeInputs((random_tensor((batch, seq, hidden), module),),
                           kwargs | _missing_arguments(module, set(kwargs)))

    table = _table_width(module, lambda kind, width: inputs(1, 2, (kind, width)), head_dim)
    if table is None:
        return Skip(f"takes no rotary tables of {' or '.join(map(str, _table_widths(module, head_dim)))} values per "
                    f"position (head_dim {head_dim}, or a pair's, or its rotated part's), as (cos, sin) or complex")

    def example(batch: int = PROBE_SHAPE[0], seq: int = PROBE_SHAPE[1]) -> ProbeInputs:
        synthesized = inputs(batch, seq, table)
        return synthesized if temperature is None else with_past_tokens(synthesized)

    # How a fused projection lays out q, k and v: tried with each rotation (with one
    # key-value head the layouts are the same); "blocks" first, the common one.
    layouts = QKV_LAYOUTS if fused_qkv and num_kv_heads > 1 else ("blocks",)

    def layout_note(layout: str) -> list[str]:
        if layout == "blocks":
            return []
        return ["q/k/v interleaved per " + ("head" if num_kv_heads == num_heads else "key-value group")]

    def variant(layout: str, rotary: str, fused_norms: bool, fused_rope: bool = True) -> Variant:
        def build(options: BuildOptions) -> FusedAttention:
            return FusedAttention(
                module, projections=names, rotary=rotary, qkv_layout=layout,
                fused_rope=fused_rope and "rope" in options.enabled_rules,
                qk_rms_norms=rms_norms if fused_norms and "rmsnorm" in options.enabled_rules else None, **features,
                **_common_options(module, head_dim, num_heads, num_kv_heads, scaling, example(1, 4)),
                fused_attention="attention" in options.enabled_rules, backend=options.backend)
        notes = ([] if rotary == "rotate_half" else [f"rotary: {rotary}"]) + layout_note(layout) + \
            ([] if temperature is None else ["q temperature-tuned (floor_scale {:g}, attn_scale {:g})".format(
                *temperature)]) + \
            (["q/k norms run as the module's own"] if len(norm_choices) == 2 and not fused_norms else []) + \
            (["rotation on te_lab's reference math"] if not fused_rope and rotary != "none" else [])
        return Variant(build, note="; ".join(notes))

    # Each rotation fully fused first (q/k RMSNorms as te_lab's rms_norm); then, where the
    # probe found the fused rounding past its bar (its error against float64 more than
    # twice the module's), the module's own q/k norms, then the rotation on te_lab's
    # reference math as well, each row saying so.
    styles = _rotary_styles(module, table[0])
    norm_choices = (True, False) if rms_norms is not None and None not in rms_norms else (False,)
    variants = [variant(layout, rotary, norm_choices[0]) for layout in layouts for rotary in styles]
    if len(norm_choices) == 2:
        variants += [variant(layout, rotary, False) for layout in layouts for rotary in styles]
    variants += [variant(layout, rotary, False, fused_rope=False) for layout in layouts for rotary in styles
                 if rotary != "none"]
    return Match(variants, example, complete_inputs=None if temperature is None else with_past_tokens,
                 probe_outputs=_attention_output)


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
        return ProbeInputs((random_tensor((batch, seq, hidden), module),),
                           _missing_arguments(module, set()))

    def build(options: BuildOptions) -> FusedQKVAttention:
        return FusedQKVAttention(
            module, qkv="c_attn", out="c_proj", resid_dropout=resid_dropout,
            **_common_options(module, head_dim, heads, heads, scaling, example(1, 4)),
            fused_attention="attention" in options.enabled_rules, backend=options.backend)

    return Match([Variant(build)], example, probe_outputs=_attention_output)


def match_latent_attention(module: nn.Module) -> MatchResult:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values decompressed
    from a low-rank latent (``kv_a_proj_with_mqa``, ``kv_b_proj``). Recognized, so its
    report row says why it stays unfused."""
    if is_linear_like(module._modules.get("kv_a_proj_with_mqa")) and is_linear_like(module._modules.get("kv_b_proj")):
        return Skip("multi-head latent attention (MLA: kv_a_proj_with_mqa, kv_b_proj) is not covered yet")
    return None


def match_attention(module: nn.Module) -> MatchResult:
    return match_projections(module) or match_qkv_projection(module) or match_latent_attention(module)


ATTENTION = FusionRule(
    "attention", "attention",
    "softmax attention with q/k/v/o or fused qkv projections -> block-wise fused attention (GQA, causal, masks)",
    match_attention)
ROPE = FusionRule(
    "rope", "rope", "rotary embedding of q and k in one pass, inside the fused attention twin",
    lambda module: None, realized_by="attention")
