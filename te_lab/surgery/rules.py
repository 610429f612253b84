"""Fusion rules: what te_lab can swap, and the registry of rules.

A :class:`FusionRule` looks at one module and answers ``None`` (not mine), a
:class:`Skip` (mine, but it cannot be fused, and why) or a :class:`Match`: the fused
twins to try (:class:`Variant`, in order; the first that passes its probe is kept) and
how to probe them. Rules match by structure (children, shapes, attributes, signatures)
and leave the final word to the probe, so a module that looks right but computes
something else is skipped with the measured error instead of being swapped.

Rules are tried in registry order; rules a user registers come before the built-in
ones, so a custom fusion wins over a built-in one for the same module.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from torch import Tensor, nn

from te_lab.inputs import ProbeInputs  # noqa: F401  (re-exported: rules build them)

KINDS = ("norm", "mlp", "attention", "rope", "loss", "other")
# Inputs that never get a gradient check: fused twins treat them as constants, as the
# models do (positions, masks).
CONSTANT_INPUTS = frozenset({"position_embeddings", "attention_mask", "position_ids", "cache_position"})


@dataclass(frozen=True)
class BuildOptions:
    """What :func:`te_lab.fuse` was asked for, as twins need it.

    ``backend``: ``None`` for automatic choice, else the name forced on the ops that
    implement it. ``enabled_rules``: the rule names selected by ``only``/``exclude``.
    """

    backend: Optional[str]
    enabled_rules: frozenset


@dataclass(frozen=True)
class Variant:
    """One way to fuse a matched module. ``build`` returns the twin: a
    :class:`te_lab.modules.FusedModule` that replaces the module, or (``replaces_forward``
    on the match) a callable installed as the module's ``forward``."""

    build: Callable[[BuildOptions], Any]
    note: str = ""


@dataclass(frozen=True)
class Match:
    """A module a rule can fuse, and how to check it.

    - ``variants``: tried in order; the first within tolerance is kept.
    - ``example_inputs``: synthesizes a probe when ``fuse`` got no ``sample``.
    - ``complete_inputs``: fills in what a captured call lacks for the probe (the LM
      head's labels).
    - ``probe_outputs``: the tensors of an output to compare (default: every tensor).
    - ``replaces_forward``: the twin is installed as ``module.forward`` instead of
      replacing the module in its parent.
    - ``example_inputs=None``: the module is probed on the sample's inputs only (a
      compiled region, whose inputs no rule can synthesize).
    - ``timed``: the twin is kept only where it measures faster than the original, as
      with ``fuse(auto=True)`` (a compiled region).
    """

    variants: Sequence[Variant]
    example_inputs: Optional[Callable[[], ProbeInputs]]
    complete_inputs: Optional[Callable[[ProbeInputs], ProbeInputs]] = None
    probe_outputs: Optional[Callable[[Any], list[Tensor]]] = None
    constant_inputs: frozenset = CONSTANT_INPUTS
    replaces_forward: bool = False
    timed: bool = False


@dataclass(frozen=True)
class Skip:
    """A module the rule recognizes but cannot fuse, with the reason."""

    reason: str


MatchResult = Union[Match, Skip, None]


@dataclass(frozen=True)
class FusionRule:
    """``name`` is what ``fuse(only=..., exclude=...)`` take; ``kind`` groups rules in
    reports (one of ``KINDS``); ``match(module)`` decides (see the module doc).
    ``realized_by`` names the rule whose twins carry this one out (RoPE is fused inside
    the attention twin), for rules that never match a module on their own."""

    name: str
    kind: str
    description: str
    match: Callable[[nn.Module], MatchResult]
    realized_by: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"FusionRule: name must be an identifier-like string, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"FusionRule {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not callable(self.match):
            raise TypeError(f"FusionRule {self.name!r}: match must be callable, got {type(self.match).__name__}")


_BUILT_IN: dict[str, FusionRule] = {}
_USER: dict[str, FusionRule] = {}

# Built-in rules renamed, old name -> new: the old names are accepted, with a
# DeprecationWarning, for one release after the rename.
RENAMED_RULES = {"swiglu_mlp": "gated_mlp"}


def current_rule_name(name: str) -> str:
    """``name`` itself, or for a renamed built-in rule its new name, with a
    DeprecationWarning pointing at the first caller outside te_lab."""
    new = RENAMED_RULES.get(name)
    if new is None:
        return name
    level, frame = 2, sys._getframe(1)  # stacklevel 2: current_rule_name's caller
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "te_lab":
        level, frame = level + 1, frame.f_back
    warnings.warn(f"te_lab: the rule {name!r} is now called {new!r}; the old name is deprecated and goes in the "
                  f"next release", DeprecationWarning, stacklevel=level)
    return new


def register_builtin_rule(rule: FusionRule) -> FusionRule:
    _BUILT_IN[rule.name] = rule
    return rule


def register_rule(rule: FusionRule, *, replace: bool = False) -> FusionRule:
    """Add a user rule; it is tried before the built-in rules (and before rules
    registered earlier). ``replace=True`` replaces a user rule of the same name."""
    if not isinstance(rule, FusionRule):
        raise TypeError(f"register_rule: rule must be a te_lab.FusionRule, got {type(rule).__name__}")
    if rule.name in _BUILT_IN:
        raise ValueError(f"register_rule: {rule.name!r} is a built-in rule; choose another name")
    if rule.name in _USER and not replace:
        raise ValueError(f"register_rule: a rule named {rule.name!r} is already registered (pass replace=True)")
    _USER.pop(rule.name, None)
    _USER[rule.name] = rule
    return rule


def unregister_rule(name: str) -> None:
    """Remove a user rule."""
    if name not in _USER:
        raise ValueError(f"unregister_rule: no user rule named {name!r} (user rules: {sorted(_USER) or 'none'})")
    del _USER[name]


def rules() -> list[FusionRule]:
    """Every rule, in the order they are tried."""
    return list(reversed(_USER.values())) + list(_BUILT_IN.values())
