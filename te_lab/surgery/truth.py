"""The truth a probe measures errors against: the original module run in float64.

Comparing a twin with its original element by element mistakes rounding for a bug once
activations reach real checkpoints' 1e3-1e4: two correct float32 computations of the same
math then differ by more than any fixed tolerance of the values. So the probe runs the
original a third time with its parameters, buffers and floating inputs in float64 and
measures each side's error against that run (:func:`te_lab.kernels.precision.error_budget`
says how much the twin may have).

:func:`float64_run` holds the module's parameters and buffers in float64 by putting
float64 copies in their place in each module's ``_parameters`` / ``_buffers`` for the block
(a tensor shared by several modules gets one copy). The original tensors are never touched:
changing a Parameter's dtype through ``.data``, even and back, drops the autograd node that
accumulates its gradient, and with it the hooks DDP registered there, so DDP would stop
all-reducing that gradient. Through a ``TorchFunctionMode`` it also keeps casts that the
module's own code makes to a lower precision (Hugging Face's norms compute in ``.float()``,
eager attention's softmax in ``dtype=torch.float32``) in float64. Autocast is off inside.
Asked to (``grouped_mm=True``: the whole-model probe and the whole model's check), it runs
``torch._grouped_mm`` (Hugging Face's grouped-GEMM MoE experts), which takes no float64, as one
matmul per group; a probe of an MoE block alone keeps comparing with the original, whose
expert gradients' rows its row bar has not been studied on (1cef204).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_LOWER_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_DOWNCASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}
_GROUPED_MM = getattr(torch, "_grouped_mm", None)  # torch >= 2.8


def _float64(value: Any) -> Any:
    if isinstance(value, torch.dtype) and value in _LOWER_FLOATS:
        return torch.float64
    return value


def _grouped_mm_by_group(mat_a: Tensor, mat_b: Tensor, offs: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                         out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``torch._grouped_mm`` as a matmul per group, for float64: ``mat_a`` [rows, k] against
    ``mat_b`` [groups, k, n] with ``offs`` the groups' cumulative row ends (rows past the last
    end belong to no group: zeros), or [groups, m, k] against [groups, k, n] without
    ``offs``; ``bias`` [groups, n]."""
    if mat_a.dim() == 3 and mat_b.dim() == 3 and offs is None:
        out = torch.bmm(mat_a, mat_b)
        return out if bias is None else out + bias.unsqueeze(1)
    if mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None:
        raise NotImplementedError(f"te_lab's float64 truth: torch._grouped_mm of a {mat_a.dim()}-D and a "
                                  f"{mat_b.dim()}-D tensor {'with' if offs is not None else 'without'} offs")
    ends = offs.tolist()
    parts = []
    for group, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        part = mat_a[start:end] @ mat_b[group]
        parts.append(part if bias is None else part + bias[group])
    return torch.cat(parts + [mat_a.new_zeros(mat_a.shape[0] - (ends[-1] if ends else 0), mat_b.shape[-1])])


class _KeepFloat64(TorchFunctionMode):
    """Rewrites requests for float32 / float16 / bfloat16 results into float64 (and, with
    ``grouped_mm``, float64 grouped matmuls into one matmul per group)."""

    def __init__(self, grouped_mm: bool = False):
        super().__init__()
        self.grouped_mm = grouped_mm

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.grouped_mm and func is _GROUPED_MM and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:
            return _grouped_mm_by_group(*args, **kwargs)
        if func in _DOWNCASTS and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            return args[0]
        if "dtype" in kwargs:
            kwargs = {**kwargs, "dtype": _float64(kwargs["dtype"])}
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(_float64(a) for a in args)
        return func(*args, **kwargs)


def to_float64(value: Any) -> Any:
    """``value`` with every floating tensor in float64 (containers rebuilt, others as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: to_float64(v) for k, v in value.items()}
    return value


@contextlib.contextmanager
def float64_run(roots: Sequence[nn.Module], *, grouped_mm: bool = False) -> Iterator[Callable[[Tensor], Tensor]]:
    """Inside the block, ``roots``' floating parameters and buffers are float64 copies (a
    Parameter's copy is a Parameter that requires grad as it does) and so is every floating
    result their code asks for; with ``grouped_mm``, ``torch._grouped_mm`` runs one matmul
    per group. Yields the map from an original tensor to the copy that
    stands in for it (a tensor the roots do not hold maps to itself), so gradients can be
    taken with respect to the copies. Afterwards each module holds its own tensors again;
    the tensors themselves were never changed."""
    copies: dict[int, Tensor] = {}

    def stand_in(tensor: Tensor) -> Tensor:
        if id(tensor) not in copies:
            wide = tensor.detach().to(torch.float64)
            copies[id(tensor)] = nn.Parameter(wide, tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
                else wide
        return copies[id(tensor)]

    modules = list({id(m): m for root in roots for m in root.modules()}.values())
    replaced = [(store, name, tensor) for module in modules for store in (module._parameters, module._buffers)
                for name, tensor in store.items() if tensor is not None and tensor.is_floating_point()]
    try:
        for store, name, tensor in replaced:
            store[name] = stand_in(tensor)
        device_types = {tensor.device.type for _, _, tensor in replaced} or {"cpu"}
        with contextlib.ExitStack() as stack:
            for device_type in device_types:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            stack.enter_context(_KeepFloat64(grouped_mm))
            yield lambda tensor: copies.get(id(tensor), tensor)
    finally:
        for store, name, tensor in replaced:
            store[name] = tensor
