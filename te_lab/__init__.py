"""te_lab: fused Transformer kernels you can see working, in Jupyter.

Importing te_lab registers its fused ops with torch (``te_lab::*`` custom ops) and its
fusion rules; it never imports IPython, ipywidgets or plotly.
"""

from te_lab import device, distributed, kernels, models, modules, optim
from te_lab.profiler import ProfileReport, profile
from te_lab.kernels import use_backend
from te_lab.surgery import (BuildOptions, FusionReport, FusionRule, Match, ProbeInputs, Skip, UnfuseResult, Variant,
                            fuse, fusions, is_fused, register_rule, rules, unfuse, unfused, unregister_rule)

__version__ = "0.1.0"


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
    "Match",
    "ProbeInputs",
    "ProfileReport",
    "Skip",
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
    "optim",
    "profile",
    "register_rule",
    "rules",
    "unfuse",
    "unfused",
    "unload_ipython_extension",
    "unregister_rule",
    "use_backend",
]
