"""How sure a ratio of two timed contenders is: a 95% bootstrap interval over paired rounds.

Sample ``i`` of each contender was measured in round ``i``, side by side (interleaved), so
the interval resamples whole rounds: each sample stays with the one measured beside it.
The ratio is one of medians, ``median(numerator) / median(denominator)``. The profiler
(:mod:`te_lab.profiler.engine`) puts one on every headline ratio, and the benchmarks
(``te_lab.benchmarks.stats``) on every speedup they report.
"""

from __future__ import annotations

import random
import statistics
from typing import Optional

BOOTSTRAP_RESAMPLES = 1000
CONFIDENCE = 0.95
FORMULA = (f"{100 * CONFIDENCE:.0f}% bootstrap interval of the ratio of medians, {BOOTSTRAP_RESAMPLES} resamples of "
           "whole interleaved rounds (each eager sample stays paired with the fused one measured beside it)")


def ratio_interval(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """The interval of ``median(numerator) / median(denominator)`` over paired rounds
    (``numerator[i]`` and ``denominator[i]`` measured side by side). Seeded, so the same
    samples give the same interval."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"ratio_interval: expected the same positive number of paired rounds, got "
                         f"{len(numerator)} and {len(denominator)}")
    generator = random.Random(0)
    ratios = []
    rounds = len(numerator)
    for _ in range(BOOTSTRAP_RESAMPLES):
        picks = [generator.randrange(rounds) for _ in range(rounds)]
        below = statistics.median(denominator[i] for i in picks)
        ratios.append(statistics.median(numerator[i] for i in picks) / below if below > 0 else float("inf"))
    ratios.sort()
    tail = (1 - CONFIDENCE) / 2
    return ratios[int(tail * len(ratios))], ratios[min(len(ratios) - 1, int((1 - tail) * len(ratios)))]


def relative_half_width(value: float, low: float, high: float) -> float:
    """Half the interval's width over the value: 0.03 is "within ±3%"."""
    return (high - low) / 2 / value if value > 0 else float("inf")


def holds_one(low: Optional[float], high: Optional[float]) -> bool:
    """Whether an interval of a ratio holds 1.0: no measurable difference."""
    return low is not None and high is not None and low <= 1.0 <= high
