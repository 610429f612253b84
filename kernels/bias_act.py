"""Bias + activation, the epilogue of a Linear layer.

    y = act(x + bias)          act in ACTIVATIONS: exact-erf GELU, tanh GELU, SiLU

``x`` is the matmul's output without its bias: :func:`linear_act` leaves the matmul to
the vendor BLAS (``F.linear`` without bias, ordinary autograd) and adds the bias and
applies the activation here, in one pass, computing in float32 (float64 for float64
inputs) and writing ``y`` in ``x``'s dtype.

Backward, also one pass: dx = dy * act'(x + bias) and dbias = sum over rows of dx.
Only ``x`` is saved and ``x + bias`` is recomputed: one add instead of a tensor
written and held for backward. The Triton kernel walks row tiles and writes one
partial bias sum per program; the partials are summed afterwards.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from te_lab import device as devices

from .activations import ACTIVATION_CODES, ACTIVATIONS, activate, activation_grad
from .autocast import LIKE_LINEAR, inputs_cast_by
from .checks import check_choice, check_tensor
from .costs.bias_act import COSTS
from .inductor_compiled import inductor_compiled
from .layout import as_rows, shaped_like
from .measured_choice import op_sample
from .op_declaration import define_op, run_reference
from .precision import cast, compute_dtype, triton_compute_dtype
from .registry import select_measured_backend
from .triton_support import HAS_TRITON, reduction_programs, tl, triton

if HAS_TRITON:
    from .activations import triton_activate, triton_activation_grad

NAME = "bias_act"
LINEAR_NAME = "linear_act"


def bias_act_reference(x: Tensor, bias: Optional[Tensor] = None, activation: str = "gelu"):
    """The unfused PyTorch math: the truth every backend is compared against."""
    return activate(activation, x if bias is None else x + bias)


def linear_act_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                         activation: str = "gelu"):
    """What model code runs today: ``act(linear(x))``."""
    return activate(activation, F.linear(x, weight, bias))


# ---- elementwise math on 2-D tensors, compiled by the inductor backend ----

def _forward_math(x: Tensor, bias: Optional[Tensor], activation: str):
    z = x.to(compute_dtype(x))
    if bias is not None:
        z = z + bias.to(z.dtype)
    return activate(activation, z).to(x.dtype)


def _backward_math(dy: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, need_dbias: bool):
    z = x.to(compute_dtype(x))
    if bias is not None:
        z = z + bias.to(z.dtype)
    dz = dy.to(z.dtype) * activation_grad(activation, z)
    dbias = dz.sum(0).to(bias.dtype) if need_dbias else None
    return dz.to(x.dtype), dbias


class _Inductor:
    forward = staticmethod(inductor_compiled(_forward_math))
    backward = staticmethod(inductor_compiled(_backward_math))


# Elements per program tile: wide rows get one 1024-column strip of a few rows,
# narrow rows get many rows, so every program has the same amount of work.
_TILE_ELEMENTS = 4096
_MAX_BLOCK_COLS = 1024
# Backward holds the tile's bias sums, x + bias and dy at once: at 4 warps (32 elements
# a thread) float32 GELU's derivative spilled on sm_80 under Triton 3.2 at 168 registers;
# 8 warps hold 16 elements a thread: 64-122 registers, no spill, more warps resident.
_BACKWARD_WARPS = 8


def _tile(n_cols: int) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_COLS) of a tile for rows of ``n_cols`` elements."""
    block_cols = min(1 << max(n_cols - 1, 0).bit_length(), _MAX_BLOCK_COLS)
    return _TILE_ELEMENTS // block_cols, block_cols


