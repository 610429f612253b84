"""The fusion-opportunity finder: where in a model unfused chains of memory-bound ops
cost time, and what a fused kernel would save there.

One step of the model runs under the profiler with *every* module labelled (so each op
belongs to the innermost module that ran it, forward, and through autograd's sequence
numbers, backward): first recorded in detail (shapes, so the cost model gives each op's
bytes), then recording times alone, which cost the profiler a tenth as much per op
(:mod:`.measurement`); the n-th op of a name, module and phase takes the n-th one's bytes.
Then, on each thread in time order:

- a *chain* is a run of consecutive top-level ops of one module and phase that are
  memory-bound: ATen ops that are neither compute (GEMMs, attention kernels:
  :func:`.ceiling.is_compute`) nor views (which move nothing: skipped, they neither join
  nor break a chain); a te_lab op, a compute op, or an op of another module or phase ends it.
  A chain of one op is no fusion; its time is counted apart (``single_ops_ms``);
- its time is its span on the thread, from its first op's start to its last op's end (the
  Python or autograd engine work between its ops, which a fused kernel removes too), less
  the profiler's cost per recorded op (:func:`.attribution.event_cost_us`);
- chains are grouped by module (layer indices written ``*``), module type, phase and op
  pattern into :class:`~.opportunity_table.Opportunity` rows, each with its bytes unfused
  and fused, the estimated fused time and gain (:mod:`.opportunity_table`'s formulas, at the
  bandwidth the fusion ceiling uses), and what would fuse it: the te_lab rule whose match
  covers the module (itself or the nearest module around it) and why it did not apply, or
  nothing.

The step's time outside compute ops is accounted for (:class:`Accounting`): chains, single
memory-bound ops, te_lab's ops, ops outside every module, views, and what lies between
ops, so a reader sees which share of the non-GEMM time the rows hold.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from te_lab import device as devices, distributed
from te_lab.modules import FusedModule
from te_lab.modules.lm_head_loss import installed_lm_head_loss
from te_lab.options import check_warmup
from te_lab.surgery import is_fused
from te_lab.surgery.rules import Match, Skip, rules

from . import measurement
from .attribution import VIEW_OPS
from .ceiling import is_compute
from .modes import Mode, model_mode
from .module_clock import ModuleClock
from .opportunity_table import (
    FUSED_BYTES_FORMULA,
    GAIN_FORMULA,
    ROOT_KEY,
    Accounting,
    Opportunities,
    Opportunity,
    ranked,
)

MIN_CHAIN_OPS = 2
# Profiled steps recording times, whose medians the rows take.
STEPS = 3
# Ops that move at most this many bytes time the launch a fused kernel still pays.
LAUNCH_BYTES = 4096
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def every_module(models: dict) -> dict:
    """Key -> module for every module of ``models`` (prefix -> model; a prefix ends with
    ``.`` where several models share a statement), the model itself as ``(model)``. What
    lies inside a fused twin is left out: the twin computes its children's math itself, and
    a hook on a projection child would send it back to the module's own GEMM
    (:func:`te_lab.modules.projection.routes_to_linear`), changing what is measured."""
    labels = {}
    for prefix, model in models.items():
        twins: list[str] = []
        for path, module in model.named_modules():
            if any(path.startswith(twin + ".") for twin in twins):
                continue
            if isinstance(module, FusedModule):
                twins.append(path)
            labels[prefix + path if path else (prefix.rstrip(".") or ROOT_KEY)] = module
    return labels


def pattern_of(path: str) -> str:
    """``model.layers.7.mlp`` -> ``model.layers.*.mlp``."""
    return _INDEX.sub("*", path)


def _memory_bound(name: str) -> bool:
    return name.startswith("aten::") and not is_compute(name) and name not in VIEW_OPS


def _moves_nothing(event) -> bool:
    """A view, or an op the cost model found to move no bytes (``.to()`` of a tensor
    already in that dtype, ``detach_``)."""
    return event.name in VIEW_OPS or (event.bytes_read == 0 and not event.bytes_written
                                      and event.name.startswith("aten::") and not is_compute(event.name))


def fused_bytes(chain: list) -> int:
    """:data:`.opportunity_table.FUSED_BYTES_FORMULA` over the chain's timeline events, at
    most what its ops move unfused."""
    produced: set = set()
    total = 0
    for index, event in enumerate(chain):
        for shape, size in zip(event.input_shapes, event.input_bytes):
            if index == 0 or tuple(shape) not in produced:
                total += size
        if event.input_shapes:
            produced.add(tuple(max(event.input_shapes, key=lambda shape: _numel(shape))))
    unfused = sum((e.bytes_read or 0) + (e.bytes_written or 0) for e in chain)
    # never more than the ops move unfused (a rule that counts an op's inputs in part: a top-k)
    return min(total + (chain[-1].bytes_written or 0), unfused)


def _numel(shape) -> int:
    count = 1
    for extent in shape:
        count *= extent
    return count


def launch_us(timeline: list, event_cost_us: float) -> float:
    """The median time of the step's memory-bound ops that move at most LAUNCH_BYTES
    (what a fused kernel still pays per call; ops the cost model cannot read, 0 bytes, left
    out), else of its fastest tenth of ops."""
    small = [e.duration_us for e in timeline if _memory_bound(e.name) and e.bytes_read
             and e.bytes_read + (e.bytes_written or 0) <= LAUNCH_BYTES]
    if not small:
        durations = sorted(e.duration_us for e in timeline)
        small = durations[:max(len(durations) // 10, 1)] if durations else [0.0]
    return max(statistics.median(small) - event_cost_us, 0.0)


def _chains(timeline: list, accounting: Accounting, event_cost_us: float) -> list[list]:
    """The step's chains (lists of timeline events), filling ``accounting``'s op times."""
    chains, current = [], []

    def close() -> None:
        nonlocal current
        own_ms = sum(max(e.duration_us - event_cost_us, 0.0) for e in current) / 1e3
        if len(current) >= MIN_CHAIN_OPS:
            chains.append(current)
            accounting.chain_ops_ms += own_ms
        else:
            accounting.single_ops_ms += own_ms
        current = []

    for event in sorted(timeline, key=lambda e: (e.lane, e.start_us)):
        own_us = max(event.duration_us - event_cost_us, 0.0)
        if _moves_nothing(event):
            accounting.views_ms += own_us / 1e3
            continue
        if is_compute(event.name):
            accounting.compute_ms += own_us / 1e3
            close()
            continue
        if event.name.startswith("te_lab::"):
            accounting.te_lab_ops_ms += own_us / 1e3
            close()
            continue
        if not event.path or event.phase == "optimizer":
            accounting.outside_modules_ms += own_us / 1e3
            close()
            continue
        if current and (current[0].path, current[0].phase, current[0].lane) != (event.path, event.phase, event.lane):
            close()
        current.append(event)
    close()
    return chains


def chain_ms(chain: list, event_cost_us: float) -> float:
    """A chain's span, less the profiler's cost per op of it."""
    span = chain[-1].start_us + chain[-1].duration_us - chain[0].start_us
    return max(span - event_cost_us * len(chain), 0.0) / 1e3


def _covering_rule(path: str, labels: dict, answers: dict) -> str:
    """What te_lab rule covers the module at ``path`` (the module or the nearest one around it)."""
    parts = path.split(".") if path != ROOT_KEY else []
    for end in range(len(parts), -1, -1):
        around = ".".join(parts[:end]) or ROOT_KEY
        module = labels.get(around)
        if module is None:
            continue
        if isinstance(module, FusedModule):
            aside = (", or the original's where the twin steps aside at these sizes (keep='faster')"
                     if module.measured_against_original else "")
            return (f"inside te_lab's fused {type(module).__name__} at {pattern_of(around)}: ops it leaves "
                    f"unfused{aside}")
        if installed_lm_head_loss(module) is not None and around == path:
            return f"inside te_lab's fused LM head + loss forward of {around}: ops it leaves unfused"
        key = (id(module), around == path)
        answer = answers.get(key)
        if answer is None:
            answer = answers[key] = _rule_answer(module, itself=around == path)
        if answer:
            where = "" if around == path else f" (at {around})"
            return answer + where
    return ""


def _rule_answer(module: nn.Module, itself: bool) -> str:
    """What the first rule that answers says of ``module``; for a module around the
    chain's (``itself`` False), rules that fuse only a part of it (the LM head + loss,
    which replaces the model's forward but covers its head alone) are passed over."""
    for rule in rules():
        try:
            result = rule.match(module)
        except Exception as error:  # noqa: BLE001 - a rule that cannot read this module does not cover it
            result = Skip(f"the rule raised {type(error).__name__}: {error}")
        if isinstance(result, Match) and result.replaces_forward and not itself:
            continue
        if isinstance(result, Skip):
            return f"rule {rule.name} did not apply: {result.reason}"
        if isinstance(result, Match):
            return f"rule {rule.name} matches (te_lab.fuse would fuse it)"
    return ""


