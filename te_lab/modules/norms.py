"""Fused twins of normalization layers: RMSNorm (plain or Gemma's ``1 + weight``) and
LayerNorm (plain or Nemotron's LayerNorm1P, ``1 + weight``), each one pass forward and
one backward; and the BERT-style output block, whose residual add joins its LayerNorm's
pass."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from te_lab.kernels.layer_norm import LAYER_NORM, layer_norm
from te_lab.kernels.rms_norm import AUTOCAST as RMS_NORM_AUTOCAST, RMS_NORM, rms_norm

from . import direct
from .base import FusedModule


def _epsilon(eps: Optional[float], x: Tensor) -> float:
    # nn.RMSNorm's eps=None means the machine epsilon of the dtype F.rms_norm computes in:
    # the input's, or float32 where autocast casts the input to it (as on CUDA).
    if eps is not None:
        return eps
    return torch.finfo(RMS_NORM_AUTOCAST.cast_dtype(x.device.type) or x.dtype).eps


class FusedRMSNorm(FusedModule):
    """``rms_norm(x, weight, eps, weight_offset)``; the weight (if any) is the original's."""
    measured_against_original = True

    ops = (RMS_NORM,)

    def __init__(self, original: nn.Module, *, eps: Optional[float], weight_offset: float = 0.0,
                 backend: Optional[str] = None):
        super().__init__(original, backend)
        self.eps = eps
        self.weight_offset = weight_offset

    def fused_forward(self, x: Tensor) -> Tensor:
        weight = self._parameters.get("weight")
        eps = _epsilon(self.eps, x)
        if direct.direct_calls_allowed(self):
            y = direct.rms_norm(x, weight, eps, self.weight_offset)
            if y is not None:
                return y
        return rms_norm(x, weight, eps, weight_offset=self.weight_offset, backend=self.backend_for(RMS_NORM))

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return f"eps={self.eps}{offset}, " + super().extra_repr()


class FusedLayerNorm(FusedModule):
    """``layer_norm(x, weight, bias, eps, weight_offset)`` with the original's weight and
    bias (if any)."""
    measured_against_original = True

    ops = (LAYER_NORM,)

    def __init__(self, original: nn.Module, *, eps: float, weight_offset: float = 0.0,
                 backend: Optional[str] = None):
        super().__init__(original, backend)
        self.eps = eps
        self.weight_offset = weight_offset

    def fused_forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self._parameters.get("weight"), self._parameters.get("bias"), self.eps,
                          weight_offset=self.weight_offset, backend=self.backend_for(LAYER_NORM))

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return f"eps={self.eps}{offset}, " + super().extra_repr()


class FusedResidualLayerNorm(FusedModule):
    """BERT's output block, ``LayerNorm(dropout(dense(h)) + residual)``, with the add
    inside the LayerNorm's pass. Children (``dense``, ``dropout``, ``norm``) are named
    as in the original and given by the rule that matched it."""
    measured_against_original = True

    ops = (LAYER_NORM,)

    def __init__(self, original: nn.Module, *, dense: str, dropout: Optional[str], norm: str,
                 backend: Optional[str] = None):
        super().__init__(original, backend)
        self.dense_name, self.dropout_name, self.norm_name = dense, dropout, norm

    def fused_forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        h = self._modules[self.dense_name](hidden_states)
        if self.dropout_name is not None:
            h = self._modules[self.dropout_name](h)
        norm = self._modules[self.norm_name]
        y, _ = layer_norm(h, norm.weight, norm.bias, norm.eps, residual=input_tensor,
                          backend=self.backend_for(LAYER_NORM))
        return y
