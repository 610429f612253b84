"""Triton constructs that Moore Threads' Triton (MUSA) rejects, found in te_lab's kernel sources.

MUSA's Triton release compiles the language of Triton 3.2 with its own front end, which
refuses annotated assignments inside a kernel (``x: tl.int32 = 0``; upstream Triton reads
the annotation as a cast). The kernels' tests cannot see this, since neither upstream
Triton nor its interpreter complains, so the source is read instead: every function
decorated with ``triton.jit`` (or ``jit`` imported from triton) in ``kernels/``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    function: str
    construct: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: in @triton.jit {self.function}: {self.construct}"


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(target, ast.Attribute):
        return target.attr == "jit" and isinstance(target.value, ast.Name) and target.value.id == "triton"
    return isinstance(target, ast.Name) and target.id == "jit"


def _findings_in(function: ast.FunctionDef, path: str) -> list[Finding]:
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.AnnAssign):
            found.append(Finding(path, node.lineno, function.name,
                                 f"annotated assignment '{ast.unparse(node).splitlines()[0]}' "
                                 f"(write the cast instead: x = tl.full((), 0, tl.int32) or value.to(...))"))
    return found


def lint_source(source: str, path: str = "<source>") -> list[Finding]:
    """The MUSA-rejected constructs inside ``source``'s Triton kernels."""
    tree = ast.parse(source, filename=path)
    return [finding
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list)
            for finding in _findings_in(node, path)]


def lint_kernels(folder: Path) -> list[Finding]:
    """:func:`lint_source` over every ``*.py`` file in ``folder``."""
    if not folder.is_dir():
        raise ValueError(f"lint_kernels: folder {folder} is not a directory; expected te_lab's kernels/ folder")
    return [finding for path in sorted(folder.glob("*.py"))
            for finding in lint_source(path.read_text(encoding="utf-8"), str(path))]
