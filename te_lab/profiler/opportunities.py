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
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from te_lab import device as devices, distributed
from te_lab.modules import FusedModule
from te_lab.options import check_warmup
from te_lab.surgery import is_fused
from te_lab.surgery.rules import Match, Skip, rules

from . import measurement
from .attribution import VIEW_OPS
from .ceiling import is_compute
from .modes import Mode, model_mode
from .opportunity_table import FUSED_BYTES_FORMULA, GAIN_FORMULA, Opportunity, ranked, table_lines

MIN_CHAIN_OPS = 2
# Profiled steps recording times, whose medians the rows take.
STEPS = 3
# Ops that move at most this many bytes time the launch a fused kernel still pays.
LAUNCH_BYTES = 4096
ROOT_KEY = "(model)"
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


@dataclass
class Accounting:
    """Where the finder's step spent its time outside compute ops (ms)."""

    step_ms: float = 0.0  # the profiled step's wall time, the profiler's cost per op taken off
    compute_ms: float = 0.0  # GEMMs and attention kernels' ops
    chain_ops_ms: float = 0.0  # the chains' ops' own time (the rows' spans hold the Python between them too)
    single_ops_ms: float = 0.0  # memory-bound ops with no memory-bound neighbour in their module
    te_lab_ops_ms: float = 0.0
    outside_modules_ms: float = 0.0  # memory-bound ops no module ran (the caller's loss, gradient accumulation)
    views_ms: float = 0.0

    @property
    def non_compute_ms(self) -> float:
        return max(self.step_ms - self.compute_ms, 0.0)

    @property
    def between_ops_ms(self) -> float:
        """What the step spent outside every op counted above (Python, the autograd engine)."""
        return max(self.non_compute_ms - self.chain_ops_ms - self.single_ops_ms - self.te_lab_ops_ms
                   - self.outside_modules_ms - self.views_ms, 0.0)


@dataclass
class Opportunities:
    """The finder's result for one mode of one model (see the module doc)."""

    mode: str
    rows: list = field(default_factory=list)  # Opportunity, ranked
    accounting: Accounting = field(default_factory=Accounting)
    bandwidth_gbs: float = 0.0
    bandwidth_source: str = ""
    launch_us: float = 0.0
    formulas: dict = field(default_factory=dict)
    # Module path -> [forward, backward] ms, its own time in the finder's step (wall time;
    # the modules nested in it left out), from which realized gains are measured.
    module_ms: dict = field(default_factory=dict)

    def top(self, count: int = 10) -> list[Opportunity]:
        return self.rows[:count]

    @property
    def estimated_gain_ms(self) -> float:
        return sum(row.estimated_gain_ms or 0.0 for row in self.rows)

    @property
    def chains_ms(self) -> float:
        return sum(row.time_ms for row in self.rows)

    def summary(self, top: int = 10) -> str:
        a = self.accounting
        lines = [f"fusion opportunities ({self.mode} step {a.step_ms:.2f} ms, {a.compute_ms:.2f} ms of it GEMMs and "
                 f"attention): {len(self.rows)} unfused chain pattern(s), {self.chains_ms:.2f} ms, estimated gain "
                 f"{self.estimated_gain_ms:.2f} ms at {self.bandwidth_gbs:.0f} GB/s ({self.bandwidth_source}) and "
                 f"{self.launch_us:.1f} us per launch",
                 f"  outside compute: chains' ops {a.chain_ops_ms:.2f} ms, single ops {a.single_ops_ms:.2f}, "
                 f"te_lab ops {a.te_lab_ops_ms:.2f}, outside modules {a.outside_modules_ms:.2f}, "
                 f"views {a.views_ms:.2f}, between ops {a.between_ops_ms:.2f} (of {a.non_compute_ms:.2f} ms)"]
        return "\n".join(lines + table_lines(self.rows, top))

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def inclusive_ms(self, path: str, phase: str) -> float:
        """The ``phase`` time of the module at ``path`` with everything nested in it (what a
        compiled region replaces)."""
        index = 1 if phase == "backward" else 0
        return sum(times[index] for key, times in self.module_ms.items() if key == path or key.startswith(path + "."))

    def realized(self, after: "Opportunities") -> "Opportunities":
        """A copy of these rows with ``realized_gain_ms``: what each row's modules saved in
        ``after`` (a later step of the same model, with regions or twins in place), the
        modules' times with everything nested in them, before less after. A module's saving
        in a phase is shared among its rows of that phase by their estimated gains; a row
        whose realized gain is outside +-30% of its estimate says why in its note."""
        copy = Opportunities.from_dict(self.to_dict())
        by_modules: dict = {}
        for row in copy.rows:
            by_modules.setdefault((tuple(sorted(row.paths)), row.phase), []).append(row)
        for (paths, phase), rows in by_modules.items():
            before = sum(self.inclusive_ms(path, phase) for path in paths)
            now = sum(after.inclusive_ms(path, phase) for path in paths)
            estimated = sum(row.estimated_gain_ms or 0.0 for row in rows)
            for row in rows:
                share = (row.estimated_gain_ms or 0.0) / estimated if estimated > 0 else 1 / len(rows)
                row.realized_gain_ms = (before - now) * share
                row.note = _realized_note(row, before, now)
        return copy

    @classmethod
    def from_dict(cls, data: dict) -> "Opportunities":
        data = dict(data)
        data["rows"] = [Opportunity.from_dict(row) for row in data["rows"]]
        data["accounting"] = Accounting(**data["accounting"])
        return cls(**data)


REALIZED_SLACK = 0.3


