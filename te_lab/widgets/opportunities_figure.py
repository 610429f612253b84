"""The Opportunities panel's chart: the fusion-opportunity finder's rows
(:mod:`te_lab.profiler.opportunities`) as a ranked bar chart of estimated gains, the
realized gains beside them where fusing measured them, each bar's module, phase, op
pattern and what would fuse it on hover."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from te_lab.profiler.opportunity_table import Opportunities, short_name

# What each mode's rows are, for the panel's chooser and titles.
OPPORTUNITY_MODES = {"fused": "what fusion left", "eager": "before fusing"}
STEP_OF = {"fused": "the fused step", "eager": "the eager step, with the gains fusing realized"}
SHOWN_ROWS = 15
COLORS = {"estimated": "#ff7f0e", "realized": "#2ca02c"}


def opportunity_modes(report) -> list[str]:
    """The modes of ``report`` the finder looked at, fused first."""
    found = report.opportunities or {}
    return [mode for mode in OPPORTUNITY_MODES if mode in found]


def _hover(row) -> str:
    pattern = " -> ".join(short_name(name) for name in row.pattern)
    unfused = "-" if row.bytes_unfused is None else f"{row.bytes_unfused / 2**20:.2f}"
    fused = "-" if row.bytes_fused is None else f"{row.bytes_fused / 2**20:.2f}"
    lines = [f"<b>{html.escape(row.module)}</b> ({html.escape(row.module_type or '-')}, {row.phase or '-'})",
             html.escape(pattern), f"{row.instances} instance(s), {row.launches} launches, {row.time_ms:.3f} ms",
             f"MiB moved: {unfused} unfused -> {fused} fused", html.escape(row.fused_by or "no te_lab rule")]
    if row.note:
        lines.append(html.escape(row.note))
    return "<br>".join(lines)


def opportunities_figure(report, mode: str = "fused") -> go.Figure:
    """The ``mode`` rows of the report's finder, largest estimated gain on top; an empty
    figure that says why where there are none."""
    found: Opportunities = (report.opportunities or {}).get(mode)
    figure = go.Figure()
    if found is None or not found.rows:
        why = ("the profile did not look for opportunities (te_lab.profile(..., opportunities=False), or a target "
               "that is not a model)" if found is None else f"no unfused chain of memory-bound ops in the {mode} step")
        figure.add_annotation(text=why, showarrow=False)
        figure.update_layout(height=200)
        return figure
    rows = found.rows[:SHOWN_ROWS]
    labels = [f"{index + 1}. {row.label(3)}" for index, row in enumerate(rows)]
    hovers = [_hover(row) for row in rows]
    figure.add_bar(y=labels, x=[row.estimated_gain_ms or 0.0 for row in rows], orientation="h", name="estimated gain",
                   marker_color=COLORS["estimated"], hovertext=hovers, hovertemplate="%{hovertext}<br>estimated "
                   "gain %{x:.3f} ms<extra></extra>")
    if any(row.realized_gain_ms is not None for row in rows):
        figure.add_bar(y=labels, x=[row.realized_gain_ms or 0.0 for row in rows], orientation="h",
                       name="realized gain", marker_color=COLORS["realized"], hovertext=hovers,
                       hovertemplate="%{hovertext}<br>realized gain %{x:.3f} ms<extra></extra>")
    title = (f"{OPPORTUNITY_MODES[mode]} ({STEP_OF[mode]}): {len(found.rows)} chain pattern(s),<br>"
             f"{found.chains_ms:.3f} ms of "
             f"{found.accounting.non_compute_ms:.3f} ms outside compute (GEMMs, attention); estimated gain "
             f"{found.estimated_gain_ms:.3f} ms at {found.bandwidth_gbs:.0f} GB/s")
    figure.update_layout(barmode="group", height=140 + 28 * len(rows), margin={"l": 380, "r": 20, "t": 60, "b": 40},
                         title={"text": title, "font": {"size": 12}}, xaxis_title="ms per step",
                         yaxis={"autorange": "reversed"})
    return figure
