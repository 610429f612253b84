"""te_lab: fused Transformer kernels you can see working, in Jupyter.

Importing te_lab registers its fused ops with torch (``te_lab::*`` custom ops); it
never imports IPython, ipywidgets or plotly.
"""

from te_lab import device, kernels
from te_lab.kernels import use_backend

__version__ = "0.1.0"

__all__ = ["device", "kernels", "use_backend", "__version__"]
