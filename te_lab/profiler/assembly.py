"""From the measured steps to a ProfileReport: each mode's summary, module times taken to
the unprofiled step, eager against fused per module and op kind with their intervals,
totals, roofline points, utilization figures, and the formula of every figure."""

from __future__ import annotations

import importlib.metadata
import statistics
from typing import Optional

import torch
from torch import nn

from te_lab import device as devices, distributed
from te_lab.inputs import output_tensors

from . import ceiling, compiles, correction, intervals
from .device_kernels import device_figures
from .estimates import BYTES_FORMULA
from .expert_load import FORMULA as EXPERT_LOAD_FORMULA
from .measurement import Profiled
from .modes import LOSS_KEY
from .report import (
    OTHER_KEY,
    Ceilings,
    Comparison,
    Environment,
    Figure,
    ModeSummary,
    ProfileReport,
    Region,
    RooflinePoint,
    Totals,
)

FORMULAS = {
    "step_ms": "median over timed steps of the step's wall time (device timer), profiler off",
    "spread_ms": "half the interquartile range of the step times",
    "speedup": "eager step median / fused step median",
    "speedup_interval": intervals.FORMULA + " of the timed steps",
    "module_speedup_interval": intervals.FORMULA + " of the clocked steps on the CPU (each module's share of "
                               "its step x the unprofiled step median), of the profiled steps on GPUs",
    "launches": "CPU: ops dispatched by the framework (ops not nested in another op); GPU: device kernels",
    "bytes_moved": BYTES_FORMULA,
    "step_time_change": "fused step median / eager step median - 1 (negative: the fused step is faster)",
    "traffic_change": "fused bytes moved / eager bytes moved - 1, summed over every module (estimates)",
    "region_time": "CPU: the module's wall time in steps without the profiler, timed by hooks (forward: pre-hook "
                   "to hook; backward: its first autograd node's start to its last one's end, the engine's gaps "
                   "included; keyed modules nested in it left out), as a share of that step less the hooks' own "
                   "time, x the unprofiled step median, median over those steps; GPUs: its kernels' device time "
                   "in the profiled steps x the step's attribution scale, median over them",
    "attribution_scale": correction.FORMULA,
    "per_event_ms": "CPU: what recording one event cost a profiled step: the median gap between two "
                    "consecutive ATen ops called by one ATen op (the one's end and the other's start recorded); "
                    "taken off the profiled time of what no module holds (the loss ops); the median over the "
                    "profiled steps",
    "profiled_ratio": correction.RATIO_FORMULA,
    "other": "unprofiled step median - the mode's scaled module times: ops no module owns (embeddings, residual "
             "adds, glue, optimizer steps) and the Python between modules",
    "compiles": compiles.FORMULA,
    "fused_share": "fused step: time of the modules holding fused ops / the step (both scaled to the unprofiled "
                   "step)",
    "achieved_gbs": "bytes moved / region time",
    "achieved_gflops": "FLOPs / region time",
    "arithmetic_intensity": "FLOPs / bytes moved",
    "communication_ms": "union of the intervals during which collectives ran in the profiled step (gloo's "
                        "worker-thread events on the CPU, NCCL / MCCL kernels on GPUs), waiting for other ranks "
                        "included; not part of the op time",
    "expert_load": EXPERT_LOAD_FORMULA,
    "fusion_ceiling": ceiling.FORMULA,
}


def _spread(values: list[float]) -> float:
    if len(values) < 4:
        return (max(values) - min(values)) / 2 if values else 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / 2


def environment(device: torch.device, target, inputs, description: str) -> Environment:
    try:
        triton_version: Optional[str] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    tensors = output_tensors(inputs if not isinstance(inputs, dict) else list(inputs.values()))
    shapes = [list(tensor.shape) for tensor in tensors]
    floating = tensors + (list(target.parameters()) if isinstance(target, nn.Module) else [])
    dtypes = {str(t.dtype).replace("torch.", "") for t in floating if t.is_floating_point()}
    return Environment(str(device), devices.device_name(device), torch.__version__, triton_version,
                       torch.get_num_threads(), ",".join(sorted(dtypes)) or "-", shapes, description,
                       *distributed.rank_and_world_size())


