"""What "eager" and "fused" mean for each kind of profile target: how a mode runs a step,
the context it runs in, what its backward differentiates, and which module each key labels.

- a fused model (:func:`target_modes`), or the fused models a statement uses
  (:func:`statement_modes`): "eager" runs inside ``te_lab.unfused`` for every model,
  "fused" as they are; keys are the fusions' module paths (prefixed by the model's name
  when a statement uses several), the LM head's fusion under :data:`LOSS_KEY`. Both are
  built by one function, :func:`_fused_models_modes`;
- a callable: "eager" runs with every te_lab op on its reference (unfused) math
  (``te_lab.use_backend("reference")``), "fused" with the automatic backends;
- a pair ``(baseline, candidate)``: "eager" is the baseline, "fused" the candidate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn
from torch.profiler import record_function

from te_lab import distributed
from te_lab.inputs import ProbeInputs, as_call_inputs
from te_lab.kernels import use_backend
from te_lab.surgery import fusions, is_fused, unfused

from . import regions

LOSS_KEY = "(model) lm_head + loss"
TARGET_KEY = "(target)"  # the region of a callable target


def _gradients(loss: torch.Tensor, leaves: list) -> None:
    torch.autograd.grad(loss, leaves, allow_unused=True)


def _backward_through_reducer(loss: torch.Tensor, leaves: list) -> None:
    """``loss.backward()`` with every ``.grad`` put back as it was: DDP all-reduces in
    hooks that run as ``.grad`` is written, which ``torch.autograd.grad`` never does."""
    saved = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    try:
        loss.backward()
    finally:
        for leaf, grad in zip(leaves, saved):
            leaf.grad = grad


@dataclass
class Mode:
    name: str
    run: Callable[[], Any]
    context: Callable[[], ContextManager]
    leaves: list
    labels: Callable[[], dict]  # key -> module to label, resolved inside the context
    backpropagate: Callable[[torch.Tensor, list], None] = _gradients


def _floating_leaves(inputs) -> tuple[Any, list]:
    """Copies of the inputs whose floating-point tensors require grad, and those tensors."""
    leaves = []

    def prepare(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            copy = value.detach().clone().requires_grad_(True)
            leaves.append(copy)
            return copy
        if isinstance(value, (tuple, list)):
            return type(value)(prepare(v) for v in value)
        if isinstance(value, dict):
            return {k: prepare(v) for k, v in value.items()}
        return value

    return prepare(inputs), leaves


def _caller(fn: Callable, inputs, region: Optional[str] = None) -> Callable[[], Any]:
    """``fn`` on ``inputs``; with ``region``, inside that labelled region."""
    probe_inputs = as_call_inputs(inputs, "te_lab.profile", "inputs") if inputs is not None else ProbeInputs()
    if region is None:
        return lambda: fn(*probe_inputs.args, **probe_inputs.kwargs)

    def run():
        with record_function(regions.PREFIX + region):
            return fn(*probe_inputs.args, **probe_inputs.kwargs)
    return run


def _model_labels(model: nn.Module) -> Callable[[], dict]:
    """Key -> module path of every fusion (the LM head's key labels the head module,
    which only the eager forward calls); resolved inside each mode's context, where
    the path holds the twin or the original."""
    paths = {LOSS_KEY if f.replaces_forward else f.path: (f.twin.head_name if f.replaces_forward else f.path)
             for f in fusions(model)}
    return lambda: {key: model.get_submodule(path) for key, path in paths.items()}


def _key_info(model: nn.Module) -> dict:
    """Key -> (op kind, the original module's type, the fusion probe's errors) for every
    fusion of ``model``."""
    return {(LOSS_KEY if f.replaces_forward else f.path): (f.kind, f.original_type,
                                                           getattr(f.twin, "verification", ""))
            for f in fusions(model)}


def _fused_models_modes(run: Callable[[], Any], models: dict, input_leaves: list) -> tuple[list[Mode], dict]:
    """The two modes of ``run`` over ``models`` (name -> fused model, possibly wrapped by
    DDP), and key -> (kind, module type, verification); keys are prefixed by the model's
    name when there are several."""
    several = len(models) > 1
    unwrapped = {name: distributed.unwrap(model) for name, model in models.items()}  # fusion paths are these

    def keyed(name: str, key: str) -> str:
        return f"{name}.{key}" if several else key

    labels_of = {name: _model_labels(model) for name, model in unwrapped.items()}
    key_info = {keyed(name, key): info for name, model in unwrapped.items() for key, info in _key_info(model).items()}

    def labels() -> dict:
        return {keyed(name, key): module for name, resolve in labels_of.items() for key, module in resolve().items()}

    def all_unfused() -> ContextManager:
        stack = contextlib.ExitStack()
        for model in models.values():
            stack.enter_context(unfused(model))
        return stack

    leaves = [p for model in models.values() for p in model.parameters() if p.requires_grad] + input_leaves
    backpropagate = (_backward_through_reducer if any(distributed.is_data_parallel(m) for m in models.values())
                     else _gradients)
    return [Mode("eager", run, all_unfused, leaves, labels, backpropagate),
            Mode("fused", run, contextlib.nullcontext, leaves, labels, backpropagate)], key_info


def target_modes(target, inputs) -> tuple[list[Mode], str, dict]:
    """``te_lab.profile``'s two modes of ``target`` on ``inputs``, a description of the
    target, and key -> (kind, module type, verification)."""
    if isinstance(target, nn.Module):
        if not is_fused(target):
            raise ValueError("te_lab.profile: target is a model with no te_lab fusions; fuse it first "
                             "(te_lab.fuse) or pass a (baseline, candidate) pair of callables")
        prepared, input_leaves = _floating_leaves(inputs)
        model = distributed.unwrap(target)
        distributed.refuse_sharded(model, "te_lab.profile", "its eager mode would unfuse the model, whose originals "
                                   "still hold the Parameters from before sharding; profile a (baseline, "
                                   "candidate) pair of callables instead")
        modes, key_info = _fused_models_modes(_caller(target, prepared), {"": target}, input_leaves)
        description = type(model).__name__ if model is target else f"{type(target).__name__}({type(model).__name__})"
        return modes, description, key_info
    if isinstance(target, tuple) and len(target) == 2 and all(callable(t) for t in target):
        prepared, leaves = _floating_leaves(inputs)
        baseline, candidate = target
        names = (getattr(baseline, "__name__", "baseline"), getattr(candidate, "__name__", "candidate"))
        return ([Mode("eager", _caller(baseline, prepared, TARGET_KEY), contextlib.nullcontext, leaves, dict),
                 Mode("fused", _caller(candidate, prepared, TARGET_KEY), contextlib.nullcontext, leaves, dict)],
                f"{names[0]} vs {names[1]}", {TARGET_KEY: ("other", " vs ".join(names), "")})
    if callable(target):
        prepared, leaves = _floating_leaves(inputs)
        run = _caller(target, prepared, TARGET_KEY)
        name = getattr(target, "__name__", type(target).__name__)
        return ([Mode("eager", run, lambda: use_backend("reference"), leaves, dict),
                 Mode("fused", run, contextlib.nullcontext, leaves, dict)], name, {TARGET_KEY: ("other", name, "")})
    raise TypeError(f"te_lab.profile: target must be a fused nn.Module, a callable or a (baseline, candidate) "
                    f"pair of callables, got {type(target).__name__}")


def statement_modes(run: Callable[[], Any], models: dict) -> tuple[list[Mode], dict]:
    """``te_lab.profile_statement``'s two modes of ``run`` over ``models`` (name -> fused
    model), and key -> (kind, module type, verification)."""
    return _fused_models_modes(run, models, [])


def model_mode(model: nn.Module, inputs, name: str) -> Mode:
    """One mode of ``model`` on ``inputs``: ``"eager"`` runs a fused model inside
    ``te_lab.unfused``, ``"fused"`` (or an unfused model) runs it as it is."""
    prepared, input_leaves = _floating_leaves(inputs)
    context = (lambda: unfused(model)) if name == "eager" and is_fused(model) else contextlib.nullcontext
    leaves = [p for p in model.parameters() if p.requires_grad] + input_leaves
    return Mode(name, _caller(model, prepared), context, leaves, dict)
