"""te_lab.profile: run a target eager and fused, interleaved, and report the difference.

What the two modes are for each kind of target (a fused model, a callable, a
``(baseline, candidate)`` pair, the models a statement uses) is :mod:`.modes`.

A step is the forward on ``inputs`` and, with ``backward=True``, the gradients of its
loss (the output's ``loss``, else the sum of its tensors) w.r.t. every parameter and
floating-point input, through ``torch.autograd.grad`` so no ``.grad`` is written. A
``DistributedDataParallel`` model's backward is ``loss.backward()`` instead, so its
gradient all-reduce runs and is measured (``.grad`` is put back as it was; with
``gradient_as_bucket_view=True`` DDP's buckets hold ``.grad``, so profile between
``zero_grad()`` and the next step). Collectives' time is reported per mode as
communication; in a distributed run the report records its rank (``report.save``
writes ``report.rank<r>.json``).
Timed steps run without the profiler (warm-up first, modes alternating which goes
first each round); then one detail step per mode records shapes, FLOPs and memory (bytes
moved, FLOPs, input shapes, peak memory), and profiled steps that record times alone,
which cost the profiler a tenth as much per op, give the attribution, launches and
timeline (see :mod:`.correction`). Module times are rescaled so each mode's modules and "(other)" add
up to its unprofiled step (:mod:`.correction`), and compilations during timed or
profiled steps are counted per mode (:mod:`.compiles`). The RNG state, parameters and
gradients are left as found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from te_lab import device as devices, distributed
from te_lab.inputs import output_tensors
from te_lab.options import check_budget, check_steps, check_warmup
from te_lab.surgery import is_fused

from . import compiles, correction, intervals, regions, trace_files
from .attribution import attribute
from .chatter import without_profiler_chatter
from .device_kernels import device_figures
from .estimates import BYTES_FORMULA
from .expert_load import FORMULA as EXPERT_LOAD_FORMULA, LoadRecorder
from .modes import LOSS_KEY, Mode, statement_modes, target_modes
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
from .sampler import UtilizationSampler

# Profiled steps per mode: the profiler's own hiccups (a few ms on a busy CPU) hit single
# ops at random, so each region's times are medians over these steps, and each module's
# speedup interval is bootstrapped over them.
PROFILED_STEPS = 5
# steps="auto": interleaved pairs are added until the speedup's 95% interval is within
# ±AUTO_TARGET of it, at least MIN_AUTO_PAIRS and at most MAX_AUTO_PAIRS, or until the
# time budget (budget_s) is spent.
AUTO_TARGET = 0.03
MIN_AUTO_PAIRS = 5
MAX_AUTO_PAIRS = 200
DEFAULT_BUDGET_S = 60.0

FORMULAS = {
    "step_ms": "median over timed steps of the step's wall time (device timer), profiler off",
    "spread_ms": "half the interquartile range of the step times",
    "speedup": "eager step median / fused step median",
    "speedup_interval": intervals.FORMULA + " of the timed steps",
    "module_speedup_interval": intervals.FORMULA + " of the profiled steps, x the ratio of the modes' "
                               "attribution scales",
    "launches": "CPU: ops dispatched by the framework (ops not nested in another op); GPU: device kernels",
    "bytes_moved": BYTES_FORMULA,
    "step_time_change": "fused step median / eager step median - 1 (negative: the fused step is faster)",
    "traffic_change": "fused bytes moved / eager bytes moved - 1, summed over every module (estimates)",
    "region_time": "CPU: the module's wall time in the profiled steps (median over them; forward: its region "
                   "from entry to exit, nested regions left out; backward: the autograd nodes its forward made, "
                   "each with the engine's gap before it); GPUs: its kernels' device time; x the mode's "
                   "attribution scale",
    "attribution_scale": correction.FORMULA,
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
}


def _loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in output_tensors(output) if t.requires_grad]
    if not tensors:
        raise ValueError("te_lab.profile: backward=True, but the target's output has no tensor that requires grad")
    return sum(t.float().sum() for t in tensors)


def _timed_step(mode: Mode, backward: bool, device: torch.device) -> tuple[float, float, float, float]:
    """(step ms, forward ms, backward ms, process CPU seconds) of one step."""
    devices.synchronize(device)
    cpu_start = time.process_time()
    with devices.Timer(device) as forward_timer:
        output = mode.run()
    backward_ms = 0.0
    if backward:
        with devices.Timer(device) as backward_timer:
            mode.backpropagate(_loss(output), mode.leaves)
        backward_ms = backward_timer.elapsed_ms
    cpu_seconds = time.process_time() - cpu_start
    return forward_timer.elapsed_ms + backward_ms, forward_timer.elapsed_ms, backward_ms, cpu_seconds


def _spread(values: list[float]) -> float:
    if len(values) < 4:
        return (max(values) - min(values)) / 2 if values else 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / 2


def _environment(device: torch.device, target, inputs, description: str) -> Environment:
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


def profile(target, inputs=None, *, steps: Union[int, str] = "auto", warmup: int = 2, backward: bool = True,
            device=None, progress: Optional[Callable[[int, int], None]] = None, trace_dir=None,
            budget_s: float = DEFAULT_BUDGET_S) -> ProfileReport:
    """Profile ``target`` eager and fused (see the module doc) and return a ProfileReport.

    ``steps``: timed (unprofiled) steps per mode, run in interleaved eager / fused pairs;
    ``"auto"`` adds pairs until the speedup's 95% interval is within ±3%
    (:data:`AUTO_TARGET`), after at least :data:`MIN_AUTO_PAIRS`, or until ``budget_s``
    seconds of timed pairs are spent (the report's notes say which).

    ``trace_dir``: a directory that receives every profiled step's raw trace
    (:mod:`te_lab.profiler.trace_files`), for :func:`te_lab.open_trace` elsewhere.

    ``progress(done, total)`` is called after every step (for progress bars). To measure
    again with the same arguments (the dashboard's Re-run), keep a
    :class:`~te_lab.profiler.ProfileRun`.
    """
    _check_counts(steps, warmup, budget_s, "te_lab.profile")
    modes, description, key_info = target_modes(target, inputs)
    if backward and not modes[0].leaves:
        raise ValueError("te_lab.profile: backward=True, but there is nothing to differentiate: no parameter of the "
                         "target requires grad and inputs hold no floating-point tensor; pass backward=False to "
                         "profile the forward only")
    dev = devices.resolve(device) if device is not None else _device_of(target, inputs)
    with trace_files.writing_to(trace_dir):
        report = _measure(modes, key_info, _environment(dev, target, inputs, description), dev, steps, warmup,
                          backward, progress, budget_s, LoadRecorder(
                              {"": distributed.unwrap(target)} if isinstance(target, nn.Module) else {}))
    return report


def profile_statement(run: Callable[[], Any], models: dict, *, steps: Union[int, str] = "auto", warmup: int = 2,
                      backward: bool = True, device=None,
                      progress: Optional[Callable[[int, int], None]] = None, trace_dir=None,
                      budget_s: float = DEFAULT_BUDGET_S) -> ProfileReport:
    """Profile code that uses fused models (what ``%te_profile`` runs): "eager" runs
    ``run()`` with every model in ``models`` (name -> fused model) inside
    ``te_lab.unfused``, "fused" as they are. Module keys are the models' module paths,
    prefixed by the model's name when there are several. With ``backward``, the value
    ``run()`` returns is differentiated as in :func:`profile`; ``steps``, ``budget_s`` and
    ``trace_dir`` as there."""
    _check_counts(steps, warmup, budget_s, "te_lab.profile_statement")
    if not models:
        raise ValueError("te_lab.profile_statement: models is empty; fuse a model first (te_lab.fuse)")
    for name, model in models.items():
        if not isinstance(model, nn.Module) or not is_fused(model):
            raise ValueError(f"te_lab.profile_statement: models[{name!r}] is not a model with te_lab fusions")
    modes, key_info = statement_modes(run, models)
    if backward and not modes[0].leaves:
        raise ValueError("te_lab.profile_statement: backward=True, but no parameter of the models requires grad, "
                         "so there is nothing to differentiate; pass backward=False to profile the forward only")
    first = next(iter(models.values()))
    dev = devices.resolve(device) if device is not None else _device_of(first, None)
    versions = [(p, p._version) for model in models.values() for p in model.parameters()]
    several = len(models) > 1
    recorder = LoadRecorder({f"{name}." if several else "": distributed.unwrap(m) for name, m in models.items()})
    with trace_files.writing_to(trace_dir):
        report = _measure(modes, key_info, _environment(dev, first, None, ", ".join(models)), dev, steps, warmup,
                          backward, progress, budget_s, recorder)
    changed = sum(p._version != version for p, version in versions)  # in-place updates bump a tensor's version
    if changed:
        runs = 2 * runs_per_mode(len(report.modes["eager"].step_ms), warmup)
        message = (f"te_lab.profile_statement: the statement changed {changed} of the models' parameters in place "
                   f"while it ran {runs} times (an optimizer step inside it?), so the "
                   f"eager and fused steps measured a moving model")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        report.notes.append(message)
    return report


def _check_counts(steps, warmup, budget_s, caller: str) -> None:
    check_steps(steps, caller)
    check_warmup(warmup, caller)
    check_budget(budget_s, caller)


def runs_per_mode(steps: int, warmup: int) -> int:
    """How many times a profile with ``steps`` timed steps (a number: what ``"auto"``
    settled on) runs its target in each mode: the warm-up and timed steps, one profiled
    step thrown away, then the profiled steps kept."""
    return warmup + steps + 1 + min(steps, PROFILED_STEPS)


def _measure(modes: list, key_info: dict, environment: Environment, dev: torch.device, steps, warmup: int,
             backward: bool, progress, budget_s: float, expert_load: LoadRecorder) -> ProfileReport:
    report = ProfileReport(environment, formulas=dict(FORMULAS))
    samples = {mode.name: [] for mode in modes}
    compile_counters = {mode.name: compiles.CompileCounter() for mode in modes}
    profiled_steps = PROFILED_STEPS if steps == "auto" else min(steps, PROFILED_STEPS)
    planned = {"timed": MIN_AUTO_PAIRS if steps == "auto" else steps}
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(modes) * (warmup + planned["timed"] + 1 + profiled_steps))

    with torch.random.fork_rng(devices=[dev] if devices.is_gpu(dev) else [],
                               **({"device_type": dev.type} if devices.is_gpu(dev) else {})):
        for mode in modes:
            with mode.context():
                for _ in range(warmup):
                    _timed_step(mode, backward, dev)
                    advance()
        with UtilizationSampler(dev) as sampler:
            started = time.perf_counter()
            index = 0
            while True:
                for mode in (modes if index % 2 == 0 else modes[::-1]):
                    with mode.context(), compile_counters[mode.name]:
                        sampler.mark(f"{mode.name} step {index + 1} start")
                        samples[mode.name].append(_timed_step(mode, backward, dev))
                        advance()
                        sampler.mark(f"{mode.name} step {index + 1} end")
                index += 1
                if steps != "auto":
                    if index >= steps:
                        break
                    continue
                stop = _auto_stop(samples, index, time.perf_counter() - started, budget_s)
                if stop:
                    report.notes.append(stop)
                    planned["timed"] = index
                    break
                pair_s = (time.perf_counter() - started) / index
                planned["timed"] = max(index + 1, min(MAX_AUTO_PAIRS, int(budget_s / pair_s) if pair_s > 0 else 0))
        runs, details = {mode.name: [] for mode in modes}, {}
        # The first profiled step per mode gives the details (shapes, bytes, FLOPs, memory),
        # not times: the profiler's first session in a process, and the first call of each
        # compiled graph under it, cost up to hundreds of ms that land on whichever op runs
        # first. The fused one records the expert load of fused MoE blocks, if any
        # (.expert_load), where counting costs nothing.
        for index in range(-1, profiled_steps):
            for mode in (modes if index % 2 == 0 else modes[::-1]):
                with compile_counters[mode.name] if index >= 0 else contextlib.nullcontext():
                    profiled = _profiled_step(mode if index >= 0 or mode.name != "fused" else dataclasses.replace(
                        mode, run=expert_load.recording(mode.run)), backward, dev, detail=index < 0)
                if index >= 0:
                    runs[mode.name].append(profiled)
                else:
                    details[mode.name] = profiled
                advance()
        per_round = _per_round_totals(runs)
        traces = {name: _with_details(_median_run(profiled), details[name]) for name, profiled in runs.items()}
    for mode in modes:
        report.modes[mode.name] = _summary(mode.name, samples[mode.name], traces[mode.name], backward, dev)
        report.modes[mode.name].compiles = compile_counters[mode.name].count
    _correct_to_unprofiled(report, traces, devices.is_gpu(dev))
    _compare(report, traces, key_info)
    _module_intervals(report, per_round)
    _utilization(report, samples, sampler, traces, dev)
    report.timeline = [event for mode in modes for event in traces[mode.name].trace.timeline]
    report.utilization_series = [vars(series) for series in sampler.series]
    report.utilization_marks = list(sampler.marks)
    report.notes += [f"unavailable: {reason}" for reason in sampler.unavailable]
    report.notes += [note for mode in modes for note in traces[mode.name].trace.notes]
    report.expert_load = expert_load.load
    return report


def _step_ms(samples: dict, mode: str) -> list[float]:
    return [sample[0] for sample in samples[mode]]


def _auto_stop(samples: dict, pairs: int, elapsed_s: float, budget_s: float) -> str:
    """Why ``steps="auto"`` stops after ``pairs`` interleaved pairs, or "" to go on: the
    speedup's interval is narrow enough, the time budget is spent, or MAX_AUTO_PAIRS ran."""
    if pairs < MIN_AUTO_PAIRS:
        return ""
    eager, fused = _step_ms(samples, "eager"), _step_ms(samples, "fused")
    value = statistics.median(eager) / statistics.median(fused)
    width = intervals.relative_half_width(value, *intervals.ratio_interval(eager, fused))
    if width < AUTO_TARGET:
        return (f"steps='auto': the speedup's 95% interval reached ±{100 * width:.1f}% (target "
                f"±{100 * AUTO_TARGET:.0f}%) after {pairs} interleaved pairs, {elapsed_s:.1f} s")
    if elapsed_s >= budget_s or pairs >= MAX_AUTO_PAIRS:
        spent = f"the budget of {budget_s:g} s was spent" if elapsed_s >= budget_s else f"{MAX_AUTO_PAIRS} pairs ran"
        return (f"steps='auto': {spent} after {pairs} interleaved pairs ({elapsed_s:.1f} s) with the speedup's 95% "
                f"interval at ±{100 * width:.1f}%, wider than the target ±{100 * AUTO_TARGET:.0f}% (raise budget_s "
                f"for a tighter one)")
    return ""


def _per_round_totals(runs: dict) -> dict:
    """key -> mode -> the key's time (ms, as profiled) in each profiled round, before
    :func:`_median_run` replaces the first round's figures; "(other)" is the profiled wall
    time no module accounts for."""
    totals: dict = {}
    for mode, profiled in runs.items():
        for round_index, run in enumerate(profiled):
            for key, region in run.trace.regions.items():
                totals.setdefault(key, {}).setdefault(mode, {})[round_index] = region.total_ms
            attributed = sum(region.total_ms for region in run.trace.regions.values())
            totals.setdefault(OTHER_KEY, {}).setdefault(mode, {})[round_index] = max(run.wall_ms - attributed, 0.0)
    return totals


def _scaled_rounds(per_round: dict, key: str, mode: str, scale: float) -> list:
    """The key's per-round times scaled as the report's are (:func:`_correct_to_unprofiled`)."""
    rounds = per_round.get(key, {}).get(mode, {})
    return [rounds.get(i, 0.0) * scale for i in range(len(per_round.get(OTHER_KEY, {}).get(mode, {})))]


def _module_intervals(report: ProfileReport, per_round: dict) -> None:
    """Each module's and op kind's speedup interval over the paired profiled rounds,
    scaled as its times were; a note when "(other)", which fusion does not touch, changed
    measurably."""
    members = {kind.key: [m.key for m in report.modules if m.kind == kind.key] for kind in report.kinds}
    rows = [(module, [module.key]) for module in report.modules] + [(kind, members[kind.key]) for kind in report.kinds]
    for comparison, keys in rows:
        eager, fused = ([sum(values) for values in zip(*(
            _scaled_rounds(per_round, key, mode, report.modes[mode].attribution_scale) for key in keys))]
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


def _device_of(target, inputs) -> torch.device:
    for value in ([*target.parameters()] if isinstance(target, nn.Module) else []) + output_tensors(inputs):
        return value.device
    return devices.default_device()


@dataclass
class _Profiled:
    trace: Any
    wall_ms: float
    peak_memory_bytes: Optional[int]
    peak_memory_source: str


def _profiled_step(mode: Mode, backward: bool, device: torch.device, detail: bool) -> _Profiled:
    """One step under the profiler. ``detail``: record shapes, FLOPs and memory too, which
    costs about ten times more per op event than the times alone (see :mod:`.correction`):
    the steps that time modules leave them out, and one detail step per mode gives bytes
    moved, FLOPs, input shapes and peak memory (:func:`_with_details`)."""
    with mode.context():
        with regions.labelled(mode.labels()):
            if devices.is_gpu(device):
                devices.synchronize(device)
                devices.reset_peak_memory_stats(device)
                before = devices.memory_allocated(device)
            profiler = torch.profiler.profile(activities=devices.profiler_activities(device), record_shapes=detail,
                                              with_flops=detail, profile_memory=detail)
            with without_profiler_chatter():
                profiler.start()
            try:
                wall_ms = _timed_step(mode, backward, device)[0]
            finally:
                with without_profiler_chatter():
                    profiler.stop()
            trace_files.export(profiler, mode.name)
            trace = attribute(profiler, mode.name, LOSS_KEY, devices.is_gpu(device), costs=detail)
    if devices.is_gpu(device):
        return _Profiled(trace, wall_ms, devices.max_memory_allocated(device) - before, "allocator peak above the "
                         "step's start (max_memory_allocated)")
    return _Profiled(trace, wall_ms, trace.peak_memory_bytes, "profiler memory records: peak of allocations "
                     "minus frees during the step")


def _median_run(runs: list[_Profiled]) -> _Profiled:
    """The first run, with each region's forward and backward time from the run whose total
    for that region is the median (lower median for an even count), so the region's total
    is the median total its speedup interval is bootstrapped from (launches, bytes and
    FLOPs do not vary between runs), and the wall time the median."""
    first = runs[0]
    for key, region in first.trace.regions.items():
        others = sorted((r for r in (run.trace.regions.get(key) for run in runs) if r is not None),
                        key=lambda r: r.total_ms)
        middle = others[(len(others) - 1) // 2]
        region.forward_ms, region.backward_ms = middle.forward_ms, middle.backward_ms
    first.trace.attributed_us = sum(r.total_ms for r in first.trace.regions.values()) * 1e3
    first.trace.communication_us = statistics.median(run.trace.communication_us for run in runs)
    first.wall_ms = statistics.median(run.wall_ms for run in runs)
    return first


def _with_details(timed: _Profiled, detail: _Profiled) -> _Profiled:
    """``timed`` (a step that timed the modules without shapes, FLOPs and memory) with
    each key's bytes moved and FLOPs, the peak memory, and the timeline's input shapes
    (the n-th op of a name, module and phase gets the n-th one's shapes) of ``detail``,
    the same step recorded in detail."""
    for key, region in detail.trace.regions.items():
        timed.trace.regions.setdefault(key, Region()).bytes_moved = region.bytes_moved
        timed.trace.regions[key].flops = region.flops
    shapes: dict = {}
    for event in detail.trace.timeline:
        shapes.setdefault((event.name, event.path, event.phase), []).append(event.input_shapes)
    for event in timed.trace.timeline:
        recorded = shapes.get((event.name, event.path, event.phase))
        if recorded:
            event.input_shapes = recorded.pop(0)
    timed.peak_memory_bytes, timed.peak_memory_source = detail.peak_memory_bytes, detail.peak_memory_source
    return timed


def _summary(name: str, samples: list, profiled: _Profiled, backward: bool, device: torch.device) -> ModeSummary:
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


def _correct_to_unprofiled(report: ProfileReport, traces: dict, device_times: bool) -> None:
    """Scale each mode's region times to its unprofiled step (:mod:`.correction`), and
    note what the profiler cost and any compilation a measured step paid for."""
    for mode, summary in report.modes.items():
        trace = traces[mode].trace
        scale = correction.attribution_scale(summary.step_median_ms, summary.profiled_step_ms,
                                             trace.attributed_us / 1e3,
                                             # a GPU trace without device activity holds host times
                                             device_times and bool(trace.kernels))
        for region in trace.regions.values():
            region.forward_ms *= scale
            region.backward_ms *= scale
        trace.attributed_us *= scale
        summary.attribution_scale = scale
        warning = correction.overhead_warning(mode, summary.step_median_ms, summary.profiled_step_ms)
        if warning:
            report.notes.append(warning)
        if summary.compiles:
            report.notes.append(f"warning: {summary.compiles} compilation events during the {mode} mode's timed or "
                                f"profiled steps: its times include compiling (raise warmup)")


def _compare(report: ProfileReport, traces: dict, key_info: dict) -> None:
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


def _device_figures(mode: str, profiled: _Profiled, multiprocessors: int) -> list[Figure]:
    kernels = profiled.trace.kernels
    start = kernels[0].start_ns if kernels else 0
    return device_figures(kernels, start, start + int(profiled.wall_ms * 1e6), multiprocessors, mode,
                          "the profiled step's wall time from its first device activity")


def _utilization(report: ProfileReport, samples: dict, sampler, traces: dict, device: torch.device) -> None:
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
                f"mean over samples and channels of {series.formula}", "sampled across every timed step"))
