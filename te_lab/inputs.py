"""Calling a model on what a user hands over: one sample, in any of the three forms
``fuse(sample=...)`` and ``profile(target, inputs)`` accept, and the tensors of whatever
the call returns.

It sits below both surgery and the profiler (it imports nothing of te_lab), so each
speaks in its own name: a mistake is reported as ``te_lab.fuse: sample ...`` or
``te_lab.profile: inputs ...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class ProbeInputs:
    """Arguments to call a module with: captured from the user's sample or synthesized."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def as_call_inputs(value: Any, caller: str, argument: str) -> ProbeInputs:
    """``value`` as the arguments of one call: a tensor (the only positional argument), a
    tuple or list of positional arguments, or a dict of keyword arguments. ``caller`` and
    ``argument`` name the function and the argument in the error (``te_lab.profile``,
    ``inputs``)."""
    if isinstance(value, torch.Tensor):
        return ProbeInputs((value,))
    if isinstance(value, (tuple, list)):
        return ProbeInputs(tuple(value))
    if isinstance(value, dict):
        return ProbeInputs((), dict(value))
    raise TypeError(
        f"{caller}: {argument} must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments for the model's forward, got {type(value).__name__}"
    )


def call_with(fn: Callable, inputs: ProbeInputs):
    return fn(*inputs.args, **inputs.kwargs)


def output_tensors(output: Any) -> list[Tensor]:
    """Every tensor in an output (tensors, tuples, lists, dicts, dataclass-like model
    outputs), in order; ``None`` entries are dropped."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in output_tensors(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in output_tensors(v)]
    if hasattr(output, "__dataclass_fields__"):
        return [t for name in output.__dataclass_fields__ for t in output_tensors(getattr(output, name))]
    return []
