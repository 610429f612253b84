"""A trace file's GPU views (:class:`te_lab.profiler.gpu_trace.GpuTrace`) drawn: the
timeline per stream, the figures, the kernel table. It never reads the file itself."""

from __future__ import annotations

import html
import pathlib

from te_lab.profiler.gpu_trace import TRACE_MODE

from .display import widget_frontend_available
from .figures import lanes_figure

# The kernel table shows this many names; the rest are in GpuTrace.kernel_table().
TABLE_ROWS = 50


def trace_timeline_figure(trace):
    return lanes_figure(trace.timeline, (TRACE_MODE,), f"Device activity per stream: {trace.device_name}",
                        "µs from the first device activity")


def figures_table_html(trace) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(f.mode)}</td><td>{html.escape(f.name)}</td>"
        f"<td>{'-' if f.value is None else f'{100 * f.value:.2f}%'}</td>"
        f"<td><code>{html.escape(f.formula)}</code>{' (' + html.escape(f.note) + ')' if f.note else ''}</td></tr>"
        for f in trace.figures)
    return (f'<table class="te-lab-trace-figures"><tr><th>span</th><th>figure</th><th>value</th><th>formula</th>'
            f"</tr>{rows}</table>")


def kernel_table_html(trace) -> str:
    table = trace.kernel_table()
    rows = "".join(f"<tr><td>{html.escape(r.name)}</td><td>{html.escape(r.kind)}</td><td>{r.count}</td>"
                   f"<td>{r.total_us:.1f}</td><td>{100 * r.share:.2f}%</td></tr>" for r in table[:TABLE_ROWS])
    more = f"<p>{len(table) - TABLE_ROWS} more names not shown.</p>" if len(table) > TABLE_ROWS else ""
    return (f'<table class="te-lab-kernels"><tr><th>kernel</th><th>kind</th><th>count</th><th>time µs</th>'
            f"<th>share of device time</th></tr>{rows}</table>{more}")


def _notes_html(trace) -> str:
    return "".join(f"<p><i>{html.escape(note)}</i></p>" for note in trace.notes)


def show_trace(trace) -> None:
    """The views as widgets in a notebook; the text summary elsewhere."""
    if not widget_frontend_available():
        print(trace.summary())
        return
    import ipywidgets as widgets
    from IPython.display import display

    from .plots import Plot

    header = widgets.HTML(f"<b>{html.escape(trace.path)}</b>: {html.escape(trace.device_name)}{_notes_html(trace)}")
    tabs = widgets.Tab(children=[Plot(trace_timeline_figure(trace)),
                                 widgets.HTML(figures_table_html(trace)), widgets.HTML(kernel_table_html(trace))])
    for index, title in enumerate(("Timeline", "Figures", "Kernels")):
        tabs.set_title(index, title)
    display(widgets.VBox([header, tabs]))


def write_trace_html(trace, path) -> pathlib.Path:
    target = pathlib.Path(path)
    if target.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"te_lab.to_html: path must end in .html, got {str(path)!r}")
    timeline = trace_timeline_figure(trace).to_html(full_html=False, include_plotlyjs=True)
    title = html.escape(f"te_lab trace: {trace.path}")
    target.write_text(f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body {{ font-family: sans-serif; margin: 1.5em; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ddd; padding: 2px 6px; }}</style></head><body>
<h1>{title}</h1><p>{html.escape(trace.device_name)}</p>{_notes_html(trace)}
<h2>Figures</h2>{figures_table_html(trace)}
<h2>Timeline</h2>{timeline}
<h2>Kernels</h2>{kernel_table_html(trace)}
</body></html>
""", encoding="utf-8")
    return target