def mode_summary(name: str, samples: list, profiled: Profiled, backward: bool, device: torch.device) -> ModeSummary:
    step, forward, back, cpu = (list(column) for column in zip(*samples))
    summary = ModeSummary(name, step, forward, back if backward else [],
                          statistics.median(step), _spread(step), statistics.median(forward),
                          statistics.median(back) if backward else None, profiled.wall_ms,
                          profiled.trace.launches, profiled.peak_memory_bytes, profiled.peak_memory_source)
    if not devices.is_gpu(device):
        summary.effective_parallelism = statistics.median(c / (s * 1e-3) for c, s in zip(cpu, step) if s > 0)
    if profiled.trace.collectives:
        summary.communication_ms = profiled.trace.communication_us / 1e3
        summary.collectives = profiled.trace.collectives
    return summary


def correct_runs(runs: dict, step_medians: dict, device_times: bool) -> dict:
    """Each mode's profiled runs, one by one, to what its unprofiled step spends
    (:mod:`.correction`): each region loses its recorded events at the run's own per-event
    cost, then the run's times are scaled by the mode's unprofiled step median over the
    run's wall time less all its events' cost. Run by run, since both move from one
    profiled step to the next (on the 2-core CPU 0.3-0.7 us per event, and steps of 35 to
    60 ms within a second). mode -> (median per-event ms, median scale) over its runs."""
    found = {}
    for mode, profiled in runs.items():
        event_costs, scales = [], []
        for run in profiled:
            trace = run.trace
            per_event_ms = trace.event_cost_us / 1e3
            for key, region in trace.regions.items():
                forward_events, backward_events = trace.events.get(key, (0, 0))
                region.forward_ms = correction.without_events(region.forward_ms, forward_events, per_event_ms)
                region.backward_ms = correction.without_events(region.backward_ms, backward_events, per_event_ms)
            attributed_ms = sum(region.total_ms for region in trace.regions.values())
            scale = correction.attribution_scale(
                step_medians[mode], run.wall_ms - trace.recorded_events * per_event_ms, attributed_ms,
                # a GPU trace without device activity holds host times
                device_times and bool(trace.kernels))
            for region in trace.regions.values():
                region.forward_ms *= scale
                region.backward_ms *= scale
            trace.attributed_us = attributed_ms * scale * 1e3
            trace.compute_ms = correction.without_events(trace.compute_us / 1e3, trace.compute_events,
                                                         per_event_ms) * scale
            event_costs.append(per_event_ms)
            scales.append(scale)
        found[mode] = (statistics.median(event_costs), statistics.median(scales)) if profiled else (0.0, 1.0)
    return found


def use_clocked_times(runs: dict, clocked: dict, step_medians: dict) -> None:
    """On the CPU, each profiled run's module times replaced by those of the clocked step
    after it (:mod:`.module_clock`: timed by hooks without the profiler), as a share of
    that step (less what the hooks spent) x the mode's unprofiled step median. The
    profiler's cost per event is no one number (0.26 us for an ATen op in a loop, 1.5-2 us
    for those of te_lab's fused RMSNorm on the 2-core CPU), so its corrected times stayed
    up to 10% off for the modules densest in events; keys no module holds (the loss ops of
    the LM head + loss) keep their corrected profiled times. Nothing to do on GPUs (no
    clocked steps: kernel times are not slowed by the profiler)."""
    for mode, steps in clocked.items():
        for run, step in zip(runs[mode], steps):
            if step.step_ms <= 0:
                continue
            for key, (forward_ms, backward_ms) in step.modules.items():
                region = run.trace.regions.setdefault(key, Region())
                region.forward_ms = max(forward_ms, 0.0) / step.step_ms * step_medians[mode]
                region.backward_ms = max(backward_ms, 0.0) / step.step_ms * step_medians[mode]
            run.trace.attributed_us = sum(region.total_ms for region in run.trace.regions.values()) * 1e3


