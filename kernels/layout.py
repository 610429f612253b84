"""The 2-D row layout the ops' implementations work in, and back, at small per-call cost.

A fused op's implementations take ``[rows, last dim]`` tensors; its ``te_lab::`` op
views the caller's ``[..., last dim]`` tensors that way and its results back. On a
small CPU op these views are a noticeable share of the call (``view(torch.Size)`` costs
a few microseconds more than ``view_as``), so they are skipped where the tensor already
has the wanted shape.
"""

from __future__ import annotations

from torch import Tensor


def as_rows(tensor: Tensor) -> Tensor:
    """``tensor`` as ``[rows, last dim]`` (a view where its layout allows, else a copy)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def shaped_like(result: Tensor, like: Tensor) -> Tensor:
    """``result`` (contiguous, ``like.numel()`` elements) viewed in ``like``'s shape."""
    result = result.contiguous()
    return result if result.shape == like.shape else result.view_as(like)
