"""Swaps and their undo: where a fused twin stands in for a module, recorded on the model.

A :class:`Swap` puts a twin where its original stood (in every parent that holds the
original, or, for the LM head + loss, as the model's ``forward``, which a wrapper such as
accelerate's mixed precision may have wrapped since) and takes it out again.
:func:`te_lab.fuse` records the swaps it made on the model (an attribute outside
``state_dict``), so :func:`unfuse` puts the very original module objects back, with
whatever their weights learned while fused, :func:`unfused` does it for the length of a
block, and :func:`fusions` tells tools such as the profiler what is installed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from torch import nn

from te_lab import distributed
from te_lab.modules.lm_head_loss import FusedLMHeadLoss, installed_lm_head_loss

from . import hooks, report as reports
from .rules import rules

STATE_ATTRIBUTE = "_te_lab_fusion"


@dataclass
class Swap:
    """One installed fusion: ``twin`` stands where ``original`` stood, at each
    (parent, child name) in ``sites``, or, with no sites, as ``original.forward``."""

    path: str
    rule: str
    original: nn.Module
    twin: Any
    sites: list = field(default_factory=list)

    def install(self) -> None:
        if self.sites:
            self.twin.adopt_original()
            hooks.share_hooks(self.original, self.twin)
            for parent, name in self.sites:
                parent._modules[name] = self.twin
        else:
            self.twin.install()

    def is_installed(self) -> bool:
        if self.sites:
            return any(parent._modules.get(name) is self.twin for parent, name in self.sites)
        return installed_lm_head_loss(self.original) is self.twin

    def remove(self) -> None:
        restored = self.twin.restore_original()
        if self.sites:
            hooks.release_hooks(restored, self.twin)
        for parent, name in self.sites:
            if parent._modules.get(name) is self.twin:
                parent._modules[name] = restored


def sites_of(model: nn.Module, module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (parent, child name) in ``model`` that holds ``module``."""
    return [(parent, name) for parent in model.modules() for name, child in parent._modules.items()
            if child is module]


def record_swaps(model: nn.Module, swaps: Iterable[Swap]) -> None:
    """Remember ``swaps`` on ``model``, for :func:`unfuse` and :func:`fusions`."""
    model.__dict__.setdefault(STATE_ATTRIBUTE, []).extend(swaps)


def installed_swaps(model: nn.Module) -> list[Swap]:
    """Every installed swap recorded on ``model`` or on modules inside it, oldest first."""
    found = []
    for module in model.modules():
        found.extend(swap for swap in module.__dict__.get(STATE_ATTRIBUTE, []) if swap.is_installed())
    return found


def _forget(model: nn.Module, swaps: Iterable[Swap]) -> None:
    gone = {id(swap) for swap in swaps}
    for module in model.modules():
        if STATE_ATTRIBUTE in module.__dict__:
            module.__dict__[STATE_ATTRIBUTE] = [s for s in module.__dict__[STATE_ATTRIBUTE] if id(s) not in gone]


def is_fused(model: nn.Module) -> bool:
    """Whether ``model`` holds any module te_lab swapped in."""
    return bool(installed_swaps(model))


@dataclass(frozen=True)
class Fusion:
    """An installed fusion, as tools (the profiler) see it."""

    path: str
    rule: str
    kind: str
    twin: Any
    original_type: str

    @property
    def replaces_forward(self) -> bool:
        return isinstance(self.twin, FusedLMHeadLoss)


def fusions(model: nn.Module) -> list[Fusion]:
    """The fusions installed in ``model`` (oldest first)."""
    kinds = {rule.name: rule.kind for rule in rules()}
    return [Fusion(swap.path, swap.rule, kinds.get(swap.rule, "other"), swap.twin, type(swap.original).__name__)
            for swap in installed_swaps(model)]


@dataclass
class UnfuseResult:
    """What :func:`unfuse` restored (module paths; ``"(model)"`` for the model's forward)."""

    model_type: str
    restored: list = field(default_factory=list)

    def __str__(self) -> str:
        if not self.restored:
            return f"te_lab.unfuse: nothing to restore; this {self.model_type} has no te_lab fusions"
        return (f"te_lab.unfuse: restored {len(self.restored)} original module(s) in {self.model_type}: "
                + ", ".join(self.restored))

    __repr__ = __str__


def _refuse_sharded_unfuse(model: nn.Module, caller: str) -> None:
    if is_fused(model):
        distributed.refuse_sharded(model, caller, "the originals kept for unfusing still hold the Parameters from "
                                   "before sharding and would run stale weights; unfuse before sharding, or build "
                                   "the model again unfused (state_dict keys are the same)")


def _remove_swaps(model: nn.Module, where: str) -> list:
    """Check ``model`` (``where`` names the caller) and take its installed swaps out, last
    first; the swaps, for the caller to forget or put back."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_sharded_unfuse(model, where)
    swaps = installed_swaps(model)
    for swap in reversed(swaps):
        swap.remove()
    return swaps


def unfuse(model: nn.Module) -> UnfuseResult:
    """Put the original module objects back (with whatever their weights learned while
    fused). On a model with no fusions it does nothing and says so."""
    swaps = _remove_swaps(model, "te_lab.unfuse")
    _forget(model, swaps)
    return UnfuseResult(type(model).__name__, [swap.path or reports.ROOT_LABEL for swap in swaps])


@contextlib.contextmanager
def unfused(model: nn.Module) -> Iterator[nn.Module]:
    """``with te_lab.unfused(model):`` runs the block on the original modules, then puts
    the same fused twins back (no re-verification: they were verified when fused)."""
    swaps = _remove_swaps(model, "te_lab.unfused")
    try:
        yield model
    finally:
        for swap in swaps:
            swap.install()
