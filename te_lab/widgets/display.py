"""Where a report goes when shown: the dashboard where a widget frontend runs, the text
summary everywhere else."""

from __future__ import annotations

import sys


def widget_frontend_available() -> bool:
    """Whether this process is a Jupyter kernel (a frontend can render widgets). A
    terminal IPython, plain Python and CI logs cannot."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def show_report(report, rerun=None) -> None:
    """Display ``report``'s dashboard (its Re-run button measuring ``rerun``, a
    ``ProfileRun``), or print its summary. Returns None, so ``te_lab.show(report)`` as a
    cell's last line does not display the dashboard a second time (for the widget
    object itself, use ``te_lab.widgets.Dashboard(report)``)."""
    if not widget_frontend_available():
        print(report.summary())
        return
    from IPython.display import display

    from .dashboard import Dashboard

    display(Dashboard(report, rerun))
