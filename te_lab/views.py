"""``te_lab.show`` and ``te_lab.to_html``: a report, a GPU trace or a generation profile
handed to the widgets layer, which draws it. ipywidgets and plotly load on the first call,
never on import."""

from te_lab.profiler import GenerationProfile
from te_lab.profiler.gpu_trace import GpuTrace


def show(report, rerun=None) -> None:
    """In a notebook, the dashboard of a :class:`ProfileReport` (its Re-run button
    measuring ``rerun``, a :class:`ProfileRun`, when given), or the views of a GPU trace
    (:func:`open_trace`: timeline per stream, figures, kernels), or the prefill and decode
    table of a :class:`GenerationProfile`; the text summary where no
    widget frontend runs (plain Python, a terminal, a CI log). Loads ipywidgets and plotly
    on first use: the data never imports them."""
    if isinstance(report, GpuTrace):
        from te_lab.widgets.trace_view import show_trace

        show_trace(report)
        return
    if isinstance(report, GenerationProfile):
        from te_lab.widgets.generation_view import show_generation

        show_generation(report)
        return
    from te_lab.widgets.display import show_report

    show_report(report, rerun)


def to_html(report, path):
    """Write a :class:`ProfileReport`'s dashboard (or a GPU trace's views) as one
    self-contained HTML file (plotly.js inlined, no network needed) and return its path
    (for a report of a distributed run, the rank's own file: ``report.rank0.html``)."""
    if isinstance(report, GpuTrace):
        from te_lab.widgets.trace_view import write_trace_html

        return write_trace_html(report, path)
    from te_lab.widgets.export import write_html

    return write_html(report, path)
