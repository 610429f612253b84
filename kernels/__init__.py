"""te_lab's fused ops (importable as ``te_lab.kernels``).

One file per op: its reference math, its Triton kernels, its autograd formula and
its ``torch.library`` custom ops (``te_lab::<op>`` and ``te_lab::<op>_backward``,
the names torch.profiler shows). Importing this package registers them.
"""

from .adamw import FusedAdamW, adamw_reference_step
from .attention import attention, attention_reference
from .bias_act import bias_act, bias_act_reference, linear_act, linear_act_reference
from .cross_entropy import cross_entropy, cross_entropy_reference
from .fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from .glu import geglu, glu, glu_reference, swiglu
from .layer_norm import layer_norm, layer_norm_reference
from .registry import BACKENDS, FusedOp, available_backends, registered_ops, select_backend, use_backend
from .rms_norm import rms_norm, rms_norm_reference
from .rope import apply_rotary, apply_rotary_reference

__all__ = [
    "BACKENDS",
    "FusedAdamW",
    "FusedOp",
    "adamw_reference_step",
    "apply_rotary",
    "apply_rotary_reference",
    "attention",
    "attention_reference",
    "available_backends",
    "bias_act",
    "bias_act_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "geglu",
    "glu",
    "glu_reference",
    "layer_norm",
    "layer_norm_reference",
    "linear_act",
    "linear_act_reference",
    "registered_ops",
    "rms_norm",
    "rms_norm_reference",
    "select_backend",
    "swiglu",
    "use_backend",
]
