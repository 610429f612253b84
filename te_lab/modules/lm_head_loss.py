"""A causal language model's forward with the LM head and its loss fused.

Called with ``labels``, the model runs its body (the decoder stack) and then
``fused_linear_cross_entropy`` over the final hidden states, in token chunks, so the
``[tokens, vocab]`` logits never exist in memory: the output carries the loss and
``logits=None``. Without labels (or with options the fused path does not cover, such as
``logits_to_keep``) the model's own forward runs unchanged and returns its logits.

A head whose logits the model scales (Cohere's ``logits * logit_scale``, Granite's
``logits / logits_scaling``) is fused with the scale applied where it costs least:
``(hidden * s) @ W^T + bias * s`` is ``s * (hidden @ W^T + bias)``, so the hidden states
(``[tokens, hidden]``, not ``[tokens, vocab]``) are scaled before the fused loss.
A head that soft-caps its logits (Gemma 2's ``final_logit_softcapping``:
``cap * tanh(logits / cap)``) passes the cap to the fused loss, which applies it, and its
derivative, inside the chunks.

The loss is Hugging Face's causal-LM convention: position ``t`` predicts label
``t + 1`` (or ``shift_labels``, when given, are the targets as they are), ``-100`` is
ignored, the mean is over labelled tokens (a sum divided by ``num_items_in_batch`` when
that is given, as Trainer's gradient accumulation passes it).

To a caller that introspects it the installed forward is the original: its signature
(``inspect.signature``, which Trainer reads to choose the dataset's columns and whether
the model takes ``num_items_in_batch``) and ``__wrapped__`` are the original forward's.
A wrapper installed over it later (Accelerator.prepare's mixed precision) keeps it
running, and te_lab still finds it (:func:`installed_lm_head_loss`); unfusing under
such a wrapper switches it to pass every call to the original forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_lab.kernels.fused_linear_cross_entropy import FUSED_LINEAR_CROSS_ENTROPY, fused_linear_cross_entropy
from te_lab.kernels.registry import select_backend

from .call_arguments import accepts, forward_signature, named_arguments
from .linear_like import linear_weight

IGNORE_INDEX = -100
# Fields of a model output that the body's output can fill in.
BODY_OUTPUT_FIELDS = ("cache", "past_key_values", "hidden_states", "attentions")


class FusedLMHeadLoss:
    """Installed as ``model.forward`` (an instance attribute) by :func:`te_lab.fuse`.

    ``head`` and ``body`` name the model's children (``lm_head`` and its
    ``base_model_prefix``); ``output_type`` is the class of the model's output;
    ``logit_scale`` the factor the model multiplies its logits by (1: none);
    ``softcap`` the cap its logits are soft-capped at after that (None: none).
    """

    ops = (FUSED_LINEAR_CROSS_ENTROPY,)

    def __init__(self, model: nn.Module, *, head: str, body: str, output_type: type, logit_scale: float = 1.0,
                 softcap: Optional[float] = None, backend: Optional[str] = None):
        self.model = model
        self.logit_scale = float(logit_scale)
        self.softcap = None if softcap is None else float(softcap)
        self.head_name, self.body_name = head, body
        self.output_type = output_type
        self.backend = backend if backend in FUSED_LINEAR_CROSS_ENTROPY.backends() else None
        # An instance-level forward installed by someone else (a hook library) is kept
        # and called, and put back on unfuse.
        self.replaced_instance_forward: Optional[Callable] = model.__dict__.get("forward")
        self.original_forward: Callable = self.replaced_instance_forward or type(model).forward.__get__(model)
        self._signature = forward_signature(self.original_forward)
        # What introspection sees (inspect.signature, inspect.unwrap): the original forward.
        self.__signature__ = self._signature
        self.__wrapped__ = self.original_forward
        self._body_signature = forward_signature(model._modules[body].forward)
        # Read once here: torch.compile graph-breaks on dataclasses.fields of a class.
        self._carried_field_names = _carried_field_names(output_type)
        # False once unfused while a wrapper installed over it still calls it.
        self.active = True

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.original_forward(*args, **kwargs)
        named = named_arguments(self._signature, args, kwargs)
        labels = named.pop("labels", None)
        if labels is None or named.pop("logits_to_keep", 0) not in (0, None) or named.get("return_dict") is False:
            return self.original_forward(*args, **kwargs)
        num_items = named.get("num_items_in_batch")
        targets = named.get("shift_labels")
        body = self.model._modules[self.body_name]
        body_output = body(**{name: value for name, value in named.items() if accepts(self._body_signature, name)})
        hidden = _last_hidden_state(body_output)
        weight, bias = linear_weight(self.model._modules[self.head_name])
        if self.logit_scale != 1.0:
            hidden = hidden * self.logit_scale
            bias = None if bias is None else bias * self.logit_scale
        if targets is None:
            targets = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
        loss = fused_linear_cross_entropy(hidden, weight, targets.to(hidden.device), bias, ignore_index=IGNORE_INDEX,
                                          reduction="mean" if num_items is None else "sum", softcap=self.softcap,
                                          backend=self.backend)
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if isinstance(num_items, Tensor) else num_items)
        return self.output_type(loss=loss, logits=None, **_carried_fields(self._carried_field_names, body_output))

    def install(self) -> None:
        """Make this the model's forward (again, after :meth:`restore_original`)."""
        if installed_lm_head_loss(self.model, include_inactive=True) is not self:
            self.model.forward = self
        self.active = True

    def resolved_backends(self, device: torch.device) -> dict[str, str]:
        return {FUSED_LINEAR_CROSS_ENTROPY.name: select_backend(FUSED_LINEAR_CROSS_ENTROPY, device, self.backend)}

    def kernel_names(self) -> list[str]:
        return [f"te_lab::{FUSED_LINEAR_CROSS_ENTROPY.name}"]

    def restore_original(self) -> nn.Module:
        self.active = False
        if self.model.__dict__.get("forward") is self:
            if self.replaced_instance_forward is not None:
                self.model.forward = self.replaced_instance_forward
            else:
                del self.model.forward
        return self.model


def installed_lm_head_loss(model: nn.Module, include_inactive: bool = False) -> Optional[FusedLMHeadLoss]:
    """The fused forward installed on ``model``: its instance ``forward``, or one that a
    wrapper installed over it calls (found through ``__wrapped__``, which
    ``functools.wraps`` and accelerate's wrappers set); ``None`` when there is none, or
    it was unfused (unless ``include_inactive``)."""
    forward = model.__dict__.get("forward")
    for _ in range(64):  # a chain of wrappers, never a cycle
        if forward is None or isinstance(forward, FusedLMHeadLoss):
            break
        forward = getattr(forward, "__wrapped__", None)
    if isinstance(forward, FusedLMHeadLoss) and forward.model is model and (forward.active or include_inactive):
        return forward
    return None


def _last_hidden_state(body_output: Any) -> Tensor:
    if isinstance(body_output, Tensor):
        return body_output
    hidden = getattr(body_output, "last_hidden_state", None)
    return hidden if hidden is not None else body_output[0]


def _carried_field_names(output_type: type) -> tuple[str, ...]:
    """The fields of ``output_type`` that the body's output can fill in."""
    if not dataclasses.is_dataclass(output_type):
        return ()
    names = {field.name for field in dataclasses.fields(output_type)}
    return tuple(name for name in BODY_OUTPUT_FIELDS if name in names)


def _carried_fields(names: tuple[str, ...], body_output: Any) -> dict[str, Any]:
    if isinstance(body_output, Tensor):
        return {}
    return {name: getattr(body_output, name) for name in names if getattr(body_output, name, None) is not None}
