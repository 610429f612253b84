"""From the profiled step's op times to times that add up to the unprofiled step.

The profiler slows what it records, by a cost per event (an op at any depth, a labelled
region, an autograd node), not per millisecond of work, and by no one cost: on the 2-core
CPU 0.26 us for an ATen op called in a loop, 1.5-2 us for each of te_lab's fused
RMSNorm's (the norm alone, with and without the profiler). So on the CPU the modules'
times come from steps without the profiler, timed by hooks (:mod:`.module_clock`,
:func:`.assembly.use_clocked_times`); what this module corrects is the rest:

- CPU, the keys no module holds (the loss ops of the LM head + loss), each profiled step
  on its own: what recording one event cost is measured in the step itself
  (``StepTrace.event_cost_us``: the gap between two consecutive ATen ops that one ATen op
  calls, where nothing but the profiler runs; median 0.31-0.46 us on the 2-core CPU);
  the key's forward and backward time loses its own events' share (``events x
  per_event_ms``), then ``scale = unprofiled step median / max(profiled step wall time -
  recorded events x per_event_ms, attributed time)`` spreads what is left. Measured
  against the modules timed by hooks (``python -m te_lab.benchmarks.module_alone``),
  this correction of module times stayed off by up to 10-20% for the norms, densest in
  events: a parent ATen op's own time beyond its children's, per child, as the cost
  (0.7-0.9 us: it holds the op's own work) under-charged the eager norms by 5-13%, the
  sibling gap over-charged the fused norms by 8-11%; one factor per mode over-charged
  the fused norms by 11-18%; the profiled against unprofiled step time per event moved
  from 0.03 to 2 us between profiles of one model with the machine's noise.
- GPUs (device kernel times, which the profiler does not slow): ``per_event_ms = 0``,
  ``scale = min(1, unprofiled step median / attributed kernel time)``: kernel times stay
  as measured unless they alone would exceed the step.

Either way "(other)" is the rest of the unprofiled step (ops no module owns, and the
Python between modules), so the modules plus "(other)" add up to the unprofiled step
median. Where the profiler's cost is large (:data:`OVERHEAD_WARNING`) the report says so.
"""

from __future__ import annotations

OVERHEAD_WARNING = 0.25  # profiled step / unprofiled step - 1 above which the report warns

FORMULA = ("on the CPU, for what no module holds (the loss ops; modules' times come from the clocked steps), "
           "per profiled step: (time - its recorded events x per-event cost) x scale, per-event cost measured in "
           "the step (the median gap between consecutive ATen ops called by one ATen op), scale = unprofiled "
           "step median / max(profiled step wall time - events x per-event cost, attributed time), the figure "
           "the median over profiled steps; "
           "on GPUs (kernel times, not slowed): time x min(1, unprofiled step median / attributed kernel time); "
           "(other) = unprofiled step median - corrected module times, so the rows add up to the unprofiled step")
RATIO_FORMULA = ("profiled step wall time (median over profiled steps) / unprofiled step median; the "
                 f"report warns when it passes {1 + OVERHEAD_WARNING:.2f}")


def without_events(time_ms: float, events: int, event_ms: float) -> float:
    """A module's time less what its ``events`` recorded events cost (never below 0)."""
    return max(time_ms - events * event_ms, 0.0)


def attribution_scale(unprofiled_ms: float, profiled_ms: float, attributed_ms: float, device_times: bool) -> float:
    """The factor applied to one mode's attributed times once the events' cost is off them
    (``profiled_ms`` likewise; see the module doc); 1.0 where a time is missing (nothing
    to scale by)."""
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
