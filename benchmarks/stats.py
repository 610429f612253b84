"""The ratio of two contenders' times, with its spread.

``speedup(contender, over)`` is ``over``'s median over ``contender``'s median: above 1
the contender is faster. Its spread comes two ways, both from the rounds the harness
interleaves (sample ``i`` of each contender was measured in round ``i``, side by side):

- a 95% bootstrap interval of the ratio of medians, resampling whole rounds so each
  sample stays paired with the one measured beside it
  (:func:`te_lab.profiler.intervals.ratio_interval`, which the profiler's headline uses too);
- the median and quartiles of the per-round ratios.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from te_lab.profiler.intervals import ratio_interval

from .harness import Timing


@dataclass(frozen=True)
class Speedup:
    contender: str
    over: str
    value: float  # median(over) / median(contender)
    interval_low: float
    interval_high: float
    round_median: float
    round_q1: float
    round_q3: float

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def verdict(self) -> str:
        if self.interval_low > 1:
            return "faster"
        if self.interval_high < 1:
            return "slower"
        return "no clear difference"


def speedup(contender: Timing, over: Timing) -> Speedup:
    """How much faster ``contender`` ran than ``over`` (see the module doc)."""
    if len(contender.samples_ms) != len(over.samples_ms) or not contender.samples_ms:
        raise ValueError(f"speedup({contender.name!r}, over={over.name!r}): expected the same positive number of "
                         f"paired rounds, got {len(contender.samples_ms)} and {len(over.samples_ms)}")
    per_round = [o / c for c, o in zip(contender.samples_ms, over.samples_ms)]
    if len(per_round) >= 4:
        q1, q2, q3 = statistics.quantiles(per_round, n=4)
    else:
        q1, q2, q3 = min(per_round), statistics.median(per_round), max(per_round)
    low, high = ratio_interval(over.samples_ms, contender.samples_ms)
    return Speedup(contender.name, over.name, over.median_ms / contender.median_ms, low, high, q2, q1, q3)
