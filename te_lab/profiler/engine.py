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

After the warm-up, one detail step per mode records shapes, FLOPs and memory (bytes
moved, FLOPs, input shapes, peak memory); then timed steps run without the profiler
(modes alternating which goes first each round), and profiled pairs that record times
alone, which cost the profiler a tenth as much per op, are spread over them: they give
the attribution, launches and timeline (:mod:`.measurement`); on the CPU each is followed
by a clocked pair, steps without the profiler whose modules are timed by hooks
(:mod:`.module_clock`), which give the module times. The report is assembled from them (:mod:`.assembly`):
module times are rescaled so each mode's modules and "(other)" add up to its unprofiled
step (:mod:`.correction`), and compilations during timed or profiled steps are counted
per mode (:mod:`.compiles`). The RNG state, parameters and gradients are left as found.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from te_lab import device as devices, distributed
from te_lab.inputs import output_tensors
from te_lab.options import check_budget, check_steps, check_warmup
from te_lab.surgery import is_fused

from . import assembly, compiles, intervals, measurement, trace_files
from .expert_load import LoadRecorder
from .modes import statement_modes, target_modes
from .opportunities import find as find_opportunities
from .report import (
    Environment,
    ProfileReport,
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
# Profiled steps per mode the opportunity finder's rows take their medians over, beyond its detail step.
OPPORTUNITY_STEPS = 2



def profile(target, inputs=None, *, steps: Union[int, str] = "auto", warmup: int = 2, backward: bool = True,
            device=None, progress: Optional[Callable[[int, int], None]] = None, trace_dir=None,
            budget_s: float = DEFAULT_BUDGET_S, opportunities: bool = True) -> ProfileReport:
    """Profile ``target`` eager and fused (see the module doc) and return a ProfileReport.

    ``steps``: timed (unprofiled) steps per mode, run in interleaved eager / fused pairs;
    ``"auto"`` adds pairs until the speedup's 95% interval is within ±3%
    (:data:`AUTO_TARGET`), after at least :data:`MIN_AUTO_PAIRS`, or until ``budget_s``
    seconds of timed pairs are spent (the report's notes say which).

    ``trace_dir``: a directory that receives every profiled step's raw trace
    (:mod:`te_lab.profiler.trace_files`), for :func:`te_lab.open_trace` elsewhere.

    ``opportunities``: after the measurement, the fusion-opportunity finder
    (:mod:`te_lab.profiler.opportunities`) looks at :data:`OPPORTUNITY_STEPS` more profiled
    steps of each mode, every module labelled, for ``report.opportunities``: the eager
    step's unfused chains with the gains the fused step realized, and what fusion left.

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
        models = {"": distributed.unwrap(target)} if isinstance(target, nn.Module) else {}
        report = _measure(modes, key_info, assembly.environment(dev, target, inputs, description), dev, steps,
                          warmup, backward, progress, budget_s, LoadRecorder(models),
                          _finder_models(models, [target], opportunities))
    if opportunities and _data_parallel([target]):
        report.notes.append(DATA_PARALLEL_NOTE)
    return report


def profile_statement(run: Callable[[], Any], models: dict, *, steps: Union[int, str] = "auto", warmup: int = 2,
                      backward: bool = True, device=None,
                      progress: Optional[Callable[[int, int], None]] = None, trace_dir=None,
                      budget_s: float = DEFAULT_BUDGET_S, opportunities: bool = True) -> ProfileReport:
    """Profile code that uses fused models (what ``%te_profile`` runs): "eager" runs
    ``run()`` with every model in ``models`` (name -> fused model) inside
    ``te_lab.unfused``, "fused" as they are. Module keys are the models' module paths,
    prefixed by the model's name when there are several. With ``backward``, the value
    ``run()`` returns is differentiated as in :func:`profile`; ``steps``, ``budget_s``,
    ``trace_dir`` and ``opportunities`` as there."""
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
    prefixed = {f"{name}." if several else "": distributed.unwrap(m) for name, m in models.items()}
    with trace_files.writing_to(trace_dir):
        report = _measure(modes, key_info, assembly.environment(dev, first, None, ", ".join(models)), dev, steps,
                          warmup, backward, progress, budget_s, LoadRecorder(prefixed),
                          _finder_models(prefixed, list(models.values()), opportunities))
    if opportunities and _data_parallel(list(models.values())):
        report.notes.append(DATA_PARALLEL_NOTE)
    changed = sum(p._version != version for p, version in versions)  # in-place updates bump a tensor's version
    if changed:
        runs = 2 * runs_per_mode(len(report.modes["eager"].step_ms), warmup, clocked=not devices.is_gpu(dev))
        message = (f"te_lab.profile_statement: the statement changed {changed} of the models' parameters in place "
                   f"while it ran {runs} times (an optimizer step inside it?), so the "
                   f"eager and fused steps measured a moving model")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        report.notes.append(message)
    return report


# Why a profile of a DistributedDataParallel model has no opportunities (report.notes).
DATA_PARALLEL_NOTE = ("fusion opportunities: not looked for under DistributedDataParallel (the finder's extra steps "
                      "would all-reduce gradients on every rank); run te_lab.opportunities on the wrapped module")


def _finder_models(models: dict, targets: list, opportunities: bool) -> dict:
    """The models the opportunity finder looks at: none where it was switched off or a
    target is data-parallel."""
    if not opportunities or _data_parallel(targets):
        return {}
    return models


def _data_parallel(targets: list) -> bool:
    return any(isinstance(t, nn.Module) and distributed.is_data_parallel(t) for t in targets)


def _check_counts(steps, warmup, budget_s, caller: str) -> None:
    check_steps(steps, caller)
    check_warmup(warmup, caller)
    check_budget(budget_s, caller)


def runs_per_mode(steps: int, warmup: int, clocked: bool) -> int:
    """How many times a profile with ``steps`` timed steps (a number: what ``"auto"``
    settled on) runs its target in each mode: the warm-up and timed steps, the detail
    step, the profiled steps kept and, with ``clocked`` (on the CPU), as many clocked
    steps."""
    return warmup + steps + 1 + min(steps, PROFILED_STEPS) * (2 if clocked else 1)


def _measure(modes: list, key_info: dict, environment: Environment, dev: torch.device, steps, warmup: int,
             backward: bool, progress, budget_s: float, expert_load: LoadRecorder,
             finder_models: dict) -> ProfileReport:
    """``finder_models``: prefix -> model, for the opportunity finder (none: no finder)."""
    report = ProfileReport(environment, formulas=dict(assembly.FORMULAS))
    samples = {mode.name: [] for mode in modes}
    compile_counters = {mode.name: compiles.CompileCounter() for mode in modes}
    profiled_steps = PROFILED_STEPS if steps == "auto" else min(steps, PROFILED_STEPS)
    clocked_steps = 0 if devices.is_gpu(dev) else profiled_steps  # on the CPU, a clocked pair after each profiled one
    planned = {"timed": MIN_AUTO_PAIRS if steps == "auto" else steps}
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(modes) * (warmup + planned["timed"] + 1 + profiled_steps + clocked_steps))

    with torch.random.fork_rng(devices=[dev] if devices.is_gpu(dev) else [],
                               **({"device_type": dev.type} if devices.is_gpu(dev) else {})):
        for mode in modes:
            with mode.context():
                for step in range(warmup):
                    # The fused mode's last warm-up step records the expert load of fused MoE
                    # blocks, if any (.expert_load): no measured or profiled step counts.
                    last = mode.name == "fused" and step == warmup - 1
                    measurement.timed_step(dataclasses.replace(mode, run=expert_load.recording(mode.run)) if last
                                           else mode, backward, dev)
                    advance()
        runs, details, clocked = {mode.name: [] for mode in modes}, {}, {mode.name: [] for mode in modes}
        # One detail step per mode first gives the details (shapes, bytes, FLOPs, memory),
        # not times: the profiler's first session in a process, and the first call of each
        # compiled graph under it, cost up to hundreds of ms that land on whichever op runs
        # first.
        for mode in modes:
            details[mode.name] = measurement.profiled_step(mode, backward, dev, detail=True)
            advance()

        def profile_pair() -> None:
            """On the CPU one clocked step per mode (the modules' times, :mod:`.module_clock`),
            then one profiled step per mode, the order alternating from pair to pair (clocked
            first, so they follow timed steps as the timed steps do; measured the other way
            round, the module check's figures moved by under 4%)."""
            pair = len(runs[modes[0].name])
            order = modes if pair % 2 == 0 else modes[::-1]
            for mode in order if clocked_steps else ():
                with compile_counters[mode.name]:
                    clocked[mode.name].append(measurement.clocked_step(mode, backward, dev))
                advance()
            for mode in order:
                with compile_counters[mode.name]:
                    runs[mode.name].append(measurement.profiled_step(mode, backward, dev, detail=False))
                advance()

        with UtilizationSampler(dev) as sampler:
            started = time.perf_counter()
            index = 0
            while True:
                for mode in (modes if index % 2 == 0 else modes[::-1]):
                    with mode.context(), compile_counters[mode.name]:
                        sampler.mark(f"{mode.name} step {index + 1} start")
                        samples[mode.name].append(measurement.timed_step(mode, backward, dev))
                        advance()
                        sampler.mark(f"{mode.name} step {index + 1} end")
                index += 1
                # The profiled pairs are spread over the timed rounds (the k-th of P after
                # round k x planned / P), so they see the machine as the timed steps do: on
                # a shared CPU a module's share of the step moves with the load, and five
                # profiled steps in a row, after the timed ones, read it at one moment.
                if len(runs[modes[0].name]) < profiled_steps and (
                        index * profiled_steps >= (len(runs[modes[0].name]) + 1) * planned["timed"]):
                    profile_pair()
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
        while len(runs[modes[0].name]) < profiled_steps:  # "auto" stopped before the planned rounds
            profile_pair()
        step_medians = {name: statistics.median(_step_ms(samples, name)) for name in runs}
        corrections = assembly.correct_runs(runs, step_medians, devices.is_gpu(dev))
        assembly.use_clocked_times(runs, clocked, step_medians)
        per_round = assembly.per_round_totals(runs, step_medians)
        traces = {name: measurement.with_details(measurement.median_run(profiled), details[name])
                  for name, profiled in runs.items()}
        if finder_models:
            eager = find_opportunities(modes[0], finder_models, backward, dev, OPPORTUNITY_STEPS)
            fused = find_opportunities(modes[1], finder_models, backward, dev, OPPORTUNITY_STEPS,
                                       clock_keys=tuple(path for row in eager.rows for path in row.paths))
            report.opportunities = {"eager": eager.realized(fused), "fused": fused}
    for mode in modes:
        report.modes[mode.name] = assembly.mode_summary(mode.name, samples[mode.name], traces[mode.name], backward, dev)
        report.modes[mode.name].compiles = compile_counters[mode.name].count
    assembly.note_corrections(report, corrections)
    assembly.compare(report, traces, key_info)
    assembly.module_intervals(report, per_round)
    assembly.utilization(report, samples, sampler, traces, dev)
    assembly.fusion_ceiling(report, traces, dev)
    report.timeline = [event for mode in modes for event in traces[mode.name].trace.timeline]
    report.utilization_series = [vars(series) for series in sampler.series]
    report.utilization_marks = list(sampler.marks)
    report.notes += [f"unavailable: {reason}" for reason in sampler.unavailable]
    report.notes += [note for mode in modes for note in traces[mode.name].trace.notes]
    report.expert_load = expert_load.load
    if expert_load.models and not warmup:
        report.notes.append("expert load: not recorded: the fused mode's last warm-up step counts it, and warmup=0 "
                            "ran none (warmup=1 or more records it)")
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


def _device_of(target, inputs) -> torch.device:
    for value in ([*target.parameters()] if isinstance(target, nn.Module) else []) + output_tensors(inputs):
        return value.device
    return devices.default_device()


