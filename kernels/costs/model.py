"""The cost model every op's cost is written in: what one call reads, writes and computes,
from its arguments' shapes and element sizes alone (no data, no device).

A cost function takes the call's arguments, each a :class:`TensorSpec` or None for a
non-tensor (or an absent optional tensor): a te_lab op's as :class:`Arguments`, read by
the names of the op's schema (``arguments.x``), ATen's by position; it returns an
:class:`OpCost`, or None when the arguments do not fit the op (the caller then falls back
to a generic rule). The same functions serve the profiler (specs from recorded shapes and dtypes)
and the benchmark cases (specs from real tensors).

Counting rules, shared by te_lab's ops and the ATen ops eager PyTorch runs, so that a
fused op and the eager ops it replaces are counted alike:

- bytes: every tensor input read once + every output written once;
- a matrix product ``[..., m, k] @ [..., k, n]``: 2*m*n*k FLOPs per batch;
- attention over q ``[b, h, s_q, d]`` and k ``[b, h_kv, s_k, d]``: 4*b*h*s_q*s_k*d
  forward (q@k^T and p@v), 2.5x that backward (non-causal: the profiler does not record
  ``causal``);
- elementwise work: one FLOP per element of each elementwise step of the math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class OpCost:
    """What one op call moves and computes; estimates, with the ``formula`` they came from."""

    bytes_read: int
    bytes_written: int
    flops: int
    formula: str

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as a cost function sees it: shape and bytes per element."""

    shape: tuple
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def rows(self) -> int:
        """Elements over the last dim: the number of rows a row-wise kernel walks."""
        return self.numel // self.shape[-1] if self.shape and self.shape[-1] else 0

    @property
    def stats_itemsize(self) -> int:
        """Per-row float statistics (rstd, mean, lse, losses) are float64 for float64, else float32."""
        return 8 if self.itemsize == 8 else 4


class Arguments(tuple):
    """A te_lab op's arguments (each an Optional[TensorSpec]) in schema order, read by
    name: ``arguments.x`` is argument ``x``, None where the call did not record it. A
    name the schema lacks raises AttributeError."""

    names: tuple[str, ...] = ()

    def __new__(cls, names: tuple[str, ...], values) -> Arguments:
        values = list(values)[:len(names)]
        bound = super().__new__(cls, values + [None] * (len(names) - len(values)))
        bound.names = tuple(names)
        return bound

    @classmethod
    def named(cls, **arguments: Optional[TensorSpec]) -> Arguments:
        """Arguments given by name (another op's arguments read as this op's)."""
        return cls(tuple(arguments), arguments.values())

    def __getattr__(self, name: str) -> Optional[TensorSpec]:
        try:
            return self[self.names.index(name)]
        except ValueError:
            raise AttributeError(f"no argument {name!r}; the op's arguments are {self.names}") from None


CostFunction = Callable[[list], Optional[OpCost]]


def at(arguments: list, index: int) -> Optional[TensorSpec]:
    """An ATen op's argument ``index``, None where the call did not record it."""
    return arguments[index] if index < len(arguments) else None


def nbytes(tensor: Optional[TensorSpec]) -> int:
    return 0 if tensor is None else tensor.nbytes


def reading_inputs(arguments: list, bytes_written: int, flops: int, formula: str) -> OpCost:
    """The usual cost: every tensor input read once, plus what the op writes."""
    return OpCost(sum(t.nbytes for t in arguments if t is not None), bytes_written, flops, formula)


def matmul_output(a: TensorSpec, b: TensorSpec) -> Optional[tuple[tuple, int]]:
    """(output shape, contracted size k) of ``a [..., m, k] @ b [..., k, n]`` with broadcast
    batch dims; None if the shapes do not fit."""
    if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != b.shape[-2]:
        return None
    batch_a, batch_b = a.shape[:-2], b.shape[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a, batch_b = (1,) * (width - len(batch_a)) + batch_a, (1,) * (width - len(batch_b)) + batch_b
    if any(p != q and 1 not in (p, q) for p, q in zip(batch_a, batch_b)):
        return None
    batch = tuple(max(p, q) for p, q in zip(batch_a, batch_b))
    return batch + (a.shape[-2], b.shape[-1]), a.shape[-1]


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


GEMM_FORMULA = "FLOPs: 2*m*n*k per product"


def attention_flops(q: TensorSpec, k: TensorSpec) -> Optional[int]:
    """4*b*h*s_q*s_k*d: the two matmuls q@k^T and p@v of q [b, h, s_q, d], k [b, h_kv, s_k, d]."""
    if len(q.shape) != 4 or len(k.shape) != 4:
        return None
    batch, heads, seq_q, head_dim = q.shape
    return 4 * batch * heads * seq_q * k.shape[2] * head_dim


ATTENTION_FORMULA = ("FLOPs: 4*b*h*s_q*s_k*d forward (q@k^T and p@v), 2.5x that backward (s recomputed, dv, dp, "
                     "dq, dk); non-causal, as causal is not recorded")
