"""Fused twins of Transformer layers, built on te_lab's fused ops.

Each twin is made from the module it replaces and shares that module's Parameters,
buffers and children (:class:`FusedModule`), so state dicts, optimizers and
checkpoints do not notice a swap. :func:`te_lab.fuse` builds and verifies them.
"""

from .attention import FusedAttention, FusedQKVAttention
from .base import FusedModule
from .lm_head_loss import FusedLMHeadLoss
from .mlp import FusedGatedMLP, FusedMLP
from .moe import FusedMoE, expert_load, imbalance, record_expert_load
from .norms import FusedLayerNorm, FusedResidualLayerNorm, FusedRMSNorm

__all__ = [
    "FusedAttention",
    "FusedGatedMLP",
    "FusedLMHeadLoss",
    "FusedLayerNorm",
    "FusedMLP",
    "FusedModule",
    "FusedMoE",
    "FusedQKVAttention",
    "FusedRMSNorm",
    "FusedResidualLayerNorm",
    "expert_load",
    "imbalance",
    "record_expert_load",
]