def _step_rows(mode_name: str, trace, wall_ms: float, labels: dict, answers: dict,
               gbs: float) -> tuple[OrderedDict, Accounting]:
    """One profiled step's rows (by key) and accounting."""
    accounting = Accounting()
    cost = trace.event_cost_us
    accounting.step_ms = max(wall_ms - cost * trace.recorded_events / 1e3, 0.0)
    grouped: OrderedDict = OrderedDict()
    for chain in _chains(trace.timeline, accounting, cost):
        path = chain[0].path
        module = labels.get(path)
        key = (pattern_of(path), type(module).__name__ if module is not None else "", chain[0].phase,
               tuple(event.name for event in chain))
        row = grouped.get(key)
        if row is None:
            row = grouped[key] = Opportunity(mode_name, key[0], key[1], key[2], list(key[3]), bytes_unfused=0,
                                             bytes_fused=0, bandwidth_gbs=gbs,
                                             fused_by=_covering_rule(path, labels, answers))
        row.instances += 1
        row.time_ms += chain_ms(chain, cost)
        row.launches += len(chain)
        row.bytes_unfused += sum((e.bytes_read or 0) + (e.bytes_written or 0) for e in chain)
        row.bytes_fused += fused_bytes(chain)
        if path not in row.paths:
            row.paths.append(path)
    return grouped, accounting


