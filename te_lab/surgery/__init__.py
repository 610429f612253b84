"""Model surgery: find the layers of a model that have a fused twin, probe-verify each
twin against the layer, swap it in place, and undo it (``te_lab.fuse`` / ``unfuse``).

Importing this package registers the built-in rules, in the order of
``builtin_rules.BUILT_IN_RULES``.
"""

from . import builtin_rules  # noqa: F401  (registers the built-in rules)
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
