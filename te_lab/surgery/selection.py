"""Selection: which modules of a model :func:`te_lab.fuse` tries, and with which rules.

``only`` / ``exclude`` take rule names and module-path globs (a glob also selects the
modules inside what it matches); :class:`Selection` checks each entry against the model
and says whether a rule may fuse a module at a path. :func:`find_candidates` walks the
model top-down and asks every allowed rule about every module, skipping what te_lab
has fused already, so each candidate arrives with its rules' answers in the order they
are tried.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from te_lab.modules.base import FusedModule
from te_lab.modules.lm_head_loss import installed_lm_head_loss

from .rules import FusionRule, Match, Skip, current_rule_name, rules


def _path_matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + ".*")


class Selection:
    """``only`` / ``exclude`` entries: rule names or module-path globs (a glob also
    selects the modules inside what it matches)."""

    def __init__(self, only, exclude, paths: list[str], names: list[str]):
        self.only_rules, self.only_paths = self._parse("only", only, paths, names)
        self.exclude_rules, self.exclude_paths = self._parse("exclude", exclude, paths, names)
        self.enabled_rules = frozenset(set(self.only_rules or names) - set(self.exclude_rules))
        # A rule is wanted when it, or a rule its twins carry out (rope for attention), is enabled.
        self._wanted = {rule.name for rule in rules() if rule.name in self.enabled_rules}
        self._wanted |= {rule.realized_by for rule in rules() if rule.realized_by and rule.name in self.enabled_rules}

    @staticmethod
    def _parse(argument: str, value, paths: list[str], names: list[str]) -> tuple[list[str], list[str]]:
        if value is None:
            return [], []
        entries = [value] if isinstance(value, str) else value
        try:
            entries = list(entries)
        except TypeError:
            raise TypeError(f"te_lab.fuse: {argument} must be a rule name, a module-path glob or a list of them, "
                            f"got {type(value).__name__}") from None
        rule_entries, path_entries = [], []
        for entry in entries:
            if not isinstance(entry, str):
                raise TypeError(f"te_lab.fuse: {argument} entries must be strings, got {entry!r}")
            if entry not in names:
                entry = current_rule_name(entry)
            if entry in names:
                rule_entries.append(entry)
            elif any(_path_matches(path, entry) for path in paths):
                path_entries.append(entry)
            else:
                examples = ", ".join(p for p in paths[1:4])
                raise ValueError(
                    f"te_lab.fuse: {argument} entry {entry!r} is neither a rule name (valid: {', '.join(names)}) "
                    f"nor a glob matching a module path of this model (paths look like: {examples})")
        return rule_entries, path_entries

    def allows(self, rule: FusionRule, path: str) -> bool:
        if rule.realized_by is not None:
            return False
        if rule.name not in self._wanted:
            return False
        if self.only_paths and not any(_path_matches(path, p) for p in self.only_paths):
            return False
        return not any(_path_matches(path, p) for p in self.exclude_paths)


@dataclass
class Candidate:
    path: str
    module: nn.Module
    results: list  # (rule, Match | Skip)


def _match(rule: FusionRule, module: nn.Module):
    try:
        return rule.match(module)
    except Exception as error:  # noqa: BLE001 - a rule's bug must not stop the others
        return Skip(f"rule {rule.name!r} raised {type(error).__name__}: {error}")


def already_fused(model: nn.Module) -> list[str]:
    """The paths of the modules in ``model`` that are te_lab twins (or run one as their forward)."""
    return [path for path, module in model.named_modules()
            if isinstance(module, FusedModule) or installed_lm_head_loss(module) is not None]


def find_candidates(model: nn.Module, selection: Selection, first_rules: tuple = ()) -> list[Candidate]:
    """Every module of ``model`` (top-down, twins and what is inside them left out) that
    some rule ``selection`` allows answered with a Match or a Skip; ``first_rules`` (a
    call's compiled regions) are asked first, whatever ``selection`` says."""
    found = []
    fused_prefixes: list[str] = []
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") for p in fused_prefixes):
            continue
        if isinstance(module, FusedModule):
            fused_prefixes.append(path)
            continue
        forward_fused = installed_lm_head_loss(module) is not None
        results = []
        for rule in (*first_rules, *rules()):
            if rule not in first_rules and not selection.allows(rule, path):
                continue
            result = _match(rule, module)
            if isinstance(result, Match) and result.replaces_forward and forward_fused:
                continue
            if result is not None:
                results.append((rule, result))
        if results:
            found.append(Candidate(path, module, results))
    return found
