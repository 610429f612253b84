"""The rule for Mixture-of-Experts blocks (``moe``): a router, routed experts held as 3-D
Parameters, optionally one shared expert (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3).

A candidate has no parameters or buffers of its own and two or three children:

- the router: a leaf with a 2-D ``weight`` [experts, hidden] (and optionally a bias and
  buffers, such as DeepSeek's ``e_score_correction_bias``) whose call on hidden states
  returns ``(router_logits, top-k weights, top-k expert indices)``, checked by calling it
  once on a small random input;
- the experts: ``gate_up_proj`` and ``down_proj`` Parameters [experts, ., .] (optionally
  ``gate_up_proj_bias`` and ``down_proj_bias``) and an activation (``act_fn``, identified by
  evaluating it, or gpt-oss's clamped SwiGLU, recognised by its ``alpha`` and ``limit``);
- optionally a shared expert: any other child with parameters, added to the output.

The weights' layout (as ``nn.Linear`` weights, or transposed) follows from the shapes;
whether the block returns the router's weights next to its output (gpt-oss) from one call
of the block on a small random input; whether gate and up are the two halves or
interleaved columns the shapes do not say: the attributes Hugging Face's experts carry
(``is_transposed``, ``is_concatenated``) choose the first variant tried, and the probe
picks the one that reproduces the block.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch import nn

from te_lab.kernels.moe import CLAMPED_SWIGLU
from te_lab.modules.moe import FusedMoE

from .hooks import silenced
from .inspection import describe_callable, identify_activation, random_tensor
from .norm_rules import PROBE_SHAPE
from .rules import FusionRule, Match, MatchResult, ProbeInputs, Skip, Variant

_EXPERT_PARAMETERS = {"gate_up_proj", "down_proj"}
_EXPERT_BIASES = {"gate_up_proj_bias", "down_proj_bias"}


def _experts_child(module: nn.Module) -> Optional[str]:
    for name, child in module._modules.items():
        if _EXPERT_PARAMETERS <= set(child._parameters):
            return name
    return None


def _is_router_weight(weight: Optional[nn.Parameter], experts: int) -> bool:
    return weight is not None and weight.dim() == 2 and weight.shape[0] == experts


def _router_returns_top_k(router: nn.Module, experts: int, hidden: int) -> Optional[str]:
    """Why the router's output is not ``(logits, top-k weights, top-k indices)``, or None."""
    probe = random_tensor((4, hidden), router)
    try:
        with torch.no_grad(), silenced(router):  # a rule's look leaves no trace in the user's hooks
            output = router(probe)
    except Exception as error:  # noqa: BLE001 - any failure means "not a router we can call"
        return f"calling it on hidden states failed ({type(error).__name__}: {error})"
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)):
        return f"it returns {type(output).__name__}, not (router_logits, top-k weights, top-k indices)"
    logits, weights, indices = output
    if (tuple(logits.shape) != (4, experts) or weights.shape != indices.shape or weights.dim() != 2
            or indices.dtype != torch.int64 or not weights.is_floating_point()):
        return (f"it returns tensors of shapes {[tuple(t.shape) for t in output]}, not [tokens, experts] logits and "
                f"[tokens, top_k] weights and int64 indices")
    return None


def _returns_router_scores(module: nn.Module, hidden: int) -> Optional[bool]:
    """Whether the block returns ``(out, top-k weights)`` (gpt-oss) rather than ``out``, from
    one call on a small random input; None when it returns neither."""
    try:
        with torch.no_grad(), silenced(module):
            output = module(random_tensor((1, 2, hidden), module))
    except Exception:  # noqa: BLE001 - the probe will say what is wrong with the block
        return None
    if isinstance(output, torch.Tensor):
        return False
    return True if isinstance(output, tuple) and len(output) == 2 else None


def _activation(experts: nn.Module) -> tuple[Optional[str], float, float, str]:
    """(activation or None, alpha, limit, a label for the skip reason)."""
    act_fn = getattr(experts, "act_fn", None)
    if act_fn is not None and callable(act_fn):
        return identify_activation(act_fn), 1.0, 1.0, describe_callable(act_fn)
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (alpha, limit)):
        return CLAMPED_SWIGLU, float(alpha), float(limit), CLAMPED_SWIGLU
    return None, 1.0, 1.0, "none found (no act_fn, no alpha and limit)"


