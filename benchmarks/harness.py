"""Interleaved timing of contenders, as DESIGN.md asks: warm up, run A B C A B C ...,
report medians and ratios, never one absolute time. The first call of each contender
is timed on its own (it includes torch.compile's and Inductor's compile waits)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch

from te_lab import device as devices
from te_lab.profiler.attribution import peak_live_bytes


@dataclass
class Timing:
    """One contender's measurements, in milliseconds."""

    name: str
    first_call_ms: float
    samples_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread_ms(self) -> float:
        """Half the interquartile range: how noisy the median is."""
        if len(self.samples_ms) < 4:
            return 0.0
        quartiles = statistics.quantiles(self.samples_ms, n=4)
        return (quartiles[2] - quartiles[0]) / 2


def _timed(step: Callable[[], object], device: torch.device) -> float:
    devices.synchronize(device)
    with devices.Timer(device) as timer:
        step()
    return timer.elapsed_ms


def interleaved(contenders: dict[str, Callable[[], object]], device: torch.device, *,
                rounds: int = 15, warmup: int = 2, progress: Callable[[str], None] = lambda _: None,
                ) -> dict[str, Timing]:
    """Time each zero-argument step ``rounds`` times, interleaved, after ``warmup`` untimed
    calls each. The order rotates every round so no contender always runs first."""
    timings = {}
    for name, step in contenders.items():
        progress(f"first call: {name}")
        timings[name] = Timing(name, _timed(step, device))
        for _ in range(warmup):
            step()
    names = list(contenders)
    for round_index in range(rounds):
        progress(f"round {round_index + 1}/{rounds}")
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timings[name].samples_ms.append(_timed(contenders[name], device))
    return timings


def fwd_bwd_step(fn: Callable, inputs: tuple) -> Callable[[], object]:
    """A zero-argument step running ``fn(*inputs)`` forward and backward, with fixed
    random upstream gradients for every output, returning the gradients of every input
    (not accumulating into ``.grad``, which would add work that is not the op's)."""
    with torch.no_grad():
        outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    upstream = [torch.randn_like(out) for out in outputs]

    def step():
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(out, inputs, upstream)

    return step


def peak_memory_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``step`` runs, above what was allocated before it: the
    allocator's statistics on GPUs, the profiler's record of every allocation and free
    on the CPU (which has no allocator statistics)."""
    if devices.is_gpu(device):
        devices.synchronize(device)
        before = devices.memory_allocated(device)
        devices.reset_peak_memory_stats(device)
        step()
        devices.synchronize(device)
        return devices.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return peak_live_bytes(prof)
