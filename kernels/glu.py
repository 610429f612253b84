"""Gated activations, the core of Llama-style MLPs: SwiGLU and GeGLU.

    y = act(gate) * up                    act in ACTIVATIONS: silu (SwiGLU), gelu / gelu_tanh (GeGLU)

computed in float32 (float64 for float64 inputs) and cast back to the input dtype.
``gate`` and ``up`` come as two tensors, or as one concatenated gate-up tensor
``[..., 2N]`` (first half gate, second half up: the output of one fused Linear). The
concatenated tensor is read in place through row strides, never split into copies,
and its gradient comes back as one ``[..., 2N]`` tensor written by the same kernel.

Backward, one pass over dy, gate and up (nothing else is saved):
dgate = dy * up * act'(gate), dup = dy * act(gate).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from te_lab import device as devices

from .activations import ACTIVATION_CODES, ACTIVATIONS, activate, activation_grad
from .checks import check_choice, check_like, check_tensor
from .costs.glu import COSTS
from .inductor_compiled import inductor_compiled
from .layout import shaped_like
from .measured_choice import op_sample
from .op_declaration import define_op, run_reference
from .precision import compute_dtype, triton_compute_dtype
from .registry import select_measured_backend
from .triton_support import HAS_TRITON, num_warps_for, tl, triton

if HAS_TRITON:
    from .activations import triton_activate, triton_activation_grad

NAME = "glu"


def glu_reference(gate: Tensor, up: Optional[Tensor] = None, activation: str = "silu") -> Tensor:
    """The unfused PyTorch math: the truth every backend is compared against."""
    if up is None:
        gate, up = gate.chunk(2, -1)
    acc = compute_dtype(gate)
    return (activate(activation, gate.to(acc)) * up.to(acc)).to(gate.dtype)


# ---- the inductor backend ----
# The compiled math takes [rows, N] halves, or a concatenated gate-up tensor viewed as
# [rows, 2, N]: unlike chunk() of [rows, 2N], that view shows Inductor that each half is
# as long as dy and the output (one size symbol), so it fuses the whole backward into
# one loop instead of first materialising act(gate) in a fresh buffer.

def _forward_math(gate: Tensor, up: Optional[Tensor], activation: str) -> Tensor:
    if up is None:
        gate, up = gate.unbind(1)
    return glu_reference(gate, up, activation)


def _backward_math(dy: Tensor, gate: Tensor, up: Optional[Tensor], activation: str):
    """Both gradients from one read of dy, gate and up; for a [rows, 2, N] gate-up
    input, one [rows, 2, N] gradient and ``None``."""
    concatenated = up is None
    if concatenated:
        gate, up = gate.unbind(1)
    acc = compute_dtype(gate)
    g, dyf = gate.to(acc), dy.to(acc)
    dgate = (dyf * up.to(acc) * activation_grad(activation, g)).to(gate.dtype)
    dup = (dyf * activate(activation, g)).to(up.dtype)
    if concatenated:
        return torch.stack((dgate, dup), 1), None
    return dgate, dup


def _paired(gate: Tensor, up: Optional[Tensor]) -> Tensor:
    """A [rows, 2N] gate-up tensor (``up`` None) as [rows, 2, N]; a split gate unchanged."""
    return gate if up is not None else gate.reshape(gate.shape[0], 2, gate.shape[1] // 2)


class _Inductor:
    _forward = staticmethod(inductor_compiled(_forward_math))
    _backward = staticmethod(inductor_compiled(_backward_math))

    @staticmethod
    def forward(gate, up, activation):
        return _Inductor._forward(_paired(gate, up), up, activation)

    @staticmethod
    def backward(dy, gate, up, activation):
        dgate, dup = _Inductor._backward(dy, _paired(gate, up), up, activation)
        return dgate.view(gate.shape), dup


if HAS_TRITON:

    @triton.jit
    def _tile_offsets(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        """This program's rows (int64, so row * stride cannot overflow) and columns,
        as a column and a row vector, and the mask of the tile's in-bounds elements."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        return rows[:, None], cols[None, :], mask

    @triton.jit
    def _glu_forward_kernel(G, U, Y, n_rows, n_cols, g_stride, u_stride,
                            ACTIVATION: tl.constexpr, ACC: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        rows, cols, mask = _tile_offsets(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
        g = tl.load(G + rows * g_stride + cols, mask=mask, other=0.0).to(ACC)
        u = tl.load(U + rows * u_stride + cols, mask=mask, other=0.0).to(ACC)
        y = triton_activate(g, ACTIVATION) * u
        tl.store(Y + rows * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_backward_kernel(DY, G, U, DG, DU, n_rows, n_cols, dy_stride, g_stride, u_stride,
                             grad_stride, ACTIVATION: tl.constexpr, ACC: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        rows, cols, mask = _tile_offsets(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
        dy = tl.load(DY + rows * dy_stride + cols, mask=mask, other=0.0).to(ACC)
        g = tl.load(G + rows * g_stride + cols, mask=mask, other=0.0).to(ACC)
        u = tl.load(U + rows * u_stride + cols, mask=mask, other=0.0).to(ACC)
        dg = dy * u * triton_activation_grad(g, ACTIVATION)
        du = dy * triton_activate(g, ACTIVATION)
        tl.store(DG + rows * grad_stride + cols, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + rows * grad_stride + cols, du.to(DU.dtype.element_ty), mask=mask)


# Elements per program: enough work per program to hide memory latency on GPUs.
_TILE = 4096
_MAX_BLOCK_COLS = 1024


def _launch_shape(rows: int, n: int):
    """(grid, BLOCK_ROWS, BLOCK_COLS, num_warps) for a [rows, n] elementwise pass: tiles of
    up to _TILE elements, several short rows per program when rows are short."""
    block_cols = min(triton.next_power_of_2(n), _MAX_BLOCK_COLS)
    block_rows = min(_TILE // block_cols, triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(n, block_cols))
    return grid, block_rows, block_cols, num_warps_for(block_rows * block_cols)


def _split(gate: Tensor, up: Optional[Tensor]):
    """The gate and up halves of a 2-D input: views into a concatenated gate-up tensor."""
    if up is not None:
        return gate, up
    n = gate.shape[-1] // 2
    return gate[:, :n], gate[:, n:]


class _Triton:
    @staticmethod
    def forward(gate, up, activation):
        g, u = _split(gate, up)
        rows, n = g.shape
        y = torch.empty((rows, n), dtype=g.dtype, device=g.device)
        if y.numel():
            grid, block_rows, block_cols, num_warps = _launch_shape(rows, n)
            with devices.device_guard(g.device):
                _glu_forward_kernel[grid](
                    g, u, y, rows, n, g.stride(0), u.stride(0),
                    ACTIVATION=ACTIVATION_CODES[activation], ACC=triton_compute_dtype(g),
                    BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps)
        return y

    @staticmethod
    def backward(dy, gate, up, activation):
        g, u = _split(gate, up)
        rows, n = g.shape
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dg, du = _split(dgate, None) if up is None else (dgate, torch.empty_like(dgate))
        if dy.numel():
            grid, block_rows, block_cols, num_warps = _launch_shape(rows, n)
            with devices.device_guard(g.device):
                _glu_backward_kernel[grid](
                    dy, g, u, dg, du, rows, n, dy.stride(0), g.stride(0), u.stride(0), dg.stride(0),
                    ACTIVATION=ACTIVATION_CODES[activation], ACC=triton_compute_dtype(g),
                    BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps)
        return (dgate, None) if up is None else (dg, du)


# No `native`: ATen has no fused gated-activation kernel.
def _cpu_samples(dtype: torch.dtype, rows: int, n: int, activation: str, *, training: bool = True):
    """One call (a training call, forward and backward, or a forward alone; through the
    public op) over a ``rows`` x 2``n`` gate-up input per CPU backend, on constant inputs
    (the caller's RNG is left alone): the C++ backend's gain is mostly what it saves around
    its kernels."""
    with torch.inference_mode(False), torch.enable_grad():
        gate_up = torch.linspace(-3, 3, rows * 2 * n, dtype=dtype).view(rows, 2 * n).requires_grad_()
        dy = torch.full((rows, n), 0.01, dtype=dtype)
    return {name: op_sample(lambda name=name: glu(gate_up, None, activation, backend=name), (gate_up,), dy,
                            training=training)
            for name in GLU.cpu_measured}


# ---- the op: te_lab::glu and its backward, what torch.compile and the profiler see ----

_IMPLEMENTATIONS = {"inductor": _Inductor}
if HAS_TRITON:
    _IMPLEMENTATIONS["triton"] = _Triton
_EMPTY = (0,)


def _rows(t: Tensor) -> Tensor:
    """``t`` as [rows, last dim] with a unit stride along the last dim, a view where possible."""
    t = t.reshape(t.shape[:-1].numel(), t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _output_shape(gate: Tensor, up: Optional[Tensor]):
    return gate.shape if up is not None else gate.shape[:-1] + (gate.shape[-1] // 2,)


def _forward(gate: Tensor, up: Optional[Tensor], activation: str, backend: str) -> Tensor:
    y = _IMPLEMENTATIONS[backend].forward(_rows(gate), None if up is None else _rows(up), activation)
    return y.view(_output_shape(gate, up)) if up is None else shaped_like(y, gate)


def _forward_fake(gate, up, activation, backend):
    return gate.new_empty(_output_shape(gate, up))


def _backward(dy: Tensor, gate: Tensor, up: Optional[Tensor], activation: str, backend: str) -> tuple[Tensor, Tensor]:
    """(dgate, dup); for a concatenated gate-up input (``up`` None) the first is the
    whole ``[..., 2N]`` gradient and the second is empty."""
    dgate, dup = _IMPLEMENTATIONS[backend].backward(
        _rows(dy), _rows(gate), None if up is None else _rows(up), activation)
    return shaped_like(dgate, gate), (gate.new_empty(_EMPTY) if up is None else shaped_like(dup, up))


def _backward_fake(dy, gate, up, activation, backend):
    return gate.new_empty(gate.shape), (gate.new_empty(_EMPTY) if up is None else up.new_empty(up.shape))


def _setup_context(ctx, inputs, output):
    gate, up, activation, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _gradients(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = ctx.backward_op(dy, gate, up, ctx.activation, ctx.backend)
    return dgate, (None if up is None else dup), None, None


GLU, _glu_op, _ = define_op(
    NAME, reference=glu_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    # act(gate) * up is on no autocast list: model code runs it in the dtype of its inputs.
    backends=_IMPLEMENTATIONS, cpp=True, cpu_preference="cpp", cpu_measured=("cpp", "inductor", "reference"),
    cpu_samples=_cpu_samples, costs=COSTS)


def glu(gate: Tensor, up: Optional[Tensor] = None, activation: str = "silu", *,
        backend: Optional[str] = None) -> Tensor:
    """Fused ``act(gate) * up``.

    ``up=None`` takes ``gate`` as one concatenated gate-up tensor ``[..., 2N]`` (first
    half gate, second half up, as ``gate, up = t.chunk(2, -1)``). ``activation`` is one
    of ``"silu"``, ``"gelu"``, ``"gelu_tanh"``. ``backend`` forces ``"triton"``,
    ``"inductor"``, ``"cpp"`` or ``"reference"`` (see :mod:`te_lab.kernels.registry`).
    """
    check_tensor(NAME, "gate", gate)
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(
                f"{NAME}: gate (with up=None, the concatenated gate-up tensor [..., 2N]) has shape "
                f"{tuple(gate.shape)}; expected an even last dimension"
            )
    else:
        check_like(NAME, "up", up, gate, "gate")
    check_choice(NAME, "activation", activation, ACTIVATIONS)
    n = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    chosen = select_measured_backend(GLU, gate.device, backend, gate.dtype, (gate.numel() // max(gate.shape[-1], 1), n),
                                     (activation,))
    if chosen == "reference":
        return run_reference(GLU, glu_reference, gate, up, activation)
    return _glu_op(gate, up, activation, chosen)


def swiglu(gate: Tensor, up: Optional[Tensor] = None, *, backend: Optional[str] = None) -> Tensor:
    """``silu(gate) * up`` (Llama, Mistral, Qwen MLPs); see :func:`glu`."""
    return glu(gate, up, "silu", backend=backend)


_GELU_APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


def geglu(gate: Tensor, up: Optional[Tensor] = None, approximate: str = "none", *,
          backend: Optional[str] = None) -> Tensor:
    """``gelu(gate, approximate) * up`` (Gemma, T5 v1.1 MLPs); see :func:`glu`."""
    check_choice("geglu", "approximate", approximate, tuple(_GELU_APPROXIMATIONS))
    return glu(gate, up, _GELU_APPROXIMATIONS[approximate], backend=backend)
