"""The precision fused ops compute in: float32 for float32/float16/bfloat16 inputs (as
LLM code does), float64 for float64 inputs (so gradcheck sees exact math)."""

from __future__ import annotations

import torch

from .triton_support import HAS_TRITON, tl


# DESIGN.md's tolerances for a fused result against its reference (forward output and
# every gradient); float64 is for gradcheck-grade comparisons.
TOLERANCES = {
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def triton_compute_dtype(tensor: torch.Tensor):
    """The Triton dtype of :func:`compute_dtype`, passed to kernels as a constexpr."""
    assert HAS_TRITON
    return tl.float64 if tensor.dtype == torch.float64 else tl.float32
