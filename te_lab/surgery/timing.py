"""``fuse(auto=True)``: is the fused twin faster than the original on this device?

Forward + backward on the candidate's probe, the two interleaved (alternating which
goes first each round) after warm-up, timed with the device's timer; medians of each.
Input copies are made outside the timed region.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
from torch import Tensor, nn

from te_lab import device as devices

from .probe import forward_backward, prepare
from .rules import ProbeInputs

WARMUP_ROUNDS = 2
TIMED_ROUNDS = 7


def median_times_ms(original: Callable, fused: Callable, inputs: ProbeInputs,
                    parameters: list[tuple[str, nn.Parameter]], constant: frozenset,
                    select: Callable[[Any], list[Tensor]], device: torch.device) -> tuple[float, float]:
    """(original, fused) median forward + backward time in milliseconds."""
    contenders = {"original": original, "fused": fused}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_index in range(WARMUP_ROUNDS + TIMED_ROUNDS):
        order = list(contenders) if round_index % 2 == 0 else list(reversed(contenders))
        for name in order:
            prepared, differentiable = prepare(original, inputs, constant)
            devices.synchronize(device)
            with devices.Timer(device) as timer:
                forward_backward(contenders[name], prepared, differentiable, parameters, select)
            if round_index >= WARMUP_ROUNDS:
                times[name].append(timer.elapsed_ms)
    return statistics.median(times["original"]), statistics.median(times["fused"])
