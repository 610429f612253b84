"""Rules for normalization layers: ``rmsnorm``, ``layernorm`` and ``residual_layernorm``.

Besides torch's own ``nn.RMSNorm`` and ``nn.LayerNorm``, a *norm-like* module from a
model library matches: no children, a 1-D ``weight`` (and maybe a ``bias`` of the same
length) as its only parameters, no buffers, and an epsilon attribute. Which formula it
computes is left to the probe: RMSNorm scaling by ``weight`` is tried first, then
Gemma's ``1 + weight``, then LayerNorm scaling by ``weight``, then by ``1 + weight``
(Nemotron's LayerNorm1P); a module none of them reproduces stays as it is. A subclass of
``nn.LayerNorm`` that overrides its forward (LayerNorm1P is one) is likewise offered
both LayerNorm scalings; ``nn.LayerNorm`` itself only its own.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from te_lab.modules.linear_like import in_out_features, is_linear_like
from te_lab.modules.norms import FusedLayerNorm, FusedResidualLayerNorm, FusedRMSNorm

from .inspection import epsilon_of, random_tensor
from .rules import FusionRule, Match, MatchResult, ProbeInputs, Skip, Variant

PROBE_SHAPE = (2, 8)  # leading dims of a synthesized probe: batch 2, sequence 8


def _norm_like(module: nn.Module) -> Optional[tuple[int, bool, float]]:
    """(hidden size, has bias, eps) of a norm-like module from outside torch.nn."""
    if type(module).__module__.startswith("torch.nn") or module._modules or module._buffers:
        return None
    parameters = module._parameters
    weight, bias = parameters.get("weight"), parameters.get("bias")
    if weight is None or set(parameters) - {"weight", "bias"} or weight.dim() != 1:
        return None
    if bias is not None and bias.shape != weight.shape:
        return None
    eps = epsilon_of(module)
    return None if eps is None else (weight.shape[0], bias is not None, eps)


def _single_dim(module: nn.Module) -> Optional[int]:
    shape = tuple(module.normalized_shape)
    return shape[0] if len(shape) == 1 else None


def _hidden_input(module: nn.Module, hidden: int):
    return lambda: ProbeInputs((random_tensor(PROBE_SHAPE + (hidden,), module),))


def _torch_norm(module: nn.Module, twin: type, weight_offsets: tuple[float, ...] = (0.0,)) -> MatchResult:
    """``nn.RMSNorm`` / ``nn.LayerNorm`` (or a subclass): the last dim only, with each of
    ``weight_offsets`` for the probe to choose from."""
    hidden = _single_dim(module)
    if hidden is None:
        return Skip(f"normalizes over {tuple(module.normalized_shape)}; the fused op normalizes the last dim only")
    return Match(_offset_variants(module, module.eps, weight_offsets, twin), _hidden_input(module, hidden))


# Weight offsets a LayerNorm whose formula is not known may scale by: weight itself, then
# 1 + weight (Nemotron's LayerNorm1P).
LAYER_NORM_OFFSETS = (0.0, 1.0)


def _offset_variants(module: nn.Module, eps: float, weight_offsets: tuple[float, ...],
                     twin: type = FusedLayerNorm) -> list[Variant]:
    """A ``twin`` per weight offset, noted where it scales by an offset weight."""
    return [Variant(lambda o, offset=offset: twin(module, eps=eps, backend=o.backend, **(
        {"weight_offset": offset} if offset else {})), note=f"scales by {offset:g} + weight" if offset else "")
        for offset in weight_offsets]


def match_rmsnorm(module: nn.Module) -> MatchResult:
    if isinstance(module, nn.RMSNorm):
        return _torch_norm(module, FusedRMSNorm)
    found = _norm_like(module)
    if found is None or found[1]:
        return None
    hidden, _, eps = found
    return Match([
        Variant(lambda o: FusedRMSNorm(module, eps=eps, backend=o.backend)),
        Variant(lambda o: FusedRMSNorm(module, eps=eps, weight_offset=1.0, backend=o.backend),
                note="scales by 1 + weight (Gemma)"),
    ], _hidden_input(module, hidden))


def match_layernorm(module: nn.Module) -> MatchResult:
    if isinstance(module, nn.LayerNorm):
        # A subclass with a forward of its own may scale by an offset weight (LayerNorm1P).
        overridden = type(module).forward is not nn.LayerNorm.forward and module.weight is not None
        return _torch_norm(module, FusedLayerNorm, LAYER_NORM_OFFSETS if overridden else (0.0,))
    found = _norm_like(module)
    if found is None:
        return None
    hidden, _, eps = found
    return Match(_offset_variants(module, eps, LAYER_NORM_OFFSETS), _hidden_input(module, hidden))


def match_residual_layernorm(module: nn.Module) -> MatchResult:
    """BERT's ``SelfOutput`` / ``Output``: a projection, a dropout and a LayerNorm, called
    as ``forward(hidden_states, input_tensor)`` to give ``LayerNorm(dropout(dense(h)) + input)``."""
    children = module._modules
    if module._parameters or not 2 <= len(children) <= 3:
        return None
    dense = [name for name, child in children.items() if is_linear_like(child)]
    norms = [name for name, child in children.items() if isinstance(child, nn.LayerNorm)]
    dropouts = [name for name, child in children.items() if isinstance(child, nn.Dropout)]
    if len(dense) != 1 or len(norms) != 1 or len(dense) + len(norms) + len(dropouts) != len(children):
        return None
    norm = children[norms[0]]
    if _single_dim(norm) is None:
        return None
    d_in, d_out = in_out_features(children[dense[0]])
    dropout = dropouts[0] if dropouts else None

    def example() -> ProbeInputs:
        return ProbeInputs((random_tensor(PROBE_SHAPE + (d_in,), module, seed=0),
                            random_tensor(PROBE_SHAPE + (d_out,), module, seed=1)))

    return Match([Variant(lambda o: FusedResidualLayerNorm(module, dense=dense[0], dropout=dropout, norm=norms[0],
                                                           backend=o.backend))], example)


RMSNORM = FusionRule(
    "rmsnorm", "norm", "nn.RMSNorm and RMSNorm-like modules (weight, eps; Gemma's 1 + weight found by the probe)",
    match_rmsnorm)
RESIDUAL_LAYERNORM = FusionRule(
    "residual_layernorm", "norm",
    "projection + dropout + LayerNorm(x + residual) blocks (BERT): the add joins the norm",
    match_residual_layernorm)
LAYERNORM = FusionRule(
    "layernorm", "norm", "nn.LayerNorm and LayerNorm-like modules (Nemotron's 1 + weight found by the probe)",
    match_layernorm)