def clocked_module_ms(mode: Mode, models: dict, keys: list, backward: bool, device: torch.device,
                      steps: int) -> dict:
    """Key -> [forward, backward] ms of each module at ``keys`` (of :func:`every_module`),
    whole (what is nested in it included), timed by hooks in ``steps`` steps without the
    profiler (:mod:`.module_clock`), medians: the profiler's cost per op, which differs from
    eager ATen ops to te_lab's, stays out of the comparison of a module before and after."""
    runs = []
    for _ in range(steps):
        with mode.context():
            present = every_module(models)
            with ModuleClock({key: present[key] for key in keys if key in present}) as clock:
                measurement.timed_step(mode, backward, device)
            runs.append(clock.take())
    return {key: [statistics.median(run[key][phase] for run in runs) for phase in (0, 1)]
            for key in keys if all(key in run for run in runs)}


def profiled_module_ms(timed: list, keys: list) -> dict:
    """On a GPU, where host clocks time launches rather than kernels: key -> [forward,
    backward] ms of each module at ``keys``, whole, from the profiled steps' kernel times
    (the regions nested in it added back), medians."""
    def whole(run, key: str, phase: int) -> float:
        return sum((region.forward_ms, region.backward_ms)[phase] for other, region in run.trace.regions.items()
                   if other == key or other.startswith(key + ".") or key == ROOT_KEY)
    return {key: [statistics.median(whole(run, key, phase) for run in timed) for phase in (0, 1)] for key in keys}


