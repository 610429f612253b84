"""The static export: one self-contained HTML file with the dashboard's charts and the
summary table; plotly.js is inlined once, so the file opens without a network."""

from __future__ import annotations

import html
import pathlib

from .figures import (
    ceiling_figure,
    expert_load_figure,
    gains_figure,
    roofline_figure,
    summary_cards,
    timeline_figure,
    utilization_figure,
)
from .opportunities_figure import OPPORTUNITY_MODES, opportunities_figure, opportunity_modes

SECTIONS = (("Gains by op kind", gains_figure), ("Fusion ceiling", ceiling_figure), ("Timeline", timeline_figure),
            ("Utilization", utilization_figure), ("Roofline", roofline_figure))
EXPERT_LOAD_SECTION = ("Expert load", expert_load_figure)  # where the report carries it


def _opportunity_sections(report) -> tuple:
    """One Opportunities chart per mode the finder looked at (what fusion left first)."""
    return tuple((f"Opportunities: {OPPORTUNITY_MODES[mode]}", lambda r, mode=mode: opportunities_figure(r, mode))
                 for mode in opportunity_modes(report))


def write_html(report, path) -> pathlib.Path:
    """Write the file and return where it went: ``path``, or in a distributed run the
    rank's own file (``report.path_for``: ``report.rank0.html``)."""
    target = report.path_for(path)
    if target.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"te_lab.to_html: path must end in .html, got {str(path)!r}")
    cards = "".join(f'<div class="card"><div class="title">{html.escape(title)}</div>'
                    f'<div class="value">{html.escape(value)}</div></div>' for title, value in summary_cards(report))
    charts = []
    sections = SECTIONS + _opportunity_sections(report) + (
        (EXPERT_LOAD_SECTION,) if report.expert_load is not None else ())
    for index, (title, build) in enumerate(sections):
        figure_html = build(report).to_html(full_html=False, include_plotlyjs=index == 0)
        charts.append(f"<h2>{html.escape(title)}</h2>{figure_html}")
    formulas = "".join(f"<tr><td>{html.escape(f.name)} ({html.escape(f.mode)})</td>"
                       f"<td>{'-' if f.value is None else f'{f.value:.3g}'} {html.escape(f.unit)}</td>"
                       f"<td>{html.escape(f.formula)}</td></tr>" for f in report.utilization)
    document = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>te_lab profile: {html.escape(report.environment.target)}</title>
<style>body {{ font-family: sans-serif; margin: 1.5em; }} .cards {{ display: flex; flex-wrap: wrap; gap: .8em; }}
.card {{ border: 1px solid #ccc; border-radius: 6px; padding: .6em 1em; }} .title {{ color: #666; font-size: .85em; }}
.value {{ font-size: 1.2em; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ddd; padding: 2px 6px; }}
</style></head><body>
<h1>te_lab profile: {html.escape(report.environment.target)} on {html.escape(report.environment.device_name)}</h1>
<div class="cards">{cards}</div>
{report._repr_html_()}
{''.join(charts)}
<h2>Utilization figures</h2><table><tr><th>figure</th><th>value</th><th>formula</th></tr>{formulas}</table>
</body></html>
"""
    target.write_text(document, encoding="utf-8")
    return target
