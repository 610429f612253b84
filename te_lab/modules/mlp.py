"""Fused twins of Transformer MLPs.

- :class:`FusedMLP`: ``fc2(act(fc1(x)))`` (GPT-2, BERT, ViT) with the bias and the
  activation done in one pass after fc1's GEMM (``linear_act``); fc2 may be absent
  (BERT's ``Intermediate`` block is fc1 + act alone).
- :class:`FusedGatedMLP`: ``down(act(gate(x)) * up(x))`` (Llama, Mistral, Qwen, Gemma)
  with ``act(gate) * up`` in one pass forward and one backward (``glu``); a merged
  gate-up projection (Phi-3) feeds ``glu`` its concatenated output directly.

GEMMs stay on the vendor BLAS, and the projections are called as the original's child
modules wherever the fusion does not need their weights, so wrappers on them keep
working; an fc1 that stands in for a Linear (a LoRA layer, :mod:`.linear_like`) is
called too, and only its activation is fused. A dropout child is applied to the block's
output, as GPT-2's MLP does.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from te_lab.kernels.bias_act import BIAS_ACT, bias_act, linear_act
from te_lab.kernels.glu import GLU, glu
from te_lab.kernels.linear import LINEAR

from . import direct
from .base import FusedModule
from .linear_like import has_linear_weight, linear_weight
from .projection import linear_ops, project


class FusedMLP(FusedModule):
    measured_against_original = True
    ops = (BIAS_ACT,)

    def __init__(self, original: nn.Module, *, fc1: str, fc2: Optional[str], activation: str,
                 dropout: Optional[str] = None, backend: Optional[str] = None):
        super().__init__(original, backend)
        self.fc1_name, self.fc2_name, self.dropout_name = fc1, fc2, dropout
        self.activation = activation

    def fused_forward(self, x: Tensor) -> Tensor:
        fc1 = self._modules[self.fc1_name]
        if has_linear_weight(fc1):
            weight, bias = linear_weight(fc1)
            h = linear_act(x, weight, bias, self.activation, backend=self.backend_for(BIAS_ACT))
        else:  # a stand-in (a LoRA layer) is called as it is; the activation is still one pass
            h = bias_act(fc1(x), None, self.activation, backend=self.backend_for(BIAS_ACT))
        if self.fc2_name is not None:
            h = self._modules[self.fc2_name](h)
        if self.dropout_name is not None:
            h = self._modules[self.dropout_name](h)
        return h

    def extra_repr(self) -> str:
        fc2 = f" -> {self.fc2_name}" if self.fc2_name else ""
        return f"{self.fc1_name} + {self.activation}{fc2}, " + super().extra_repr()


class FusedGatedMLP(FusedModule):
    measured_against_original = True
    @property
    def ops(self):
        # A property, not an attribute: fused ops hold functions, and a fused model pickles.
        names = (self.gate_name, self.up_name, self.down_name)
        return (GLU,) + linear_ops(*(self._modules[name] for name in names if name is not None))

    def __init__(self, original: nn.Module, *, gate: str, up: Optional[str], down: str, activation: str,
                 dropout: Optional[str] = None, backend: Optional[str] = None):
        """``up=None``: ``gate`` names one projection whose output is ``[gate | up]``."""
        super().__init__(original, backend)
        self.gate_name, self.up_name, self.down_name, self.dropout_name = gate, up, down, dropout
        self.activation = activation

    def fused_forward(self, x: Tensor) -> Tensor:
        backend = self.backend_for(LINEAR)
        runs_direct = direct.direct_calls_allowed(self)
        projected = direct.project if runs_direct else project
        gate = projected(self._modules[self.gate_name], x, backend)
        up = None if self.up_name is None else projected(self._modules[self.up_name], x, backend)
        h = direct.glu(gate, up, self.activation) if runs_direct else None
        if h is None:
            h = glu(gate, up, self.activation, backend=self.backend_for(GLU))
        h = projected(self._modules[self.down_name], h, backend)
        if self.dropout_name is not None:
            h = self._modules[self.dropout_name](h)
        return h

    def extra_repr(self) -> str:
        up = f", up={self.up_name}" if self.up_name else " (gate-up merged)"
        return f"gate={self.gate_name}{up}, down={self.down_name}, {self.activation}, " + super().extra_repr()
