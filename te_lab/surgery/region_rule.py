"""``fuse(regions=...)``: modules named by the user, compiled alone and verified
(:class:`te_lab.modules.compiled_region.CompiledRegion`).

The regions become one rule for that call, tried before every other rule on exactly the
modules named, so everything a swap gets from :func:`te_lab.fuse` a region gets too: the
probe on the sample's inputs against the float64 truth, forward and backward, hooks moved,
undo on error, ``unfuse``, the report's row. A region is kept only where it measured faster
than the original by more than 5% (forward + backward, interleaved medians), and refused, the module left
as it was, where it cannot be compiled as one graph, where its numbers differ, or where it
holds a dropout in training mode (the compiled dropout draws from Inductor's random stream,
not eager's: a training step would not reproduce the original's).
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Optional

from torch import nn

from te_lab.device import is_gpu, triton_unavailable_reason
from te_lab.modules.compiled_region import CompiledRegion

from .inspection import tensor_like
from .report import ROOT_LABEL
from .rules import FusionRule, Match, Skip, Variant

RULE_NAME = "compiled_region"


def _entries(regions) -> list:
    if isinstance(regions, (str, type)) or not isinstance(regions, Iterable):
        return [regions]
    rows = getattr(regions, "rows", None)  # te_lab.opportunities' result: its rows
    return list(rows) if isinstance(rows, list) else list(regions)


def resolve_regions(model: nn.Module, regions, caller: str = "te_lab.fuse") -> list[str]:
    """The paths of the modules ``regions`` names: module paths or globs
    (``"layers.*.norm"``), module classes or class names, rows of
    :func:`te_lab.opportunities` (their modules' paths) or its whole result, one or a list.
    An entry that names no module is an error."""
    modules = dict(model.named_modules())
    paths: list[str] = []
    for entry in _entries(regions):
        found = _paths_of(entry, modules, caller)
        if not found:
            raise ValueError(f"{caller}: regions entry {_describe(entry)} names no module of the model (give module "
                             f"paths or globs, e.g. {next(iter(p for p in modules if p), 'layers.0')!r}, module "
                             f"classes or class names, or rows of te_lab.opportunities)")
        paths += [path for path in found if path not in paths]
    return paths


def _paths_of(entry, modules: dict, caller: str) -> list[str]:
    if isinstance(entry, type) and issubclass(entry, nn.Module):
        return [path for path, module in modules.items() if isinstance(module, entry)]
    if isinstance(entry, str):
        named = [path for path in modules if path and fnmatch.fnmatchcase(path, entry)]
        return named or [path for path, module in modules.items() if type(module).__name__ == entry]
    paths = getattr(entry, "paths", None)
    if isinstance(paths, list) and all(isinstance(p, str) for p in paths):
        named = ["" if path == ROOT_LABEL else path for path in paths]  # the model itself: its row says it cannot be
        return [path for path in named if path in modules]
    raise TypeError(f"{caller}: regions entries must be module paths or globs, module classes or class names, "
                    f"or rows of te_lab.opportunities; got {type(entry).__name__}")


def _describe(entry) -> str:
    return entry.__name__ if isinstance(entry, type) else repr(entry) if isinstance(entry, str) else \
        f"{type(entry).__name__}({getattr(entry, 'module', '')})"


def _active_dropout(module: nn.Module) -> Optional[str]:
    for path, inner in module.named_modules():
        p = getattr(inner, "p", None)
        if isinstance(inner, nn.modules.dropout._DropoutNd) and inner.training and isinstance(p, float) and p > 0:
            return f"{path or 'itself'} ({type(inner).__name__}, p={p:g})"
    return None


def region_rule(model: nn.Module, paths: list[str], compile_options: Optional[dict]) -> FusionRule:
    """The rule that offers a :class:`CompiledRegion` for each module at ``paths``."""
    wanted = {id(model.get_submodule(path)) for path in paths}

    def match(module: nn.Module):
        if id(module) not in wanted:
            return None
        dropout = _active_dropout(module)
        if dropout is not None:
            return Skip(f"holds a dropout in training mode, {dropout}: compiled, it draws its mask from Inductor's "
                        f"random stream, not eager's, so a training step would not reproduce the original's; call "
                        f"model.eval() first, or set its p to 0")
        _, device = tensor_like(module)
        if is_gpu(device):
            unavailable = triton_unavailable_reason(device.type)
            if unavailable is not None:
                return Skip(f"Inductor compiles for {device.type} with Triton, which cannot run here: {unavailable}")
        return Match([Variant(lambda options: CompiledRegion(module, compile_options, options.backend),
                              note="compiled alone by torch.compile")], example_inputs=None, timed=True)

    return FusionRule(RULE_NAME, "other", "a module named in fuse(regions=...), compiled alone by torch.compile "
                      "(fullgraph) and kept where verified and faster", match)
