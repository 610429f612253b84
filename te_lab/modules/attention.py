"""Fused twins of self-attention blocks: the projections stay GEMMs, rotary embedding
of q and k is one pass (``rope``), and softmax attention is the block-wise
kernel that never holds the score matrix (``attention``).

- :class:`FusedAttention`: q/k/v projections, separate (``q_proj``/``k_proj``/``v_proj``:
  Llama, Mistral, Qwen, Gemma, OLMo, gpt-oss, ...) or one fused projection in either of
  :data:`QKV_LAYOUTS`: ``[q | k | v]`` with grouped-query widths (Phi-3's ``qkv_proj``,
  Falcon's multi-query ``query_key_value``), or q, k and v interleaved per key-value group
  (Falcon's ``new_decoder_architecture``) or per head (GPT-NeoX, Persimmon, Falcon's
  ``multi_query=False``), and an output projection; RoPE from
  ``position_embeddings`` ``(cos, sin)`` or complex frequencies (Llama 4's ``freqs_cis``)
  in any of :data:`ROTARY_STYLES`, over all or the first dims of each head (partial
  rotary: the tables' width says how many); optional q/k norms (QK-norm: Qwen3, Gemma 3,
  OLMo 2, Llama 4's weightless ``qk_norm``; RMSNorms over each head run inside the
  rotation's pass), attention sinks (gpt-oss), logit soft-capping (Gemma 2), q/k/v
  clipping (OLMo), output dropout (Starcoder2) and a position-dependent temperature on q
  (Llama 4's no-RoPE layers).
- :class:`FusedQKVAttention`: one ``c_attn`` projection giving ``[q | k | v]`` and a
  ``c_proj`` (GPT-2, te_lab's demo GPT-2), no RoPE.

Calls are read by parameter name against the original's signature. A call the fused
path does not cover (cross-attention, head masks, requested attention weights, a
non-tensor or 2-D mask, an attention implementation other than SDPA or eager) is handed
to the original module unchanged. Masks follow Hugging Face's convention: the given
additive or boolean mask (sliding windows and padding are in it), or with ``None`` what
the original's implementation does then: causal over a multi-token query under SDPA
(top-left aligned, also against a cache), nothing under eager. A KV cache (Hugging
Face's ``DynamicCache``, ``StaticCache`` and their sliding-window layers) is updated
with the rotated keys and the values, as the original does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_lab.kernels.attention import ATTENTION, attention
from te_lab.kernels.linear import LINEAR
from te_lab.kernels.rms_norm import RMS_NORM, rms_norm
from te_lab.kernels.rope import ROPE, rope

from . import direct
from .base import FusedModule
from .call_arguments import ArgumentReader, forward_signature
from .projection import linear_ops, project

# Names model libraries give the KV cache argument (Hugging Face renamed it over releases).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
# Arguments whose presence (not None / not False) the fused path does not cover.
UNCOVERED_ARGUMENTS = ("encoder_hidden_states", "head_mask", "output_attentions", "alibi")
# Hugging Face attention implementations whose math the fused path reproduces (None: a
# module without a config, such as te_lab's demo models, which call SDPA).
COVERED_IMPLEMENTATIONS = (None, "sdpa", "eager")
# How a twin rotates q and k, and in which order the tables come: Hugging Face's
# rotate-half pairs (i, i + d/2) with a table value per dim (Llama); the same pairs with
# one value per pair, tables half as wide (gpt-oss); interleaved pairs (2i, 2i + 1) with
# per-dim tables in that order (Cohere); interleaved pairs with rotate-half tables, whose
# first half is repeated pairwise (GLM-4); interleaved pairs rotated by one complex number
# each, the tables a complex tensor [batch, seq, pairs] (Llama 4's freqs_cis, applied with
# view_as_complex); or no rotation (layers without RoPE: SmolLM3, EXAONE 4's global layers).
ROTARY_STYLES = ("rotate_half", "rotate_half_pair_tables", "interleaved", "interleaved_rotate_half_tables",
                 "interleaved_complex_tables", "none")
# The styles whose position_embeddings is one complex tensor rather than (cos, sin).
COMPLEX_TABLE_STYLES = ("interleaved_complex_tables",)
# How one fused projection's output holds q, k and v: "blocks" ``[q heads | k heads | v
# heads]`` (Phi-3's qkv_proj, Falcon's multi-query query_key_value); "grouped" per key-value
# group, ``[kv_heads, heads // kv_heads + 2, head_dim]``: each group's query heads, then its
# key head and its value head (Falcon's new_decoder_architecture), which with one query head
# per group is ``[heads, 3, head_dim]``, q, k and v interleaved per head (GPT-NeoX, whose
# ``[heads, 3 * head_dim]`` view chunked in three is the same; Persimmon; Falcon's
# multi_query=False). With one key-value head both layouts are the same.
QKV_LAYOUTS = ("blocks", "grouped")
# Where q/k norms apply: over each head's dims (Qwen3, Gemma 3, Cohere) or over the whole
# projection output before it is split into heads (OLMo 2).
QK_NORM_SCOPES = ("head", "projection")


class _FusedSelfAttention(FusedModule):
    def __init__(self, original: nn.Module, *, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 is_causal: bool, dropout_p: float, returns: Optional[tuple[type, int]],
                 fused_attention: bool = True,
                 backend: Optional[str] = None):
        super().__init__(original, backend)
        self.fused_attention = fused_attention
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling, self.is_causal, self.dropout_p = scaling, is_causal, dropout_p
        self.returns = returns  # (tuple or list, length) of the original's output, None: bare
        self.layer_idx = getattr(original, "layer_idx", None)
        signature = forward_signature(original.forward)
        self._arguments = ArgumentReader(signature)
        # Hugging Face's "hidden_states"; GPT-1's attention calls it "x"
        self._input_name = next(iter(signature.parameters), "hidden_states")

    def _call_original(self, args: tuple, kwargs: dict):
        self.original.training = self.training  # the children are shared and already in this mode
        return self.original(*args, **kwargs)

    def _implementation(self) -> Optional[str]:
        # Read per call: a user may switch config._attn_implementation after fusing.
        return getattr(getattr(self.original, "config", None), "_attn_implementation", None)

    @staticmethod
    def _cache(named: dict[str, Any]):
        cache = next((named[name] for name in CACHE_ARGUMENTS if named.get(name) is not None), None)
        # Encoder-decoder caches hold the self-attention cache inside.
        return getattr(cache, "self_attention_cache", cache)

    def _covers(self, named: dict[str, Any]) -> bool:
        """Whether the fused path computes exactly what the original would for this call."""
        if any(named.get(name) not in (None, False) for name in UNCOVERED_ARGUMENTS):
            return False
        if self._implementation() not in COVERED_IMPLEMENTATIONS:
            return False  # flash-attention and flex layouts: 2-D masks, bottom-right causality
        mask = named.get("attention_mask")
        if mask is not None and (not isinstance(mask, Tensor) or mask.dim() != 4):
            return False  # block masks and 2-D padding masks (flash-attention layouts)
        cache = self._cache(named)
        return cache is None or (self.layer_idx is not None and hasattr(cache, "update"))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, named: dict[str, Any], sinks: Optional[Tensor] = None,
                softcap: Optional[float] = None, runs_direct: bool = False) -> Tensor:
        """q/k/v [batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]."""
        cache = self._cache(named)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = named.get("attention_mask")
        causal = False
        if mask is not None:
            mask = mask[..., : k.shape[-2]]
        elif q.shape[-2] > 1:
            # Without a mask SDPA is causal (top-left aligned) and eager masks nothing.
            causal = self.is_causal and self._implementation() != "eager"
        out = None
        if runs_direct and self._attention_is_fused and sinks is None:
            out = direct.attention(q, k, v, mask, causal, self.scaling)
        if out is None:
            out = attention(q, k, v, causal=causal, mask=mask, scale=self.scaling,
                            dropout_p=self.dropout_p if self.training else 0.0, sinks=sinks, softcap=softcap,
                            backend=self.backend_for(ATTENTION) if self._attention_is_fused else "reference")
        batch, _, seq, _ = q.shape
        return out.transpose(1, 2).reshape(batch, seq, -1)

    @property
    def _attention_is_fused(self) -> bool:
        return self.fused_attention

    def _project(self, name: str, x: Tensor, runs_direct: bool = False) -> Tensor:
        # The projections' GEMMs join the fusion with the attention (not under only="rope").
        module = self._modules[name]
        if runs_direct:
            return direct.project(module, x, self.backend_for(LINEAR) if self.fused_attention else "reference")
        return project(module, x, self.backend_for(LINEAR)) if self.fused_attention else module(x)

    def _projection_ops(self, *names: str) -> tuple:
        return linear_ops(*(self._modules[name] for name in names)) if self.fused_attention else ()

    def _result(self, out: Tensor):
        if self.returns is None:
            return out
        container, length = self.returns
        return container([out] + [None] * (length - 1))  # no attention weights: SDPA forms none

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.is_causal}, " + super().extra_repr())


class FusedAttention(_FusedSelfAttention):
    """q/k/v and output projections with RoPE.

    ``projections``: ``(q, k, v, out)`` child names, or ``(qkv, out)`` for one projection
    giving ``num_heads`` query and ``num_kv_heads`` key and value heads, laid out as
    ``qkv_layout`` says (one of :data:`QKV_LAYOUTS`).
    ``rotary``: one of :data:`ROTARY_STYLES`. ``qk_norms``: the ``(q, k)`` norm children,
    applied over each head or the whole projection (``qk_norm_scope``); with
    ``qk_rms_norms`` (``(eps, weight_offset)`` of each, found by the rule) they run on the
    children's weights: over each head, inside the fused rotation's one pass over q and k
    (``rope``'s norm weights); over the whole projection (OLMo 2, whose norm spans
    every head) or without a fused rotation, as te_lab's ``rms_norm``. Otherwise the
    children are called. A norm child without a weight (Llama 4's one ``qk_norm`` for q and
    k, named twice in ``qk_norms``) runs with unit weights; Llama 4 applies it after the
    rotation, which changes nothing: the rotation keeps each head's sum of squares (its
    tables are unit complex numbers), so the twin normalizes first, as for the others.
    ``sinks``: the name
    of a per-head Parameter of attention-sink logits. ``softcap``: scores become
    ``softcap * tanh(scores / softcap)`` (no fused kernel has it: the attention then runs
    te_lab's reference math, and the twin does not list the attention op). ``clip_qkv``:
    q, k and v are clamped to +-clip_qkv after projecting. ``output_dropout``: dropout
    after the output projection while training. ``temperature``: ``(floor_scale,
    attn_scale)``, q is multiplied by ``log1p(floor((position + 1) / floor_scale)) *
    attn_scale + 1`` after its rotation, the positions counted from the tokens the KV cache
    has already seen (Llama 4's ``attn_temperature_tuning`` on its no-RoPE layers, as it
    computes them). ``fused_rope=False`` keeps the rotation
    and ``fused_attention=False`` the softmax attention on te_lab's reference math, for
    ``fuse(exclude=["rope"])`` and ``fuse(only=["rope"])``."""

    def __init__(self, original: nn.Module, *, projections: tuple[str, ...], rotary: str = "rotate_half",
                 qk_norms: Optional[tuple[str, str]] = None, qk_norm_scope: str = "head",
                 qk_rms_norms: Optional[tuple[tuple[float, float], tuple[float, float]]] = None,
                 sinks: Optional[str] = None, softcap: Optional[float] = None, clip_qkv: Optional[float] = None,
                 output_dropout: float = 0.0, temperature: Optional[tuple[float, float]] = None,
                 qkv_layout: str = "blocks", fused_rope: bool = True, **options):
        super().__init__(original, **options)
        if len(projections) not in (2, 4):
            raise ValueError(f"FusedAttention: projections must be (q, k, v, out) or (qkv, out) child names, "
                             f"got {projections!r}")
        if rotary not in ROTARY_STYLES:
            raise ValueError(f"FusedAttention: rotary must be one of {ROTARY_STYLES}, got {rotary!r}")
        if qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"FusedAttention: qkv_layout must be one of {QKV_LAYOUTS}, got {qkv_layout!r}")
        if qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"FusedAttention: qk_norm_scope must be one of {QK_NORM_SCOPES}, got {qk_norm_scope!r}")
        self.input_names, self.o_name = projections[:-1], projections[-1]
        self.rotary, self.qk_norms, self.qk_norm_scope = rotary, qk_norms, qk_norm_scope
        self.qk_rms_norms = qk_rms_norms if qk_norms is not None else None
        self.sinks_name, self.softcap, self.clip_qkv = sinks, softcap, clip_qkv
        self.output_dropout, self.temperature = output_dropout, temperature
        self.qkv_layout = qkv_layout
        self.fused_rope = fused_rope and rotary != "none"

    @property
    def _attention_is_fused(self) -> bool:
        return self.fused_attention and self.softcap is None

    @property
    def _norms_in_rope(self) -> bool:
        """Whether the q/k RMSNorms run inside the fused rotation: per head, with one eps and
        weight offset for both."""
        return (self.qk_rms_norms is not None and self.qk_norm_scope == "head" and self.fused_rope
                and self.qk_rms_norms[0] == self.qk_rms_norms[1])

    @property
    def ops(self):
        # A property, not an attribute: fused ops hold functions, and a fused model pickles.
        separate_norms = self.qk_rms_norms is not None and not self._norms_in_rope
        fused_ops = tuple(op for op, fused in ((ATTENTION, self._attention_is_fused), (ROPE, self.fused_rope),
                                               (RMS_NORM, separate_norms)) if fused)
        return fused_ops + self._projection_ops(*self.input_names, self.o_name)

    def _qkv(self, hidden_states: Tensor, runs_direct: bool) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as [batch, seq, heads * head_dim], or [batch, seq, heads, head_dim] for
        a grouped fused projection (views of one product where the layout allows)."""
        if len(self.input_names) == 3:
            return tuple(self._project(name, hidden_states, runs_direct) for name in self.input_names)
        kv_width = self.num_kv_heads * self.head_dim
        qkv = self._project(self.input_names[0], hidden_states, runs_direct)
        if self.qkv_layout == "grouped":
            grouped = qkv.unflatten(-1, (self.num_kv_heads, -1, self.head_dim))
            return grouped[..., :-2, :].flatten(-3, -2), grouped[..., -2, :], grouped[..., -1, :]
        return qkv.split((self.num_heads * self.head_dim, kv_width, kv_width), dim=-1)

    def _norm(self, index: int, x: Tensor, runs_direct: bool) -> Tensor:
        if self.qk_norms is None:
            return x
        norm = self._modules[self.qk_norms[index]]
        if self.qk_rms_norms is None:
            return norm(x)
        eps, weight_offset = self.qk_rms_norms[index]
        weight = norm._parameters.get("weight")  # None: a weightless norm (Llama 4's qk_norm)
        y = direct.rms_norm(x, weight, eps, weight_offset) if runs_direct else None
        return y if y is not None else rms_norm(x, weight, eps, weight_offset=weight_offset,
                                                backend=self.backend_for(RMS_NORM))

    def _norm_weights(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """The q and k norms' weights for the rope op, ones for a weightless norm."""
        weights = [self._modules[name]._parameters.get("weight") for name in self.qk_norms]
        return tuple(torch.ones(self.head_dim, dtype=like.dtype, device=like.device) if weight is None else weight
                     for weight in weights)

    def _rotate(self, q: Tensor, k: Tensor, position_embeddings, runs_direct: bool) -> tuple[Tensor, Tensor]:
        if self.rotary == "none":
            return q, k
        if self.rotary in COMPLEX_TABLE_STYLES:
            # One complex number per pair (2i, 2i + 1): its real part is the pair's cos.
            tables = position_embeddings.to(q.device)
            cos, sin = tables.real.repeat_interleave(2, -1), tables.imag.repeat_interleave(2, -1)
        else:
            cos, sin = position_embeddings
        if self.rotary == "rotate_half_pair_tables":
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        elif self.rotary == "interleaved_rotate_half_tables":
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
        norm = {}
        if self._norms_in_rope:
            (eps, weight_offset), _ = self.qk_rms_norms
            q_weight, k_weight = self._norm_weights(q)
            norm = dict(q_norm_weight=q_weight, k_norm_weight=k_weight, norm_eps=eps, norm_weight_offset=weight_offset)
        interleaved = self.rotary.startswith("interleaved")
        rotated = direct.rope(q, k, cos, sin, interleaved, norm) if runs_direct and self.fused_rope else None
        return rotated if rotated is not None else rope(
            q, k, cos, sin, interleaved=interleaved, backend=self.backend_for(ROPE) if self.fused_rope else "reference",
            **norm)

    def forward(self, *args, **kwargs):
        named = self._arguments(args, kwargs)
        hidden_states = named[self._input_name]
        position_embeddings = named.get("position_embeddings")
        if (self.rotary != "none" and position_embeddings is None) or not self._covers(named) \
                or direct.compiled_decode(self, hidden_states):
            return self._call_original(args, kwargs)
        batch, seq, _ = hidden_states.shape
        runs_direct = direct.direct_calls_allowed(self)
        q, k, v = self._qkv(hidden_states, runs_direct)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.qk_norm_scope == "projection":
            q, k = self._norm(0, q.flatten(2), runs_direct), self._norm(1, k.flatten(2), runs_direct)
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm_scope == "head" and not self._norms_in_rope:
            q, k = self._norm(0, q, runs_direct), self._norm(1, k, runs_direct)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = self._rotate(q, k, position_embeddings, runs_direct)
        if self.temperature is not None:
            q = self._temperature_tuned(q, named)
        sinks = None if self.sinks_name is None else self._parameters[self.sinks_name]
        attended = self._attend(q, k, v, named, sinks=sinks, softcap=self.softcap, runs_direct=runs_direct)
        out = self._project(self.o_name, attended, runs_direct)
        if self.output_dropout and self.training:
            out = F.dropout(out, self.output_dropout)
        return self._result(out)

    def _temperature_tuned(self, q: Tensor, named: dict[str, Any]) -> Tensor:
        """q [batch, heads, seq, head_dim] times its position's temperature, computed as
        Llama 4 does: positions from the cache's length before this call's tokens, the
        scales in float32, the product rounded to q's dtype."""
        floor_scale, attn_scale = self.temperature
        cache = self._cache(named)
        past_seen_tokens = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        positions = torch.arange(q.shape[-2], device=q.device) + past_seen_tokens
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return (q * scales.view(1, 1, -1, 1)).to(q.dtype)

    def extra_repr(self) -> str:
        features = [f"rotary={self.rotary}"] + ([] if self.qkv_layout == "blocks" else [f"qkv={self.qkv_layout}"])
        if self.qk_norms is not None:
            features.append(f"qk_norm={self.qk_norm_scope}" + (" (in rope)" if self._norms_in_rope else ""))
        if self.sinks_name is not None:
            features.append("sinks")
        if self.softcap is not None:
            features.append(f"softcap={self.softcap:g}")
        if self.temperature is not None:
            features.append("temperature(floor_scale={:g}, attn_scale={:g})".format(*self.temperature))
        return ", ".join(features) + ", " + super().extra_repr()


class FusedQKVAttention(_FusedSelfAttention):
    """One ``[q | k | v]`` projection (``qkv``) and an output projection (``out``);
    ``resid_dropout`` (when the original has one) is applied after ``out``."""

    def __init__(self, original: nn.Module, *, qkv: str, out: str, resid_dropout: Optional[str] = None, **options):
        super().__init__(original, **options)
        self.qkv_name, self.out_name, self.resid_dropout_name = qkv, out, resid_dropout

    @property
    def ops(self):
        return ((ATTENTION,) if self.fused_attention else ()) + self._projection_ops(self.qkv_name, self.out_name)

    def forward(self, *args, **kwargs):
        named = self._arguments(args, kwargs)
        hidden_states = named[self._input_name]
        if not self._covers(named) or direct.compiled_decode(self, hidden_states):
            return self._call_original(args, kwargs)
        batch, seq, _ = hidden_states.shape
        width = self.num_heads * self.head_dim
        runs_direct = direct.direct_calls_allowed(self)
        q, k, v = self._project(self.qkv_name, hidden_states, runs_direct).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = self._project(self.out_name, self._attend(q, k, v, named, runs_direct=runs_direct), runs_direct)
        if self.resid_dropout_name is not None:
            out = self._modules[self.resid_dropout_name](out)
        return self._result(out)