def _layouts(gate_up: tuple, down: tuple, hidden: int, experts_module: nn.Module) -> list[bool]:
    """The ``transposed`` values the shapes allow, the one the experts declare first."""
    fits = []
    if gate_up[2] == hidden and down[1] == hidden and gate_up[1] == 2 * down[2]:
        fits.append(False)
    if gate_up[1] == hidden and down[2] == hidden and gate_up[2] == 2 * down[1]:
        fits.append(True)
    declared = getattr(experts_module, "is_transposed", None)
    return sorted(fits, key=lambda value: value != declared)


def _expert_list(module: nn.Module) -> Optional[str]:
    """A ModuleList child of per-expert modules beside a router for that many experts."""
    for name, child in module._modules.items():
        if isinstance(child, nn.ModuleList) and len(child) > 1 and any(
                _is_router_weight(other._parameters.get("weight"), len(child))
                for other_name, other in module._modules.items() if other_name != name):
            return name
    return None


def match_moe(module: nn.Module) -> MatchResult:
    experts_name = _experts_child(module)
    if experts_name is None:
        listed = _expert_list(module)
        return None if listed is None else Skip(
            f"its experts ({listed}) are a ModuleList of per-expert modules; the fused block takes experts stored "
            f"as 3-D gate_up_proj / down_proj Parameters (no transformers 5.24 MoE family stores them as a list)")
    experts_module = module._modules[experts_name]
    gate_up, down = experts_module._parameters["gate_up_proj"], experts_module._parameters["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return None
    n_experts = gate_up.shape[0]
    router_name = next((name for name, child in module._modules.items()
                        if name != experts_name and _is_router_weight(child._parameters.get("weight"), n_experts)),
                       None)
    if router_name is None:
        return Skip("has expert weights but no router child with a [experts, hidden] weight")
    hidden = module._modules[router_name]._parameters["weight"].shape[1]
    if module._modules[router_name]._modules:
        return Skip(f"its router {router_name} has children of its own; the fused block calls a plain router")
    others = [name for name in module._modules if name not in (experts_name, router_name)]
    if module._parameters or module._buffers:
        return Skip(f"has parameters or buffers of its own ({', '.join([*module._parameters, *module._buffers])}) "
                    f"beyond its router, experts and shared expert")
    if len(others) > 1:
        return Skip(f"has children beyond its router, experts and one shared expert: {', '.join(others)} (a gated "
                    f"shared expert, as in Qwen2-MoE, is not covered)")
    if getattr(module, "jitter_noise", 0):
        return Skip(f"its router adds jitter noise to the hidden states in training (jitter_noise="
                    f"{module.jitter_noise}), which the fused block does not")
    unexpected = set(experts_module._parameters) - _EXPERT_PARAMETERS - _EXPERT_BIASES
    if unexpected:
        return Skip(f"its experts have parameters beyond gate_up_proj and down_proj and their biases: "
                    f"{', '.join(sorted(unexpected))}")
    layouts = _layouts(tuple(gate_up.shape), tuple(down.shape), hidden, experts_module)
    if not layouts:
        return Skip(f"expert weights gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} fit "
                    f"neither [experts, 2I, {hidden}] and [experts, {hidden}, I] nor their transposes")
    activation, alpha, limit, label = _activation(experts_module)
    if activation is None:
        return Skip(f"expert activation {label} has no fused kernel (fused: gelu, gelu_tanh, silu, gpt-oss's "
                    f"clamped SwiGLU)")
    refusal = _router_returns_top_k(module._modules[router_name], n_experts, hidden)
    if refusal is not None:
        return Skip(f"its router {router_name} is not one the fused block can call: {refusal}")
    scores = _returns_router_scores(module, hidden)
    if scores is None:
        return Skip("its output is neither the hidden states nor (hidden states, router scores)")
    declared_concatenated = getattr(experts_module, "is_concatenated", True)
    interleavings = sorted((False, True), key=lambda value: value == bool(declared_concatenated))
    shared = others[0] if others else None
    variants = [
        Variant(lambda o, transposed=transposed, interleaved=interleaved: FusedMoE(
            module, router=router_name, experts=experts_name, shared=shared, transposed=transposed,
            interleaved=interleaved, activation=activation, alpha=alpha, limit=limit, returns_router_scores=scores,
            backend=o.backend),
            note=f"{'transposed' if transposed else 'linear'} weights, {'interleaved' if interleaved else 'halved'} "
                 f"gate-up{', returns router scores' if scores else ''}")
        for transposed, interleaved in itertools.product(layouts, interleavings)
    ]
    return Match(variants, lambda: ProbeInputs((random_tensor(PROBE_SHAPE + (hidden,), module),)))


MOE = FusionRule(
    "moe", "mlp", "Mixture-of-Experts blocks: the model's router, then the experts as one fused op (grouped GEMMs); "
                  "a shared expert added (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3)",
    match_moe)