if HAS_TRITON:

    @triton.jit
    def _bias_act_forward_kernel(X, B, Y, n_rows, n_cols, x_row_stride, x_col_stride,
                                 HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ACC: tl.constexpr,
                                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        # convert right after loading: Triton's interpreter computes wrongly in bf16
        z = tl.load(X + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride,
                    mask=mask, other=0.0).to(ACC)
        if HAS_BIAS:
            z += tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
        y = triton_activate(z, ACTIVATION)
        tl.store(Y + rows[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_act_backward_kernel(DY, X, B, DX, DBIAS_PARTIAL, n_rows, n_cols, tiles_per_program,
                                  dy_row_stride, dy_col_stride, x_row_stride, x_col_stride,
                                  HAS_BIAS: tl.constexpr, NEED_DBIAS: tl.constexpr,
                                  ACTIVATION: tl.constexpr, ACC: tl.constexpr,
                                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        program = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        if HAS_BIAS:
            bias = tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)
        # summed over rows once at the end: one cross-row reduction per program, not per tile
        dbias = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=ACC)
        first = program * tiles_per_program
        last = tl.minimum(first + tiles_per_program, tl.cdiv(n_rows, BLOCK_ROWS))
        for tile in range(first, last):
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            z = tl.load(X + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride,
                        mask=mask, other=0.0).to(ACC)
            if HAS_BIAS:
                z += bias[None, :]
            dy = tl.load(DY + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride,
                         mask=mask, other=0.0).to(ACC)
            # masked-out elements have dy = 0, so they add nothing to the bias sums
            dz = dy * triton_activation_grad(z, ACTIVATION)
            tl.store(DX + rows[:, None] * n_cols + cols[None, :], dz.to(DX.dtype.element_ty), mask=mask)
            if NEED_DBIAS:
                dbias += dz
        if NEED_DBIAS:
            tl.store(DBIAS_PARTIAL + program * n_cols + cols, tl.sum(dbias, axis=0), mask=col_mask)


class _Triton:
    """Strided 2-D loads, so transposed or expanded inputs (an upstream gradient of
    ``y.sum()`` is an expanded scalar) need no copy."""

    @staticmethod
    def forward(x, bias, activation):
        rows, n = x.shape
        block_rows, block_cols = _tile(n)
        bias = None if bias is None else bias.contiguous()
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(rows, block_rows), triton.cdiv(n, block_cols))
        with devices.device_guard(x.device):
            _bias_act_forward_kernel[grid](
                x, bias, y, rows, n, x.stride(0), x.stride(1),
                HAS_BIAS=bias is not None, ACTIVATION=ACTIVATION_CODES[activation],
                ACC=triton_compute_dtype(x), BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)
        return y

    @staticmethod
    def backward(dy, x, bias, activation, need_dbias):
        rows, n = x.shape
        block_rows, block_cols = _tile(n)
        bias = None if bias is None else bias.contiguous()
        row_tiles, col_blocks = triton.cdiv(rows, block_rows), triton.cdiv(n, block_cols)
        # a few programs per parallel unit in all, split over the column strips; at least
        # one, which writes zero bias sums when there are no rows
        programs = max(1, min(row_tiles, triton.cdiv(reduction_programs(x.device, row_tiles * col_blocks),
                                                     col_blocks)))
        dx = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        partial = torch.empty((programs, n) if need_dbias else (0,), dtype=compute_dtype(x), device=x.device)
        with devices.device_guard(x.device):
            _bias_act_backward_kernel[(programs, col_blocks)](
                dy, x, bias, dx, partial, rows, n, triton.cdiv(row_tiles, programs),
                dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                HAS_BIAS=bias is not None, NEED_DBIAS=need_dbias, ACTIVATION=ACTIVATION_CODES[activation],
                ACC=triton_compute_dtype(x), BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
                num_warps=_BACKWARD_WARPS)
        dbias = partial.sum(0).to(bias.dtype) if need_dbias else None
        return dx, dbias


class _Native:
    """ATen's activation kernels and their fused backward kernels (``gelu_backward``,
    ``silu_backward``) around the bias add. ATen has no bias + activation kernel (its
    _addmm_activation fuses GELU into the CUDA matmul, a different op), so this is two
    passes each way; on the CPU it is still the fastest choice next to the GEMMs: an
    Inductor kernel in between costs the GEMMs more than it saves (see the benchmark)."""

    @staticmethod
    def _pre_activation(x, bias):
        """x + bias at full precision: half inputs are rounded once, at the end, like
        the other backends (and F.linear's fused bias) do."""
        z = cast(x, compute_dtype(x))
        return z if bias is None else z + cast(bias, z.dtype)

    @staticmethod
    def forward(x, bias, activation):
        return cast(activate(activation, _Native._pre_activation(x, bias)), x.dtype)

    @staticmethod
    def backward(dy, x, bias, activation, need_dbias):
        z = _Native._pre_activation(x, bias)
        if activation == "silu":
            dz = torch.ops.aten.silu_backward(cast(dy, z.dtype), z)
        elif activation == "relu_squared":  # no ATen backward kernel: dy * 2 relu(z)
            dz = cast(dy, z.dtype) * activation_grad(activation, z)
        else:
            dz = torch.ops.aten.gelu_backward(cast(dy, z.dtype), z,
                                              approximate="tanh" if activation == "gelu_tanh" else "none")
        dbias = cast(dz.sum(0), bias.dtype) if need_dbias else None
        return cast(dz, x.dtype), dbias


def _cpu_samples(dtype: torch.dtype, rows: int, n: int, activation: str, *, training: bool = True):
    """One call (a training call, forward and backward, or a forward alone; through the
    public op) of ``activation(x + bias)`` over ``rows`` x ``n`` per CPU backend, on
    constant inputs (the caller's RNG is left alone): what the op costs around its kernels
    counts too."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.linspace(-2, 2, rows * n, dtype=dtype).view(rows, n).requires_grad_()
        bias = torch.zeros(n, dtype=dtype, requires_grad=True)
        dy = torch.full((rows, n), 0.01, dtype=dtype)
    return {name: op_sample(lambda name=name: bias_act(x, bias, activation, backend=name), (x, bias), dy,
                            training=training)
            for name in BIAS_ACT.cpu_measured}


# ---- the op: te_lab::bias_act and its backward, what torch.compile and the profiler see ----

_IMPLEMENTATIONS = {"native": _Native, "inductor": _Inductor}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton
_EMPTY = (0,)


def _forward(x: Tensor, bias: Optional[Tensor], activation: str, backend: str) -> Tensor:
    return shaped_like(_IMPLEMENTATIONS[backend].forward(as_rows(x), bias, activation), x)


def _forward_fake(x, bias, activation, backend):
    return x.new_empty(x.shape)


def _backward(dy: Tensor, x: Tensor, bias: Optional[Tensor], activation: str, need_dbias: bool,
              backend: str) -> tuple[Tensor, Tensor]:
    dx, dbias = _IMPLEMENTATIONS[backend].backward(as_rows(dy), as_rows(x), bias, activation, need_dbias)
    return shaped_like(dx, x), (x.new_empty(_EMPTY) if dbias is None else dbias)


def _backward_fake(dy, x, bias, activation, need_dbias, backend):
    return x.new_empty(x.shape), (bias.new_empty(bias.shape) if need_dbias else x.new_empty(_EMPTY))


def _setup_context(ctx, inputs, output):
    x, bias, activation, backend = inputs
    ctx.save_for_backward(x, bias)
    ctx.activation = activation


def _gradients(ctx, dy):
    x, bias = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[1]
    dx, dbias = ctx.backward_op(dy, x, bias, ctx.activation, need_dbias, ctx.backend)
    return dx, (dbias if need_dbias else None), None, None


BIAS_ACT, _bias_act_op, _ = define_op(
    NAME, reference=bias_act_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    # The bias add and the activation are on no autocast list: they run in x's dtype (the
    # GEMM before them, F.linear, is where autocast casts).
    backends=_IMPLEMENTATIONS,
    # cpp: one C++ pass each way (kernels/cpp/bias_act.cpp), the bias gradient summed in the
    # backward's pass. On the CPU the fastest of cpp, native and inductor is measured per
    # class of sizes and activation.
    cpp=True, cpu_preference="cpp", cpu_measured=("cpp", "native", "inductor", "reference"),
    cpu_samples=_cpu_samples, costs=COSTS)


def _check_bias(op: str, bias, x: Tensor, length: int, length_from: str, same_dtype: bool = True) -> Tensor:
    check_tensor(op, "bias", bias)
    if tuple(bias.shape) != (length,):
        raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}; expected ({length},), {length_from}")
    # F.linear adds its bias in the input's dtype; a mixed-dtype sum would change the output dtype
    if same_dtype and bias.dtype != x.dtype:
        raise TypeError(f"{op}: bias has dtype {bias.dtype}; expected {x.dtype} like x")
    if bias.device != x.device:
        raise ValueError(f"{op}: bias is on {bias.device}; expected {x.device} like x")
    return bias


def bias_act(x: Tensor, bias: Optional[Tensor] = None, activation: str = "gelu", *,
             backend: Optional[str] = None):
    """``act(x + bias)`` in one pass forward and one pass backward.

    ``x`` is a Linear's output without its bias (any number of leading dims);
    ``bias`` has the length of the last dimension and ``x``'s dtype. ``activation`` is
    ``"gelu"`` (exact erf), ``"gelu_tanh"`` or ``"silu"``. ``backend`` forces
    ``"triton"``, ``"native"``, ``"inductor"``, ``"cpp"`` or ``"reference"`` (see :mod:`te_lab.kernels.registry`).
    """
    check_tensor(NAME, "x", x)
    if bias is not None:
        _check_bias(NAME, bias, x, x.shape[-1], "the last dimension of x")
    check_choice(NAME, "activation", activation, ACTIVATIONS)
    n = x.shape[-1]
    chosen = select_measured_backend(BIAS_ACT, x.device, backend, x.dtype, (x.numel() // max(n, 1), n), (activation,))
    if chosen == "reference":
        return run_reference(BIAS_ACT, bias_act_reference, x, bias, activation)
    return _bias_act_op(x, bias, activation, chosen)


def linear_act(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "gelu", *,
               backend: Optional[str] = None):
    """``act(F.linear(x, weight, bias))``, what model code's ``act(linear(x))`` becomes.

    The matmul stays on the vendor BLAS (``F.linear``, with ordinary autograd); the
    bias and the activation go through :func:`bias_act`, which picks the backend
    (``backend`` as there), except on ``native``, where the GEMM adds the bias itself.
    """
    check_tensor(LINEAR_NAME, "x", x)
    check_tensor(LINEAR_NAME, "weight", weight)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{LINEAR_NAME}: weight has shape {tuple(weight.shape)}; expected (out_features, {x.shape[-1]}), "
            f"its in_features being the last dimension of x"
        )
    # Under autocast F.linear casts x, weight and bias to one dtype itself.
    same_dtype = not inputs_cast_by(LIKE_LINEAR, x.device)
    if same_dtype and weight.dtype != x.dtype:
        raise TypeError(f"{LINEAR_NAME}: weight has dtype {weight.dtype}; expected {x.dtype} like x")
    if weight.device != x.device:
        raise ValueError(f"{LINEAR_NAME}: weight is on {weight.device}; expected {x.device} like x")
    if bias is not None:
        _check_bias(LINEAR_NAME, bias, x, weight.shape[0], "the out_features of weight", same_dtype)
    check_choice(LINEAR_NAME, "activation", activation, ACTIVATIONS)
    rows = x.numel() // max(x.shape[-1], 1)
    chosen = select_measured_backend(BIAS_ACT, x.device, backend, x.dtype, (rows, weight.shape[0]), (activation,))
    if chosen == "reference":
        return linear_act_reference(x, weight, bias, activation)
    if chosen == "native":
        # ATen's kernels cannot fuse the bias with the activation, but BLAS adds it for
        # free inside the GEMM (addmm), so native leaves it there.
        return _bias_act_op(F.linear(x, weight, bias), None, activation, chosen)
    return _bias_act_op(F.linear(x, weight), bias, activation, chosen)
