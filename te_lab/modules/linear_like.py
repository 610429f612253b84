"""Projections te_lab recognizes: ``nn.Linear`` and the transposed ``Conv1D`` of
Hugging Face's GPT-2 family (weight ``[in, out]``, ``y = x @ W + b``)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn


def is_linear_like(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    # Conv1D keeps its output width in ``nf`` and its weight as [in, out].
    return (isinstance(weight, nn.Parameter) and weight.dim() == 2 and isinstance(getattr(module, "nf", None), int)
            and weight.shape[1] == module.nf)


def in_out_features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


def linear_weight(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """The ``[out, in]`` weight (a view for Conv1D) and the bias, as ``F.linear`` takes them."""
    weight = module.weight if isinstance(module, nn.Linear) else module.weight.t()
    return weight, module.bias
