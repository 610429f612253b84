"""ProfileReport: what :func:`te_lab.profile` measured, eager against fused, as pure data.

Every figure is a measurement or computed from measurements, and the derived ones carry
the formula they came from (``formulas``, ``Figure.formula``). Dataclasses only; a JSON
round trip (``to_json`` / ``from_json``) is lossless. The dashboard draws it
(``te_lab.show(report)``, ``te_lab.to_html(report, path)``); no profiler module imports
widgets or plotly.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Optional

from .expert_load import ExpertLoad
from .intervals import holds_one
from .opportunity_table import Opportunities, table_lines

MODES = ("eager", "fused")
OTHER_KEY = "(other)"  # the row of step time no module accounts for


@dataclass
class ModeSummary:
    """One mode's step: medians over the timed (unprofiled) steps, and what the
    profiled steps showed (launches, peak memory). ``per_event_ms`` is what each event the
    profiler recorded cost a profiled step (taken off the module it landed in, on the
    CPU), and ``attribution_scale`` the factor a profiled step's times were then
    multiplied by so they add up to the unprofiled step, each the median over the profiled
    steps, which are corrected one by one (:mod:`te_lab.profiler.correction`; on the CPU
    the modules' times come from clocked steps instead); ``compiles`` counts compilation
    events during the mode's timed and profiled steps (:mod:`te_lab.profiler.compiles`)."""

    mode: str
    step_ms: list = field(default_factory=list)
    forward_ms: list = field(default_factory=list)
    backward_ms: list = field(default_factory=list)
    step_median_ms: float = 0.0
    step_spread_ms: float = 0.0  # half the interquartile range
    forward_median_ms: float = 0.0
    backward_median_ms: Optional[float] = None
    profiled_step_ms: float = 0.0
    launches: int = 0
    peak_memory_bytes: Optional[int] = None
    peak_memory_source: str = ""
    effective_parallelism: Optional[float] = None
    communication_ms: Optional[float] = None  # profiled step; None where it ran no collective
    collectives: int = 0
    attribution_scale: float = 1.0
    per_event_ms: float = 0.0
    compiles: int = 0

    @property
    def profiled_ratio(self) -> Optional[float]:
        """Profiled step wall time / unprofiled step median (1.0: the profiler cost nothing);
        None where either was not measured."""
        if self.step_median_ms <= 0 or self.profiled_step_ms <= 0:
            return None
        return self.profiled_step_ms / self.step_median_ms


@dataclass
class Region:
    """One module path (or op kind) in one mode, from the profiled step."""

    forward_ms: float = 0.0
    backward_ms: float = 0.0
    launches: int = 0
    bytes_moved: int = 0
    flops: int = 0

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def gbs(self) -> Optional[float]:
        return self.bytes_moved / (self.total_ms * 1e-3) / 1e9 if self.total_ms > 0 else None

    @property
    def gflops(self) -> Optional[float]:
        return self.flops / (self.total_ms * 1e-3) / 1e9 if self.total_ms > 0 else None


@dataclass
class Comparison:
    """A module path or an op kind, eager against fused."""

    key: str
    kind: str
    module_type: str = ""
    eager: Region = field(default_factory=Region)
    fused: Region = field(default_factory=Region)
    verification: str = ""  # the fusion probe's errors, when the profiled model was fused with a probe
    # 95% interval of the speedup over the paired profiled steps (te_lab.profiler.intervals); None where
    # there is none (an op kind, a row that is empty in a mode, "(other)")
    speedup_low: Optional[float] = None
    speedup_high: Optional[float] = None

    @property
    def speedup(self) -> Optional[float]:
        return self.eager.total_ms / self.fused.total_ms if self.fused.total_ms > 0 else None

    @property
    def distinguishable(self) -> Optional[bool]:
        """Whether the speedup's interval excludes 1.0; None without an interval."""
        if self.speedup_low is None or self.speedup_high is None:
            return None
        return not holds_one(self.speedup_low, self.speedup_high)

    @property
    def time_saved_ms(self) -> float:
        return self.eager.total_ms - self.fused.total_ms


@dataclass
class Totals:
    speedup: float
    time_saved_ms: float
    launches_saved: int
    bytes_saved_estimate: int
    fused_share: float  # of the fused profiled step, the share of time inside fused ops
    step_time_change: float = 0.0  # fused step median / eager step median - 1 (negative: faster)
    traffic_change: Optional[float] = None  # fused bytes moved / eager bytes moved - 1; None without bytes
    # 95% bootstrap interval of ``speedup`` over the paired timed steps (te_lab.profiler.intervals)
    speedup_low: Optional[float] = None
    speedup_high: Optional[float] = None

    @property
    def step_time_change_interval(self) -> Optional[tuple[float, float]]:
        """The interval of ``step_time_change`` (fused / eager - 1), from the speedup's."""
        if self.speedup_low is None or self.speedup_high is None:
            return None
        return 1 / self.speedup_high - 1, 1 / self.speedup_low - 1

    @property
    def measurable(self) -> Optional[bool]:
        """Whether the step time changed measurably: the speedup's interval excludes 1.0."""
        if self.speedup_low is None or self.speedup_high is None:
            return None
        return not holds_one(self.speedup_low, self.speedup_high)


@dataclass
class RooflinePoint:
    mode: str
    name: str
    arithmetic_intensity: Optional[float]  # FLOP / byte
    achieved_gflops: Optional[float]
    achieved_gbs: Optional[float]
    time_ms: float


@dataclass
class Ceilings:
    memory_bandwidth_gbs: float
    fp32_tflops: Optional[float]
    bf16_tflops: Optional[float]
    source: str


@dataclass
class ModeSplit:
    """One mode's step split into compute (GEMMs and attention kernels' products, which
    fusion does not speed up) and the rest (:mod:`te_lab.profiler.ceiling`)."""

    compute_ms: float
    rest_ms: float
    compute_bytes: int
    rest_bytes: int

    @property
    def compute_share(self) -> float:
        total = self.compute_ms + self.rest_ms
        return self.compute_ms / total if total > 0 else 0.0


@dataclass
class FusionCeiling:
    """How fast the step could get if fusion did all it can: compute as the faster mode ran
    it, the rest at its bytes over the bandwidth (:mod:`te_lab.profiler.ceiling`)."""

    eager_step_ms: float
    fused_step_ms: float
    eager: ModeSplit
    fused: ModeSplit
    compute_ms: float  # the faster of the two modes' compute
    rest_bytes: int  # the fewer of the two modes' bytes outside compute
    rest_floor_ms: float  # rest_bytes at the bandwidth
    ceiling_step_ms: float
    bandwidth_gbs: float
    bandwidth_source: str

    @classmethod
    def from_dict(cls, data: dict) -> "FusionCeiling":
        data = dict(data)
        data["eager"], data["fused"] = ModeSplit(**data["eager"]), ModeSplit(**data["fused"])
        return cls(**data)

    @property
    def ceiling_speedup(self) -> float:
        return self.eager_step_ms / self.ceiling_step_ms if self.ceiling_step_ms > 0 else float("nan")

    @property
    def available_gain(self) -> float:
        """What fusion could buy at most: ceiling speedup - 1."""
        return self.ceiling_speedup - 1

    @property
    def achieved_gain(self) -> float:
        """What te_lab bought: speedup - 1 (negative: slower)."""
        return self.eager_step_ms / self.fused_step_ms - 1 if self.fused_step_ms > 0 else float("nan")

    @property
    def share_of_available(self) -> Optional[float]:
        """te_lab's gain / the available gain; None where fusion can buy nothing here."""
        return self.achieved_gain / self.available_gain if self.available_gain > 0 else None

    def verdict(self) -> str:
        """One sentence that tells "fusion cannot help here" from "te_lab is not there yet"."""
        got, available = self.achieved_gain, self.available_gain
        compute = f"GEMMs and attention are {100 * self.eager.compute_share:.0f}% of the eager step"
        if available < SMALL_AVAILABLE_GAIN:
            return (f"fusion can buy at most {available:+.2f} here ({compute}): fusion cannot help this model "
                    f"much on this device; te_lab got {got:+.2f}")
        share = self.share_of_available
        standing = ("te_lab is near the ceiling" if share >= NEAR_CEILING else
                    "te_lab's fused step is slower than eager here" if got < 0 else
                    "te_lab's fusion is not good enough yet: the rest of the gain is left on the table")
        gemms = self.eager.compute_ms - self.fused.compute_ms
        faster_gemms = (f"; {gemms:.3g} ms of it from the fused step's faster GEMMs and attention"
                        if got > 0 and gemms > GEMM_CHANGE * self.eager.compute_ms else "")
        return (f"te_lab got {got:.2f} of the {available:.2f} available ({100 * share:.0f}%; {compute}"
                f"{faster_gemms}): {standing}")


# Below this available gain (ceiling speedup 1.03x) fusion cannot help a model measurably.
SMALL_AVAILABLE_GAIN = 0.03
# From this share of the available gain on, te_lab is "near the ceiling".
NEAR_CEILING = 0.7
# A change of the compute time by more than this fraction between the modes is named in the
# verdict (te_lab's linear op may run the projections on another GEMM library).
GEMM_CHANGE = 0.03


@dataclass
class TimelineEvent:
    mode: str
    name: str
    start_us: float  # from the profiled step's first op
    duration_us: float
    lane: str  # thread (CPU) or stream (GPU)
    path: str
    phase: str  # "forward" | "backward" | "optimizer"
    input_shapes: list = field(default_factory=list)  # of the op's tensor inputs, as recorded
    # From a step recorded in detail (the cost model; None where no shapes were recorded): the
    # op's bytes read and written, and each tensor input's bytes, in input_shapes' order.
    bytes_read: Optional[int] = None
    bytes_written: Optional[int] = None
    input_bytes: list = field(default_factory=list)


@dataclass
class Figure:
    """A utilization figure with the formula it came from."""

    name: str
    mode: str
    value: Optional[float]
    unit: str
    formula: str
    note: str = ""


@dataclass
class Environment:
    device: str
    device_name: str
    torch_version: str
    triton_version: Optional[str]
    threads: int
    dtype: str
    input_shapes: list = field(default_factory=list)
    target: str = ""
    rank: Optional[int] = None  # in a torch.distributed run
    world_size: int = 1


@dataclass
class ProfileReport:
    environment: Environment
    modes: dict = field(default_factory=dict)  # mode -> ModeSummary
    modules: list = field(default_factory=list)  # Comparison per module path, plus "(other)"
    kinds: list = field(default_factory=list)  # Comparison per op kind
    totals: Optional[Totals] = None
    roofline: list = field(default_factory=list)
    ceilings: Optional[Ceilings] = None
    timeline: list = field(default_factory=list)
    utilization: list = field(default_factory=list)  # Figure
    utilization_series: list = field(default_factory=list)  # sampler series, as dicts
    utilization_marks: list = field(default_factory=list)  # (label, seconds)
    formulas: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    # Tokens per expert of every fused MoE block in one fused step (te_lab.profiler.expert_load);
    # None where the profiled models hold none (a trace file, te_lab.open_trace, never has it)
    expert_load: Optional[ExpertLoad] = None
    # What fusion could buy at most here, and te_lab's share of it (te_lab.profiler.ceiling);
    # None where the report has no step times (a trace file)
    ceiling: Optional[FusionCeiling] = None
    # Mode -> the fusion-opportunity finder's result (te_lab.profiler.opportunities): the eager
    # step's rows with the gains the fused step realized, and what the fused step left
    opportunities: Optional[dict] = None

    # ---- views ----------------------------------------------------------------------

    def headline(self) -> list[tuple[str, str]]:
        """The figures a reader wants first, as ``(title, value)``: step time change and
        memory traffic change, eager against fused, then launches saved."""
        totals = self.totals
        if totals is None:
            return [("step time", "-"), ("memory traffic (estimate)", "-"), ("launches saved", "-"),
                ("fusion ceiling", "-")]
        eager, fused = self.modes["eager"], self.modes["fused"]
        traffic = "-" if totals.traffic_change is None else _change(totals.traffic_change)
        return [
            ("step time", step_time_headline(totals, eager.step_median_ms, fused.step_median_ms)),
            ("memory traffic (estimate)", f"{traffic} ({_mib(totals.bytes_saved_estimate)} MiB saved)"),
            ("launches saved", f"{totals.launches_saved} ({eager.launches} -> {fused.launches})"),
            ("fusion ceiling", ceiling_headline(self.ceiling)),
        ]

    def summary(self) -> str:
        eager, fused = self.modes["eager"], self.modes["fused"]
        env = self.environment
        rank = "" if env.rank is None else f", rank {env.rank} of {env.world_size}"
        lines = [f"te_lab.profile: {env.target} on {env.device_name} ({env.device}, {env.threads} threads, "
                 f"{env.dtype}{rank}), {len(eager.step_ms)} interleaved steps per mode; [low, high]: 95% interval"]
        lines += _table([(f"{title}:", value) for title, value in self.headline()])
        lines.append("")
        header = ("", "eager", "fused", "")
        rows = [
            ("step ms (median ± spread)", f"{eager.step_median_ms:.3f} ± {eager.step_spread_ms:.3f}",
             f"{fused.step_median_ms:.3f} ± {fused.step_spread_ms:.3f}",
             f"speedup {self.totals.speedup:.3f}x {_interval(self.totals.speedup_low, self.totals.speedup_high)}"
             if self.totals else ""),
            ("forward / backward ms", _pair(eager), _pair(fused), ""),
            ("ops launched (profiled step)", str(eager.launches), str(fused.launches),
             f"saved {self.totals.launches_saved}" if self.totals else ""),
            ("peak memory MiB", _mib(eager.peak_memory_bytes), _mib(fused.peak_memory_bytes), eager.peak_memory_source),
            ("effective parallelism", _num(eager.effective_parallelism), _num(fused.effective_parallelism),
             f"of {env.threads} threads"),
            ("profiled / unprofiled step", _ratio(eager.profiled_ratio), _ratio(fused.profiled_ratio),
             "module times rescaled to the unprofiled step"),
            ("compiles in timed or profiled steps", str(eager.compiles), str(fused.compiles), "expected 0"),
        ]
        if self.ceiling is not None:
            split = self.ceiling
            rows += [
                ("compute ms (GEMMs, attention)", f"{split.eager.compute_ms:.3f}", f"{split.fused.compute_ms:.3f}",
                 f"{100 * split.eager.compute_share:.0f}% / {100 * split.fused.compute_share:.0f}% of the step"),
                ("rest ms (MiB moved)", f"{split.eager.rest_ms:.3f} ({_mib(split.eager.rest_bytes)})",
                 f"{split.fused.rest_ms:.3f} ({_mib(split.fused.rest_bytes)})",
                 f"ceiling {split.ceiling_step_ms:.3f} ms: rest at {split.bandwidth_gbs:.3g} GB/s "
                 f"({split.bandwidth_source})"),
            ]
        if eager.communication_ms is not None or fused.communication_ms is not None:
            rows.append(("communication ms (profiled step)", _num(eager.communication_ms, 3),
                         _num(fused.communication_ms, 3), f"collectives {eager.collectives}/{fused.collectives}"))
        if self.totals:
            rows.append(("time in fused ops", "", f"{100 * self.totals.fused_share:.0f}%", ""))
        lines += _table([header] + rows)
        lines.append("")
        lines += _table([("kind", "eager ms", "fused ms", "speedup", "launches e/f")] + [
            (c.key, f"{c.eager.total_ms:.3f}", f"{c.fused.total_ms:.3f}", _ratio(c.speedup),
             f"{c.eager.launches}/{c.fused.launches}") for c in self.kinds])
        lines.append("")
        lines += _table([("module", "eager ms", "fused ms", "speedup [95% interval]", "")] + [
            (c.key, f"{c.eager.total_ms:.3f}", f"{c.fused.total_ms:.3f}",
             f"{_ratio(c.speedup)} {_interval(c.speedup_low, c.speedup_high)}".strip(),
             "no measurable difference" if c.distinguishable is False else "") for c in self.modules])
        if self.expert_load is not None:
            lines += ["", "expert load: tokens per expert in one fused step's forward; imbalance: the busiest "
                          "expert's tokens / the mean per expert"]
            lines += _table([("MoE layer", "experts", "routed", "busiest expert", "imbalance")] + [
                (layer.layer, str(len(layer.tokens_per_expert)), str(layer.routed),
                 f"{max(range(len(layer.tokens_per_expert)), key=layer.tokens_per_expert.__getitem__)} "
                 f"({max(layer.tokens_per_expert)} tokens)", _ratio(layer.imbalance))
                for layer in self.expert_load.layers] + [("overall", "", "", "", _ratio(self.expert_load.imbalance))])
        lines += self.notes
        return "\n".join(lines)

    def opportunity_lines(self, top: int = 10) -> list[str]:
        """The opportunity finder's ``top`` rows per mode: what the fused step left, and the
        eager step's with the gains fusing realized (``te-lab profile --opportunities``)."""
        if not self.opportunities:
            return ["fusion opportunities: not looked for (te_lab.profile(..., opportunities=False), or a target "
                    "that is not a model)"]
        lines = []
        for mode, title in (("fused", "what fusion left (fused step)"), ("eager", "eager step, realized by fusing")):
            found = self.opportunities.get(mode)
            if found is not None:
                lines += ["", f"fusion opportunities, {title}: {len(found.rows)} chain pattern(s), "
                              f"{found.chains_ms:.3f} ms, estimated gain {found.estimated_gain_ms:.3f} ms"]
                lines += table_lines(found.rows, top)
        return lines

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
                c.key, c.kind, f"{c.eager.total_ms:.3f}", f"{c.fused.total_ms:.3f}", _ratio(c.speedup),
                c.eager.launches, c.fused.launches)) + "</tr>"
            for c in self.modules)
        head = "".join(f"<th>{h}</th>" for h in ("module", "kind", "eager ms", "fused ms", "speedup", "eager launches",
                                                   "fused launches"))
        summary = "<br>".join(html.escape(line) for line in self.summary().splitlines()[:8])
        return (f'<div class="te-lab-profile"><pre>{summary}</pre><table><thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table></div>")

    def save(self, path) -> pathlib.Path:
        """Write the JSON to ``path`` and return where it went (:meth:`path_for`)."""
        target = self.path_for(path)
        target.write_text(self.to_json(indent=1))
        return target

    def path_for(self, path) -> pathlib.Path:
        """Where this report's file named ``path`` goes: ``path`` itself, or in a distributed
        run the rank before the suffix (``report.rank0.json``), so ranks never overwrite
        each other."""
        path = pathlib.Path(path)
        rank = self.environment.rank
        return path if rank is None else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")

    # ---- data -----------------------------------------------------------------------

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **dumps_options) -> str:
        return json.dumps(self.to_dict(), **dumps_options)

    @classmethod
    def from_dict(cls, data: dict) -> "ProfileReport":
        def comparison(entry: dict) -> Comparison:
            return Comparison(entry["key"], entry["kind"], entry.get("module_type", ""),
                              Region(**entry["eager"]), Region(**entry["fused"]), entry.get("verification", ""),
                              entry.get("speedup_low"), entry.get("speedup_high"))

        data = dict(data)
        data["environment"] = Environment(**data["environment"])
        data["modes"] = {mode: ModeSummary(**summary) for mode, summary in data["modes"].items()}
        data["modules"] = [comparison(c) for c in data["modules"]]
        data["kinds"] = [comparison(c) for c in data["kinds"]]
        data["totals"] = None if data.get("totals") is None else Totals(**data["totals"])
        data["roofline"] = [RooflinePoint(**p) for p in data["roofline"]]
        data["ceilings"] = None if data.get("ceilings") is None else Ceilings(**data["ceilings"])
        data["timeline"] = [TimelineEvent(**e) for e in data["timeline"]]
        data["utilization"] = [Figure(**f) for f in data["utilization"]]
        data["utilization_marks"] = [tuple(mark) for mark in data.get("utilization_marks", [])]
        data["expert_load"] = None if data.get("expert_load") is None else ExpertLoad.from_dict(data["expert_load"])
        data["ceiling"] = None if data.get("ceiling") is None else FusionCeiling.from_dict(data["ceiling"])
        data["opportunities"] = None if data.get("opportunities") is None else {
            mode: Opportunities.from_dict(found) for mode, found in data["opportunities"].items()}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "ProfileReport":
        return cls.from_dict(json.loads(text))


