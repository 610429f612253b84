"""Fused twins of self-attention blocks: the projections stay GEMMs, rotary embedding
of q and k is one pass (``apply_rotary``), and softmax attention is the block-wise
kernel that never holds the score matrix (``attention``).

- :class:`FusedAttention`: separate ``q_proj``/``k_proj``/``v_proj``/``o_proj``
  (Llama, Mistral, Qwen2, te_lab's demo Llama), RoPE from ``position_embeddings``
  ``(cos, sin)``, grouped-query heads.
- :class:`FusedQKVAttention`: one ``c_attn`` projection giving ``[q | k | v]`` and a
  ``c_proj`` (GPT-2, te_lab's demo GPT-2), no RoPE.

Calls are read by parameter name against the original's signature. A call the fused
path does not cover (cross-attention, head masks, requested attention weights, a
non-tensor mask, multi-token decoding against a cache without a mask) is handed to the
original module unchanged. Masks follow Hugging Face's convention: ``None`` means
causal (when the module is causal), otherwise the given additive or boolean mask.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from te_lab.kernels.attention import ATTENTION, attention
from te_lab.kernels.linear import LINEAR
from te_lab.kernels.rope import ROPE, apply_rotary

from .base import FusedModule
from .call_arguments import forward_signature, named_arguments
from .projection import linear_ops, project

# Names model libraries give the KV cache argument (Hugging Face renamed it over releases).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
# Arguments whose presence (not None / not False) the fused path does not cover.
UNCOVERED_ARGUMENTS = ("encoder_hidden_states", "head_mask", "output_attentions")


class _FusedSelfAttention(FusedModule):
    def __init__(self, original: nn.Module, *, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 is_causal: bool, dropout_p: float, returns_tuple: bool, fused_attention: bool = True,
                 backend: Optional[str] = None):
        super().__init__(original, backend)
        self.fused_attention = fused_attention
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling, self.is_causal, self.dropout_p = scaling, is_causal, dropout_p
        self.returns_tuple = returns_tuple
        self.layer_idx = getattr(original, "layer_idx", None)
        self._signature = forward_signature(original.forward)

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        return named_arguments(self._signature, args, kwargs)

    def _call_original(self, args: tuple, kwargs: dict):
        self.original.training = self.training  # the children are shared and already in this mode
        return self.original(*args, **kwargs)

    @staticmethod
    def _cache(named: dict[str, Any]):
        cache = next((named[name] for name in CACHE_ARGUMENTS if named.get(name) is not None), None)
        # Encoder-decoder caches hold the self-attention cache inside.
        return getattr(cache, "self_attention_cache", cache)

    def _covers(self, named: dict[str, Any], query_length: int) -> bool:
        """Whether the fused path computes exactly what the original would for this call."""
        if any(named.get(name) not in (None, False) for name in UNCOVERED_ARGUMENTS):
            return False
        mask = named.get("attention_mask")
        if mask is not None and (not isinstance(mask, Tensor) or mask.dim() != 4):
            return False  # block masks and 2-D padding masks (flash-attention layouts)
        cache = self._cache(named)
        if cache is not None:
            if self.layer_idx is None or not hasattr(cache, "update"):
                return False
            # With earlier tokens cached and no mask, the causal diagonal is offset.
            if mask is None and query_length > 1 and cache.get_seq_length(self.layer_idx) > 0:
                return False
        return True

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, named: dict[str, Any]) -> Tensor:
        """q/k/v [batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]."""
        cache = self._cache(named)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = named.get("attention_mask")
        causal = False
        if mask is not None:
            mask = mask[..., : k.shape[-2]]
        elif q.shape[-2] > 1:
            causal = self.is_causal
        out = attention(q, k, v, causal=causal, mask=mask, scale=self.scaling,
                        dropout_p=self.dropout_p if self.training else 0.0,
                        backend=self.backend_for(ATTENTION) if self.fused_attention else "reference")
        batch, _, seq, _ = q.shape
        return out.transpose(1, 2).reshape(batch, seq, -1)

    def _project(self, name: str, x: Tensor) -> Tensor:
        # The projections' GEMMs join the fusion with the attention (not under only="rope").
        module = self._modules[name]
        return project(module, x, self.backend_for(LINEAR)) if self.fused_attention else module(x)

    def _projection_ops(self, *names: str) -> tuple:
        return linear_ops(*(self._modules[name] for name in names)) if self.fused_attention else ()

    def _result(self, out: Tensor):
        return (out, None) if self.returns_tuple else out

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.is_causal}, " + super().extra_repr())


class FusedAttention(_FusedSelfAttention):
    """Separate q/k/v/o projections with RoPE. ``fused_rope=False`` keeps the rotation
    and ``fused_attention=False`` the softmax attention on te_lab's reference math, for
    ``fuse(exclude=["rope"])`` and ``fuse(only=["rope"])``."""

    def __init__(self, original: nn.Module, *, projections: tuple[str, str, str, str], fused_rope: bool = True,
                 **options):
        super().__init__(original, **options)
        self.q_name, self.k_name, self.v_name, self.o_name = projections
        self.fused_rope = fused_rope

    @property
    def ops(self):
        # A property, not an attribute: fused ops hold functions, and a fused model pickles.
        fused_ops = tuple(op for op, fused in ((ATTENTION, self.fused_attention), (ROPE, self.fused_rope)) if fused)
        return fused_ops + self._projection_ops(self.q_name, self.k_name, self.v_name, self.o_name)

    def forward(self, *args, **kwargs):
        named = self._arguments(args, kwargs)
        hidden_states = named["hidden_states"]
        position_embeddings = named.get("position_embeddings")
        if position_embeddings is None or not self._covers(named, hidden_states.shape[-2]):
            return self._call_original(args, kwargs)
        batch, seq, _ = hidden_states.shape
        q = self._project(self.q_name, hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self._project(self.k_name, hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self._project(self.v_name, hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin, backend=self.backend_for(ROPE) if self.fused_rope else "reference")
        return self._result(self._project(self.o_name, self._attend(q, k, v, named)))


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
        hidden_states = named["hidden_states"]
        if not self._covers(named, hidden_states.shape[-2]):
            return self._call_original(args, kwargs)
        batch, seq, _ = hidden_states.shape
        width = self.num_heads * self.head_dim
        q, k, v = self._project(self.qkv_name, hidden_states).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = self._project(self.out_name, self._attend(q, k, v, named))
        if self.resid_dropout_name is not None:
            out = self._modules[self.resid_dropout_name](out)
        return self._result(out)
