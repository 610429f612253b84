"""Bytes moved and FLOPs of one profiled op, from what torch.profiler records, by the cost
model of :mod:`te_lab.kernels.costs`.

With ``record_shapes=True`` the profiler gives each op event its name, the shape and the
dtype string of every argument (``[]`` and ``""`` or ``"Scalar"`` for non-tensors), and, for
a few ops (matmuls, some elementwise ops) with ``with_flops=True``, a FLOP count. This
module turns those into :class:`~te_lab.kernels.costs.TensorSpec` arguments and asks the
op's cost function: te_lab's ops the one their :class:`~te_lab.kernels.registry.FusedOp`
registered, ATen's ops :mod:`te_lab.kernels.costs.aten`'s rules, so both modes of a
profile are counted by one model. Every :class:`OpCost` carries the formula it came from.

Arguments the profiler shows only as ``"Scalar"`` (``causal``, ``need_dw``, the
activation's name...) are invisible here; where they change the cost the formula says
which case was assumed (the training case: gradients needed, non-causal FLOPs).
"""

from __future__ import annotations

from typing import Optional

from te_lab.kernels.costs import Arguments, CostFunction, OpCost, TensorSpec
from te_lab.kernels.costs.aten import ATEN_COSTS, largest_input
from te_lab.kernels.registry import registered_ops
from te_lab.kernels.torch_internals import argument_names

__all__ = ["BYTES_FORMULA", "OpCost", "cost_of", "element_size", "has_rule", "op_cost"]

BYTES_FORMULA = (
    "bytes an op must move: every tensor input read once + every output written once, "
    "from shapes and dtypes (outputs are not recorded by the profiler: estimated per op, "
    "see each op's formula)")

_ELEMENT_SIZES = {
    "bool": 1, "signed char": 1, "unsigned char": 1, "c10::quint8": 1, "c10::qint8": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1, "c10::Float8_e8m0fnu": 1, "c10::Float4_e2m1fn_x2": 1,
    "short int": 2, "short unsigned int": 2, "c10::Half": 2, "c10::BFloat16": 2,
    "int": 4, "unsigned int": 4, "float": 4, "c10::qint32": 4, "c10::complex<c10::Half>": 4,
    "long int": 8, "long unsigned int": 8, "double": 8, "c10::complex<float>": 8,
    "c10::complex<double>": 16,
}


def element_size(dtype: str) -> Optional[int]:
    """Bytes per element of a profiler dtype string (``"float"``, ``"c10::BFloat16"``...);
    None for non-tensor arguments (``""``, ``"Scalar"``, ``"ScalarList"``) and unknown names."""
    return _ELEMENT_SIZES.get(dtype)


def _te_lab_costs() -> dict[str, CostFunction]:
    """Custom-op name -> cost function, over every registered FusedOp (read per call:
    ops may be registered after this module is imported)."""
    return {name: cost for op in registered_ops().values() for name, cost in op.costs.items()}


def _rule(name: str) -> Optional[CostFunction]:
    if not name.startswith("te_lab::"):
        return ATEN_COSTS.get(name)
    cost = _te_lab_costs().get(name)
    return None if cost is None else _by_name(name, cost)


def _by_name(name: str, cost: CostFunction) -> CostFunction:
    """te_lab's cost functions read an operator's arguments by the names of its schema; a
    labelled region (``te_lab::adamw_step``) has no schema and is read by position."""
    try:
        names = argument_names(name)
    except AttributeError:
        return cost
    return lambda arguments: cost(Arguments(names, arguments))


def has_rule(name: str) -> bool:
    """Whether ``name`` has a cost rule of its own (a GEMM, attention, a copy, a reduction,
    te_lab's ops), so its cost is not the sum of the ops it calls."""
    return _rule(name) is not None


def cost_of(name: str, arguments: list) -> OpCost:
    """The cost of one call of op ``name`` (``"aten::mm"``, ``"te_lab::rms_norm"``) on
    ``arguments``, by position: a TensorSpec per tensor, None for anything else. An op
    without a rule, or arguments its rule cannot read, get the default rule."""
    rule = _rule(name)
    cost = rule(arguments) if rule is not None else None
    return cost if cost is not None else largest_input(name, arguments)


def _tensor_arguments(shapes, dtypes) -> list:
    """One entry per argument, by position: a TensorSpec, or None for a non-tensor. A 0-dim
    tensor is recorded as shape ``[]`` like a non-tensor, but with a real dtype (also for a
    Python number wrapped as a tensor): one element."""
    arguments = []
    for shape, dtype in zip(shapes or (), dtypes or ()):
        size = element_size(dtype)
        valid = size is not None and isinstance(shape, (list, tuple)) \
            and all(isinstance(extent, int) and extent >= 0 for extent in shape)
        arguments.append(TensorSpec(tuple(shape), size) if valid else None)
    return arguments


def op_cost(name: str, shapes: list[list[int]], dtypes: list[str], profiler_flops: int = 0) -> OpCost:
    """Estimated bytes read and written and FLOPs of one op event, from its recorded name,
    input shapes and dtypes (:func:`cost_of`); ``profiler_flops`` (torch's count, where
    > 0) wins over ours."""
    cost = cost_of(name, _tensor_arguments(shapes, dtypes))
    if profiler_flops > 0:
        return OpCost(cost.bytes_read, cost.bytes_written, int(profiler_flops),
                      f"{cost.formula} (FLOPs: torch.profiler's count used instead)")
    return cost
