"""The profiler dashboard: an ipywidgets layout of plotly charts drawn from a
ProfileReport, each chart's data sent once (:mod:`.plots`: no plotly.js in the widget
state). It never measures; the Re-run button runs the
:class:`~te_lab.profiler.ProfileRun` it was given (without one, as for a report loaded
from JSON, the button is off and says why).
"""

from __future__ import annotations

import html
from typing import Optional

import ipywidgets as widgets

from .figures import (
    GROUP_BY,
    PHASES,
    ceiling_figure,
    expert_load_figure,
    gain_rows,
    gains_figure,
    other_explanation,
    roofline_figure,
    summary_cards,
    timeline_figure,
    timeline_pages,
    utilization_figure,
)
from .opportunities_figure import OPPORTUNITY_MODES, opportunities_figure, opportunity_modes
from .plots import Plot

GROUP_LABELS = {"kind": "op kind", "module_type": "module type", "module": "module instance"}
NO_DETAILS = "<i>Choose a row under \"details of\" for its modules, ops and shapes.</i>"
TAB_TITLES = ("Gains", "Timeline", "Utilization", "Roofline", "Opportunities", "Expert load")
NO_RERUN = ("No ProfileRun was given with this report (te_lab.show(report, rerun=te_lab.ProfileRun(...))): "
            "there is nothing to re-run")


def _cards_html(report) -> str:
    cards = "".join(
        f'<div style="border:1px solid #ccc;border-radius:6px;padding:6px 12px;margin:4px">'
        f'<div style="color:#666;font-size:85%">{html.escape(title)}</div>'
        f'<div style="font-size:120%">{html.escape(value)}</div></div>' for title, value in summary_cards(report))
    return f'<div class="te-lab-cards" style="display:flex;flex-wrap:wrap">{cards}</div>'


def _figures_table(report) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(f.name)}</td><td>{html.escape(f.mode)}</td>"
        f"<td>{'-' if f.value is None else f'{f.value:.3g}'} {html.escape(f.unit)}</td>"
        f"<td><code>{html.escape(f.formula)}</code></td></tr>" for f in report.utilization)
    return (f'<table class="te-lab-utilization"><tr><th>figure</th><th>mode</th><th>value</th><th>formula</th></tr>'
            f"{rows}</table>")


def _window_label(window) -> str:
    return "the whole step" if window is None else f"{window[0]:.0f} to {window[1]:.0f} µs"