def note_corrections(report: ProfileReport, corrections: dict) -> None:
    """Record each mode's per-event cost and attribution scale (medians over its profiled
    runs, :func:`correct_runs`), and note what the profiler cost and any compilation a
    measured step paid for."""
    for mode, summary in report.modes.items():
        summary.per_event_ms, summary.attribution_scale = corrections[mode]
        warning = correction.overhead_warning(mode, summary.step_median_ms, summary.profiled_step_ms)
        if warning:
            report.notes.append(warning)
        if summary.compiles:
            report.notes.append(f"warning: {summary.compiles} compilation events during the {mode} mode's timed or "
                                f"profiled steps: its times include compiling (raise warmup)")


def compare(report: ProfileReport, traces: dict, key_info: dict) -> None:
    keys = list(key_info) + [k for t in traces.values() for k in t.trace.regions if k not in key_info]
    for key in dict.fromkeys(keys):
        kind, module_type, verification = key_info.get(key, ("loss" if key == LOSS_KEY else "other", "", ""))
        report.modules.append(Comparison(key, kind, module_type,
                                         traces["eager"].trace.regions.get(key, Region()),
                                         traces["fused"].trace.regions.get(key, Region()), verification))
    other = Comparison(OTHER_KEY, "other")
    for mode in ("eager", "fused"):
        trace = traces[mode].trace
        region = getattr(other, mode)
        region.forward_ms = max(report.modes[mode].step_median_ms - trace.attributed_us / 1e3, 0.0)
        region.launches = trace.launches - sum(r.launches for r in trace.regions.values())
    report.modules.append(other)
    by_kind: dict[str, Comparison] = {}
    for comparison in report.modules:
        merged = by_kind.setdefault(comparison.kind, Comparison(comparison.kind, comparison.kind))
        for mode in ("eager", "fused"):
            target, source = getattr(merged, mode), getattr(comparison, mode)
            target.forward_ms += source.forward_ms
            target.backward_ms += source.backward_ms
            target.launches += source.launches
            target.bytes_moved += source.bytes_moved
            target.flops += source.flops
    report.kinds = list(by_kind.values())
    eager, fused = report.modes["eager"], report.modes["fused"]
    fused_op_ms = sum(c.fused.total_ms for c in report.modules if c.key != OTHER_KEY)
    all_fused_ms = sum(c.fused.total_ms for c in report.modules)
    eager_bytes = sum(c.eager.bytes_moved for c in report.modules)
    fused_bytes = sum(c.fused.bytes_moved for c in report.modules)
    speedup_low = speedup_high = None
    if fused.step_median_ms > 0 and len(eager.step_ms) >= 2:
        speedup_low, speedup_high = intervals.ratio_interval(eager.step_ms, fused.step_ms)
    report.totals = Totals(
        eager.step_median_ms / fused.step_median_ms if fused.step_median_ms > 0 else float("nan"),
        eager.step_median_ms - fused.step_median_ms, eager.launches - fused.launches, eager_bytes - fused_bytes,
        fused_op_ms / all_fused_ms if all_fused_ms > 0 else 0.0,
        fused.step_median_ms / eager.step_median_ms - 1 if eager.step_median_ms > 0 else float("nan"),
        fused_bytes / eager_bytes - 1 if eager_bytes > 0 else None, speedup_low, speedup_high)
    for mode in ("eager", "fused"):
        for comparison in report.kinds:
            region = getattr(comparison, mode)
            if region.total_ms > 0 and region.bytes_moved > 0:
                report.roofline.append(RooflinePoint(
                    mode, comparison.key, region.flops / region.bytes_moved if region.bytes_moved else None,
                    region.gflops, region.gbs, region.total_ms))


def per_round_totals(runs: dict, step_medians: dict) -> dict:
    """key -> mode -> the key's time (ms, corrected: :func:`correct_runs`; on the CPU the
    modules' from their clocked steps: :func:`use_clocked_times`) in each profiled round,
    before :func:`.measurement.median_run` replaces the first round's figures;
    "(other)" is the rest of the mode's unprofiled step median."""
    totals: dict = {}
    for mode, profiled in runs.items():
        for round_index, run in enumerate(profiled):
            for key, region in run.trace.regions.items():
                totals.setdefault(key, {}).setdefault(mode, {})[round_index] = region.total_ms
            attributed = sum(region.total_ms for region in run.trace.regions.values())
            totals.setdefault(OTHER_KEY, {}).setdefault(mode, {})[round_index] = max(
                step_medians[mode] - attributed, 0.0)
    return totals


