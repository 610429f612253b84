"""Model surgery: find the layers of a model that have a fused twin, probe-verify each
twin against the layer, swap it in place, and undo it (``te_lab.fuse`` / ``unfuse``).

Importing this package registers the built-in rules, in the order they are tried.
"""

# The built-in rules register on import, in the order they are tried: keep this order.
# isort: off
from . import norm_rules, mlp_rules, moe_rules, attention_rules, lm_head_rule  # noqa: F401
# isort: on
from .fuse import fuse
from .report import FusionReport, FusionRow, ModelCheck
from .rules import BuildOptions, FusionRule, Match, ProbeInputs, Skip, Variant, register_rule, rules, unregister_rule
from .swaps import Fusion, UnfuseResult, fusions, is_fused, unfuse, unfused

__all__ = [
    "BuildOptions",
    "FusionReport",
    "FusionRow",
    "Fusion",
    "FusionRule",
    "Match",
    "ModelCheck",
    "ProbeInputs",
    "Skip",
    "UnfuseResult",
    "Variant",
    "fuse",
    "fusions",
    "is_fused",
    "register_rule",
    "rules",
    "unfuse",
    "unfused",
    "unregister_rule",
]
