"""Plotly figures drawn from a :class:`~te_lab.profiler.report.ProfileReport`.

Pure functions: each takes a report and returns a fresh ``go.Figure`` (or plain data,
for the gains table and the headline cards); nothing here measures or keeps state. The
dashboard wraps these figures in ``FigureWidget`` s and wires their clicks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from te_lab.profiler.report import MODES, OTHER_KEY, Comparison, ProfileReport, Region

GROUP_BY = ("kind", "module_type", "module")  # op kind / module type / module instance (Comparison.key)
PHASES = ("both", "forward", "backward")

MODE_COLORS = {"eager": "#7f7f7f", "fused": "#1f77b4"}
PHASE_COLORS = {"forward": "#2ca02c", "backward": "#d62728", "optimizer": "#9467bd"}

_PHASE_MS: dict[str, Callable[[Region], float]] = {
    "both": lambda region: region.total_ms,
    "forward": lambda region: region.forward_ms,
    "backward": lambda region: region.backward_ms,
}
_STEP_MARK = re.compile(r"^(?P<step>(?P<mode>\S+) step \d+) (?P<edge>start|end)$")


@dataclass
class GainRow:
    """One bar pair of the gains figure: a kind, a module type or one module, eager against fused."""

    label: str
    eager_ms: float
    fused_ms: float
    speedup: float | None
    time_saved_ms: float
    keys: list[str]  # the module keys (Comparison.key) merged into this row
    speedup_low: float | None = None  # the speedup's 95% interval, where the report has one for the row
    speedup_high: float | None = None

    @property
    def distinguishable(self) -> bool | None:
        """Whether the interval excludes 1.0; None without one."""
        if self.speedup_low is None or self.speedup_high is None:
            return None
        return not (self.speedup_low <= 1.0 <= self.speedup_high)


# ---- the fusion ceiling -------------------------------------------------------------------

CEILING_COLORS = {"compute": "#bcbd22", "rest": "#17becf"}


def ceiling_figure(report: ProfileReport) -> go.Figure:
    """Each mode's step split into compute (GEMMs, attention) and the rest, and the fusion
    ceiling below them: compute as the faster mode ran it, the rest at its bytes over the
    bandwidth. An empty figure that says why where the report has no ceiling."""
    ceiling = report.ceiling
    figure = go.Figure()
    if ceiling is None:
        figure.add_annotation(text="no fusion ceiling: the report has no step times", showarrow=False)
        return figure
    labels = ["eager", "fused", "ceiling"]
    compute = [ceiling.eager.compute_ms, ceiling.fused.compute_ms, ceiling.compute_ms]
    rest = [ceiling.eager.rest_ms, ceiling.fused.rest_ms, ceiling.rest_floor_ms]
    rest_bytes = [ceiling.eager.rest_bytes, ceiling.fused.rest_bytes, ceiling.rest_bytes]
    figure.add_bar(y=labels, x=compute, orientation="h", name="GEMMs and attention", marker_color=CEILING_COLORS[
        "compute"], hovertemplate="%{y}: %{x:.3f} ms of GEMMs and attention<extra></extra>")
    figure.add_bar(y=labels, x=rest, orientation="h", name="the rest", marker_color=CEILING_COLORS["rest"],
                   customdata=[b / 2**20 for b in rest_bytes],
                   hovertemplate="%{y}: %{x:.3f} ms for the rest, %{customdata:.1f} MiB moved<extra></extra>")
    figure.update_layout(barmode="stack", height=220, margin={"l": 70, "r": 20, "t": 50, "b": 40},
                         title={"text": ceiling.verdict(), "font": {"size": 12}}, xaxis_title="ms per step",
                         yaxis={"autorange": "reversed"})
    return figure


# ---- fusion gains --------------------------------------------------------------------------


def gain_rows(report: ProfileReport, group_by: str = "kind", phase: str = "both") -> list[GainRow]:
    """Eager and fused time per group, sorted by time saved, largest first.

    The time no module accounts for (``"(other)"``) is real step time, so it stays, but
    last: it is not something fusion targeted.
    """
    if group_by not in GROUP_BY:
        raise ValueError(f"gain_rows: group_by must be one of {GROUP_BY}, got {group_by!r}")
    if phase not in PHASES:
        raise ValueError(f"gain_rows: phase must be one of {PHASES}, got {phase!r}")
    if group_by == "kind":
        groups = [(kind.key, [kind], [m.key for m in report.modules if m.kind == kind.key])
                  for kind in report.kinds]
    else:
        by_label: dict[str, list[Comparison]] = {}
        for module in report.modules:
            label = module.key if group_by == "module" else module.module_type or module.key
            by_label.setdefault(label, []).append(module)
        groups = [(label, members, [m.key for m in members]) for label, members in by_label.items()]
    rows = [_gain_row(label, comparisons, keys, _PHASE_MS[phase], phase == "both")
            for label, comparisons, keys in groups]
    return sorted(rows, key=lambda row: (OTHER_KEY in row.keys, -row.time_saved_ms))


def _gain_row(label: str, comparisons: list[Comparison], keys: list[str],
              phase_ms: Callable[[Region], float], whole_step: bool) -> GainRow:
    eager_ms = sum(phase_ms(c.eager) for c in comparisons)
    fused_ms = sum(phase_ms(c.fused) for c in comparisons)
    # The report's intervals are of one module's (or kind's) forward + backward time.
    low, high = ((comparisons[0].speedup_low, comparisons[0].speedup_high) if whole_step and len(comparisons) == 1
                 else (None, None))
    return GainRow(label, eager_ms, fused_ms, eager_ms / fused_ms if fused_ms > 0 else None,
                   eager_ms - fused_ms, keys, low, high)


# The report rescales the profiled op times so that each mode's rows add up to its
# unprofiled step (te_lab.profiler.correction): the bars are per-step times as the model
# runs without the profiler.
GAINS_AXIS = "ms per unprofiled step"


INDISTINGUISHABLE_COLOR = "#c7c7c7"  # a fused bar whose speedup's interval holds 1.0


def gains_figure(report: ProfileReport, group_by: str = "kind", phase: str = "both") -> go.Figure:
    """Grouped bars, eager beside fused, per row of :func:`gain_rows`; the fused bar is
    labelled with its speedup and its 95% interval where the report has one, and drawn
    grey where that interval holds 1.0 (no measurable difference). Each series is in the
    figure once: the labels are the x values, the hover reads them from there."""
    rows = gain_rows(report, group_by, phase)
    labels = [row.label for row in rows]
    figure = go.Figure()
    for mode in MODES:
        fused = mode == "fused"
        figure.add_trace(go.Bar(
            name=mode, x=labels, y=[round(row.eager_ms if mode == "eager" else row.fused_ms, 4) for row in rows],
            marker_color=[INDISTINGUISHABLE_COLOR if row.distinguishable is False else MODE_COLORS[mode]
                          for row in rows] if fused else MODE_COLORS[mode],
            text=[_speedup_text(row) for row in rows] if fused else None,
            textposition="outside" if fused else None,
            hovertemplate=f"%{{x}}<br>{mode}: %{{y:.3f}} ms" + ("<br>%{text}" if fused else "") + "<extra></extra>"))
    figure.update_layout(barmode="group", title=f"Eager vs fused time by {group_by.replace('_', ' ')} ({phase})"
                         "<br><sup>fused bar grey: its speedup's 95% interval holds 1.0 (no measurable "
                         "difference)</sup>", yaxis_title=GAINS_AXIS)
    return figure


def _speedup_text(row: GainRow) -> str:
    if row.speedup_low is None or row.speedup_high is None:
        return _ratio(row.speedup)
    return f"{_ratio(row.speedup)} [{row.speedup_low:.2f}, {row.speedup_high:.2f}]"


def other_explanation(report: ProfileReport) -> str:
    """What the "(other)" row holds in each mode, and a warning when it changed
    measurably though fusion cannot change it (plain text)."""
    other = next((c for c in report.modules if c.key == OTHER_KEY), None)
    if other is None:
        return ""
    text = (f"{OTHER_KEY}: the unprofiled step minus the modules' rescaled times, that is the ops no fused "
            f"module owns (embeddings, residual adds, the loss where it is not fused, optimizer steps) and the "
            f"Python between modules. Eager: {other.eager.total_ms:.3f} ms of it around the original modules; "
            f"fused: {other.fused.total_ms:.3f} ms of the same code around the twins. Fusion does not change it.")
    if other.distinguishable:
        text += (f" Here it changed {other.speedup:.2f}x [{other.speedup_low:.2f}, {other.speedup_high:.2f}]: "
                 f"a difference fusion cannot cause (noise, or the profiler's overhead moved between rows), so "
                 f"read the module rows' shares of the step with care.")
    return text


# ---- timeline --------------------------------------------------------------------------------


# The dashboard draws the timeline a page at a time: a window of the step holding at most
# this many events of the busiest mode (a 30-layer model's training step has ~10k ops).
TIMELINE_PAGE_EVENTS = 2000


def timeline_pages(timeline: list, modes: tuple = MODES, per_page: int = TIMELINE_PAGE_EVENTS) -> list:
    """``(start_us, end_us)`` windows of equal length that cover the timeline, as many as
    keep the busiest mode at about ``per_page`` events per window; one window (None) for
    a short timeline."""
    busiest = max((sum(e.mode == mode for e in timeline) for mode in modes), default=0)
    if busiest <= per_page:
        return [None]
    end = max(e.start_us + e.duration_us for e in timeline)
    count = math.ceil(busiest / per_page)
    return [(end * index / count, end * (index + 1) / count) for index in range(count)]


def timeline_figure(report: ProfileReport, window: tuple | None = None) -> go.Figure:
    """Gantt chart of the profiled step, eager above fused on one time axis: one bar per
    op on its lane (thread or stream), coloured by phase; ``window`` (start_us, end_us)
    draws only the ops that overlap it (:func:`timeline_pages`)."""
    return lanes_figure(report.timeline, MODES, "Profiled step, op by op", "µs from the step's first op", window)


def lanes_figure(timeline: list, modes: tuple, title: str, x_title: str, window: tuple | None = None) -> go.Figure:
    """Gantt chart of ``timeline`` (TimelineEvent), one subplot per mode on one time
    axis, one bar per event on its lane, coloured by phase (also a trace file's
    kernels, :func:`te_lab.open_trace`). Each event's start, duration, lane, name and
    module are in the figure once; times rounded to 0.01 µs."""
    if window is not None:
        timeline = [e for e in timeline if e.start_us < window[1] and e.start_us + e.duration_us >= window[0]]
        title = f"{title}: {window[0]:.0f} to {window[1]:.0f} µs"
    figure = make_subplots(rows=len(modes), cols=1, shared_xaxes=True, subplot_titles=modes,
                           vertical_spacing=0.08)
    for row, mode in enumerate(modes, start=1):
        for phase, color in PHASE_COLORS.items():
            events = [e for e in timeline if e.mode == mode and e.phase == phase]
            if not events:
                continue
            figure.add_trace(go.Bar(
                name=phase, legendgroup=phase, showlegend=row == 1, orientation="h", marker_color=color,
                y=[e.lane for e in events], base=[round(e.start_us, 2) for e in events],
                x=[round(e.duration_us, 2) for e in events],
                customdata=[(e.name, e.path or "(outside any module)") for e in events],
                hovertemplate="%{customdata[0]}<br>%{customdata[1]}<br>%{x:.1f} µs<extra></extra>"),
                row=row, col=1)
    # Bars of one lane share a y position; grouping would shift them apart.
    figure.update_layout(barmode="overlay", title=title)
    figure.update_xaxes(title_text=x_title, row=len(modes), col=1)
    return figure


# ---- utilization ----------------------------------------------------------------------------


def utilization_figure(report: ProfileReport) -> go.Figure:
    """Utilization of each sampled channel (CPU core, GPU) over time, with every timed
    eager and fused step shaded, so busy and idle stretches line up with the steps."""
    if not report.utilization_series:
        unavailable = [note for note in report.notes if note.startswith("unavailable: ")]
        why = "; ".join(unavailable) if unavailable else "the sampler recorded none"
        return go.Figure(layout={"title": f"No utilization samples: {why}"})
    figure = go.Figure()
    for series in report.utilization_series:
        for channel, label in enumerate(series["labels"]):
            figure.add_trace(go.Scatter(
                name=label, x=series["times_s"], y=[row[channel] for row in series["values"]], mode="lines",
                hovertemplate=f"{label}: %{{y:.0f}}%<extra>{series['source']}</extra>"))
    in_legend: set[str] = set()
    for mode, start_s, end_s in _step_spans(report.utilization_marks):
        # One legend entry per mode; the other bands of that mode toggle with it.
        figure.add_vrect(x0=start_s, x1=end_s, fillcolor=MODE_COLORS.get(mode, "#bcbd22"), opacity=0.15,
                         line_width=0, layer="below", name=f"{mode} steps", legendgroup=mode,
                         showlegend=mode not in in_legend)
        in_legend.add(mode)
    sources = ", ".join(series["source"] for series in report.utilization_series)
    figure.update_layout(title=f"Utilization per channel ({sources})", xaxis_title="s since sampling started",
                         yaxis_title="utilization %", yaxis_range=[0, 105])
    return figure


def _step_spans(marks: list) -> list[tuple[str, float, float]]:
    """``(mode, start_s, end_s)`` for each "<mode> step N start" / "... end" pair;
    a step whose end was never marked has no span."""
    starts: dict[str, float] = {}
    spans = []
    for label, seconds in marks:
        match = _STEP_MARK.match(label)
        if match is None:
            continue
        if match["edge"] == "start":
            starts[match["step"]] = seconds
        elif match["step"] in starts:
            spans.append((match["mode"], starts.pop(match["step"]), seconds))
    return spans


# ---- roofline --------------------------------------------------------------------------------


def roofline_figure(report: ProfileReport) -> go.Figure:
    """Achieved GFLOP/s against arithmetic intensity per op kind, log-log, under the
    device's memory ceiling (bandwidth x intensity) and, where known, its fp32 peak."""
    figure = go.Figure()
    intensities = []
    for mode in MODES:
        # A log axis cannot place zero: ops with no FLOPs (or no time) have no point.
        points = [p for p in report.roofline if p.mode == mode and p.arithmetic_intensity and p.achieved_gflops]
        intensities += [p.arithmetic_intensity for p in points]
        figure.add_trace(go.Scatter(
            name=mode, mode="markers+text", marker_color=MODE_COLORS[mode], textposition="top center",
            x=[p.arithmetic_intensity for p in points], y=[p.achieved_gflops for p in points],
            text=[p.name for p in points], customdata=[(p.achieved_gbs or 0.0, p.time_ms) for p in points],
            hovertemplate=(f"%{{text}} ({mode})<br>%{{x:.3g}} FLOP/byte<br>%{{y:.3g}} GFLOP/s<br>"
                           "%{customdata[0]:.3g} GB/s, %{customdata[1]:.3f} ms<extra></extra>")))
    ceilings = report.ceilings
    if ceilings is not None:
        bandwidth = ceilings.memory_bandwidth_gbs
        peak_gflops = ceilings.fp32_tflops * 1e3 if ceilings.fp32_tflops else None
        ridge = peak_gflops / bandwidth if peak_gflops else None  # where memory and compute ceilings meet
        span = intensities + ([ridge] if ridge else [])
        low, high = (min(span) / 4, max(span) * 4) if span else (0.01, 100.0)
        memory_end = ridge if ridge else high
        figure.add_trace(go.Scatter(
            name="memory ceiling", mode="lines", line={"color": "black", "dash": "dash"},
            x=[low, memory_end], y=[bandwidth * low, bandwidth * memory_end],
            hovertemplate=f"{bandwidth:.3g} GB/s x intensity<extra>{ceilings.source}</extra>"))
        if peak_gflops:
            figure.add_trace(go.Scatter(
                name="fp32 compute ceiling", mode="lines", line={"color": "black"},
                x=[ridge, high], y=[peak_gflops, peak_gflops],
                hovertemplate=f"{ceilings.fp32_tflops:.3g} TFLOP/s fp32<extra>{ceilings.source}</extra>"))
    source = f" (ceilings: {ceilings.source})" if ceilings is not None else ""
    figure.update_layout(title=f"Roofline per op kind{source}", xaxis_type="log", yaxis_type="log",
                         xaxis_title="arithmetic intensity, FLOP/byte", yaxis_title="achieved GFLOP/s")
    return figure


