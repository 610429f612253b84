"""Input validation shared by the fused ops.

Every error names the op, the argument, what was given and what was expected, and
nothing is broadcast silently: a fused kernel that quietly accepted a wrong shape
would produce wrong numbers instead of an error.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(op: str, name: str, value, *, min_dim: int = 1) -> torch.Tensor:
    """``value`` must be a floating-point tensor with at least ``min_dim`` dimensions."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {value.dtype}; expected one of float32, float16, bfloat16, float64"
        )
    if value.dim() < min_dim:
        raise ValueError(f"{op}: {name} must have at least {min_dim} dimension(s), got shape {tuple(value.shape)}")
    return value


def check_like(op: str, name: str, value, reference: torch.Tensor, reference_name: str,
               shape: Optional[Sequence[int]] = None, same_dtype: bool = True) -> torch.Tensor:
    """``value`` must match ``reference`` in device and (with ``same_dtype``) dtype, and have
    ``shape`` (``reference``'s shape when not given)."""
    check_tensor(op, name, value)
    expected = tuple(reference.shape if shape is None else shape)
    if tuple(value.shape) != expected:
        raise ValueError(
            f"{op}: {name} has shape {tuple(value.shape)}; expected {expected} (from {reference_name})"
        )
    if same_dtype and value.dtype != reference.dtype:
        raise TypeError(f"{op}: {name} has dtype {value.dtype}; expected {reference.dtype} like {reference_name}")
    if value.device != reference.device:
        raise ValueError(f"{op}: {name} is on {value.device}; expected {reference.device} like {reference_name}")
    return value


def check_parameter(op: str, name: str, value, reference: torch.Tensor, reference_name: str,
                    length: int) -> torch.Tensor:
    """A per-feature parameter (weight, bias): 1-D of ``length`` on ``reference``'s device.
    Its dtype may differ from the input's (fp32 weights with bf16 activations are common)."""
    check_tensor(op, name, value)
    if tuple(value.shape) != (length,):
        raise ValueError(
            f"{op}: {name} has shape {tuple(value.shape)}; expected ({length},), "
            f"the last dimension of {reference_name}"
        )
    if value.device != reference.device:
        raise ValueError(f"{op}: {name} is on {value.device}; expected {reference.device} like {reference_name}")
    return value


def check_positive(op: str, name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{op}: {name} must be a positive number, got {value!r}")
    return float(value)


def check_choice(op: str, name: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_label_tensor(op: str, labels, expected_shape, reference: Tensor, reference_name: str) -> Tensor:
    """``labels`` must be an integer tensor of ``expected_shape`` on ``reference``'s device."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{op}: labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{op}: labels has dtype {labels.dtype}; expected an integer dtype such as torch.int64")
    if tuple(labels.shape) != tuple(expected_shape):
        raise ValueError(
            f"{op}: labels has shape {tuple(labels.shape)}; expected {tuple(expected_shape)} "
            f"(the leading dimensions of {reference_name})"
        )
    if labels.device != reference.device:
        raise ValueError(f"{op}: labels is on {labels.device}; expected {reference.device} like {reference_name}")
    return labels


def check_labels_in_range(op: str, labels: Tensor, vocab: int, ignore_index: int) -> None:
    """Every label is ``ignore_index`` or a class in [0, vocab). Reading the answer waits
    for the device, so each op call checks once, before any kernel runs: an
    out-of-range label would otherwise read outside the row (Triton) or trip a device
    assert far from its cause."""
    outside = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(outside.any()):
        value = int(labels[outside][0])
        raise ValueError(
            f"{op}: labels contains {value}, which is neither ignore_index ({ignore_index}) "
            f"nor a class index in [0, {vocab})"
        )
