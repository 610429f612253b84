"""A twin's projections: large plain ``nn.Linear`` children run as te_lab's ``linear`` op.

On CPUs where oneDNN's GEMM beats torch's BLAS (:mod:`te_lab.kernels.linear`) the
projections are most of a Transformer's training step, so the attention and MLP twins
call their large projections through ``linear``. Only a plain ``nn.Linear`` with no
hooks of its own is routed: a subclass (LoRA, quantized layers) may compute something
else, and a direct call would skip hooks; those children are called as modules, as
are small ones (under ``MIN_ROUTED_WEIGHT`` elements the custom op's dispatch costs
more than a faster GEMM saves).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from te_lab.kernels.linear import LINEAR, linear_of_module

# A 256 x 256 weight: measured on the 2-core CPU (1 thread), oneDNN's forward product of a
# 512-token batch through it takes 0.28 ms against MKL's 0.63, a saving well above the
# ~50 us of dispatch; at 64 x 176 (the tiny demo Llama) the saving is ~20 us, below it.
MIN_ROUTED_WEIGHT = 256 * 256


def routes_to_linear(module: nn.Module) -> bool:
    """Whether :func:`project` runs ``module`` as te_lab's ``linear`` op."""
    return (type(module) is nn.Linear and module.weight.numel() >= MIN_ROUTED_WEIGHT
            and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                     or module._backward_pre_hooks))


def project(module: nn.Module, x: Tensor, backend: Optional[str]) -> Tensor:
    """``module(x)``, through ``linear`` (with ``backend``) where :func:`routes_to_linear`."""
    if routes_to_linear(module):
        return linear_of_module(x, module.weight, module.bias, backend)
    return module(x)


def linear_ops(*modules: nn.Module) -> tuple:
    """``(LINEAR,)`` when any of ``modules`` is routed, for a twin's ``ops``."""
    return (LINEAR,) if any(routes_to_linear(module) for module in modules) else ()
