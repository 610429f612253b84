"""Triton, imported when present. The op files define their kernels only when
``triton`` is importable, so te_lab works (with the other backends) without it.

Kernels stay inside Triton 3.2's language, the release Moore Threads ships for MUSA:
no libdevice calls (tanh is written through exp), nothing vendor-specific.
"""

from __future__ import annotations

import importlib.util

import torch

from te_lab import device as devices

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # the op files check HAS_TRITON before touching these
    triton = None
    tl = None

# A row must fit in one block: a row-wise kernel holds a whole row in registers.
MAX_ROW_BLOCK = 65536


def row_block(op: str, n: int) -> int:
    """The power-of-two block that holds a row of ``n`` elements."""
    block = 1 << max(n - 1, 0).bit_length()
    if block > MAX_ROW_BLOCK:
        raise ValueError(
            f"{op}: rows of {n} elements exceed the triton backend's limit of {MAX_ROW_BLOCK}; "
            f"use backend='native' or 'inductor'"
        )
    return block


def num_warps_for(block: int) -> int:
    return min(max(block // 256, 1), 16)


def reduction_programs(device: torch.device, rows: int) -> int:
    """How many programs a kernel that also reduces over rows (weight/bias gradients)
    launches: a few per parallel unit, each accumulating a partial sum."""
    units = devices.multiprocessor_count(device) if devices.is_gpu(device) else 4
    return max(1, min(rows, 4 * units))
