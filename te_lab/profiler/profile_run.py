"""A profile that can be measured again: what to profile and how, as an object.

A :class:`~te_lab.profiler.report.ProfileReport` is data (a loaded report has no model
to run); the dashboard's Re-run button needs the target too, so it is given a
``ProfileRun``, which holds the target and the options and measures anew on each
:meth:`ProfileRun.run`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .engine import profile, profile_statement
from .report import ProfileReport


class ProfileRun:
    """``ProfileRun(target, inputs, steps=3)`` keeps :func:`te_lab.profile`'s arguments;
    ``ProfileRun.statement(run, models, ...)`` keeps
    :func:`te_lab.profiler.profile_statement`'s (what ``%te_profile`` runs)."""

    def __init__(self, target, inputs=None, **options):
        self.target, self.inputs, self.options = target, inputs, options  # options: steps, warmup, backward, device
        self._measure: Callable[..., ProfileReport] = profile

    @classmethod
    def statement(cls, run: Callable[[], Any], models: dict, **options) -> "ProfileRun":
        profile_run = cls(run, models, **options)
        profile_run._measure = profile_statement
        return profile_run

    def run(self, progress: Optional[Callable[[int, int], None]] = None) -> ProfileReport:
        """Measure now and return a new report; ``progress(done, total)`` after every step."""
        return self._measure(self.target, self.inputs, **self.options, progress=progress)

    def __repr__(self) -> str:
        return f"ProfileRun({self._measure.__name__}, {self.options})"