def find(mode: Mode, models: dict, backward: bool, device: torch.device, steps: int = STEPS,
         bandwidth: Optional[tuple[float, str]] = None, clock_keys: tuple = ()) -> Opportunities:
    """The opportunities of ``mode`` over ``models`` (prefix -> model), every module of
    which is labelled for it (see the module doc): one step recorded in detail, then
    ``steps`` recording times, each row's times (and the accounting's) the median over
    them; then the modules of the rows, and those at ``clock_keys`` (an earlier result's,
    to measure its realized gains against), are clocked in ``steps`` steps
    (:func:`clocked_module_ms`; on a GPU their kernel times come from the profiled steps,
    :func:`profiled_module_ms`)."""
    labelled = dataclasses.replace(mode, labels=lambda: every_module(models))
    with mode.context():
        labels = every_module(models)
    detail = measurement.profiled_step(labelled, backward, device, detail=True)
    timed = [measurement.with_details(measurement.profiled_step(labelled, backward, device, detail=False), detail)
             for _ in range(steps)]
    gbs, source = bandwidth or devices.fusion_bandwidth(device)
    result = Opportunities(mode.name, bandwidth_gbs=gbs, bandwidth_source=source,
                           formulas={"fused bytes": FUSED_BYTES_FORMULA, "gain": GAIN_FORMULA})
    result.launch_us = statistics.median(launch_us(run.trace.timeline, run.trace.event_cost_us) for run in timed)
    answers: dict = {}
    with mode.context():  # the rules' answers about the modules as the mode runs them
        per_step = [_step_rows(mode.name, run.trace, run.wall_ms, labels, answers, gbs) for run in timed]
    grouped = per_step[0][0]
    for key, row in grouped.items():
        found = [rows[key] for rows, _ in per_step if key in rows]
        row.time_ms = statistics.median(r.time_ms for r in found)
        row.fused_ms = row.bytes_fused / (gbs * 1e9) * 1e3 + row.instances * result.launch_us / 1e3
    result.accounting = Accounting(**{name.name: statistics.median(getattr(a, name.name) for _, a in per_step)
                                      for name in dataclasses.fields(Accounting)})
    result.rows = ranked(list(grouped.values()))
    keys = list(dict.fromkeys([*(path for row in result.rows for path in row.paths), *clock_keys]))
    result.module_ms = (profiled_module_ms(timed, keys) if devices.is_gpu(device) else
                        clocked_module_ms(mode, models, keys, backward, device, steps))
    return result


def opportunities(model: nn.Module, sample, *, backward: bool = True, mode: Optional[str] = None, warmup: int = 1,
                  steps: int = STEPS, against: Optional[Opportunities] = None, device=None) -> Opportunities:
    """Where ``model``'s step on ``sample`` (a tensor, a tuple of positional arguments or a
    dict of keyword arguments) runs unfused chains of memory-bound ops, ranked by the gain
    a fused kernel would estimate (see the module doc). ``mode``: ``"fused"`` (the default
    for a fused model: what fusion left), or ``"eager"`` (the default otherwise; a fused
    model then runs inside ``te_lab.unfused``). ``backward``: the step includes the
    gradients of its loss (the output's ``loss``, else the sum of its tensors), as
    :func:`te_lab.profile`'s does. ``warmup`` steps run first, unrecorded; the figures are
    medians over ``steps`` profiled steps. ``against``: an earlier result on the same model
    (before :func:`te_lab.fuse` ``(regions=...)``): its rows' modules are clocked too, so
    ``against.realized(result)`` says what fusing them realized."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"te_lab.opportunities: model must be a torch.nn.Module, got {type(model).__name__}")
    if sample is None:
        raise ValueError("te_lab.opportunities: sample is required (the model's inputs: a tensor, a tuple of "
                         "positional arguments or a dict of keyword arguments)")
    if mode not in (None, "eager", "fused"):
        raise ValueError(f"te_lab.opportunities: mode must be 'eager', 'fused' or None, got {mode!r}")
    check_warmup(warmup, "te_lab.opportunities")
    if against is not None and not isinstance(against, Opportunities):
        raise TypeError(f"te_lab.opportunities: against must be an earlier te_lab.opportunities result, got "
                        f"{type(against).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"te_lab.opportunities: steps must be a positive int, got {steps!r}")
    unwrapped = distributed.unwrap(model)
    name = mode or ("fused" if is_fused(unwrapped) else "eager")
    step = model_mode(unwrapped, sample, name)
    if backward and not step.leaves:
        raise ValueError("te_lab.opportunities: backward=True, but no parameter of the model requires grad and the "
                         "sample holds no floating-point tensor; pass backward=False to look at the forward only")
    dev = devices.resolve(device) if device is not None else next(
        (p.device for p in unwrapped.parameters()), devices.default_device())
    with torch.random.fork_rng(devices=[dev] if devices.is_gpu(dev) else [],
                               **({"device_type": dev.type} if devices.is_gpu(dev) else {})):
        with step.context():
            for _ in range(warmup):
                measurement.timed_step(step, backward, dev)
        clock_keys = () if against is None else tuple(path for row in against.rows for path in row.paths)
        return find(step, {"": unwrapped}, backward, dev, steps, clock_keys=clock_keys)
