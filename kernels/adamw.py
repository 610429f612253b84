"""AdamW: one fused optimizer step over many parameters at once.

For each parameter p with gradient g (negated when maximizing), at step t:

    p     <- p * (1 - lr * weight_decay)                       decoupled weight decay
    m     <- m + (1 - beta1) * (g - m)                         torch's lerp form
    v     <- v * beta2 + (1 - beta2) * g * g
    v_max <- max(v_max, v)                                     amsgrad only; replaces v below
    p     <- p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

This is torch.optim.AdamW's algorithm in the order torch evaluates it, so float32
results agree with it to rounding. The arithmetic runs in float32 (float64 for float64
parameters) and each tensor is rounded once when written back. For bfloat16/float16
parameters that is what ``torch.optim.AdamW(fused=True)`` does (the CPU results agree bit
for bit); torch's default foreach path rounds after every elementary op instead, so it
drops updates smaller than half a bf16 step and drifts away within tens of steps, and in
float16 it adds ``eps=1e-8`` where that is zero and divides by zero. The state (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) has torch's keys, dtypes and devices, so
state dicts load both ways between :class:`FusedAdamW` and ``torch.optim.AdamW``. As in
torch's default, ``step`` is a float32 CPU tensor and the bias corrections are computed on
the host in double precision.

Backends (see :mod:`te_lab.kernels.registry`):

- ``triton``: one multi-tensor launch per device, dtype and amsgrad setting, covering
  every param group. A table of raw tensor addresses, per-chunk offsets and per-tensor
  hyperparameters goes to the device in one copy; each program updates one chunk of one
  tensor. Under Triton's interpreter the addresses are host addresses, so the kernel
  runs there on CPU tensors only (which is what the tests do).
- ``native``: ``torch._fused_adamw_`` where the device has it (the CPU and CUDA in recent
  torch), torch's foreach implementation elsewhere. The CPU default.
- ``reference``: :func:`adamw_reference_step`, one parameter at a time.

There is no ``inductor`` backend: on the CPU, torch.compile of AdamW's step ran 1.24x
slower than ATen's fused kernel over 21M parameters, after a 49 s compile.
"""

from __future__ import annotations

import functools
import math
import os
from array import array
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from torch.optim.adamw import adamw as torch_adamw

from te_lab import device as devices

from .costs.adamw import COSTS
from .precision import compute_dtype, triton_compute_dtype
from .registry import FusedOp, aten_kernel_exists, register_op, select_backend
from .triton_support import HAS_TRITON, tl, triton

NAME = "adamw"
OPTIMIZER = "FusedAdamW"
PROFILER_NAME = "te_lab::adamw_step"


def adamw_reference_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                         exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor],
                         state_steps: list[Tensor], *, lr: float, beta1: float, beta2: float,
                         eps: float, weight_decay: float, amsgrad: bool = False,
                         maximize: bool = False) -> None:
    """One AdamW step, one parameter at a time, in place (the arguments of
    ``torch.optim.adamw.adamw``): the truth every backend is compared against."""
    for index, param in enumerate(params):
        state_steps[index] += 1
        step = state_steps[index].item()
        acc = compute_dtype(param)
        grad = grads[index].to(acc)
        if maximize:
            grad = -grad
        p = param.to(acc) * (1 - lr * weight_decay)
        m = exp_avgs[index].to(acc)
        m = m + (1 - beta1) * (grad - m)
        v = exp_avg_sqs[index].to(acc) * beta2 + (1 - beta2) * grad * grad
        exp_avgs[index].copy_(m)
        exp_avg_sqs[index].copy_(v)
        if amsgrad:
            v = torch.maximum(max_exp_avg_sqs[index].to(acc), v)
            max_exp_avg_sqs[index].copy_(v)
        denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
        param.copy_(p - lr / (1 - beta1**step) * (m / denom))


