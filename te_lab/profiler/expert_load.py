"""Expert load in a live profile: the tokens routed to each expert of every fused MoE block.

When the profiled models hold fused MoE blocks (:class:`te_lab.modules.FusedMoE`), the
fused mode's last warm-up step runs its forward inside
:func:`te_lab.modules.record_expert_load`: each block counts, per expert, the tokens its
router sent there (a token sent to k experts counts once for each). No figure comes from
a warm-up step, so the counting (a scatter-add per block) changes no measured time, launch
count or byte; with ``warmup=0`` there is none to count in, and the report's notes say so.
Only the forward counts: a forward recomputed in the backward (activation
checkpointing) routes the same tokens again and is not counted twice. Counts a user was
recording before the profile are put back after it.

The report carries one :class:`LayerLoad` per block and the overall imbalance
(:class:`ExpertLoad`). A trace file (:func:`te_lab.open_trace`) holds kernels, not the
router's choices, so a trace has no expert load; only live profiles do.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn

from te_lab.modules.moe import FusedMoE, expert_load, imbalance, record_expert_load

FORMULA = ("tokens per expert: tokens the router sent to each expert in the forward of one fused step (a token "
           "sent to k experts counts once for each, so a layer's counts add up to tokens x k); imbalance of a "
           "layer: its busiest expert's tokens / the mean tokens per expert (1.0: balanced; the number of "
           "experts: one expert took every token); overall: the sum over layers of the busiest expert's tokens / "
           "the sum over layers of the mean")
STEP = "the fused mode's last warm-up step's forward (no figure comes from it, so counting changes none)"


@dataclass
class LayerLoad:
    """One fused MoE block: ``layer`` is its module key in the report (its path, prefixed by
    the model's name where a statement profiled several models)."""

    layer: str
    tokens_per_expert: list = field(default_factory=list)  # int per expert
    imbalance: float = 1.0  # max(tokens_per_expert) / mean(tokens_per_expert)

    @property
    def routed(self) -> int:
        """Token-expert assignments: tokens x the experts each token goes to."""
        return sum(self.tokens_per_expert)


@dataclass
class ExpertLoad:
    """Every fused MoE block's load in one fused step (``step`` says which), and the
    imbalance over all of them (see :data:`FORMULA`)."""

    layers: list = field(default_factory=list)  # LayerLoad
    imbalance: float = 1.0
    step: str = STEP

    @classmethod
    def from_counts(cls, counts: dict) -> "ExpertLoad":
        """From layer key -> tokens per expert (layers that routed at least one token)."""
        layers = [LayerLoad(key, list(tokens), imbalance(tokens)) for key, tokens in counts.items()]
        means = sum(layer.routed / len(layer.tokens_per_expert) for layer in layers)
        return cls(layers, sum(max(layer.tokens_per_expert) for layer in layers) / means)

    @classmethod
    def from_dict(cls, data: dict) -> "ExpertLoad":
        return cls([LayerLoad(**layer) for layer in data["layers"]], data["imbalance"], data["step"])


class LoadRecorder:
    """Records the expert load of ``models`` (key prefix -> model) over one call of a step."""

    def __init__(self, models: dict[str, nn.Module]):
        self.models = {prefix: model for prefix, model in models.items()
                       if any(isinstance(module, FusedMoE) for module in model.modules())}
        self.load: Optional[ExpertLoad] = None

    def recording(self, run: Callable[[], Any]) -> Callable[[], Any]:
        """``run`` counting the expert load of its call; ``run`` itself without MoE blocks."""
        if not self.models:
            return run

        def counted():
            blocks = [block for model in self.models.values() for block in model.modules()
                      if isinstance(block, FusedMoE)]
            before = [block.tokens_per_expert for block in blocks]
            try:
                with contextlib.ExitStack() as stack:
                    for model in self.models.values():
                        stack.enter_context(record_expert_load(model))
                    output = run()
                counts = {prefix + path: tokens for prefix, model in self.models.items()
                          for path, tokens in expert_load(model).items() if sum(tokens) > 0}
                self.load = ExpertLoad.from_counts(counts) if counts else None
            finally:
                for block, tokens in zip(blocks, before):
                    block.tokens_per_expert = tokens
            return output
        return counted