def _realized_note(row: Opportunity, before_ms: float, after_ms: float) -> str:
    estimated = row.estimated_gain_ms or 0.0
    realized = row.realized_gain_ms or 0.0
    text = f"realized {realized:.3g} ms of the estimated {estimated:.3g} ms"
    if estimated > 0 and abs(realized - estimated) <= REALIZED_SLACK * estimated:
        return text + " (within 30%)"
    if after_ms >= before_ms:
        return text + (f": the module ran {after_ms:.3g} ms after against {before_ms:.3g} ms before, no faster "
                       f"(not fused, or its fused code is no quicker here)")
    bound = row.fused_ms or 0.0
    if realized > estimated:
        return text + (f": the modules saved more than the chain's time, {after_ms:.3g} ms after against "
                       f"{before_ms:.3g} ms before: the region also removed other work of theirs (single ops, the "
                       f"Python and autograd engine between ops, a slower eager kernel of the same math)")
    return text + (f": the modules now take {after_ms:.3g} ms where the estimate's bound is {bound:.3g} ms for the "
                   f"chain alone; the bound costs only the bytes at the copy bandwidth and one launch, while compiled "
                   f"code also pays its math (exp, tanh, division), its own launches and the other ops the modules "
                   f"hold")


def every_module(models: dict) -> dict:
    """Key -> module for every module of ``models`` (prefix -> model; a prefix ends with
    ``.`` where several models share a statement), the model itself as ``(model)``."""
    labels = {}
    for prefix, model in models.items():
        for path, module in model.named_modules():
            labels[prefix + path if path else (prefix.rstrip(".") or ROOT_KEY)] = module
    return labels


def pattern_of(path: str) -> str:
    """``model.layers.7.mlp`` -> ``model.layers.*.mlp``."""
    return _INDEX.sub("*", path)


def _memory_bound(name: str) -> bool:
    return name.startswith("aten::") and not is_compute(name) and name not in VIEW_OPS


def fused_bytes(chain: list) -> int:
    """:data:`.opportunity_table.FUSED_BYTES_FORMULA` over the chain's timeline events."""
    produced: set = set()
    total = 0
    for index, event in enumerate(chain):
        for shape, size in zip(event.input_shapes, event.input_bytes):
            if index == 0 or tuple(shape) not in produced:
                total += size
        if event.input_shapes:
            produced.add(tuple(max(event.input_shapes, key=lambda shape: _numel(shape))))
    return total + (chain[-1].bytes_written or 0)


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
        if event.name in VIEW_OPS:
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
            return f"inside te_lab's fused {type(module).__name__} at {around}: ops it leaves unfused"
        answer = answers.get(id(module))
        if answer is None:
            answer = answers[id(module)] = _rule_answer(module)
        if answer:
            where = "" if around == path else f" (at {around})"
            return answer + where
    return ""


def _rule_answer(module: nn.Module) -> str:
    for rule in rules():
        try:
            result = rule.match(module)
        except Exception as error:  # noqa: BLE001 - a rule that cannot read this module does not cover it
            result = Skip(f"the rule raised {type(error).__name__}: {error}")
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


def find(mode: Mode, models: dict, backward: bool, device: torch.device, steps: int = STEPS,
         bandwidth: Optional[tuple[float, str]] = None) -> Opportunities:
    """The opportunities of ``mode`` over ``models`` (prefix -> model), every module of
    which is labelled for it (see the module doc): one step recorded in detail, then
    ``steps`` recording times, each row's times (and the accounting's, and each module's)
    the median over them."""
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
    per_step = [_step_rows(mode.name, run.trace, run.wall_ms, labels, answers, gbs) for run in timed]
    grouped = per_step[0][0]
    for key, row in grouped.items():
        found = [rows[key] for rows, _ in per_step if key in rows]
        row.time_ms = statistics.median(r.time_ms for r in found)
        row.fused_ms = row.bytes_fused / (gbs * 1e9) * 1e3 + row.instances * result.launch_us / 1e3
    result.accounting = Accounting(**{name.name: statistics.median(getattr(a, name.name) for _, a in per_step)
                                      for name in dataclasses.fields(Accounting)})
    result.rows = ranked(list(grouped.values()))
    result.module_ms = {key: [statistics.median(run.trace.regions[key].forward_ms for run in timed
                                                if key in run.trace.regions),
                              statistics.median(run.trace.regions[key].backward_ms for run in timed
                                                if key in run.trace.regions)]
                        for key in timed[0].trace.regions}
    return result


def opportunities(model: nn.Module, sample, *, backward: bool = True, mode: Optional[str] = None, warmup: int = 1,
                  steps: int = STEPS, device=None) -> Opportunities:
    """Where ``model``'s step on ``sample`` (a tensor, a tuple of positional arguments or a
    dict of keyword arguments) runs unfused chains of memory-bound ops, ranked by the gain
    a fused kernel would estimate (see the module doc). ``mode``: ``"fused"`` (the default
    for a fused model: what fusion left), or ``"eager"`` (the default otherwise; a fused
    model then runs inside ``te_lab.unfused``). ``backward``: the step includes the
    gradients of its loss (the output's ``loss``, else the sum of its tensors), as
    :func:`te_lab.profile`'s does. ``warmup`` steps run first, unrecorded; the figures are
    medians over ``steps`` profiled steps."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"te_lab.opportunities: model must be a torch.nn.Module, got {type(model).__name__}")
    if sample is None:
        raise ValueError("te_lab.opportunities: sample is required (the model's inputs: a tensor, a tuple of "
                         "positional arguments or a dict of keyword arguments)")
    if mode not in (None, "eager", "fused"):
        raise ValueError(f"te_lab.opportunities: mode must be 'eager', 'fused' or None, got {mode!r}")
    check_warmup(warmup, "te_lab.opportunities")
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
        return find(step, {"": unwrapped}, backward, dev, steps)
