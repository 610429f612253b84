"""Triton, imported when present. The op files define their kernels only when
``triton`` is importable, so te_lab works (with the other backends) without it.

Kernels stay inside Triton 3.2's language, the release Moore Threads ships for MUSA:
no libdevice calls (tanh is written through exp), nothing vendor-specific.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Iterator, Optional

import torch

from te_lab import device as devices

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # the op files check HAS_TRITON before touching these
    triton = None
    tl = None
    load_norm_input = None

if HAS_TRITON:

    @triton.jit
    def load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, cols, HAS_RESIDUAL: tl.constexpr,
                        STORE_H: tl.constexpr, ACC: tl.constexpr):
        """A norm's input over columns ``cols`` of ``row``, in ACC: x, or with HAS_RESIDUAL
        h = x + residual, added at full precision and rounded once to the input dtype as
        torch's add does (written to H with STORE_H)."""
        mask = cols < n_cols
        hf = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(ACC)
        if HAS_RESIDUAL:
            h = (hf + tl.load(R + row * r_stride + cols, mask=mask, other=0.0).to(ACC)).to(H.dtype.element_ty)
            if STORE_H:
                tl.store(H + row * n_cols + cols, h, mask=mask)
            hf = h.to(ACC)
        return hf

# The widest column block a row-wise kernel holds in registers: 8192 columns keep the
# norms' backward spill-free on sm_80 and sm_90 in float32 (compiled by
# te_lab.gpu_checks.gpu_kernels); wider rows are walked block by block.
MAX_COLUMN_BLOCK = 8192


def column_block(n: int) -> int:
    """The power-of-two block of columns a row-wise kernel works on for rows of ``n``
    elements: the whole row up to MAX_COLUMN_BLOCK, else MAX_COLUMN_BLOCK at a time."""
    return min(1 << max(n - 1, 0).bit_length(), MAX_COLUMN_BLOCK)


def num_warps_for(block: int, most: int = 16) -> int:
    """One warp per 256 elements of ``block``, between 1 and ``most`` (32 is a GPU's limit)."""
    return min(max(block // 256, 1), most)


def norm_backward_warps(block: int) -> int:
    """Warps for a norm's backward over ``block`` columns, up to 32: with 16 at 8192 columns
    ptxas settles on 64 registers and spills (sm_80, half precision); 32 hold 8 columns
    per thread without spilling."""
    return num_warps_for(block, most=32)


# The GPU that launches made through the interpreter stand for, set by
# :func:`standing_for_gpu` (te_lab.gpu_checks.kernel_launches records the launches a GPU
# would get from CPU runs); None: launches are what this machine gets.
_STOOD_FOR_MULTIPROCESSORS: Optional[int] = None


@contextlib.contextmanager
def standing_for_gpu(multiprocessors: int) -> Iterator[None]:
    """Within this block the launch wrappers choose what they would on a GPU with
    ``multiprocessors`` parallel units, even while the interpreter runs the kernels:
    the dtypes compiled Triton handles and the interpreter does not (see
    :func:`interpreter_dtypes`), and GPU-sized reductions (:func:`reduction_programs`)."""
    global _STOOD_FOR_MULTIPROCESSORS
    if not isinstance(multiprocessors, int) or multiprocessors < 1:
        raise ValueError(f"standing_for_gpu: multiprocessors must be a positive int, got {multiprocessors!r}")
    saved, _STOOD_FOR_MULTIPROCESSORS = _STOOD_FOR_MULTIPROCESSORS, multiprocessors
    try:
        yield
    finally:
        _STOOD_FOR_MULTIPROCESSORS = saved


def interpreter_dtypes() -> bool:
    """Whether kernels must avoid what Triton's interpreter computes wrongly (it multiplies
    bf16 bit patterns as integers in tl.dot): true under TRITON_INTERPRET=1, unless the
    launches stand for a GPU's."""
    return os.environ.get("TRITON_INTERPRET") == "1" and _STOOD_FOR_MULTIPROCESSORS is None


def reduction_programs(device: torch.device, rows: int) -> int:
    """How many programs a kernel that also reduces over rows (weight/bias gradients)
    launches: a few per parallel unit, each accumulating a partial sum."""
    if _STOOD_FOR_MULTIPROCESSORS is not None:
        units = _STOOD_FOR_MULTIPROCESSORS
    else:
        units = devices.multiprocessor_count(device) if devices.is_gpu(device) else 4
    return max(1, min(rows, 4 * units))


def row_ranges(device: torch.device, rows: int) -> tuple[int, int]:
    """(programs, rows per program) for a kernel whose programs each take a contiguous range
    of rows and reduce over them: :func:`reduction_programs` of them at most, and none
    without a row (a program's range starts at program * rows per program)."""
    per_program = max(1, -(-rows // reduction_programs(device, rows)))
    return max(1, -(-rows // per_program)), per_program
