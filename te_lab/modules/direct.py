"""A twin's calls at inference, straight to the kernels the registry chose.

A public op (``te_lab.kernels.rope``, ``rms_norm``...) checks its arguments, asks the
registry for a backend and enters its custom op, which asks again whether it may skip the
dispatcher: on one row (a decode step) that Python costs several times what the kernel
takes (a one-row ``rope`` measured 108 us through the public op against 13 us for its C++
kernel called directly, on the loaded 2-core CPU). A twin knows its arguments are
consistent (the original's own Parameters, its own shapes), so a call that needs none of
what those layers are for (:func:`direct_calls_allowed`: no gradients, eval mode, every
op choosing automatically, outside torch.compile, autocast and dispatch or function
modes) asks the registry exactly what the public op would ask, and runs the chosen
backend's forward itself where that is one call (``cpp``: the op's C++ overload;
``reference``: the plain math; for ``rms_norm``, ``inductor``'s compiled kernel); any
other backend goes through the public op. Each
function returns None where it does not run the call itself.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_lab.kernels import registry
from te_lab.kernels.attention import ATTENTION
from te_lab.kernels.glu import GLU, glu_reference
from te_lab.kernels.layout import as_rows, shaped_like
from te_lab.kernels.linear import runs_on_onednn
from te_lab.kernels.registry import select_backend, select_measured_backend
from te_lab.kernels.rms_norm import RMS_NORM, rms_norm_reference
from te_lab.kernels.rope import ROPE, rope_reference
from te_lab.kernels.torch_internals import any_autocast_enabled, dispatch_modes_active, function_modes_active

from . import projection


def _inference_choosing_automatically(twin: nn.Module) -> bool:
    """No gradients, eval mode, and every op of ``twin`` choosing its backend itself."""
    return not (torch.is_grad_enabled() or twin.training or twin.backend is not None or registry.backends_forced())


def direct_calls_allowed(twin: nn.Module) -> bool:
    """Whether ``twin``'s call now may run its kernels directly (see the module doc)."""
    return _inference_choosing_automatically(twin) and not (
        torch.compiler.is_compiling() or any_autocast_enabled() or dispatch_modes_active()
        or function_modes_active())


#: Calls of at most this many rows (a decode step at batch 16 and below) that torch.compile
#: traces without gradients are the original's: Inductor fuses that math across the whole
#: layer itself, where te_lab's ops stand in its graph as calls it cannot look into (issue
#: 28's generation benchmark, batch 1: fused under torch.compile decoded at 0.90x of
#: torch.compile alone, while its prefill of 128 rows ran 1.13x faster).
COMPILED_DECODE_ROWS = 16


def compiled_decode(twin: nn.Module, x) -> bool:
    """Whether ``twin``'s call is a decode step torch.compile traces without gradients
    (:data:`COMPILED_DECODE_ROWS`), every op choosing automatically: then the original runs."""
    return (torch.compiler.is_compiling() and isinstance(x, Tensor) and x.dim() > 0
            and x.numel() // max(x.shape[-1], 1) <= COMPILED_DECODE_ROWS and _inference_choosing_automatically(twin))


def _without_hooks(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def project(module: nn.Module, x: Tensor, pinned: Optional[str]) -> Tensor:
    """``module(x)`` for a twin's projection child: a plain ``nn.Linear`` without hooks as
    ``F.linear`` (what its forward runs) unless the registry routes it to oneDNN (``linear``
    on ``native``, then through :func:`te_lab.modules.projection.project`); anything else
    (hooks, a LoRA layer) as a module call. ``pinned``: the twin's backend for ``linear``."""
    if type(module) is not nn.Linear or not _without_hooks(module):
        return module(x)
    if projection.routes_to_linear(module) and (
            pinned == "native" or (pinned is None and runs_on_onednn(x, module.weight))):
        return projection.project(module, x, pinned)
    return F.linear(x, module.weight, module.bias)


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, weight_offset: float) -> Optional[Tensor]:
    """``te_lab.kernels.rms_norm(x, weight, eps, weight_offset=...)`` on ``cpp``, ``inductor``
    (its compiled row kernel, one call: at one row it measures as fast as ``cpp``) or
    ``reference``."""
    n = x.shape[-1]
    chosen = select_measured_backend(RMS_NORM, x.device, None, x.dtype, (x.numel() // max(n, 1), n))
    if chosen == "cpp":
        return RMS_NORM.implementations["cpp"](x, None, weight, float(eps), float(weight_offset))[0]
    if chosen == "inductor":
        y = RMS_NORM.implementations["inductor"].forward(as_rows(x), None, weight, float(eps), float(weight_offset))[0]
        return shaped_like(y, x)
    if chosen == "reference":
        return rms_norm_reference(x, weight, eps, weight_offset=weight_offset)
    return None


def glu(gate: Tensor, up: Optional[Tensor], activation: str) -> Optional[Tensor]:
    """``te_lab.kernels.glu(gate, up, activation)`` on ``cpp`` or ``reference``."""
    n = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    chosen = select_measured_backend(GLU, gate.device, None, gate.dtype,
                                     (gate.numel() // max(gate.shape[-1], 1), n), (activation,))
    if chosen == "cpp":
        return GLU.implementations["cpp"](gate, up, activation)
    if chosen == "reference":
        return glu_reference(gate, up, activation)
    return None


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
         norm: dict) -> Optional[tuple[Tensor, Tensor]]:
    """``te_lab.kernels.rope(q, k, cos, sin, interleaved=..., **norm)`` (layout ``bhsd``) on
    ``cpp`` or ``reference``."""
    rows = (q.numel() + k.numel()) // max(q.shape[-1], 1)
    normalized = norm.get("q_norm_weight") is not None
    chosen = select_measured_backend(ROPE, q.device, None, q.dtype, (rows, q.shape[-1]), (interleaved, normalized))
    if chosen == "cpp":
        # The C++ kernels read the tables as dense rows (as the public op ensures).
        cos, sin = (table if table.is_contiguous() else table.contiguous() for table in (cos, sin))
        return ROPE.implementations["cpp"](q, k, cos, sin, interleaved, "bhsd", norm.get("q_norm_weight"),
                                           norm.get("k_norm_weight"), float(norm.get("norm_eps", 1e-6)),
                                           float(norm.get("norm_weight_offset", 0.0)))
    if chosen == "reference":
        return rope_reference(q, k, cos, sin, interleaved=interleaved, **norm)
    return None


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool,
              scale: float) -> Optional[Tensor]:
    """``te_lab.kernels.attention(q, k, v, causal=..., mask=..., scale=...)`` without sinks,
    soft-capping or dropout, where the registry's automatic choice is ``native``: SDPA, as
    that op runs a call without gradients. Not with both a mask and ``causal`` (the op
    merges them), nor a float mask of another dtype than q's (the op converts it)."""
    if (mask is not None and (causal or (mask.dtype != torch.bool and mask.dtype != q.dtype))
            or select_backend(ATTENTION, q.device) != "native"):
        return None
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa)
