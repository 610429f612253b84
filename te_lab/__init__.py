"""te_lab: fused Transformer kernels you can see working, in Jupyter.

Importing te_lab registers its fused ops with torch (``te_lab::*`` custom ops) and its
fusion rules; it never imports IPython, ipywidgets or plotly.
"""

from te_lab import device, distributed, kernels, models, modules, optim
from te_lab.kernels import use_backend
from te_lab.profiler import GenerationProfile, ProfileReport, ProfileRun, profile, profile_generation
from te_lab.profiler.gpu_trace import open_trace
from te_lab.profiler.opportunities import opportunities
from te_lab.surgery import (
    BuildOptions,
    FusionReport,
    FusionRule,
    Match,
    ProbeInputs,
    Skip,
    UnfuseResult,
    Variant,
    fuse,
    fusions,
    is_fused,
    register_rule,
    rules,
    unfuse,
    unfused,
    unregister_rule,
)
from te_lab.version import __version__
from te_lab.views import show, to_html


def __getattr__(name: str):
    # te_lab.TrainerCallback subclasses transformers.TrainerCallback: loaded on first use,
    # so `import te_lab` does not import transformers.
    if name == "TrainerCallback":
        from te_lab.integrations.trainer import TrainerCallback

        return TrainerCallback
    raise AttributeError(f"module 'te_lab' has no attribute {name!r}")


def load_ipython_extension(shell) -> None:
    """``%load_ext te_lab``: the magics (see ``te_lab.extensions``)."""
    from te_lab.extensions import load_ipython_extension as load

    load(shell)


def unload_ipython_extension(shell) -> None:
    """``%unload_ext te_lab``."""
    from te_lab.extensions import unload_ipython_extension as unload

    unload(shell)


__all__ = [
    "BuildOptions",
    "FusionReport",
    "FusionRule",
    "GenerationProfile",
    "Match",
    "ProbeInputs",
    "ProfileReport",
    "ProfileRun",
    "Skip",
    "TrainerCallback",
    "UnfuseResult",
    "Variant",
    "__version__",
    "device",
    "distributed",
    "fuse",
    "is_fused",
    "fusions",
    "kernels",
    "load_ipython_extension",
    "models",
    "modules",
    "open_trace",
    "optim",
    "opportunities",
    "profile",
    "profile_generation",
    "register_rule",
    "rules",
    "show",
    "to_html",
    "unfuse",
    "unfused",
    "unload_ipython_extension",
    "unregister_rule",
    "use_backend",
]
