"""From the profiled step's op times to times that add up to the unprofiled step.

The profiler slows what it records, by a cost per event (an op at any depth, a labelled
region, an autograd node), not per millisecond of work: a module dense in small ops pays
more of it than its share of the step. So the steps that time modules record times alone
(measured on the 2-core CPU, about 1 us per event, against about 13 us with shapes, FLOPs
and memory, which one detail step per mode records instead), and label module regions
with torch's C++ region (1.4 us inside the region, against 8-20 us for
``record_function``). Measured against each module timed alone, this took an eager norm
from 77-117% above its share of the step to within the machine's noise; what remains is
spread by one factor per mode:

- CPU (modules' wall times, slowed with the step): ``scale = unprofiled step median /
  max(profiled step wall time, attributed time)``; every module's time is multiplied
  by it, and "(other)" is the rest of the unprofiled step (ops no module owns, and the
  Python between modules).
- GPUs (device kernel times, which the profiler does not slow): ``scale = min(1,
  unprofiled step median / attributed kernel time)``: kernel times stay as measured
  unless they alone would exceed the step; "(other)" is again the rest of the step.

Either way the modules plus "(other)" add up to the unprofiled step median. The
scaling spreads what the profiler still costs in proportion to module time; where that
cost is large (:data:`OVERHEAD_WARNING`) the report says so, since small ops carry more
of it than large ones.
"""

from __future__ import annotations

OVERHEAD_WARNING = 0.25  # profiled step / unprofiled step - 1 above which the report warns

FORMULA = ("each mode's module times x scale, scale = unprofiled step median / max(profiled step wall time, "
           "attributed time) on the CPU (module wall times slow with the step), min(1, unprofiled "
           "step median / attributed kernel time) on GPUs (kernel times are not); (other) = unprofiled step "
           "median - scaled module times, so the rows add up to the unprofiled step")
RATIO_FORMULA = ("profiled step wall time (median over profiled steps) / unprofiled step median; the "
                 f"report warns when it passes {1 + OVERHEAD_WARNING:.2f}")


def attribution_scale(unprofiled_ms: float, profiled_ms: float, attributed_ms: float, device_times: bool) -> float:
    """The factor applied to one mode's attributed times (see the module doc); 1.0 where a
    time is missing (nothing to scale by)."""
    if unprofiled_ms <= 0:
        return 1.0
    if device_times:
        return min(1.0, unprofiled_ms / attributed_ms) if attributed_ms > 0 else 1.0
    measured = max(profiled_ms, attributed_ms)
    return unprofiled_ms / measured if measured > 0 else 1.0


def profiler_overhead(unprofiled_ms: float, profiled_ms: float) -> float:
    """How much longer the profiled step ran than the unprofiled one, as a fraction."""
    return profiled_ms / unprofiled_ms - 1 if unprofiled_ms > 0 else 0.0


def overhead_warning(mode: str, unprofiled_ms: float, profiled_ms: float) -> str:
    """A note for the report when the profiler's own overhead passes OVERHEAD_WARNING, else ""."""
    overhead = profiler_overhead(unprofiled_ms, profiled_ms)
    if overhead <= OVERHEAD_WARNING:
        return ""
    return (f"warning: the profiler slowed the {mode} step by {100 * overhead:.0f}% ({profiled_ms:.3f} ms profiled "
            f"against {unprofiled_ms:.3f} ms unprofiled; warned above {100 * OVERHEAD_WARNING:.0f}%): per-module "
            f"times are rescaled to the unprofiled step, assuming the overhead is proportional to op time; small "
            f"ops carry more of it than large ones, so read them as approximate")
