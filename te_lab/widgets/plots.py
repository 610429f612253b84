"""A plotly figure inside a widget layout, as data only.

plotly's ``FigureWidget`` carries plotly.js (about 5 MB) in every widget's state: a
dashboard of four charts sent it to the browser four times and saved it four times into
the notebook. Here a chart is an ``ipywidgets.Output`` holding one output, the figure's
JSON under plotly's MIME type (``application/vnd.plotly.v1+json``), which JupyterLab,
Notebook 7 and VS Code render with the plotly.js they already have (JupyterLab through
the ``jupyterlab-plotly`` extension that ships with plotly). Redrawing replaces that one
output, so each chart's data is in the widget state once.
"""

from __future__ import annotations

import json

import ipywidgets as widgets
import plotly.graph_objects as go

PLOTLY_MIME = "application/vnd.plotly.v1+json"


def figure_output(figure: go.Figure) -> dict:
    """The figure as one nbformat display output (plotly's MIME type, a text fallback)."""
    data = json.loads(figure.to_json())
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: {"data": data.get("data", []), "layout": data.get("layout", {}),
                                   "config": {"displaylogo": False}},
                     "text/plain": f"<plotly figure: {figure.layout.title.text or 'untitled'}>"}}


class Plot(widgets.Output):
    """An Output widget showing one plotly figure; :meth:`draw` replaces it."""

    def __init__(self, figure: go.Figure | None = None, **kwargs):
        super().__init__(**kwargs)
        self.figure = go.Figure()
        if figure is not None:
            self.draw(figure)

    def draw(self, figure: go.Figure) -> None:
        self.figure = figure
        self.outputs = (figure_output(figure),)

    def clear(self) -> None:
        """Show nothing (and hold no figure's data)."""
        self.figure = go.Figure()
        self.outputs = ()