# ---- expert load -------------------------------------------------------------------------------


def expert_load_figure(report: ProfileReport) -> go.Figure:
    """Heatmap of the tokens each expert received in one fused step, a row per fused MoE
    block (in model order, top down) labelled with its imbalance (busiest expert / mean),
    a column per expert; the overall imbalance in the title. A report without expert load
    (no fused MoE block, or a trace file's view) gets an empty figure saying so."""
    load = report.expert_load
    if load is None:
        return go.Figure(layout={"title": "No expert load: the profile ran no fused MoE block"})
    experts = max(len(layer.tokens_per_expert) for layer in load.layers)
    # A layer with fewer experts than the widest leaves its remaining cells empty.
    counts = [layer.tokens_per_expert + [None] * (experts - len(layer.tokens_per_expert)) for layer in load.layers]
    figure = go.Figure(go.Heatmap(
        z=counts, x=list(range(experts)), y=[f"{layer.layer} ({layer.imbalance:.2f}x)" for layer in load.layers],
        colorscale="Viridis", colorbar={"title": "tokens"},
        hovertemplate="%{y}<br>expert %{x}: %{z} tokens<extra></extra>"))
    figure.update_layout(
        title=f"Tokens per expert, one fused step's forward: imbalance {load.imbalance:.2f}x overall"
              "<br><sup>imbalance: the busiest expert's tokens / the mean per expert (1.00x: balanced), per layer "
              "in brackets; overall: the layers' busiest summed / their means summed</sup>",
        xaxis_title="expert", yaxis_autorange="reversed", height=max(300, 120 + 28 * len(load.layers)))
    return figure


# ---- headline cards -------------------------------------------------------------------------


def summary_cards(report: ProfileReport) -> list[tuple[str, str]]:
    """``(title, value)`` pairs for the dashboard's headline row: the report's headline
    (step time change, memory traffic change, launches saved) first, then the rest."""
    eager, fused = report.modes["eager"], report.modes["fused"]
    cards = report.headline() + [
        ("peak memory", f"eager {_mib(eager.peak_memory_bytes)} / fused {_mib(fused.peak_memory_bytes)}"),
        ("modules fused", str(sum(module.key != OTHER_KEY for module in report.modules))),
        ("profiled / unprofiled step", f"eager {_ratio(eager.profiled_ratio)} / fused {_ratio(fused.profiled_ratio)}"),
        ("compiles in measured steps", f"eager {eager.compiles} / fused {fused.compiles}"),
    ]
    if eager.communication_ms is not None or fused.communication_ms is not None:
        rank = report.environment.rank
        cards.append(("communication (profiled step)" + ("" if rank is None else f", rank {rank}"),
                      f"eager {_ms(eager.communication_ms)} / fused {_ms(fused.communication_ms)}"))
    return cards


def _ratio(value: float | None) -> str:
    # NaN: the report's speedup when the fused step took no time.
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"
