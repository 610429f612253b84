"""Rules for MLP blocks: ``mlp`` (Linear -> activation [-> Linear]) and ``gated_mlp``
(gated: SwiGLU / GeGLU; named ``swiglu_mlp`` before, which ``fuse`` still accepts).

A candidate's children are projections (``nn.Linear`` or GPT-2's ``Conv1D``), at most
one dropout and exactly one activation (a child module, or a plain function held in
an attribute such as ``act_fn``); it has no parameters of its own. The activation is
identified by evaluating it. Which projection is which follows from the shapes; where
shapes leave it open (square layers, gate vs up), every assignment is a variant and the
probe picks the one that reproduces the module.
"""

from __future__ import annotations

import itertools
from typing import Optional

from torch import nn

from te_lab.kernels.activations import ACTIVATIONS
from te_lab.modules.linear_like import in_out_features, is_linear_like
from te_lab.modules.mlp import FusedGatedMLP, FusedMLP

from .inspection import activation_attribute, describe_callable, identify_activation, random_tensor
from .norm_rules import PROBE_SHAPE
from .rules import FusionRule, Match, MatchResult, ProbeInputs, Skip, Variant


class _Parts:
    """A candidate MLP's projections (name -> (in, out)), dropout and activation."""

    def __init__(self, module: nn.Module):
        self.projections: dict[str, tuple[int, int]] = {}
        self.dropout: Optional[str] = None
        self.activation: Optional[str] = None  # the fused activation's name
        self.activation_label = ""
        self.understood = False
        others = []
        dropouts = []
        for name, child in module._modules.items():
            if is_linear_like(child):
                self.projections[name] = in_out_features(child)
            elif isinstance(child, nn.Dropout):
                dropouts.append(name)
            else:
                others.append((name, child))
        attribute = activation_attribute(module)
        activations = others + ([attribute] if attribute else [])
        # An activation is a leaf without parameters; anything else makes this no MLP.
        leaves = all(not child._modules and not child._parameters for _, child in others)
        if (module._parameters or not leaves or len(activations) != 1 or len(dropouts) > 1
                or not self.projections):
            return
        self.understood = True
        self.dropout = dropouts[0] if dropouts else None
        label, fn = activations[0]
        self.activation_label = describe_callable(fn)
        self.activation = identify_activation(fn)

    def unsupported_activation(self) -> Skip:
        return Skip(f"activation {self.activation_label} has no fused kernel (fused: {', '.join(ACTIVATIONS)})")


def _input(module: nn.Module, width: int):
    return lambda: ProbeInputs((random_tensor(PROBE_SHAPE + (width,), module),))


def match_mlp(module: nn.Module) -> MatchResult:
    parts = _Parts(module)
    if not parts.understood or len(parts.projections) > 2:
        return None
    shapes = parts.projections
    if len(shapes) == 1:
        (fc1,) = shapes
        orders = [(fc1, None)]
    else:
        first, second = shapes  # in registration order, which model code writes in call order
        square = len(set(shapes[first] + shapes[second])) == 1
        # Only a square pair may run against registration order; the probe tells which.
        orders = [(a, b) for a, b in ((first, second), (second, first))[: 2 if square else 1]
                  if shapes[a][1] == shapes[b][0]]
        if not orders:
            return None  # a merged gate-up pair (out = 2 x in) is gated_mlp's; others are not MLPs
    if parts.activation is None:
        return parts.unsupported_activation()
    return Match([
        Variant(lambda o, fc1=fc1, fc2=fc2: FusedMLP(module, fc1=fc1, fc2=fc2, activation=parts.activation,
                                                     dropout=parts.dropout, backend=o.backend),
                note=f"{fc1} -> {fc2}" if len(orders) > 1 else "")
        for fc1, fc2 in orders
    ], _input(module, shapes[orders[0][0]][0]))


def _gate_first(names: tuple[str, str]) -> tuple[str, str]:
    # Try the assignment the names suggest first, to save a probe.
    return names if "up" not in names[0] and ("gate" in names[0] or "up" in names[1]) else names[::-1]


def match_gated_mlp(module: nn.Module) -> MatchResult:
    parts = _Parts(module)
    if not parts.understood or len(parts.projections) not in (2, 3):
        return None
    shapes = parts.projections
    variants = []
    if len(shapes) == 3:
        for down in shapes:
            gate_up = tuple(name for name in shapes if name != down)
            d_in, width = shapes[gate_up[0]]
            if shapes[gate_up[1]] != (d_in, width) or shapes[down][0] != width:
                continue
            for gate, up in (_gate_first(gate_up), _gate_first(gate_up)[::-1]):
                variants.append((gate, up, down, d_in))
    else:
        for merged, down in itertools.permutations(shapes):
            if shapes[merged][1] == 2 * shapes[down][0]:
                variants.append((merged, None, down, shapes[merged][0]))
    if not variants:
        return None
    if parts.activation is None:
        return parts.unsupported_activation()
    return Match([
        Variant(lambda o, gate=gate, up=up, down=down: FusedGatedMLP(
            module, gate=gate, up=up, down=down, activation=parts.activation, dropout=parts.dropout,
            backend=o.backend), note=f"gate={gate}, up={up or '(merged)'}, down={down}")
        for gate, up, down, _ in variants
    ], _input(module, variants[0][3]))


GATED_MLP = FusionRule(
    "gated_mlp", "mlp", "gated MLPs down(act(gate(x)) * up(x)), SiLU or GELU (Llama, Mistral, Qwen, Gemma)",
    match_gated_mlp)
MLP = FusionRule(
    "mlp", "mlp", "Linear -> GELU/SiLU/ReLU^2 [-> Linear] MLPs (GPT-2, BERT, ViT, Nemotron): bias + activation in "
    "one pass",
    match_mlp)
