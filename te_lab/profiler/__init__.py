"""The profiler engine: eager against fused, per op kind and per module, as data.

``te_lab.profile(target, inputs)`` returns a :class:`ProfileReport`; a
:class:`ProfileRun` keeps the arguments to measure again. No module here imports
widgets or plotly (the dashboard draws the report).
"""

from .engine import profile, profile_statement
from .generation import GenerationProfile, profile_generation
from .profile_run import ProfileRun
from .report import ProfileReport

__all__ = ["GenerationProfile", "ProfileReport", "ProfileRun", "profile", "profile_generation", "profile_statement"]
