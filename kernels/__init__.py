"""te_lab's fused ops (importable as ``te_lab.kernels``).

One file per op: its reference math, its Triton kernels, its autograd formula and
its ``torch.library`` custom ops (``te_lab::<op>`` and ``te_lab::<op>_backward``,
the names torch.profiler shows). Importing this package registers them.
"""


if __name__ != "te_lab.kernels":
    # This folder was imported as a top-level "kernels": a source checkout's root is on
    # sys.path (`python -m pytest`, a shell or notebook started there). Running this
    # package a second time would re-register te_lab's custom ops and destroy the live
    # registrations, so it never runs here. transformers (>= 5.25 depends on it) imports
    # the Hugging Face Hub package of that name: where one is installed elsewhere on
    # sys.path, it takes this module's place; otherwise an empty module without __file__
    # stands in, which transformers reads as "not installed".
    import importlib.machinery
    import importlib.util
    import os
    import sys
    import types

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _checkout]
    _installed = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _installed is not None and _installed.loader is not None:
        _module = importlib.util.module_from_spec(_installed)
        sys.modules[__name__] = _module  # before it runs: its own `from kernels.x import` finds it
        _installed.loader.exec_module(_module)
    else:
        _stand_in = types.ModuleType(__name__, "not te_lab.kernels: import te_lab.kernels instead")
        _stand_in.__spec__ = __spec__  # importlib.util.find_spec needs one
        sys.modules[__name__] = _stand_in
else:
    from .adamw import FusedAdamW, adamw_reference_step
    from .attention import attention, attention_reference
    from .bias_act import bias_act, bias_act_reference, linear_act, linear_act_reference
    from .cross_entropy import cross_entropy, cross_entropy_reference
    from .fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
    from .glu import geglu, glu, glu_reference, swiglu
    from .layer_norm import layer_norm, layer_norm_reference
    from .linear import linear, linear_reference
    from .moe import moe, moe_experts, moe_experts_reference, moe_reference, moe_routing
    from .registry import BACKENDS, FusedOp, available_backends, registered_ops, select_backend, use_backend
    from .rms_norm import rms_norm, rms_norm_reference
    from .rope import apply_rotary, apply_rotary_reference, rope, rope_reference

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
        "linear",
        "linear_reference",
        "linear_act",
        "linear_act_reference",
        "moe",
        "moe_experts",
        "moe_experts_reference",
        "moe_reference",
        "moe_routing",
        "registered_ops",
        "rms_norm",
        "rms_norm_reference",
        "rope",
        "rope_reference",
        "select_backend",
        "swiglu",
        "use_backend",
    ]
