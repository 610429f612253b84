"""Training-loop helpers built on te_lab's fused optimizer (importable as ``te_lab.optim``).

``overlap_step(model, optimizer_factory)`` applies each parameter's update during
backward, as soon as its gradient is final (see :mod:`te_lab.optim.overlap`).
"""

from .overlap import OverlappedStep, overlap_step

__all__ = ["OverlappedStep", "overlap_step"]
