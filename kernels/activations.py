"""Activation functions and their derivatives, shared by the fused ops that apply one
(bias + activation, gated MLPs): the eager PyTorch form used by the reference and
Inductor backends, and ``@triton.jit`` helpers used inside Triton kernels.

    gelu       0.5 x (1 + erf(x / sqrt 2))                    F.gelu(x)
    gelu_tanh  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  F.gelu(x, approximate="tanh")
    silu       x sigmoid(x)                                   F.silu(x)
    relu_squared  relu(x)^2                                   ReLU-squared MLPs (Nemotron, Arcee,
                                                              Persimmon, Nanochat: "relu2")

Triton 3.2 (what MUSA ships) has no tanh in its core language, so tanh(z) is
written as 2 sigmoid(2z) - 1.

The derivatives never produce subnormal floats: GELU's Gaussian term is evaluated at x
clamped to [-10, 10] and SiLU's sigmoid at x >= -80, where the true values are below
1e-20 anyway. Without the clamps a large pre-activation (|x| ~ 13 for GELU) yields
subnormal gradients, and the GEMMs that consume them run several times slower on x86
CPUs (measured here: Linear + GELU backward 3x slower than eager).
"""


from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .triton_support import HAS_TRITON, tl, triton

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu_squared")
# Triton kernels take the activation as an integer constexpr.
ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}

# The eager code's constants. The Triton kernels write them as literals (Triton reads a
# module's globals only as constexprs, which its interpreter cannot multiply from the
# left), and kernels/cpp/activations.h as its own constants.
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Where the clamped terms are already negligible (< 1e-20) but still normal floats.
_PDF_CLAMP = 10.0
_SIGMOID_FLOOR = -80.0


def activate(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation itself, as model code calls it."""
    if name == "silu":
        return F.silu(x)
    if name == "relu_squared":
        return torch.square(F.relu(x))
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


def activation_grad(name: str, x: torch.Tensor) -> torch.Tensor:
    """d activation(x) / dx, written out so Inductor fuses it with its neighbours."""
    if name == "silu":
        sig = torch.sigmoid(x.clamp(min=_SIGMOID_FLOOR))
        return sig * (1 + x * (1 - sig))
    if name == "relu_squared":
        return 2 * F.relu(x)
    if name == "gelu":
        bounded = x.clamp(-_PDF_CLAMP, _PDF_CLAMP)
        return 0.5 * (1 + torch.erf(x * _SQRT_HALF)) + bounded * torch.exp(-0.5 * bounded * bounded) * _INV_SQRT_2PI
    # ATen's own tanh-GELU derivative: Inductor lowers it to tighter code than the
    # formula written out (it cannot go subnormal: 1 - tanh^2 is 0 or a normal float).
    return torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate="tanh")


if HAS_TRITON:

    @triton.jit
    def _tanh(z):
        return 2.0 * tl.sigmoid(2.0 * z) - 1.0

    @triton.jit
    def triton_activate(x, ACTIVATION: tl.constexpr):
        """The activation with code ``ACTIVATION`` (see ACTIVATION_CODES) of a float tensor."""
        if ACTIVATION == 0:
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # _SQRT_HALF
        elif ACTIVATION == 1:  # sqrt(2 / pi) and the cubic term's 0.044715, as F.gelu's
            y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
        elif ACTIVATION == 2:
            y = x * tl.sigmoid(x)
        else:
            positive = tl.maximum(x, 0.0)
            y = positive * positive
        return y

    @triton.jit
    def triton_activation_grad(x, ACTIVATION: tl.constexpr):
        """d activation(x) / dx for the activation with code ``ACTIVATION``."""
        if ACTIVATION == 0:
            bounded = tl.minimum(tl.maximum(x, -10.0), 10.0)  # _PDF_CLAMP: no subnormals
            g = (0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
                 + bounded * tl.exp(-0.5 * bounded * bounded) * 0.3989422804014327)  # _INV_SQRT_2PI
        elif ACTIVATION == 1:
            t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))  # 0.134145 = 3 * 0.044715
            g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        elif ACTIVATION == 2:
            sig = tl.sigmoid(tl.maximum(x, -80.0))  # _SIGMOID_FLOOR: no subnormals
            g = sig * (1.0 + x * (1.0 - sig))
        else:
            g = 2.0 * tl.maximum(x, 0.0)
        return g
