"""A compiled region: fusion for a module no te_lab rule knows.

:func:`te_lab.fuse` ``(regions=...)`` makes this twin of each module it is given: the
module's own forward compiled alone by ``torch.compile`` (Inductor: C++ on the CPU,
Triton on CUDA, and on MUSA where torch_musa's build provides Inductor's Triton backend),
with ``fullgraph=True``, so a forward Dynamo cannot capture as one graph (data-dependent
control flow, a call it cannot trace) is refused by its probe instead of running in
pieces. Like every twin it adopts the original's Parameters, buffers and children; the
compiled code runs the original's forward on them (handed back first, so a child replaced
in the twin, a LoRA layer, is the one that runs). It is probed against the original like
every twin (float64 truth, forward and backward) and kept only where it measured faster.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .base import FusedModule

# The profile's and the report's name for what a region runs.
KERNEL_PREFIX = "inductor:"


class CompiledRegion(FusedModule):
    """``original`` compiled alone; ``compile_options``: keyword arguments of
    ``torch.compile`` (``mode``, ``options``, ``backend``, ``dynamic``) beside
    ``fullgraph=True``."""

    def __init__(self, original: nn.Module, compile_options: Optional[dict] = None, backend: Optional[str] = None):
        super().__init__(original, backend)
        self.compile_options = dict(compile_options or {})
        self.__dict__["compiled"] = torch.compile(original.forward, fullgraph=True, **self.compile_options)

    def fused_forward(self, *args, **kwargs):
        self.restore_original()
        return self.compiled(*args, **kwargs)

    def kernel_names(self) -> list[str]:
        return [f"{KERNEL_PREFIX}{type(self.original).__name__}"]

    def resolved_backends(self, device: torch.device) -> dict[str, str]:
        return {"torch.compile": str(self.compile_options.get("backend", "inductor"))}

    def extra_repr(self) -> str:
        return f"compiled from {type(self.original).__name__}"
