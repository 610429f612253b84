"""What each op moves and computes, from its arguments' shapes and dtypes: the cost model
(:mod:`.model`), ATen's ops (:mod:`.aten`), and one file per te_lab op, whose ``COSTS``
its kernel file registers with its :class:`~te_lab.kernels.registry.FusedOp`."""

from .model import Arguments, CostFunction, OpCost, TensorSpec

__all__ = ["Arguments", "CostFunction", "OpCost", "TensorSpec"]
