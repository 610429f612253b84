"""Module hooks across a swap: the hooks of a module keep firing while its fused twin
stands in for it, and the modules whose hooks a twin could not fire stop the swap.

A twin shares the original's hook tables (the same dict objects, not copies) while it
is installed: forward, forward-pre, backward and backward-pre hooks registered before
the swap fire around the twin, hooks registered on either while fused land on both,
and a hook's handle removes it from both. ``unfuse`` hands the twin fresh, empty tables
again, so the original keeps every hook it has then. A hook receives the twin as its
``module`` argument while fused.

A twin computes its children's math itself (the MLP twin reads the projections'
weights and never calls the projection modules), so hooks on modules inside the one it
replaces could not fire; such a module is left unfused, and the report names the hook.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

# The tables nn.Module._call_impl reads (with the kwargs / always-called sets that go with them).
HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks")
HOOK_KINDS = {"_forward_pre_hooks": "forward-pre", "_forward_hooks": "forward", "_backward_pre_hooks": "backward-pre",
              "_backward_hooks": "backward"}


def hook_kinds(module: nn.Module) -> list[str]:
    """The kinds of hook registered on ``module`` itself (``["forward", "backward"]``)."""
    return [kind for table, kind in HOOK_KINDS.items() if getattr(module, table, None)]


def share_hooks(original: nn.Module, twin: nn.Module) -> None:
    """Make ``twin`` fire ``original``'s hooks (and any hook registered on either from now)."""
    for table in HOOK_TABLES:
        setattr(twin, table, getattr(original, table))
    twin._is_full_backward_hook = original._is_full_backward_hook


def release_hooks(original: nn.Module, twin: nn.Module) -> None:
    """End the sharing: ``original`` keeps the tables (hooks registered on the twin while
    fused included), the twin gets empty ones."""
    if twin._is_full_backward_hook is not None:  # a backward hook registered on the twin while fused
        original._is_full_backward_hook = twin._is_full_backward_hook
    for table in HOOK_TABLES:
        setattr(twin, table, type(getattr(original, table))())
    twin._is_full_backward_hook = None


def hooked_modules(root: nn.Module, prefix: str, *, include_root: bool, called: tuple[str, ...] = ()) -> list[str]:
    """``"path (forward, backward hook)"`` for every module in ``root`` (``root`` itself
    only with ``include_root``) that has hooks; ``prefix`` is ``root``'s path. The children
    named in ``called``, which a twin calls as modules (their hooks fire), and everything
    inside them are left out."""
    fired = {id(inner) for name in called for inner in root._modules[name].modules()}
    found = []
    for path, module in root.named_modules(prefix=prefix):
        if (include_root or module is not root) and id(module) not in fired and hook_kinds(module):
            found.append(f"{path} ({', '.join(hook_kinds(module))} hook)")
    return found


@contextlib.contextmanager
def silenced(module: nn.Module) -> Iterator[None]:
    """``module``'s own hooks off for the block: a probe compares the module's math, and
    a probe must leave no trace (a counting hook would count probe calls). The same
    hooks then run around the twin, so they need no check of their own."""
    saved = {table: getattr(module, table) for table in HOOK_TABLES}
    try:
        for table, value in saved.items():
            setattr(module, table, type(value)())
        yield
    finally:
        for table, value in saved.items():
            setattr(module, table, value)
