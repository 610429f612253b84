"""The rule for Mixture-of-Experts blocks (``moe``): a router, routed experts held as 3-D
Parameters, optionally one shared expert (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3,
Llama 4).

A candidate has no parameters or buffers of its own and two or three children:

- the router: a leaf with a 2-D ``weight`` [experts, hidden] (and optionally a bias and
  buffers, such as DeepSeek's ``e_score_correction_bias``) whose call on hidden states
  returns ``(router_logits, top-k weights, top-k expert indices)``, or ``(scores,
  router_logits)`` with the scores zero outside the same top k of every token's logits
  (Llama 4), checked by calling it once on a small random input;
- the experts: ``gate_up_proj`` and ``down_proj`` Parameters [experts, ., .] (optionally
  ``gate_up_proj_bias`` and ``down_proj_bias``) and an activation (``act_fn``, identified by
  evaluating it, or gpt-oss's clamped SwiGLU, recognised by its ``alpha`` and ``limit``);
- optionally a shared expert: any other child with parameters, added to the output.

The weights' layout (as ``nn.Linear`` weights, or transposed) follows from the shapes;
whether the block returns the router's weights (gpt-oss) or its logits (Llama 4) next to
its output from one call of the block on a small random input; whether gate and up are the
two halves or interleaved columns the shapes do not say, nor whether a scores router's
scores scale the experts' inputs (Llama 4) or outputs: the attributes Hugging Face's
experts carry (``is_transposed``, ``is_concatenated``) choose the first variant tried, and
the probe picks the one that reproduces the block.
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


def _router_output(router: nn.Module, experts: int, hidden: int) -> tuple[Optional[str], Optional[int], str]:
    """(``"top_k"`` or ``"dense_scores"`` or None, top_k of a scores router, why not a router
    the twin can call)."""
    probe = random_tensor((4, hidden), router)
    try:
        with torch.no_grad(), silenced(router):  # a rule's look leaves no trace in the user's hooks
            output = router(probe)
    except Exception as error:  # noqa: BLE001 - any failure means "not a router we can call"
        return None, None, f"calling it on hidden states failed ({type(error).__name__}: {error})"
    expected = "(router_logits, top-k weights, top-k indices) nor (scores, router_logits)"
    if not (isinstance(output, tuple) and len(output) in (2, 3) and all(isinstance(t, torch.Tensor) for t in output)):
        return None, None, f"it returns {type(output).__name__}, not {expected}"
    shapes = [tuple(t.shape) for t in output]
    if len(output) == 2:
        scores, logits = output
        if shapes != [(4, experts)] * 2 or not (scores.is_floating_point() and logits.is_floating_point()):
            return None, None, f"it returns tensors of shapes {shapes}, not {expected} (each [tokens, experts])"
        chosen = scores != 0
        top_k = int(chosen[0].sum())
        if top_k < 1 or not bool((chosen.sum(-1) == top_k).all()) or not torch.equal(
                chosen, torch.zeros_like(chosen).scatter_(-1, torch.topk(logits, top_k, dim=-1).indices, True)):
            return None, None, ("it returns (scores, logits) whose nonzero scores are not the same top k of every "
                                "token's logits")
        return "dense_scores", top_k, ""
    logits, weights, indices = output
    if (shapes[0] != (4, experts) or weights.shape != indices.shape or weights.dim() != 2
            or indices.dtype != torch.int64 or not weights.is_floating_point()):
        return None, None, (f"it returns tensors of shapes {shapes}, not [tokens, experts] logits and "
                            f"[tokens, top_k] weights and int64 indices")
    return "top_k", None, ""


def _block_returns(module: nn.Module, router: nn.Module, hidden: int) -> tuple[Optional[str], bool]:
    """What the block returns, from one call on a small random input: ``"out"`` (the hidden
    states), ``"logits"`` (with its router's logits: Llama 4) or ``"weights"`` (with the top-k
    weights: gpt-oss), None when it returns neither; and whether its output is flattened to
    [tokens, hidden] (Llama 4) rather than shaped as its input."""
    x = random_tensor((1, 2, hidden), module)
    try:
        with torch.no_grad(), silenced(module):
            output = module(x)
            routed = router(x.reshape(-1, hidden))
    except Exception:  # noqa: BLE001 - the probe will say what is wrong with the block
        return None, False
    out = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else None
    flat = isinstance(out, torch.Tensor) and tuple(out.shape) == (2, hidden)
    if isinstance(output, torch.Tensor):
        return "out", flat
    if not (isinstance(output, tuple) and len(output) == 2 and all(isinstance(t, torch.Tensor) for t in output)):
        return None, False
    logits, second = routed[0] if len(routed) == 3 else routed[-1], output[1]
    is_logits = second.numel() == logits.numel() and torch.equal(second.reshape(logits.shape), logits)
    return ("logits" if is_logits else "weights"), flat


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
    router_output, top_k, refusal = _router_output(module._modules[router_name], n_experts, hidden)
    if router_output is None:
        return Skip(f"its router {router_name} is not one the fused block can call: {refusal}")
    returns, flat_output = _block_returns(module, module._modules[router_name], hidden)
    if returns is None:
        return Skip("its output is neither the hidden states nor (hidden states, router scores or logits)")
    declared_concatenated = getattr(experts_module, "is_concatenated", True)
    interleavings = sorted((False, True), key=lambda value: value == bool(declared_concatenated))
    # A scores router's scores may scale the experts' inputs (Llama 4) or their outputs.
    scalings = (True, False) if router_output == "dense_scores" else (False,)
    shared = others[0] if others else None
    variants = [
        Variant(lambda o, transposed=transposed, interleaved=interleaved, scales_input=scales_input: FusedMoE(
            module, router=router_name, experts=experts_name, shared=shared, transposed=transposed,
            interleaved=interleaved, activation=activation, alpha=alpha, limit=limit, router_output=router_output,
            top_k=top_k, scales_input=scales_input, returns=returns, flat_output=flat_output,
            backend=o.backend),
            note=f"{'transposed' if transposed else 'linear'} weights, {'interleaved' if interleaved else 'halved'} "
                 f"gate-up{', scores scale the inputs' if scales_input else ''}"
                 f"{'' if returns == 'out' else f', returns router {returns}'}")
        for transposed, interleaved, scales_input in itertools.product(layouts, interleavings, scalings)
    ]
    return Match(variants, lambda: ProbeInputs((random_tensor(PROBE_SHAPE + (hidden,), module),)))


MOE = FusionRule(
    "moe", "mlp", "Mixture-of-Experts blocks: the model's router, then the experts as one fused op (grouped GEMMs); "
                  "a shared expert added (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3, Llama 4)",
    match_moe)
