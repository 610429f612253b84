"""LayerNorm, optionally fused with the residual add before it.

    h = x + residual                      (when a residual is given)
    y = (h - mean(h)) * rsqrt(var(h) + eps) * (weight + weight_offset) + bias

computed in float32 (float64 for float64 inputs) and cast back to the input dtype;
the variance is the biased one, as ``nn.LayerNorm`` uses. ``weight_offset=1.0`` gives
Nemotron's LayerNorm1P, which scales by ``1 + weight``. With a residual the op returns
``(y, h)``: ``h`` is the next residual stream, written in the same pass.

Backward: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * (weight + offset)
and x_hat = (h - mean) * rstd; dweight = sum over rows of dy * x_hat, dbias = sum
over rows of dy. The gradient of ``h`` flowing in from the residual stream is added
in the same pass, and x and residual share it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from te_lab import device as devices

from .autocast import FLOAT32, AutocastRule, inputs_cast_by
from .checks import check_like, check_parameter, check_positive, check_tensor
from .costs.layer_norm import COSTS
from .inductor_compiled import inductor_compiled
from .layout import as_rows, shaped_like
from .measured_choice import op_sample
from .op_declaration import define_op, run_reference
from .precision import cast, compute_dtype, triton_compute_dtype
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

NAME = "layer_norm"


def layer_norm_reference(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                         eps: float = 1e-5, *, residual: Optional[Tensor] = None, weight_offset: float = 0.0):
    """The unfused PyTorch math: the truth every backend is compared against."""
    h = x if residual is None else x + residual
    hf = h.to(compute_dtype(h))
    centered = hf - hf.mean(-1, keepdim=True)
    y = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(hf.dtype) + weight_offset)
    if bias is not None:
        y = y + bias.to(hf.dtype)
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


# ---- row-wise math on 2-D tensors, compiled by the inductor backend ----

def _forward_math(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                  bias: Optional[Tensor], eps: float, offset: float):
    h = x if residual is None else x + residual
    hf = h.to(compute_dtype(h))
    mean = hf.mean(-1)
    centered = hf - mean[:, None]
    rstd = torch.rsqrt(centered.pow(2).mean(-1) + eps)
    y = centered * rstd[:, None]
    if weight is not None:
        y = y * (weight.to(hf.dtype) + offset)
    if bias is not None:
        y = y + bias.to(hf.dtype)
    return y.to(x.dtype), (None if residual is None else h), mean, rstd


def _backward_math(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor],
                   bias: Optional[Tensor], mean: Tensor, rstd: Tensor, offset: float, need_dw: bool,
                   need_db: bool):
    x_hat = (h.to(rstd.dtype) - mean[:, None]) * rstd[:, None]
    dyf = dy.to(rstd.dtype)
    g = dyf if weight is None else dyf * (weight.to(rstd.dtype) + offset)
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.to(rstd.dtype)
    dw = (dyf * x_hat).sum(0).to(weight.dtype) if need_dw else None
    db = dyf.sum(0).to(bias.dtype) if need_db else None
    return dx.to(h.dtype), dw, db


class _Inductor:
    forward = staticmethod(inductor_compiled(_forward_math))
    backward = staticmethod(inductor_compiled(_backward_math))


def _native_supports(device_type: str) -> bool:
    return all(aten_kernel_exists(f"aten::{name}", device_type)
               for name in ("native_layer_norm", "native_layer_norm_backward"))


def _offset_weight(weight: Optional[Tensor], dtype: torch.dtype, offset: float) -> Optional[Tensor]:
    """``weight + offset`` in ``dtype`` (the weight itself, cast, without an offset)."""
    if weight is None:
        return None
    return cast(weight, dtype) + offset if offset else cast(weight, dtype)


class _Native:
    """ATen's fused LayerNorm kernels, with the residual add as a separate op.

    The win over eager model code is in the backward: eager autograd sums the
    residual stream's gradient and LayerNorm's input gradient into a freshly
    allocated tensor, while here it is added into ATen's input gradient in place (on
    the CPU, writing fresh memory costs about three times an in-place pass).
    ATen keeps mean and rstd in the input dtype for half-precision inputs without
    float32 parameters, so those inputs are normalised in the compute dtype. A weight
    offset is added to the weight ATen is given (its weight gradient does not read it).
    """

    @staticmethod
    def forward(x, residual, weight, bias, eps, offset):
        h = x if residual is None else x + residual
        acc = compute_dtype(h)
        y, mean, rstd = torch.native_layer_norm(
            cast(h, acc), [h.shape[-1]], _offset_weight(weight, acc, offset),
            None if bias is None else cast(bias, acc), eps)
        return cast(y, x.dtype), (None if residual is None else h), mean.view(-1), rstd.view(-1)

    @staticmethod
    def backward(dy, dh, h, weight, bias, mean, rstd, offset, need_dw, need_db):
        acc = rstd.dtype
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            cast(dy, acc), cast(h, acc), [h.shape[-1]], mean.view(-1, 1), rstd.view(-1, 1),
            _offset_weight(weight, acc, offset), None if bias is None else cast(bias, acc),
            [True, need_dw, need_db])
        if dh is not None:
            dx = dx.add_(dh)
        return (cast(dx, h.dtype), cast(dw, weight.dtype) if need_dw else None,
                cast(db, bias.dtype) if need_db else None)


if HAS_TRITON:

    @triton.jit
    def _layer_norm_output(W, B, Y, centered, rstd, row, n_cols, cols, offset, HAS_WEIGHT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
        mask = cols < n_cols
        y = centered * rstd
        if HAS_WEIGHT:
            y = y * (tl.load(W + cols, mask=mask, other=0.0).to(ACC) + offset)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(ACC)
        tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _layer_norm_forward_kernel(X, R, W, B, Y, H, MEAN, RSTD, x_stride, r_stride, n_cols, eps, offset,
                                   HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                                   HAS_BIAS: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
                                   ONE_BLOCK: tl.constexpr):
        """One row per program, held in registers when it fits one BLOCK (ONE_BLOCK); a wider
        row is walked in column blocks three times: its mean, its variance (two passes, as
        the one-block path computes it, rather than the cancellation-prone E[h^2] - mean^2),
        then its output, from x (+ residual) read again."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        if ONE_BLOCK:
            hf = load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, cols, HAS_RESIDUAL, True, ACC)
            mean = tl.sum(hf, axis=0) / n_cols
            # the padding past the row's end must not count towards the variance
            centered = tl.where(cols < n_cols, hf - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
            _layer_norm_output(W, B, Y, centered, rstd, row, n_cols, cols, offset, HAS_WEIGHT, HAS_BIAS, ACC)
        else:
            sums = tl.zeros((BLOCK,), dtype=ACC)
            for start in range(0, n_cols, BLOCK):
                sums += load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, start + cols, HAS_RESIDUAL,
                                          True, ACC)
            mean = tl.sum(sums, axis=0) / n_cols
            squares = tl.zeros((BLOCK,), dtype=ACC)
            for start in range(0, n_cols, BLOCK):
                hf = load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, start + cols, HAS_RESIDUAL, False,
                                       ACC)
                centered = tl.where(start + cols < n_cols, hf - mean, 0.0)
                squares += centered * centered
            rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK):
                hf = load_norm_input(X, R, H, row, x_stride, r_stride, n_cols, start + cols, HAS_RESIDUAL, False,
                                       ACC)
                centered = tl.where(start + cols < n_cols, hf - mean, 0.0)
                _layer_norm_output(W, B, Y, centered, rstd, row, n_cols, start + cols, offset, HAS_WEIGHT, HAS_BIAS,
                                   ACC)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _layer_norm_backward_terms(DY, H, W, mean, rstd, start, n_cols, cols, offset, HAS_WEIGHT: tl.constexpr,
                                   ACC: tl.constexpr):
        """(dy, x_hat, g = dy * (w + offset)) over columns ``cols`` of the row at element ``start``."""
        mask = cols < n_cols
        dy = tl.load(DY + start + cols, mask=mask, other=0.0).to(ACC)
        h = tl.load(H + start + cols, mask=mask, other=0.0).to(ACC)
        x_hat = tl.where(mask, (h - mean) * rstd, 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * (tl.load(W + cols, mask=mask, other=0.0).to(ACC) + offset)
        return dy, x_hat, g

    @triton.jit
    def _layer_norm_input_grad(DH, DX, g, x_hat, rstd, sum_g, sum_g_x_hat, start, n_cols, cols,
                               HAS_DH: tl.constexpr, ACC: tl.constexpr):
        mask = cols < n_cols
        dx = rstd * (g - (sum_g + x_hat * sum_g_x_hat) / n_cols)
        if HAS_DH:
            dx += tl.load(DH + start + cols, mask=mask, other=0.0).to(ACC)
        tl.store(DX + start + cols, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def _layer_norm_backward_kernel(DY, DH, H, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, n_rows, n_cols,
                                    rows_per_program, offset, HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                                    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
                                    ACC: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """Rows [first, last) per program, every program at least one. A row that fits one BLOCK
        is held in registers and the program's weight/bias-gradient partial sums too; a wider
        row is walked in column blocks twice (the row's sums of g and g * x_hat, then dx),
        the partial sums kept in this program's rows of DW_PARTIAL/DB_PARTIAL, which only it
        touches."""
        program = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        first = program * rows_per_program
        last = tl.minimum(first + rows_per_program, n_rows)
        if ONE_BLOCK:
            dw = tl.zeros((BLOCK,), dtype=ACC)
            db = tl.zeros((BLOCK,), dtype=ACC)
            for row in range(first, last):
                start = row * n_cols
                rstd = tl.load(RSTD + row)
                dy, x_hat, g = _layer_norm_backward_terms(DY, H, W, tl.load(MEAN + row), rstd, start, n_cols, cols,
                                                          offset, HAS_WEIGHT, ACC)
                if NEED_DW:
                    dw += dy * x_hat
                if NEED_DB:
                    db += dy
                _layer_norm_input_grad(DH, DX, g, x_hat, rstd, tl.sum(g, axis=0), tl.sum(g * x_hat, axis=0), start,
                                       n_cols, cols, HAS_DH, ACC)
            if NEED_DW:
                tl.store(DW_PARTIAL + program * n_cols + cols, dw, mask=cols < n_cols)
            if NEED_DB:
                tl.store(DB_PARTIAL + program * n_cols + cols, db, mask=cols < n_cols)
        else:
            for row in range(first, last):
                start = row * n_cols
                mean = tl.load(MEAN + row)
                rstd = tl.load(RSTD + row)
                g_sums = tl.zeros((BLOCK,), dtype=ACC)
                products = tl.zeros((BLOCK,), dtype=ACC)
                for block_start in range(0, n_cols, BLOCK):
                    dy, x_hat, g = _layer_norm_backward_terms(DY, H, W, mean, rstd, start, n_cols,
                                                              block_start + cols, offset, HAS_WEIGHT, ACC)
                    g_sums += g
                    products += g * x_hat
                sum_g = tl.sum(g_sums, axis=0)
                sum_g_x_hat = tl.sum(products, axis=0)
                for block_start in range(0, n_cols, BLOCK):
                    block = block_start + cols
                    inside = block < n_cols
                    dy, x_hat, g = _layer_norm_backward_terms(DY, H, W, mean, rstd, start, n_cols, block,
                                                              offset, HAS_WEIGHT, ACC)
                    _layer_norm_input_grad(DH, DX, g, x_hat, rstd, sum_g, sum_g_x_hat, start, n_cols, block,
                                           HAS_DH, ACC)
                    # the first row starts the partial sums (the buffers are not zeroed: their contents are ignored)
                    if NEED_DW:
                        partial = DW_PARTIAL + program * n_cols + block
                        earlier = tl.where(row > first, tl.load(partial, mask=inside, other=0.0), 0.0)
                        tl.store(partial, earlier + dy * x_hat, mask=inside)
                    if NEED_DB:
                        partial = DB_PARTIAL + program * n_cols + block
                        earlier = tl.where(row > first, tl.load(partial, mask=inside, other=0.0), 0.0)
                        tl.store(partial, earlier + dy, mask=inside)


class _Triton:
    @staticmethod
    def forward(x, residual, weight, bias, eps, offset):
        rows, n = x.shape
        block = column_block(n)
        x = x if x.stride(-1) == 1 else x.contiguous()
        residual = None if residual is None else (residual if residual.stride(-1) == 1 else residual.contiguous())
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        h = None if residual is None else torch.empty_like(y)
        mean = torch.empty(rows, dtype=compute_dtype(x), device=x.device)
        rstd = torch.empty_like(mean)
        with devices.device_guard(x.device):
            _layer_norm_forward_kernel[(rows,)](
                x, residual, weight, bias, y, h, mean, rstd, x.stride(0),
                0 if residual is None else residual.stride(0), n, eps, offset,
                HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                ACC=triton_compute_dtype(x), BLOCK=block, ONE_BLOCK=n <= block, num_warps=num_warps_for(block))
        return y, h, mean, rstd

    @staticmethod
    def backward(dy, dh, h, weight, bias, mean, rstd, offset, need_dw, need_db):
        rows, n = h.shape
        block = column_block(n)
        dy, h = dy.contiguous(), h.contiguous()
        dh = None if dh is None else dh.contiguous()
        programs, rows_per_program = row_ranges(h.device, rows)
        dx = torch.empty_like(h)
        dw_partial = torch.empty((programs, n) if need_dw else (0,), dtype=rstd.dtype, device=h.device)
        db_partial = torch.empty((programs, n) if need_db else (0,), dtype=rstd.dtype, device=h.device)
        with devices.device_guard(h.device):
            _layer_norm_backward_kernel[(programs,)](
                dy, dh, h, weight, mean, rstd, dx, dw_partial, db_partial, rows, n,
                rows_per_program, offset, HAS_DH=dh is not None, HAS_WEIGHT=weight is not None,
                NEED_DW=need_dw, NEED_DB=need_db,
                ACC=triton_compute_dtype(h), BLOCK=block, ONE_BLOCK=n <= block, num_warps=norm_backward_warps(block))
        return (dx, dw_partial.sum(0).to(weight.dtype) if need_dw else None,
                db_partial.sum(0).to(bias.dtype) if need_db else None)


def _cpu_samples(dtype: torch.dtype, rows: int, n: int, *, training: bool = True):
    """One call (a training call, forward and backward, or a forward alone; through the
    public op) of an affine LayerNorm over ``rows`` x ``n`` per CPU backend, on constant
    inputs (the caller's RNG is left alone): what the C++ backend saves is mostly the
    Python around the kernels."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.linspace(-1, 1, rows * n, dtype=dtype).view(rows, n).requires_grad_()
        weight = torch.ones(n, dtype=dtype, requires_grad=True)
        bias = torch.zeros(n, dtype=dtype, requires_grad=True)
        dy = torch.full((rows, n), 0.01, dtype=dtype)
    return {name: op_sample(lambda name=name: layer_norm(x, weight, bias, backend=name), (x, weight, bias), dy,
                            training=training)
            for name in LAYER_NORM.cpu_measured}


# ---- the op: te_lab::layer_norm and its backward, what torch.compile and the profiler see ----

_IMPLEMENTATIONS = {"native": _Native, "inductor": _Inductor}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton
_EMPTY = (0,)


def _forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
             eps: float, weight_offset: float, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, h, mean, rstd = _IMPLEMENTATIONS[backend].forward(
        as_rows(x), None if residual is None else as_rows(residual), weight, bias, eps, weight_offset)
    h = x.new_empty(_EMPTY) if h is None else shaped_like(h, x)
    return shaped_like(y, x), h, mean, rstd


def _forward_fake(x, residual, weight, bias, eps, weight_offset, backend):
    h = x.new_empty(_EMPTY) if residual is None else x.new_empty(x.shape)
    stats = x.new_empty(x.shape[:-1].numel(), dtype=compute_dtype(x))
    return x.new_empty(x.shape), h, stats, torch.empty_like(stats)


def _backward(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
              mean: Tensor, rstd: Tensor, weight_offset: float, need_dw: bool, need_db: bool,
              backend: str) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _IMPLEMENTATIONS[backend].backward(
        as_rows(dy), None if dh is None else as_rows(dh), as_rows(h), weight, bias, mean, rstd, weight_offset,
        need_dw, need_db)
    return (shaped_like(dx, h), h.new_empty(_EMPTY) if dw is None else dw,
            h.new_empty(_EMPTY) if db is None else db)


def _backward_fake(dy, dh, h, weight, bias, mean, rstd, weight_offset, need_dw, need_db, backend):
    return (h.new_empty(h.shape), weight.new_empty(weight.shape) if need_dw else h.new_empty(_EMPTY),
            bias.new_empty(bias.shape) if need_db else h.new_empty(_EMPTY))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, weight_offset, backend = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(x if residual is None else h, weight, bias, mean, rstd)
    ctx.has_residual = residual is not None
    ctx.weight_offset = weight_offset
    ctx.set_materialize_grads(False)


def _gradients(ctx, dy, dh, _dmean, _drstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    need_dw = weight is not None and ctx.needs_input_grad[2]
    need_db = bias is not None and ctx.needs_input_grad[3]
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw, db = ctx.backward_op(dy, dh if ctx.has_residual else None, h, weight, bias,
                                 mean, rstd, ctx.weight_offset, need_dw, need_db, ctx.backend)
    return (dx, (dx if ctx.has_residual else None), (dw if need_dw else None),
            (db if need_db else None), None, None, None)


# As F.layer_norm under autocast: float32 where it is on autocast's float32 list (CUDA).
AUTOCAST = AutocastRule(follows="aten::layer_norm", to=FLOAT32)
LAYER_NORM, _layer_norm_op, _ = define_op(
    NAME, reference=layer_norm_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    autocast=AUTOCAST, backends=_IMPLEMENTATIONS,
    # The cpp backend: the same ATen kernels as native, reached from C++ (kernels/cpp/layer_norm.cpp).
    cpp=True, cpu_preference="cpp",
    # On the CPU the fastest of cpp (ATen's kernels, reached from C++), native (the same
    # kernels through Python) and inductor is measured per class of sizes: Inductor's
    # wrapper cost less per call than the Python path at small sizes, ATen's row
    # reductions are faster at large ones (4096 x 2048 float32 on a 2-core CPU: native
    # 1.13-1.21x eager, inductor 0.90-0.99x).
    cpu_measured=("cpp", "native", "inductor", "reference"), cpu_samples=_cpu_samples,
    native_supports=_native_supports, costs=COSTS)


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5, *, residual: Optional[Tensor] = None, weight_offset: float = 0.0,
               backend: Optional[str] = None):
    """Fused LayerNorm over the last dimension of ``x``.

    Returns ``y``, or ``(y, x + residual)`` when ``residual`` is given. ``weight``
    and ``bias`` have the length of the last dimension (their dtypes may differ from
    ``x``'s). ``weight_offset=1.0`` scales by ``1 + weight`` (Nemotron's LayerNorm1P).
    ``backend`` forces ``"triton"``, ``"native"``, ``"inductor"``, ``"cpp"`` or
    ``"reference"`` (see :mod:`te_lab.kernels.registry`).
    """
    check_tensor(NAME, "x", x)
    n = x.shape[-1]
    if residual is not None:
        check_like(NAME, "residual", residual, x, "x", same_dtype=not inputs_cast_by(AUTOCAST, x.device))
    if weight is not None:
        check_parameter(NAME, "weight", weight, x, "x", n)
    if bias is not None:
        check_parameter(NAME, "bias", bias, x, "x", n)
    eps = check_positive(NAME, "eps", eps)
    if not isinstance(weight_offset, (int, float)) or isinstance(weight_offset, bool):
        raise TypeError(f"{NAME}: weight_offset must be a number, got {weight_offset!r}")
    chosen = select_measured_backend(LAYER_NORM, x.device, backend, x.dtype, (x.numel() // max(n, 1), n))
    if chosen == "reference":
        return run_reference(LAYER_NORM, layer_norm_reference, x, weight, bias, eps, residual=residual,
                             weight_offset=weight_offset)
    y, h, _, _ = _layer_norm_op(x, residual, weight, bias, eps, float(weight_offset), chosen)
    return y if residual is None else (y, h)
