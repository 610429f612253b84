"""RMSNorm, optionally fused with the residual add before it.

    h = x + residual                      (when a residual is given)
    y = h * rsqrt(mean(h**2) + eps) * (weight + weight_offset)

computed in float32 (float64 for float64 inputs) and cast back to the input dtype,
as Llama-family code does. ``weight_offset=1.0`` gives Gemma's ``(1 + weight)`` scaling. With a residual the op
returns ``(y, h)``: ``h`` is the next residual stream, written in the same pass.

Backward: dx = rstd * (g - x_hat * mean(g * x_hat)) with g = dy * w and
x_hat = h * rstd; dw = sum over rows of dy * x_hat. The gradient of ``h`` flowing
in from the residual stream is added in the same pass, and x and residual share it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from te_lab import device as devices

from .autocast import FLOAT32, AutocastRule, inputs_cast_by
from .checks import check_like, check_parameter, check_positive, check_tensor
from .costs.rms_norm import COSTS
from .inductor_compiled import inductor_compiled
from .layout import as_rows, shaped_like
from .measured_choice import op_sample
from .op_declaration import define_op, run_reference
from .precision import compute_dtype, triton_compute_dtype
from .registry import aten_kernel_exists, select_measured_backend
from .triton_support import (
    HAS_TRITON,
    column_block,
    load_norm_input,
    norm_backward_warps,
    num_warps_for,
    row_ranges,
    tl,
    triton,
)

NAME = "rms_norm"


def rms_norm_reference(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
                       residual: Optional[Tensor] = None, weight_offset: float = 0.0):
    """The unfused PyTorch math: the truth every backend is compared against."""
    h = x if residual is None else x + residual
    hf = h.to(compute_dtype(h))
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(hf.dtype) + weight_offset)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


# ---- row-wise math on 2-D tensors, shared by the native and inductor backends ----

def _forward_math(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float,
                  offset: float):
    h = x if residual is None else x + residual
    hf = h.to(compute_dtype(h))
    rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
    y = hf * rstd[:, None]
    if weight is not None:
        y = y * (weight.to(hf.dtype) + offset)
    return y.to(x.dtype), (None if residual is None else h), rstd


def _backward_math(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor],
                   rstd: Tensor, offset: float, need_dw: bool):
    x_hat = h.to(rstd.dtype) * rstd[:, None]
    dyf = dy.to(rstd.dtype)
    g = dyf if weight is None else dyf * (weight.to(rstd.dtype) + offset)
    dx = rstd[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.to(rstd.dtype)
    dw = (dyf * x_hat).sum(0).to(weight.dtype) if need_dw else None
    return dx.to(h.dtype), dw


class _Inductor:
    forward = staticmethod(inductor_compiled(_forward_math))
    backward = staticmethod(inductor_compiled(_backward_math))


def _native_supports(device_type: str) -> bool:
    return all(aten_kernel_exists(f"aten::{name}", device_type)
               for name in ("_fused_rms_norm", "_fused_rms_norm_backward"))


class _Native:
    """ATen's fused RMSNorm kernels where the torch build has both directions for the
    device (CUDA in recent torch; not the CPU, which lacks the backward); the residual
    add stays a separate op."""

    @staticmethod
    def forward(x, residual, weight, eps, offset):
        h = x if residual is None else x + residual
        acc = compute_dtype(h)
        w = None if weight is None else weight.to(acc) + offset
        y, rstd = torch.ops.aten._fused_rms_norm(h.to(acc), [h.shape[-1]], w, eps)
        return y.to(x.dtype), (None if residual is None else h), rstd.reshape(-1)

    @staticmethod
    def backward(dy, dh, h, weight, rstd, offset, need_dw):
        acc = rstd.dtype
        w = None if weight is None else weight.to(acc) + offset
        dx, dw = torch.ops.aten._fused_rms_norm_backward(
            dy.to(acc), h.to(acc), [h.shape[-1]], rstd[:, None], w, [True, need_dw])
        if dh is not None:
            dx = dx.add_(dh)
        return dx.to(h.dtype), (dw.to(weight.dtype) if need_dw else None)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_output(W, Y, hf, rstd, row, n_cols, cols, offset, HAS_WEIGHT: tl.constexpr,
                         ACC: tl.constexpr):
        mask = cols < n_cols
        y = hf * rstd
        if HAS_WEIGHT:
            y = y * (tl.load(W + cols, mask=mask, other=0.0).to(ACC) + offset)
        tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_forward_kernel(X, R, W, Y, H, RSTD, x_stride, r_stride, n_cols, eps, offset,
                                 HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                                 ACC: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """One row per program, held in registers when it fits one BLOCK (ONE_BLOCK); a wider
        row is walked in column blocks twice: its sum of squares, then its output, from
        x (+ residual) read again."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        if ONE_BLOCK:
            hf = load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, cols, HAS_RESIDUAL, True, ACC)
            rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
            _rms_norm_output(W, Y, hf, rstd, row, n_cols, cols, offset, HAS_WEIGHT, ACC)
        else:
            squares = tl.zeros((BLOCK,), dtype=ACC)
            for start in range(0, n_cols, BLOCK):
                hf = load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, start + cols, HAS_RESIDUAL, True,
                                     ACC)
                squares += hf * hf
            rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK):
                hf = load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, start + cols, HAS_RESIDUAL, False,
                                     ACC)
                _rms_norm_output(W, Y, hf, rstd, row, n_cols, start + cols, offset, HAS_WEIGHT, ACC)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_norm_backward_terms(DY, H, W, rstd, start, n_cols, cols, offset, HAS_WEIGHT: tl.constexpr,
                                 ACC: tl.constexpr):
        """(dy, x_hat, g = dy * w) over columns ``cols`` of the row at element ``start``."""
        mask = cols < n_cols
        dy = tl.load(DY + start + cols, mask=mask, other=0.0).to(ACC)
        x_hat = tl.load(H + start + cols, mask=mask, other=0.0).to(ACC) * rstd
        g = dy
        if HAS_WEIGHT:
            g = dy * (tl.load(W + cols, mask=mask, other=0.0).to(ACC) + offset)
        return dy, x_hat, g

    @triton.jit
    def _rms_norm_input_grad(DH, DX, g, x_hat, rstd, mean_g_x_hat, start, n_cols, cols, HAS_DH: tl.constexpr,
                             ACC: tl.constexpr):
        mask = cols < n_cols
        dx = rstd * (g - x_hat * mean_g_x_hat)
        if HAS_DH:
            dx += tl.load(DH + start + cols, mask=mask, other=0.0).to(ACC)
        tl.store(DX + start + cols, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_backward_kernel(DY, DH, H, W, RSTD, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program,
                                  offset, HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                                  ACC: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """Rows [first, last) per program, every program at least one. A row that fits one BLOCK
        is held in registers and the program's weight-gradient partial sum too; a wider row
        is walked in column blocks twice (the row's mean of g * x_hat, then dx), the partial
        sum kept in DW_PARTIAL's row of this program, which only this program touches."""
        program = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        first = program * rows_per_program
        last = tl.minimum(first + rows_per_program, n_rows)
        if ONE_BLOCK:
            dw = tl.zeros((BLOCK,), dtype=ACC)
            for row in range(first, last):
                start = row * n_cols
                rstd = tl.load(RSTD + row)
                dy, x_hat, g = _rms_norm_backward_terms(DY, H, W, rstd, start, n_cols, cols, offset, HAS_WEIGHT,
                                                        ACC)
                if HAS_WEIGHT:
                    dw += dy * x_hat
                _rms_norm_input_grad(DH, DX, g, x_hat, rstd, tl.sum(g * x_hat, axis=0) / n_cols, start, n_cols,
                                     cols, HAS_DH, ACC)
            if HAS_WEIGHT:
                tl.store(DW_PARTIAL + program * n_cols + cols, dw, mask=cols < n_cols)
        else:
            for row in range(first, last):
                start = row * n_cols
                rstd = tl.load(RSTD + row)
                products = tl.zeros((BLOCK,), dtype=ACC)
                for block_start in range(0, n_cols, BLOCK):
                    dy, x_hat, g = _rms_norm_backward_terms(DY, H, W, rstd, start, n_cols, block_start + cols,
                                                            offset, HAS_WEIGHT, ACC)
                    products += g * x_hat
                mean_g_x_hat = tl.sum(products, axis=0) / n_cols
                for block_start in range(0, n_cols, BLOCK):
                    block = block_start + cols
                    dy, x_hat, g = _rms_norm_backward_terms(DY, H, W, rstd, start, n_cols, block, offset,
                                                            HAS_WEIGHT, ACC)
                    _rms_norm_input_grad(DH, DX, g, x_hat, rstd, mean_g_x_hat, start, n_cols, block, HAS_DH, ACC)
                    if HAS_WEIGHT:
                        # the first row starts the partial sum (DW_PARTIAL is not zeroed: its contents are ignored)
                        partial = DW_PARTIAL + program * n_cols + block
                        earlier = tl.where(row > first, tl.load(partial, mask=block < n_cols, other=0.0), 0.0)
                        tl.store(partial, earlier + dy * x_hat, mask=block < n_cols)


class _Triton:
    @staticmethod
    def forward(x, residual, weight, eps, offset):
        rows, n = x.shape
        block = column_block(n)
        x = x if x.stride(-1) == 1 else x.contiguous()
        residual = None if residual is None else (residual if residual.stride(-1) == 1 else residual.contiguous())
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        h = None if residual is None else torch.empty_like(y)
        rstd = torch.empty(rows, dtype=compute_dtype(x), device=x.device)
        with devices.device_guard(x.device):
            _rms_norm_forward_kernel[(rows,)](
                x, residual, weight, y, h, rstd, x.stride(0),
                0 if residual is None else residual.stride(0), n, eps, offset,
                HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
                ACC=triton_compute_dtype(x), BLOCK=block, ONE_BLOCK=n <= block, num_warps=num_warps_for(block))
        return y, h, rstd

    @staticmethod
    def backward(dy, dh, h, weight, rstd, offset, need_dw):
        rows, n = h.shape
        block = column_block(n)
        dy, h = dy.contiguous(), h.contiguous()
        dh = None if dh is None else dh.contiguous()
        programs, rows_per_program = row_ranges(h.device, rows)
        dx = torch.empty_like(h)
        partial = torch.empty((programs, n) if weight is not None else (0,), dtype=rstd.dtype, device=h.device)
        with devices.device_guard(h.device):
            _rms_norm_backward_kernel[(programs,)](
                dy, dh, h, weight, rstd, dx, partial, rows, n, rows_per_program, offset,
                HAS_DH=dh is not None, HAS_WEIGHT=weight is not None,
                ACC=triton_compute_dtype(h), BLOCK=block, ONE_BLOCK=n <= block, num_warps=norm_backward_warps(block))
        dw = partial.sum(0).to(weight.dtype) if need_dw else None
        return dx, dw


def _cpu_samples(dtype: torch.dtype, rows: int, n: int, *, training: bool = True):
    """One call (a training call, forward and backward, or a forward alone; through the
    public op) of a weighted RMSNorm over ``rows`` x ``n`` per CPU backend, on constant
    inputs (the caller's RNG is left alone): the C++ backend's gain is mostly what it saves
    around its kernels."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.linspace(-1, 1, rows * n, dtype=dtype).view(rows, n).requires_grad_()
        weight = torch.ones(n, dtype=dtype, requires_grad=True)
        dy = torch.full((rows, n), 0.01, dtype=dtype)
    return {name: op_sample(lambda name=name: rms_norm(x, weight, backend=name), (x, weight), dy, training=training)
            for name in RMS_NORM.cpu_measured}


# ---- the op: te_lab::rms_norm and its backward, what torch.compile and the profiler see ----

_IMPLEMENTATIONS = {"native": _Native, "inductor": _Inductor}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton
_EMPTY = (0,)


def _forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float,
             weight_offset: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    y, h, rstd = _IMPLEMENTATIONS[backend].forward(
        as_rows(x), None if residual is None else as_rows(residual), weight, eps, weight_offset)
    h = x.new_empty(_EMPTY) if h is None else shaped_like(h, x)
    return shaped_like(y, x), h, rstd


def _forward_fake(x, residual, weight, eps, weight_offset, backend):
    h = x.new_empty(_EMPTY) if residual is None else x.new_empty(x.shape)
    return x.new_empty(x.shape), h, x.new_empty(x.shape[:-1].numel(), dtype=compute_dtype(x))


def _backward(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], rstd: Tensor,
              weight_offset: float, need_dw: bool, backend: str) -> tuple[Tensor, Tensor]:
    dx, dw = _IMPLEMENTATIONS[backend].backward(
        as_rows(dy), None if dh is None else as_rows(dh), as_rows(h), weight, rstd, weight_offset, need_dw)
    return shaped_like(dx, h), (h.new_empty(_EMPTY) if dw is None else dw)


def _backward_fake(dy, dh, h, weight, rstd, weight_offset, need_dw, backend):
    return h.new_empty(h.shape), (weight.new_empty(weight.shape) if need_dw else h.new_empty(_EMPTY))


def _setup_context(ctx, inputs, output):
    x, residual, weight, eps, weight_offset, backend = inputs
    _, h, rstd = output
    ctx.save_for_backward(x if residual is None else h, weight, rstd)
    ctx.has_residual = residual is not None
    ctx.weight_offset = weight_offset
    ctx.set_materialize_grads(False)


def _gradients(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[2]
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw = ctx.backward_op(dy, dh if ctx.has_residual else None, h, weight, rstd,
                             ctx.weight_offset, need_dw, ctx.backend)
    return dx, (dx if ctx.has_residual else None), (dw if need_dw else None), None, None, None


# As F.rms_norm under autocast: float32 where it is on autocast's float32 list (CUDA).
AUTOCAST = AutocastRule(follows="aten::rms_norm", to=FLOAT32)
RMS_NORM, _rms_norm_op, _ = define_op(
    NAME, reference=rms_norm_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    autocast=AUTOCAST, backends=_IMPLEMENTATIONS, cpp=True, cpu_preference="cpp",
    cpu_measured=("cpp", "inductor", "reference"), cpu_samples=_cpu_samples, native_supports=_native_supports,
    costs=COSTS)


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
             residual: Optional[Tensor] = None, weight_offset: float = 0.0,
             backend: Optional[str] = None):
    """Fused RMSNorm over the last dimension of ``x``.

    Returns ``y``, or ``(y, x + residual)`` when ``residual`` is given. ``weight`` has
    the length of the last dimension (its dtype may differ from ``x``'s);
    ``weight_offset=1.0`` scales by ``1 + weight`` (Gemma). ``backend`` forces
    ``"triton"``, ``"native"``, ``"inductor"``, ``"cpp"`` or ``"reference"`` (see
    :mod:`te_lab.kernels.registry`).
    """
    check_tensor(NAME, "x", x)
    n = x.shape[-1]
    if residual is not None:
        check_like(NAME, "residual", residual, x, "x", same_dtype=not inputs_cast_by(AUTOCAST, x.device))
    if weight is not None:
        check_parameter(NAME, "weight", weight, x, "x", n)
    eps = check_positive(NAME, "eps", eps)
    if not isinstance(weight_offset, (int, float)) or isinstance(weight_offset, bool):
        raise TypeError(f"{NAME}: weight_offset must be a number, got {weight_offset!r}")
    chosen = select_measured_backend(RMS_NORM, x.device, backend, x.dtype, (x.numel() // max(n, 1), n))
    if chosen == "reference":
        return run_reference(RMS_NORM, rms_norm_reference, x, weight, eps, residual=residual,
                             weight_offset=weight_offset)
    y, h, _ = _rms_norm_op(x, residual, weight, eps, float(weight_offset), chosen)
    return y if residual is None else (y, h)
