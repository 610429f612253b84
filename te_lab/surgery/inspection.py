"""What the rules read off a module: its activation (by what it computes, not by its
class), its epsilon, its head counts, and the dtype and device its inputs will have."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_lab.kernels.precision import TOLERANCES
from te_lab.modules.call_arguments import forward_signature

EPSILON_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")
ACTIVATION_ATTRIBUTES = ("act_fn", "act", "activation_fn", "activation", "intermediate_act_fn")
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads")

_ACTIVATION_REFERENCES: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu_squared": lambda x: torch.square(F.relu(x)),
}


def _evaluated(fn: Callable, x: Tensor) -> Optional[Tensor]:
    """``fn(x)`` without gradients when it is a tensor of ``x``'s shape, else ``None`` (a
    function that fails or returns something else is not the one being identified)."""
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:  # noqa: BLE001 - any failure means "not what we know"
        return None
    return y if isinstance(y, Tensor) and y.shape == x.shape else None


def identify_activation(fn: Callable) -> Optional[str]:
    """The fused activation ``fn`` computes ("gelu", "gelu_tanh", "silu", "relu_squared"), found by
    evaluating it, or ``None``. Exact and tanh GELU differ by up to ~5e-4 on this grid,
    far above float64 rounding, so the answer is unambiguous."""
    x = torch.linspace(-8.0, 8.0, 1601, dtype=torch.float64)
    y = _evaluated(fn, x)
    if y is None:
        return None
    for name, reference in _ACTIVATION_REFERENCES.items():
        if torch.allclose(y.double(), reference(x), rtol=0, atol=1e-7):
            return name
    return None


def identify_rms_norm(norm: nn.Module) -> Optional[tuple[float, float]]:
    """``(eps, weight_offset)`` when ``norm`` computes RMSNorm over the last dim scaled by
    its ``weight`` (offset 0) or by ``1 + weight`` (Gemma, offset 1), found by evaluating
    it; ``None`` for anything else (LayerNorm, per-head weights, no weight). The two
    scalings differ by the normalized input itself, so the answer is unambiguous."""
    weight, eps = norm._parameters.get("weight"), epsilon_of(norm)
    if weight is None or weight.dim() != 1 or eps is None or norm._modules or set(norm._parameters) != {"weight"}:
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((4, weight.shape[0]), generator=generator).to(weight.device, weight.dtype)
    y = _evaluated(norm, x)
    if y is None:
        return None
    normalized = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    # Model libraries compute norms in float32 whatever the dtype: float64 weights too.
    atol = rtol = max(TOLERANCES.get(weight.dtype, TOLERANCES[torch.float32])["rtol"], 1e-5)
    for offset in (0.0, 1.0):
        if torch.allclose(y.double(), normalized * (weight.double() + offset), rtol=rtol, atol=atol):
            return eps, offset
    return None


def identify_weightless_rms_norm(norm: nn.Module, width: int) -> Optional[float]:
    """The ``eps`` of a norm without parameters that computes ``x * rsqrt(mean(x**2) + eps)``
    over the last dim (Llama 4's ``qk_norm``), found by evaluating it on rows ``width``
    wide; ``None`` for anything else (a LayerNorm without affine parameters, a norm with
    weights: :func:`identify_rms_norm`)."""
    eps = epsilon_of(norm)
    if eps is None or norm._parameters or norm._modules:
        return None
    x = torch.randn((4, width), generator=torch.Generator(device="cpu").manual_seed(0)) * 3
    y = _evaluated(norm, x)
    if y is None:
        return None
    normalized = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    atol = rtol = TOLERANCES[torch.float32]["rtol"]
    return eps if torch.allclose(y.double(), normalized, rtol=rtol, atol=atol) else None


def describe_callable(fn: Any) -> str:
    return type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", type(fn).__name__)


def activation_attribute(module: nn.Module) -> Optional[tuple[str, Callable]]:
    """An activation held as a plain attribute (``self.act_fn = F.silu``)."""
    for name in ACTIVATION_ATTRIBUTES:
        value = module.__dict__.get(name)
        if callable(value) and not isinstance(value, nn.Module):
            return name, value
    return None


def epsilon_of(module: nn.Module) -> Optional[float]:
    for name in EPSILON_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def head_count(module: nn.Module) -> Optional[int]:
    for source in (module, getattr(module, "config", None)):
        for name in HEAD_COUNT_ATTRIBUTES:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def float_attribute(module: nn.Module, name: str, default: float) -> float:
    value = getattr(module, name, default)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def takes_argument(module: nn.Module, name: str) -> bool:
    try:
        return name in forward_signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def tensor_like(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of a module's floating-point parameters (its inputs will
    have them); float32 on the CPU for a module without any."""
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype, parameter.device
    return torch.float32, torch.device("cpu")


def random_tensor(shape: tuple[int, ...], like: nn.Module, seed: int = 0) -> Tensor:
    """A standard-normal tensor in the module's dtype and device, drawn from a private
    generator so the caller's RNG stream is untouched."""
    dtype, device = tensor_like(like)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def rotary_tables(batch: int, seq: int, head_dim: int, like: nn.Module, theta: float = 10000.0):
    """Hugging Face-convention RoPE tables ``(cos, sin)``, each ``[batch, seq, head_dim]``."""
    dtype, device = tensor_like(like)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1).expand(batch, seq, head_dim)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def complex_rotary_tables(batch: int, seq: int, pairs: int, like: nn.Module, theta: float = 10000.0) -> Tensor:
    """RoPE tables as complex frequencies (Llama 4's ``freqs_cis``): ``[batch, seq, pairs]``
    unit complex numbers ``exp(i * position * inv_freq)``, complex64 (complex128 for a
    float64 module), the rotation of each pair of dims."""
    dtype, device = tensor_like(like)
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.float64) / (2 * pairs)))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    tables = torch.polar(torch.ones_like(angles), angles).expand(batch, seq, pairs)
    return tables.to(device, torch.complex128 if dtype == torch.float64 else torch.complex64)