@dataclass(frozen=True)
class AdamWHyperparameters:
    """A param group's settings for one step (a tensor lr read as a float)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool

    def as_kwargs(self) -> dict:
        return dict(lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=self.weight_decay, amsgrad=self.amsgrad, maximize=self.maximize)


@dataclass
class AdamWTensors:
    """The tensors of one param group on one device that take this step, in the lists
    ``torch.optim.adamw.adamw`` takes (``max_exp_avg_sqs`` is empty without amsgrad)."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    max_exp_avg_sqs: list[Tensor] = field(default_factory=list)
    state_steps: list[Tensor] = field(default_factory=list)

    def as_lists(self) -> tuple[list[Tensor], ...]:
        return (self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs,
                self.state_steps)

    def members(self, index: int) -> list[Tensor]:
        """Parameter ``index``'s param, grad, exp_avg, exp_avg_sq (and max_exp_avg_sq)."""
        return [tensors[index] for tensors in self.as_lists()[:5] if tensors]

    def append(self, members: list[Tensor], state_step: Tensor) -> None:
        """Add one parameter's :meth:`members` and step count."""
        for tensors, member in zip(self.as_lists(), members):
            tensors.append(member)
        self.state_steps.append(state_step)


def _share_dense_layout(tensors: list[Tensor]) -> bool:
    """Whether the tensors fill the same ``numel()`` consecutive elements in the same
    order, so a kernel can walk them as flat arrays from their data pointers."""
    first = tensors[0]
    expected = 1
    for size, stride in sorted(zip(first.shape, first.stride()), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    strides = [stride for size, stride in zip(first.shape, first.stride()) if size != 1]
    return all(tensor.shape == first.shape
               and [s for size, s in zip(tensor.shape, tensor.stride()) if size != 1] == strides
               for tensor in tensors[1:])


def _flat_walkable(members: list[Tensor], write_backs: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """``members`` (see :meth:`AdamWTensors.members`) in a form a flat kernel can walk:
    themselves when they share one dense layout, else contiguous stand-ins (rare: a
    strided parameter, or a gradient laid out unlike its parameter). For each stand-in
    the kernel writes (all but the gradient's), ``(original, stand_in)`` is appended to
    ``write_backs``, to be copied back once the kernel has run."""
    if all(map(Tensor.is_contiguous, members)) or _share_dense_layout(members):
        return members
    flat = [member.contiguous() for member in members]
    write_backs += [(original, stand_in) for index, (original, stand_in) in enumerate(zip(members, flat))
                    if index != 1 and stand_in is not original]
    return flat


def _copy_back(write_backs: list[tuple[Tensor, Tensor]]) -> None:
    for original, stand_in in write_backs:
        original.copy_(stand_in)


def _count_step(state_steps: list[Tensor]) -> None:
    """Add one to every step count. The counts live on the CPU, where a tensor operand
    keeps foreach off its slow path (wrapping the scalar once per tensor), as torch does."""
    torch._foreach_add_(state_steps, torch.tensor(1.0), alpha=1.0)


# What every backend's step() takes: the param groups' work on one device.
DeviceWork = list[tuple[AdamWHyperparameters, AdamWTensors]]


class _Reference:
    @staticmethod
    def step(work: DeviceWork) -> None:
        for hyper, tensors in work:
            adamw_reference_step(*tensors.as_lists(), **hyper.as_kwargs())


def _flat_by_dtype(tensors: AdamWTensors, write_backs: list[tuple[Tensor, Tensor]]
                   ) -> dict[torch.dtype, AdamWTensors]:
    """One group's tensors split by dtype (fused kernels take one dtype per call), each
    parameter's members made walkable as flat arrays (see :func:`_flat_walkable`)."""
    dtypes = {param.dtype for param in tensors.params}
    if len(dtypes) == 1 and all(all(map(Tensor.is_contiguous, tensor_list))
                                for tensor_list in tensors.as_lists()[:5]):
        return {dtypes.pop(): tensors}  # the common case, without a per-parameter pass
    split: dict[torch.dtype, AdamWTensors] = {}
    for index, param in enumerate(tensors.params):
        split.setdefault(param.dtype, AdamWTensors()).append(
            _flat_walkable(tensors.members(index), write_backs), tensors.state_steps[index])
    return split


class _Native:
    """``torch._fused_adamw_`` (one pass per tensor) where the device has it; torch's
    foreach implementation (a few passes over each dtype group) elsewhere."""

    @staticmethod
    def step(work: DeviceWork) -> None:
        for hyper, tensors in work:
            device = tensors.params[0].device
            if not aten_kernel_exists("aten::_fused_adamw_", device.type):
                torch_adamw(*tensors.as_lists(), foreach=True, **hyper.as_kwargs())  # counts the step too
                continue
            # ATen's fused kernels walk each tensor as a flat array from its data pointer:
            # given a strided parameter, or a gradient laid out unlike its parameter, the
            # CPU one (torch 2.13) computes wrong values and writes outside the parameter.
            write_backs: list[tuple[Tensor, Tensor]] = []
            for part in _flat_by_dtype(tensors, write_backs).values():
                _count_step(part.state_steps)
                # The fused kernels read the step counts on the parameters' device;
                # te_lab keeps them on the CPU like torch.optim.AdamW's default does.
                steps = part.state_steps
                if device.type != "cpu":
                    steps = list(torch.stack(steps).to(device).unbind())
                torch._fused_adamw_(part.params, part.grads, part.exp_avgs, part.exp_avg_sqs,
                                    part.max_exp_avg_sqs, steps, grad_scale=None, found_inf=None,
                                    **hyper.as_kwargs())
            _copy_back(write_backs)


# ---- the triton backend: a multi-tensor kernel fed by a table of raw addresses ----

# Per tensor, the table holds these int64 fields ...
_TENSOR_FIELDS = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "numel")
# ... per chunk: the tensor's row and the chunk's first element ...
_CHUNK_FIELDS = ("tensor", "start")
# ... and per tensor these scalars, in the compute dtype, from the host's double-precision math.
_SCALAR_FIELDS = ("decay", "lerp_weight", "beta2", "one_minus_beta2", "eps", "neg_step_size",
                  "bias_correction2_sqrt", "grad_sign")

_BLOCK = 1024
_MAX_CHUNK = 65536
_PROGRAMS_PER_UNIT = 8

_TRITON_DTYPES = {}
if HAS_TRITON:
    _TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
                      torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}

    @triton.jit
    def _chunk_pointer(row, field: tl.constexpr, start, ELEMENT: tl.constexpr, ALIGNED: tl.constexpr):
        """Field ``field`` of a tensor's table row, an address, as a pointer to the chunk's
        first element."""
        pointer = tl.load(row + field).to(tl.pointer_type(ELEMENT))
        if ALIGNED:
            pointer = tl.multiple_of(pointer, 16)
        return pointer + start

    @triton.jit
    def _adamw_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, scalars, index, mask,
                     ACC: tl.constexpr, AMSGRAD: tl.constexpr):
        """Update the elements at ``index`` (all of them when ``mask`` is None). Lanes
        masked off load undefined values, which are never stored."""
        # Offsets follow _SCALAR_FIELDS.
        decay = tl.load(scalars)
        lerp_weight = tl.load(scalars + 1)
        beta2 = tl.load(scalars + 2)
        one_minus_beta2 = tl.load(scalars + 3)
        eps = tl.load(scalars + 4)
        neg_step_size = tl.load(scalars + 5)
        bias_correction2_sqrt = tl.load(scalars + 6)
        grad_sign = tl.load(scalars + 7)
        # Everything is converted to ACC right after loading: the arithmetic happens once,
        # at full precision (Triton's interpreter also mis-computes bf16 arithmetic).
        g = tl.load(grad + index, mask=mask).to(ACC) * grad_sign
        p = tl.load(param + index, mask=mask).to(ACC) * decay
        m = tl.load(exp_avg + index, mask=mask).to(ACC)
        m = m + lerp_weight * (g - m)
        v = tl.load(exp_avg_sq + index, mask=mask).to(ACC) * beta2
        v = v + one_minus_beta2 * g * g
        tl.store(exp_avg + index, m.to(exp_avg.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq + index, v.to(exp_avg_sq.dtype.element_ty), mask=mask)
        if AMSGRAD:
            v = tl.maximum(tl.load(max_exp_avg_sq + index, mask=mask).to(ACC), v)
            tl.store(max_exp_avg_sq + index, v.to(max_exp_avg_sq.dtype.element_ty), mask=mask)
        p = p + neg_step_size * (m / (tl.sqrt(v) / bias_correction2_sqrt + eps))
        tl.store(param + index, p.to(param.dtype.element_ty), mask=mask)

    @triton.jit
    def _adamw_multi_tensor_kernel(TENSORS, CHUNKS, SCALARS, chunk_elements,
                                   ELEMENT: tl.constexpr, ACC: tl.constexpr, AMSGRAD: tl.constexpr,
                                   ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        # Table offsets follow _TENSOR_FIELDS (6 per tensor), _CHUNK_FIELDS (2 per chunk)
        # and _SCALAR_FIELDS (8 per tensor).
        chunk = tl.program_id(0).to(tl.int64)
        tensor = tl.load(CHUNKS + 2 * chunk)
        start = tl.multiple_of(tl.load(CHUNKS + 2 * chunk + 1), BLOCK)  # chunks are whole blocks
        row = TENSORS + 6 * tensor
        param = _chunk_pointer(row, 0, start, ELEMENT, ALIGNED)
        grad = _chunk_pointer(row, 1, start, ELEMENT, ALIGNED)
        exp_avg = _chunk_pointer(row, 2, start, ELEMENT, ALIGNED)
        exp_avg_sq = _chunk_pointer(row, 3, start, ELEMENT, ALIGNED)
        max_exp_avg_sq = _chunk_pointer(row, 4, start, ELEMENT, ALIGNED)  # address 0 without amsgrad
        scalars = SCALARS + 8 * tensor
        length = tl.minimum(tl.load(row + 5) - start, chunk_elements)
        # Whole blocks without a mask, so that with aligned addresses the compiler can
        # vectorize their loads and stores; then the tail, masked.
        blocks = length // BLOCK
        for block in range(0, blocks):
            index = block * BLOCK + tl.arange(0, BLOCK)
            _adamw_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, scalars, index, None,
                         ACC, AMSGRAD)
        if blocks * BLOCK < length:
            index = blocks * BLOCK + tl.arange(0, BLOCK)
            _adamw_block(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, scalars, index,
                         index < length, ACC, AMSGRAD)


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    return _PROGRAMS_PER_UNIT * devices.multiprocessor_count(device)


def _chunk_elements(device: torch.device, total: int) -> int:
    """Elements per program: enough programs to fill every parallel unit a few times,
    each looping over at most _MAX_CHUNK elements."""
    share = max(total // _target_programs(device), 1)
    return min(max(1 << (share.bit_length() - 1), _BLOCK), _MAX_CHUNK)


class _MultiTensorLaunch:
    """The tensors one kernel launch updates: one device, one dtype, one amsgrad setting.
    The table is built in a flat int64 ``array`` (several times faster than torch.tensor
    of Python lists) that becomes a tensor without a copy."""

    def __init__(self):
        self.tensor_rows = array("q")  # _TENSOR_FIELDS per tensor
        self.scalars: list[float] = []  # _SCALAR_FIELDS per tensor
        self.numels: list[int] = []
        # The table holds raw addresses only: the tensors (stand-ins included) are kept
        # alive here until the launch is queued.
        self.walked: list[list[Tensor]] = []
        self.write_backs: list[tuple[Tensor, Tensor]] = []

    def add(self, members: list[Tensor], scalars: tuple[float, ...]) -> None:
        """One parameter's :meth:`AdamWTensors.members` and its :func:`_kernel_scalars`."""
        # The kernel reads every member as the parameter's dtype, through raw addresses.
        if any(member.dtype != members[0].dtype for member in members[2:]):
            raise TypeError(
                f"{OPTIMIZER}: the state of a {members[0].dtype} parameter has dtypes "
                f"{[member.dtype for member in members[2:]]}; expected {members[0].dtype} "
                f"(load_state_dict casts the state to the parameter's dtype)")
        walked = _flat_walkable(members, self.write_backs)
        self.walked.append(walked)
        self.numels.append(walked[0].numel())
        self.tensor_rows.extend(map(Tensor.data_ptr, walked))
        self.tensor_rows.extend([0] * (len(_TENSOR_FIELDS) - 1 - len(walked)))
        self.tensor_rows.append(self.numels[-1])
        self.scalars.extend(scalars)

    def run(self, device: torch.device, dtype: torch.dtype, amsgrad: bool) -> None:
        chunk_elements = _chunk_elements(device, sum(self.numels))
        chunk_rows = array("q")  # _CHUNK_FIELDS per chunk
        for tensor, numel in enumerate(self.numels):
            for start in range(0, numel, chunk_elements):
                chunk_rows.extend((tensor, start))
        chunks = len(chunk_rows) // len(_CHUNK_FIELDS)
        if not chunks:
            return
        sample = torch.empty((), dtype=dtype)
        acc = compute_dtype(sample)
        # One host-to-device copy per launch: tensor rows, chunk rows and scalars share a buffer.
        table = self.tensor_rows + chunk_rows
        table.frombytes(array("d" if acc == torch.float64 else "f", self.scalars).tobytes())
        table = torch.frombuffer(table, dtype=torch.int64)
        tensor_end = len(self.tensor_rows)
        chunk_end = tensor_end + len(chunk_rows)
        # Chunks start at multiples of _BLOCK elements: only the bases can be unaligned.
        addresses = table[:tensor_end].view(-1, len(_TENSOR_FIELDS))[:, :-1]
        aligned = bool((addresses % 16 == 0).all())
        table = table.to(device)
        with devices.device_guard(device):
            _adamw_multi_tensor_kernel[(chunks,)](
                table[:tensor_end], table[tensor_end:chunk_end], table[chunk_end:].view(acc),
                chunk_elements, ELEMENT=_TRITON_DTYPES[dtype], ACC=triton_compute_dtype(sample),
                AMSGRAD=amsgrad, ALIGNED=aligned, BLOCK=_BLOCK, num_warps=4)
        _copy_back(self.write_backs)


def _kernel_scalars(hyper: AdamWHyperparameters, step: float) -> tuple[float, ...]:
    """The per-tensor values of _SCALAR_FIELDS, computed as torch computes them."""
    return (1 - hyper.lr * hyper.weight_decay, 1 - hyper.beta1, hyper.beta2, 1 - hyper.beta2,
            hyper.eps, -hyper.lr / (1 - hyper.beta1**step), (1 - hyper.beta2**step) ** 0.5,
            -1.0 if hyper.maximize else 1.0)


class _Triton:
    @staticmethod
    def step(work: DeviceWork) -> None:
        device = work[0][1].params[0].device
        if os.environ.get("TRITON_INTERPRET") == "1" and device.type != "cpu":
            raise ValueError(
                f"{NAME}: the triton backend cannot run on {device} under TRITON_INTERPRET=1: "
                f"its kernel follows raw tensor addresses, which the interpreter can only read "
                f"in CPU memory; expected CPU tensors, or unset TRITON_INTERPRET")
        launches: dict[tuple[torch.dtype, bool], _MultiTensorLaunch] = {}
        for hyper, tensors in work:
            _count_step(tensors.state_steps)
            # A group's parameters mostly share one step count, hence one set of scalars.
            scalars_by_step: dict[float, tuple[float, ...]] = {}
            for index, param in enumerate(tensors.params):
                key = (param.dtype, hyper.amsgrad)
                if key not in launches:
                    launches[key] = _MultiTensorLaunch()
                step = tensors.state_steps[index].item()
                if step not in scalars_by_step:
                    scalars_by_step[step] = _kernel_scalars(hyper, step)
                launches[key].add(tensors.members(index), scalars_by_step[step])
        for (dtype, amsgrad), launch in launches.items():
            launch.run(device, dtype, amsgrad)


_IMPLEMENTATIONS = {"native": _Native}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton

# Registered by hand, not declared with define_op (kernels/op_declaration.py): a declaration
# makes a functional op (its outputs returned, with fakes for them, an autograd formula, an
# autocast cast, a C++ overload, the reference path run as the op runs under autocast). An
# optimizer step has none of these: it runs under no_grad, returns nothing and updates five
# lists of tensors in place, across param groups with hyperparameters of their own, in one
# Triton launch per dtype. What it shares with the declared ops, a registry entry for its
# backends and its costs, is this registration; with no te_lab custom op behind it, opcheck
# has nothing of its own to check (the native backend calls ATen's torch._fused_adamw_).
ADAMW = register_op(FusedOp(
    name=NAME,
    reference=adamw_reference_step,
    implementations=_IMPLEMENTATIONS,
    cpu_preference="native",
    costs=COSTS,
))

_STEPPERS = {**_IMPLEMENTATIONS, "reference": _Reference}


# ---- the optimizer ----

def _step_dtype() -> torch.dtype:
    """The dtype torch.optim.AdamW gives ``state['step']`` (outside fused/capturable mode)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_hyperparameters(where: str, group: dict) -> None:
    """torch.optim.AdamW's checks, with messages naming the argument, what was given and
    what was expected."""
    lr = group["lr"]
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: lr as a tensor must have one element, got shape {tuple(lr.shape)}")
    elif not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"{where}: lr must be a float or a one-element tensor, got {type(lr).__name__}")
    if not 0.0 <= lr:
        raise ValueError(f"{where}: lr must be >= 0, got {float(lr)!r}")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{where}: betas[{index}] must be in [0, 1), got {float(beta)!r}")
    for name in ("eps", "weight_decay"):
        if not 0.0 <= group[name]:
            raise ValueError(f"{where}: {name} must be >= 0, got {group[name]!r}")


class FusedAdamW(torch.optim.Optimizer):
    """A drop-in for ``torch.optim.AdamW`` whose step runs as te_lab's fused ``adamw`` op.

    Same constructor, defaults, param groups and per-parameter state (``step``,
    ``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq`` with ``amsgrad=True``), so
    ``state_dict()`` loads into ``torch.optim.AdamW`` and back. torch's
    ``foreach``/``fused``/``capturable``/``differentiable`` switches are replaced by
    ``backend``: ``"triton"``, ``"native"``, ``"reference"``, or ``None`` to choose per
    device (see :mod:`te_lab.kernels.registry`). A tensor ``lr`` is read as a float each
    step. bfloat16/float16 parameters are updated with float32 math, rounded once.
    The step shows in ``torch.profiler`` as ``te_lab::adamw_step``.
    """

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, backend: Optional[str] = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        _check_hyperparameters(OPTIMIZER, defaults)
        self.backend = backend
        super().__init__(params, defaults)
        # A backend that cannot run on a parameter's device is reported now, not at the first step.
        for device in {param.device for group in self.param_groups for param in group["params"]}:
            select_backend(ADAMW, device, backend)

    def add_param_group(self, param_group: dict) -> None:
        merged = {key: param_group.get(key, default) for key, default in self.defaults.items()}
        _check_hyperparameters(f"{OPTIMIZER} param group {len(self.param_groups)}", merged)
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # Pickles carry no backend: Optimizer.__getstate__ keeps defaults, state and groups.
        self.__dict__.setdefault("backend", None)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            for param in group["params"]:
                param_state = self.state.get(param, {})
                step = param_state.get("step")
                # torch's fused or capturable AdamW keeps the count on the parameter's device.
                if step is not None and not (isinstance(step, Tensor) and step.device.type == "cpu"):
                    param_state["step"] = torch.tensor(float(step), dtype=_step_dtype())

    def _group_work(self, group_index: int, group: dict) -> dict[torch.device, AdamWTensors]:
        """The tensors of a group that take this step, by device; creates state lazily."""
        amsgrad = group["amsgrad"]
        work: dict[torch.device, AdamWTensors] = {}
        for param_index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if grad.layout != torch.strided:
                raise RuntimeError(
                    f"{OPTIMIZER}: the gradient of parameter {param_index} in param group {group_index} "
                    f"is sparse ({grad.layout}); expected a dense gradient "
                    f"(torch.optim.SparseAdam handles sparse ones)")
            if grad.dtype != param.dtype or grad.device != param.device:
                raise TypeError(
                    f"{OPTIMIZER}: the gradient of parameter {param_index} in param group {group_index} "
                    f"is {grad.dtype} on {grad.device}; expected {param.dtype} on {param.device} "
                    f"like the parameter")
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_step_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            # Also when amsgrad is switched on mid-run (torch then fails on the missing key):
            # the running maximum starts from zero.
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            tensors = [param, grad, state["exp_avg"], state["exp_avg_sq"]]
            if amsgrad:
                tensors.append(state["max_exp_avg_sq"])
            if torch.is_complex(param):
                tensors = [torch.view_as_real(tensor) for tensor in tensors]
            if param.device not in work:
                work[param.device] = AdamWTensors()
            work[param.device].append(tensors, state["step"])
        return work

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.profiler.record_function(PROFILER_NAME):
            work_by_device: dict[torch.device, DeviceWork] = {}
            for group_index, group in enumerate(self.param_groups):
                beta1, beta2 = group["betas"]
                hyper = AdamWHyperparameters(
                    lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]))
                for device, tensors in self._group_work(group_index, group).items():
                    work_by_device.setdefault(device, []).append((hyper, tensors))
            for device, work in work_by_device.items():
                _STEPPERS[select_backend(ADAMW, device, self.backend)].step(work)
                # ATen's fused kernels and the Triton kernel write through data pointers,
                # which autograd does not see: without the bump, a graph kept from before
                # the step (retain_graph=True) would silently read the updated weights.
                for _, tensors in work:
                    for param in tensors.params:
                        torch.autograd.graph.increment_version(param)
        return loss
