"""The precision fused ops compute in: float32 for float32/float16/bfloat16 inputs (as
LLM code does), float64 for float64 inputs (so gradcheck sees exact math)."""

from __future__ import annotations

import torch

from .triton_support import HAS_TRITON, tl

# docs/design.md's tolerances for a fused result against its reference (forward output and
# every gradient); float64 is for gradcheck-grade comparisons.
TOLERANCES = {
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


# A fused result measured against the float64 truth may be this many times as far from it as
# the unfused computation in the same dtype, plus the dtype's tolerance of the true values:
# one rounding more than eager's is not a failure (the probe and the GPU check both judge so).
ERROR_FACTOR = 2.0


def error_budget(original_error, true_scale, dtype: torch.dtype):
    """How far from the truth a fused result may be, given the unfused computation's own
    error and the true values' largest magnitude (floats, or tensors of them, per row):
    ``ERROR_FACTOR x original_error + atol + rtol x true_scale`` with ``dtype``'s tolerance."""
    tolerance = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    return ERROR_FACTOR * original_error + tolerance["atol"] + tolerance["rtol"] * true_scale


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def triton_compute_dtype(tensor: torch.Tensor):
    """The Triton dtype of :func:`compute_dtype`, passed to kernels as a constexpr."""
    assert HAS_TRITON
    return tl.float64 if tensor.dtype == torch.float64 else tl.float32


def float32_matmul_allows_tf32() -> bool:
    """Whether torch's float32 matmul precision lets GEMMs run in TF32, the setting
    ``torch.matmul`` and ``F.scaled_dot_product_attention`` follow on GPUs
    (``torch.set_float32_matmul_precision("high")``, ``torch.backends.cuda.matmul.allow_tf32``
    or, since torch 2.9, ``fp32_precision``). Reads the newer setting where it exists: the
    older getter raises once both spellings have been used."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:  # torch < 2.9
        return bool(matmul.allow_tf32)
    if precision == "none":  # inherits the global setting
        precision = torch.backends.fp32_precision
    return precision == "tf32"


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``: itself when it is already (``Tensor.to`` returns it too, but
    its call costs microseconds a small op's eager path feels)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