def _rounds(per_round: dict, key: str, mode: str) -> list:
    """The key's time in each profiled round (0.0 in a round it did not run in)."""
    rounds = per_round.get(key, {}).get(mode, {})
    return [rounds.get(i, 0.0) for i in range(len(per_round.get(OTHER_KEY, {}).get(mode, {})))]


def module_intervals(report: ProfileReport, per_round: dict) -> None:
    """Each module's and op kind's speedup interval over the paired rounds, each as the
    report's times are (:func:`correct_runs`, :func:`use_clocked_times`); a note when
    "(other)", which fusion does not touch, changed measurably."""
    members = {kind.key: [m.key for m in report.modules if m.kind == kind.key] for kind in report.kinds}
    rows = [(module, [module.key]) for module in report.modules] + [(kind, members[kind.key]) for kind in report.kinds]
    for comparison, keys in rows:
        eager, fused = ([sum(values) for values in zip(*(_rounds(per_round, key, mode) for key in keys))]
            for mode in ("eager", "fused"))
        if len(eager) < 2 or len(eager) != len(fused) or comparison.speedup is None or min(fused) <= 0:
            continue
        comparison.speedup_low, comparison.speedup_high = intervals.ratio_interval(eager, fused)
    other = next(c for c in report.modules if c.key == OTHER_KEY)
    if other.distinguishable:
        report.notes.append(
            f"warning: (other) ran {other.speedup:.2f}x [{other.speedup_low:.2f}, {other.speedup_high:.2f}] eager "
            f"against fused, a change fusion cannot cause: it holds the same code in both modes (ops no fused "
            f"module owns and the Python between ops); the machine's noise or the profiler's overhead moved it, "
            f"so read the module rows' shares of the step with care")


def _device_figures(mode: str, profiled: Profiled, multiprocessors: int) -> list[Figure]:
    kernels = profiled.trace.kernels
    start = kernels[0].start_ns if kernels else 0
    return device_figures(kernels, start, start + int(profiled.wall_ms * 1e6), multiprocessors, mode,
                          "the profiled step's wall time from its first device activity")


def utilization(report: ProfileReport, samples: dict, sampler, traces: dict, device: torch.device) -> None:
    peak = devices.peak(device)
    report.ceilings = Ceilings(peak.memory_bandwidth_gbs, peak.fp32_tflops, peak.bf16_tflops, peak.source)
    threads = torch.get_num_threads()
    for mode, summary in report.modes.items():
        if summary.effective_parallelism is not None:
            report.utilization.append(Figure(
                "effective parallelism", mode, summary.effective_parallelism, "threads",
                "process CPU time / wall time of each timed step, median over steps",
                f"against torch.get_num_threads() = {threads}"))
            report.utilization.append(Figure(
                "parallel efficiency", mode, min(summary.effective_parallelism / threads, 1.0), "fraction",
                "effective parallelism / torch.get_num_threads()"))
        if devices.is_gpu(device):
            report.utilization.extend(_device_figures(mode, traces[mode], devices.multiprocessor_count(device)))
    for series in sampler.series:
        if series.values:
            mean = statistics.mean(v for row in series.values for v in row) / 100
            report.utilization.append(Figure(
                f"mean {series.source} utilization", "both", mean, "fraction",
                f"mean over samples and channels of {series.formula}",
                "sampled across the timed steps and the profiled steps among them"))


def fusion_ceiling(report: ProfileReport, traces: dict, device: torch.device) -> None:
    """The report's fusion ceiling (:mod:`.ceiling`) from each mode's compute time (median
    over its profiled steps, corrected as the modules' times are) and bytes (detail step)."""
    splits = {mode: ceiling.mode_split(report.modes[mode].step_median_ms, traces[mode].trace.compute_ms,
                                       traces[mode].trace.step_bytes, traces[mode].trace.compute_bytes)
              for mode in ("eager", "fused")}
    bandwidth, source = devices.fusion_bandwidth(device)
    report.ceiling = ceiling.fusion_ceiling(report.modes["eager"].step_median_ms, report.modes["fused"].step_median_ms,
                                            splits["eager"], splits["fused"], bandwidth, source)
