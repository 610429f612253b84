"""Labels for module regions in a profiler trace.

While active, each labelled module's forward runs inside ``record_function`` named
``te_lab.module:<key>``, so every op it launches nests under its key in the trace
(backward work is attributed to the key afterwards, through autograd's sequence
numbers; see :mod:`te_lab.profiler.attribution`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from te_lab.kernels.torch_internals import profiler_region

PREFIX = "te_lab.module:"
# One parameter's update inside backward (te_lab.optim.overlap_step): "te_lab.optimizer:<parameter name>".
OPTIMIZER_PREFIX = "te_lab.optimizer:"
# torch.optim.Optimizer.step's own region: "Optimizer.step#<class>.step".
TORCH_OPTIMIZER_STEP_PREFIX = "Optimizer.step#"


@contextlib.contextmanager
def labelled(modules: dict[str, nn.Module]) -> Iterator[None]:
    """Label ``modules`` (key -> module) for the duration of the block."""
    handles = []
    open_regions: dict[int, list] = {}

    def enter(key: str):
        def hook(module, args):
            region = profiler_region(PREFIX + key)
            region.__enter__()
            open_regions.setdefault(id(module), []).append(region)
        return hook

    def leave(module, args, output):
        open_regions[id(module)].pop().__exit__(None, None, None)

    try:
        for key, module in modules.items():
            handles.append(module.register_forward_pre_hook(enter(key)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