def _pair(mode: ModeSummary) -> str:
    backward = "-" if mode.backward_median_ms is None else f"{mode.backward_median_ms:.3f}"
    return f"{mode.forward_median_ms:.3f} / {backward}"


def _mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _num(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def _interval(low: Optional[float], high: Optional[float]) -> str:
    return "" if low is None or high is None else f"[{low:.2f}, {high:.2f}]"


def ceiling_headline(ceiling: Optional[FusionCeiling]) -> str:
    """The fusion ceiling card: the most fusion could buy and te_lab's share of it."""
    if ceiling is None:
        return "-"
    return f"{_ratio(ceiling.ceiling_speedup)} at most: {ceiling.verdict()}"


def step_time_headline(totals: Totals, eager_ms: float, fused_ms: float) -> str:
    """The step time card: the change with its 95% interval, or "no measurable
    difference" when the speedup's interval holds 1.0."""
    timings = f"{eager_ms:.3f} -> {fused_ms:.3f} ms, {_ratio(totals.speedup)}"
    change = totals.step_time_change_interval
    if change is None:
        return f"{_change(totals.step_time_change)} ({timings})"
    interval = f"[{_change(change[0])}, {_change(change[1])}]"
    if not totals.measurable:
        return f"no measurable difference: {_change(totals.step_time_change)} {interval} ({timings})"
    return f"{_change(totals.step_time_change)} {interval} ({timings})"


def _change(fraction: float) -> str:
    """A relative change as a signed percentage: -0.123 -> "-12.3%"."""
    return "-" if math.isnan(fraction) else f"{100 * fraction:+.1f}%"


def _table(rows: list) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