class Dashboard(widgets.VBox):
    """``Dashboard(report, rerun=None)``: summary cards (the fusion ceiling among them), then
    tabs Gains (the ceiling's chart below the gains) / Timeline /
    Utilization / Roofline / Opportunities (the finder's rows, what fusion left or the eager
    step's with their realized gains), and Expert load where the report carries it (a
    heatmap layer x expert), and a Re-run button that measures ``rerun`` (a
    :class:`~te_lab.profiler.ProfileRun`) again. The gains tab's "details of" list fills
    the details panel; the timeline of a long step is drawn a window at a time."""

    def __init__(self, report, rerun=None):
        self.cards = widgets.HTML()
        self.group_by = widgets.Dropdown(options=[(GROUP_LABELS[g], g) for g in GROUP_BY], value="kind",
                                         description="group by")
        self.phase = widgets.ToggleButtons(options=list(PHASES), value="both", description="phase")
        self.detail_row = widgets.Dropdown(options=[], description="details of")
        self.details = widgets.HTML(NO_DETAILS)
        self.other = widgets.HTML()
        self.gains = Plot()
        self.ceiling = Plot()
        self.timeline_page = widgets.Dropdown(options=[], description="window")
        self.timeline = Plot()
        self.utilization = Plot()
        self.utilization_table = widgets.HTML()
        self.roofline = Plot()
        self.opportunity_mode = widgets.ToggleButtons(options=[], description="rows of")
        self.opportunities = Plot()
        self.expert_load = Plot()
        self.rerun_button = widgets.Button(description="Re-run", icon="refresh")
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="profiling", layout={"visibility":
                                                                                                       "hidden"})
        self.pages = (
            widgets.VBox([widgets.HBox([self.group_by, self.phase]), self.gains, self.ceiling, self.other,
                          self.detail_row, self.details]),
            widgets.VBox([self.timeline_page, self.timeline]),
            widgets.VBox([self.utilization_table, self.utilization]),
            self.roofline,
            widgets.VBox([self.opportunity_mode, self.opportunities]),
            self.expert_load,
        )
        self.tabs = widgets.Tab()
        super().__init__([self.cards, self.tabs, widgets.HBox([self.rerun_button, self.progress])])
        self.add_class("te-lab-dashboard")
        self.group_by.observe(lambda _: self._draw_gains(), names="value")
        self.phase.observe(lambda _: self._draw_gains(), names="value")
        self.detail_row.observe(lambda change: self._show_details(change["new"]), names="value")
        self.timeline_page.observe(lambda change: self._draw_timeline(change["new"]), names="value")
        self.opportunity_mode.observe(lambda change: self._draw_opportunities(change["new"]), names="value")
        self.rerun_button.on_click(lambda _: self.rerun())
        self.report = None
        self.timeline_windows = [None]
        self.profile_run = rerun
        self.update(report)

    # ---- drawing ----------------------------------------------------------------------

    def update(self, report) -> None:
        """Draw ``report`` in place (the same widgets, new data)."""
        self.report = report
        self.cards.value = _cards_html(report)
        self.other.value = f'<p class="te-lab-other"><i>{html.escape(other_explanation(report))}</i></p>'
        self.timeline_windows = timeline_pages(report.timeline)
        self.timeline_page.layout.display = None if len(self.timeline_windows) > 1 else "none"
        self.timeline_page.options = [(_window_label(window), index)
                                      for index, window in enumerate(self.timeline_windows)]
        self._draw_timeline(0)
        self.ceiling.draw(ceiling_figure(report))
        self.utilization.draw(utilization_figure(report))
        self.roofline.draw(roofline_figure(report))
        modes = opportunity_modes(report)
        chosen = self.opportunity_mode.value if self.opportunity_mode.value in modes else None
        self.opportunity_mode.options = [(OPPORTUNITY_MODES[mode], mode) for mode in modes]
        self.opportunity_mode.layout.display = None if modes else "none"
        if modes:
            self.opportunity_mode.value = chosen or modes[0]  # (options alone leave no value chosen)
        self._draw_opportunities(chosen or (modes[0] if modes else "fused"))
        # The expert load's tab only where the report carries it; otherwise its chart holds nothing.
        shown = len(self.pages) if report.expert_load is not None else len(self.pages) - 1
        if len(self.tabs.children) != shown:
            self.tabs.children = self.pages[:shown]
            self.tabs.titles = TAB_TITLES[:shown]
        if report.expert_load is not None:
            self.expert_load.draw(expert_load_figure(report))
        else:
            self.expert_load.clear()
        self.utilization_table.value = _figures_table(report)
        self._draw_gains()
        can_rerun = self.profile_run is not None
        self.rerun_button.disabled = not can_rerun
        self.rerun_button.tooltip = "Profile the model again and redraw" if can_rerun else NO_RERUN

    def _draw_opportunities(self, mode) -> None:
        if mode is not None:
            self.opportunities.draw(opportunities_figure(self.report, mode))

    def _draw_timeline(self, index) -> None:
        if index is not None:
            self.timeline.draw(timeline_figure(self.report, self.timeline_windows[index]))

    def _draw_gains(self) -> None:
        self.gains.draw(gains_figure(self.report, self.group_by.value, self.phase.value))
        labels = [row.label for row in gain_rows(self.report, self.group_by.value, self.phase.value)]
        self.detail_row.options = [("(choose a row)", "")] + [(label, label) for label in labels]
        self.details.value = NO_DETAILS

    def _show_details(self, label: str) -> None:
        self.details.value = self.details_html(label) if label else NO_DETAILS

    def details_html(self, label: str) -> str:
        """Details of one gains row: each module merged into it, eager vs fused."""
        row = next((r for r in gain_rows(self.report, self.group_by.value, self.phase.value) if r.label == label), None)
        if row is None:
            return f"<i>No row {html.escape(label)!s}.</i>"
        modules = {c.key: c for c in self.report.modules + self.report.kinds}
        lines = []
        for key in row.keys:
            comparison = modules.get(key)
            if comparison is None:
                continue
            ops = sorted({f"{e.name} {e.input_shapes}" for e in self.report.timeline if e.path == key})
            for mode in ("eager", "fused"):
                region = getattr(comparison, mode)
                gbs = "-" if region.gbs is None else f"{region.gbs:.2f}"
                lines.append(
                    f"<tr><td>{html.escape(key)}</td><td>{mode}</td><td>{region.forward_ms:.3f} / "
                    f"{region.backward_ms:.3f}</td><td>{region.launches}</td>"
                    f"<td>{region.bytes_moved / 2**20:.2f}</td><td>{gbs}</td></tr>")
            if ops:
                lines.append(f'<tr><td colspan="6">ops (input shapes): {html.escape("; ".join(ops))}</td></tr>')
            if comparison.verification:
                lines.append(f'<tr><td colspan="6">{html.escape(comparison.verification)}</td></tr>')
        speedup = "-" if row.speedup is None else f"{row.speedup:.2f}x"
        if row.speedup_low is not None and row.speedup_high is not None:
            speedup += f" [{row.speedup_low:.2f}, {row.speedup_high:.2f}] (95% interval)"
            if row.distinguishable is False:
                speedup += ": no measurable difference"
        return (f'<div class="te-lab-details"><b>{html.escape(label)}</b>: eager {row.eager_ms:.3f} ms, fused '
                f"{row.fused_ms:.3f} ms, speedup {speedup}<table><tr><th>module</th><th>mode</th>"
                f"<th>fwd / bwd ms</th><th>launches</th><th>MiB moved (est.)</th><th>GB/s</th></tr>"
                f"{''.join(lines)}</table></div>")

    # ---- re-run -------------------------------------------------------------------------

    def rerun(self) -> Optional[object]:
        """Measure the ProfileRun again, showing progress; redraw in place. None without one."""
        if self.profile_run is None:
            return None
        self.rerun_button.disabled = True
        self.progress.layout.visibility = "visible"

        def advance(done: int, total: int) -> None:
            self.progress.max, self.progress.value = total, done

        try:
            report = self.profile_run.run(progress=advance)
        finally:
            self.progress.layout.visibility = "hidden"
            self.rerun_button.disabled = False
        self.update(report)
        return report
