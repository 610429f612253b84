"""The HTML report of a results object: one self-contained file (plotly.js inlined once,
as the dashboard's static export does) with the targets, te_lab's speedups per op, the
achieved bandwidth, and the end-to-end throughput and time to first step."""

from __future__ import annotations

import html
import pathlib

from .report import machine_lines


def _plotly():
    try:
        import plotly.graph_objects as go
    except ImportError as error:
        raise ImportError("te_lab.benchmarks.html_report needs plotly: pip install plotly") from error
    return go


def _label(record: dict) -> str:
    size = record["size"]
    return f"{record['case']} {size['tokens']}x{size['hidden']} {record['dtype']} {record['mode']}"


def speedup_figure(results: dict):
    go = _plotly()
    figure = go.Figure()
    for over in ("eager", "torch.compile", "liger"):
        labels, values, low, high = [], [], [], []
        for record in results["ops"]:
            auto = next((c["name"] for c in record["contenders"] if c["kind"] == "te_lab" and c["auto"]), None)
            found = next((s for s in record["speedups"] if s["contender"] == auto and s["over"] == over), None)
            if found is not None:
                labels.append(_label(record))
                values.append(found["value"])
                low.append(found["value"] - found["interval_low"])
                high.append(found["interval_high"] - found["value"])
        if labels:
            figure.add_bar(name=f"vs {over}", x=labels, y=values,
                           error_y=dict(type="data", symmetric=False, array=high, arrayminus=low))
    figure.add_hline(y=1.0, line_dash="dot")
    figure.update_layout(title="te_lab (automatic backend): speedup per op, 95% interval", barmode="group",
                         yaxis_title="speedup (above 1: te_lab faster)", yaxis_type="log", height=520)
    return figure


def bandwidth_figure(results: dict):
    go = _plotly()
    figure = go.Figure()
    names = sorted({c["name"] for record in results["ops"] for c in record["contenders"]})
    for name in names:
        labels, values = [], []
        for record in results["ops"]:
            found = next((c for c in record["contenders"] if c["name"] == name and c["error"] is None), None)
            if found is not None:
                labels.append(_label(record))
                values.append(100 * found["fraction_of_copy_bandwidth"])
        figure.add_bar(name=name, x=labels, y=values)
    figure.update_layout(title="achieved bandwidth, % of the measured copy bandwidth", barmode="group",
                         yaxis_title="% of copy bandwidth", height=520)
    return figure


def models_figure(results: dict, field: str, title: str, axis: str):
    go = _plotly()
    figure = go.Figure()
    names = []
    for record in results["models"]:
        names += [c["name"] for c in record["contenders"] if c["name"] not in names]
    for name in names:
        labels, values = [], []
        for record in results["models"]:
            found = next((c for c in record["contenders"] if c["name"] == name and c["error"] is None), None)
            if found is not None:
                labels.append(f"{record['model']} {record['mode']}")
                values.append(found[field])
        figure.add_bar(name=name, x=labels, y=values)
    figure.update_layout(title=title, barmode="group", yaxis_title=axis, height=460)
    return figure


def write_html(results: dict, path) -> pathlib.Path:
    target = pathlib.Path(path)
    if target.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"write_html: path must end in .html, got {str(path)!r}")
    figures = []
    if results["models"]:
        figures += [models_figure(results, "tokens_per_s", "end to end: tokens per second", "tokens/s"),
                    models_figure(results, "time_to_first_step_s", "end to end: time to first step "
                                  "(fuse and compile waits included)", "seconds")]
    if results["ops"]:
        figures += [speedup_figure(results), bandwidth_figure(results)]
    charts = "".join(figure.to_html(full_html=False, include_plotlyjs=index == 0)
                     for index, figure in enumerate(figures))
    met_label = {True: "yes", False: "NO", None: "not measured"}
    rows = "".join(f"<tr><td>{html.escape(t['target'])}</td><td>{met_label[t['met']]}</td>"
                   f"<td>{html.escape(t['measured'])}<br>"
                   f"{'<br>'.join(html.escape(d) for d in t['detail'][:12])}</td></tr>"
                   for t in results["targets"])
    machine = "".join(f"<li>{html.escape(line[2:])}</li>" for line in machine_lines(results))
    document = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>te_lab benchmark: {html.escape(results['environment']['device_name'])}</title>
<style>body {{ font-family: sans-serif; margin: 1.5em; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ddd; padding: 2px 6px; vertical-align: top; }}</style></head><body>
<h1>te_lab benchmark results</h1>
<ul>{machine}</ul>
<h2>Targets (issue 9)</h2>
<table><tr><th>target</th><th>met</th><th>measured</th></tr>{rows}</table>
{charts}
</body></html>
"""
    target.write_text(document, encoding="utf-8")
    return target
