"""The fused AdamW step (kernels/adamw.py): its arguments are the parameters it updates."""

from __future__ import annotations

from typing import Optional

from .model import Arguments, OpCost


def step(arguments: Arguments) -> Optional[OpCost]:
    # one tensor per parameter; its gradient and two moments are alike
    parameters = [t for t in arguments if t is not None]
    if not parameters:
        return None
    size = sum(t.nbytes for t in parameters)
    return OpCost(4 * size, 3 * size, 14 * sum(t.numel for t in parameters),
                  "parameter, gradient and both moments read, parameter and both moments written (all like the "
                  "parameter); FLOPs: 14 per element (two moment updates 7, bias corrections and the square-root "
                  "denominator 4, the update and weight decay 3)")


COSTS = {"te_lab::adamw_step": step}
