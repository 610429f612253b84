"""The profiler dashboard (ipywidgets + plotly), imported only when a report is shown
or exported: ``import te_lab`` never loads widgets or plotly."""

from .dashboard import Dashboard

__all__ = ["Dashboard"]
