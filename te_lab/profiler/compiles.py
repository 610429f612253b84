"""Counting compilations while a step runs, so a report can show that none of its timed or
profiled steps paid for one.

Three sources, each counted as an event:

- Dynamo frame compiles, recompiles after a guard failure included
  (``torch._dynamo.utils.counters["frames"]["ok"]``);
- Inductor graph compiles, Dynamo's or a standalone one (each looks its graph up in
  Inductor's FX-graph cache: ``counters["inductor"]`` hits, misses and bypasses);
- Triton JIT compiles (Triton's post-compile hook: ``triton.knobs.runtime.
  jit_post_compile_hook`` in newer releases, ``JITFunction.compiled_hook`` in 3.2),
  counted only where Triton is already imported; te_lab never imports it for this.

A torch.compile call of a fresh graph counts at least two events (its frame and its
graph): the figure says whether compilation happened, not how many graphs.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from te_lab.kernels.torch_internals import compile_counters

FORMULA = ("compilation events while the mode's timed and profiled steps ran: Dynamo frame compiles "
           "(recompiles included) + Inductor graph compiles (FX-graph cache hits, misses, bypasses) + "
           "Triton JIT compiles; 0 means no step's time includes compiling")
_INDUCTOR_LOOKUPS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def _torch_count() -> int:
    counters = compile_counters()
    return counters["frames"]["ok"] + sum(counters["inductor"][name] for name in _INDUCTOR_LOOKUPS)


def _triton_hook_slot() -> Optional[tuple[Any, str]]:
    """(object, attribute) holding Triton's post-compile hook, or None where Triton is not
    imported or has neither."""
    if "triton" not in sys.modules:
        return None
    try:
        from triton import knobs

        return knobs.runtime, "jit_post_compile_hook"
    except (ImportError, AttributeError):
        pass
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    return (JITFunction, "compiled_hook") if hasattr(JITFunction, "compiled_hook") else None


class CompileCounter:
    """``with CompileCounter() as counter: ...``; ``counter.count`` is the number of
    compilation events inside the block (see the module doc). Blocks may repeat: the
    count accumulates."""

    def __init__(self) -> None:
        self.count = 0
        self._torch_start = 0
        self._slot: Optional[tuple[Any, str]] = None
        self._previous_hook: Optional[Callable] = None

    def __enter__(self) -> "CompileCounter":
        self._torch_start = _torch_count()
        self._slot = _triton_hook_slot()
        if self._slot is not None:
            owner, name = self._slot
            self._previous_hook = getattr(owner, name)
            setattr(owner, name, self._on_triton_compile)
        return self

    def _on_triton_compile(self, *args, **kwargs):
        self.count += 1
        if self._previous_hook is not None:
            return self._previous_hook(*args, **kwargs)
        return None

    def __exit__(self, *exc_info) -> None:
        self.count += _torch_count() - self._torch_start
        if self._slot is not None:
            owner, name = self._slot
            setattr(owner, name, self._previous_hook)
            self._slot = None
