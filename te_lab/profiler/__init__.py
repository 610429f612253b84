"""The profiler engine: eager against fused, per op kind and per module, as data.

``te_lab.profile(target, inputs)`` returns a :class:`ProfileReport`; it never imports
widgets or plotly (the dashboard draws the report).
"""

from .engine import profile, profile_statement
from .report import ProfileReport

__all__ = ["ProfileReport", "profile", "profile_statement"]
