"""The ``lm_head_loss`` rule: a causal LM's head and loss become fused linear
cross-entropy (see :mod:`te_lab.modules.lm_head_loss`).

A candidate has an ``lm_head`` projection, a body child named by its
``base_model_prefix`` (Hugging Face's convention, which te_lab's demo models follow),
a forward that takes ``labels`` and an output object with ``loss`` and ``logits``
fields. The probe runs the whole model with labels and compares the loss and every
parameter gradient; labels are added to a captured call that lacks them (the inputs
shifted by one, as for language-model training). A model with a logit scale among its
attributes (Cohere's ``logit_scale``, a factor; Granite's ``config.logits_scaling``, a
divisor) is offered the head with that scale applied first, then without; one whose
config names a final logit soft-cap (``final_logit_softcapping``: Gemma 2 and 3, VaultGemma,
Nanochat, ...) is offered the fused loss with that cap first, then without; the probe
keeps the first that reproduces the model. An ``lm_head`` that stands in for a Linear (a LoRA
layer) and a model whose forward someone else has wrapped are skipped with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from te_lab.inputs import call_with
from te_lab.modules.linear_like import has_linear_weight, in_out_features, is_linear_like
from te_lab.modules.lm_head_loss import FusedLMHeadLoss

from .inspection import describe_callable, takes_argument, tensor_like
from .probe import quiet_state
from .rules import BuildOptions, FusionRule, Match, MatchResult, ProbeInputs, Skip, Variant

PROBE_TOKENS = (2, 16)


def _with_labels(inputs: ProbeInputs) -> ProbeInputs:
    if "labels" in inputs.kwargs:
        return inputs
    input_ids = inputs.kwargs.get("input_ids", inputs.args[0] if inputs.args else None)
    if not isinstance(input_ids, Tensor):
        return inputs
    return ProbeInputs(inputs.args, {**inputs.kwargs, "labels": input_ids.clone()})


def _loss_only(output) -> list[Tensor]:
    loss = getattr(output, "loss", None)
    return [] if loss is None else [loss]


def _number(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def logit_scales(module: nn.Module) -> tuple[float, ...]:
    """The factors the model may multiply its logits by, read off its attributes (not 1):
    Cohere's ``logit_scale`` and the inverse of Granite's ``config.logits_scaling``."""
    scales = []
    factor = _number(getattr(module, "logit_scale", None))
    if factor is not None and factor != 1.0:
        scales.append(factor)
    divisor = _number(getattr(getattr(module, "config", None), "logits_scaling", None))
    if divisor not in (None, 0.0, 1.0):
        scales.append(1.0 / divisor)
    return tuple(scales)


def logit_softcaps(module: nn.Module) -> tuple[float, ...]:
    """The soft-cap the model's config names for its final logits (``cap * tanh(logits /
    cap)``), if a positive number."""
    cap = _number(getattr(getattr(module, "config", None), "final_logit_softcapping", None))
    return (cap,) if cap is not None and cap > 0 else ()


def match_lm_head_loss(module: nn.Module) -> MatchResult:
    head = module._modules.get("lm_head")
    body_name = getattr(module, "base_model_prefix", None)
    if not is_linear_like(head) or not isinstance(body_name, str) or body_name not in module._modules:
        return None
    if not takes_argument(module, "labels"):
        return None
    if not has_linear_weight(head):
        return Skip(f"lm_head is a {type(head).__name__} standing in for a Linear (an adapter), whose weight alone "
                    f"is not its product; the fused loss multiplies by the weight itself")
    wrapper = module.__dict__.get("forward")
    if hasattr(wrapper, "__wrapped__") and not isinstance(wrapper, FusedLMHeadLoss):
        return Skip(f"its forward is wrapped ({describe_callable(wrapper)}, e.g. by Accelerator.prepare's mixed "
                    f"precision or a device-map hook), and the fused loss would bypass the wrapper; fuse before "
                    f"wrapping")
    vocab = in_out_features(head)[1]
    _, device = tensor_like(module)

    def example() -> ProbeInputs:
        generator = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, vocab, PROBE_TOKENS, generator=generator).to(device)
        return ProbeInputs((), {"input_ids": ids, "labels": ids.clone()})

    def variant(logit_scale: float, softcap: Optional[float]) -> Variant:
        def build(options: BuildOptions) -> FusedLMHeadLoss:
            with quiet_state([module], device), torch.no_grad():
                output = call_with(module, example())
            names = {field.name for field in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
            if not {"loss", "logits"} <= names:
                raise TypeError(f"{type(module).__name__} returns {type(output).__name__}, not an output object with "
                                f"loss and logits fields, which the fused forward fills in")
            return FusedLMHeadLoss(module, head="lm_head", body=body_name, output_type=type(output),
                                   logit_scale=logit_scale, softcap=softcap, backend=options.backend)
        notes = ([] if logit_scale == 1.0 else [f"logits scaled by {logit_scale:g}"]) + (
            [] if softcap is None else [f"logits soft-capped at {softcap:g}"])
        return Variant(build, note="; ".join(notes))

    return Match([variant(scale, cap) for scale in (*logit_scales(module), 1.0)
                  for cap in (*logit_softcaps(module), None)], example, complete_inputs=_with_labels,
                 probe_outputs=_loss_only, replaces_forward=True)


LM_HEAD_LOSS = FusionRule(
    "lm_head_loss", "loss",
    "causal-LM head + cross-entropy -> chunked fused linear cross-entropy when called with labels "
    "(the output's logits are then None); logit scales and final logit soft-capping included",
    match_lm_head_loss)
