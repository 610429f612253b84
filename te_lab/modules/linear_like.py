"""Projections te_lab recognizes, by structure.

- Weight-readable projections: ``nn.Linear`` and the transposed ``Conv1D`` of Hugging
  Face's GPT-2 family (weight ``[in, out]``, ``y = x @ W + b``). A twin may read their
  weight and bias and compute the product itself (:func:`linear_weight`).
- Stand-ins: a module that takes an ``nn.Linear``'s place and must be called as it is,
  because it computes more than its weight says: an adapter wrapper such as PEFT's LoRA
  layers (a ``base_layer`` projection plus low-rank updates) or any module declaring
  integer ``in_features`` and ``out_features``. Twins call these as modules, so adapters
  train, drop out and merge exactly as they would unfused; rules that need the weight
  itself (the LM head's fused loss, ``linear_act``) treat them as calls instead.

Nothing here imports an adapter library: the checks read attributes only.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn


def has_linear_weight(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` is a projection whose product is ``F.linear`` of its weight and
    bias (:func:`linear_weight`): ``nn.Linear`` or a ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    # Conv1D keeps its output width in ``nf`` and its weight as [in, out].
    return (isinstance(weight, nn.Parameter) and weight.dim() == 2 and isinstance(getattr(module, "nf", None), int)
            and weight.shape[1] == module.nf)


def _declared_features(module: nn.Module) -> Optional[tuple[int, int]]:
    sizes = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in sizes):
        return sizes
    return None


def _base_layer(module: nn.Module) -> Optional[nn.Module]:
    # PEFT's convention: an adapter layer keeps the projection it wraps as ``base_layer``
    # (wrappers may nest: the innermost one holds the projection).
    base = module._modules.get("base_layer")
    while base is not None and not has_linear_weight(base):
        base = base._modules.get("base_layer")
    return base


def is_linear_like(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` stands where an ``nn.Linear`` stands: a weight-readable
    projection, or a stand-in that wraps one (``base_layer``) or declares its
    ``in_features`` and ``out_features``."""
    if not isinstance(module, nn.Module):
        return False
    return has_linear_weight(module) or _base_layer(module) is not None or _declared_features(module) is not None


def in_out_features(module: nn.Module) -> tuple[int, int]:
    """``(in, out)`` of a linear-like module (:func:`is_linear_like`)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if has_linear_weight(module):
        return module.weight.shape[0], module.weight.shape[1]
    declared = _declared_features(module)
    return declared if declared is not None else in_out_features(_base_layer(module))


def linear_weight(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """The ``[out, in]`` weight (a view for Conv1D) and the bias, as ``F.linear`` takes
    them, of a weight-readable projection (:func:`has_linear_weight`)."""
    weight = module.weight if isinstance(module, nn.Linear) else module.weight.t()
    return weight, module.bias
