"""Linear projections, ``y = x @ weight^T + bias``, on the CPU's faster GEMM library.

PyTorch runs a float32 ``F.linear`` on the CPU through its BLAS, MKL in the x86 wheels.
Which of MKL and oneDNN (whose GEMMs PyTorch ships for its mkldnn ops) is faster depends
on the machine and the sizes, not on the vendor: on one AMD EPYC (AVX-512) oneDNN ran
every product of a Llama training step's projections about 2x faster (1 thread, 512
tokens: 768 -> 2048 forward 48.7 -> 23.0 ms), on another AMD EPYC it ran at 0.73x MKL for
256 -> 256 and 1.19x for 768 -> 2048.

Backends: ``native`` runs all three products of a projection on oneDNN
(``mkldnn::_linear_pointwise``: ``a @ b^T`` of dense tensors, transposed views read in
place, no copies); ``reference`` is ``F.linear`` with its own autograd. Backward: the
products ``F.linear``'s autograd computes, dx = dy @ W, dW = dy^T @ x, db = rows of dy
summed. Chosen automatically only where it measured faster on this machine, for float32
inputs, per class of sizes (:mod:`te_lab.kernels.measured_choice`). Which projections are
worth a custom op's dispatch (~50 us forward and backward) is the caller's call: te_lab's
twins route the large ones here (:mod:`te_lab.modules.projection`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .autocast import LIKE_LINEAR, inputs_cast_by
from .checks import check_tensor
from .costs.linear import COSTS
from .layout import as_rows, shaped_like
from .op_declaration import define_op, run_reference
from .registry import Call, aten_kernel_exists, choose

NAME = "linear"

@torch.compiler.assume_constant_result
def _onednn_has_bfloat16() -> bool:
    """Whether this CPU has oneDNN's bfloat16 inner product (AVX512-BF16 or AMX; not on
    AVX2-only CPUs): a constant under torch.compile."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """What oneDNN's inner product takes on this CPU: float32 always, bfloat16 where the
    CPU has the instructions, float16 never here (it needs AVX512-FP16)."""
    return (torch.float32, torch.bfloat16) if _onednn_has_bfloat16() else (torch.float32,)

_EMPTY = (0,)


def linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """The unfused PyTorch math: the truth every backend is compared against."""
    return F.linear(x, weight, bias)


def matmul_nt(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``a @ b^T (+ bias)`` of 2-D tensors on oneDNN; ``a`` and ``b`` may be transposed views."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


@torch.compiler.assume_constant_result
def _onednn_available() -> bool:
    """A property of the torch build; a constant under torch.compile (Dynamo refuses to trace
    ``torch.backends.mkldnn.is_available``, which would break the graph at every projection)."""
    return torch.backends.mkldnn.is_available() and aten_kernel_exists("mkldnn::_linear_pointwise", "cpu")


def _native_supports(device_type: str) -> bool:
    return device_type == "cpu" and _onednn_available()


def _sample_products(dtype: torch.dtype, tokens: int, in_features: int, out_features: int, *, training: bool = True):
    """Per backend, on constant inputs of the given sizes (the caller's RNG and tensors are
    left alone): for training, a projection's three products (forward, dx, dW) on each
    library; for a forward alone (a decode step), the public op's forward, since at a few
    tokens what the op costs around its GEMM decides."""
    x = torch.full((tokens, in_features), 0.01, dtype=dtype)
    weight = torch.full((out_features, in_features), 0.01, dtype=dtype)
    dy = torch.full((tokens, out_features), 0.01, dtype=dtype)

    @torch.no_grad()
    def onednn():
        matmul_nt(x, weight), matmul_nt(dy, weight.t()), matmul_nt(dy.t(), x.t())

    @torch.no_grad()
    def blas():
        F.linear(x, weight), torch.mm(dy, weight), torch.mm(dy.t(), x)

    if training:
        return {"native": onednn, "reference": blas}

    def forward(backend):
        @torch.no_grad()
        def run():
            linear(x, weight, backend=backend)
        return run

    return {name: forward(name) for name in LINEAR.cpu_measured}


class _Native:
    @staticmethod
    def forward(x2, weight, bias):
        return matmul_nt(x2, weight, bias)

    @staticmethod
    def backward(dy2, x2, weight, need_x, need_weight, need_bias):
        dx = matmul_nt(dy2, weight.t()) if need_x else None
        dweight = matmul_nt(dy2.t(), x2.t()) if need_weight else None
        dbias = dy2.sum(0) if need_bias else None
        return dx, dweight, dbias


_IMPLEMENTATIONS = {"native": _Native}


def _declines(backend: str, call: Call) -> Optional[str]:
    """oneDNN's inner product takes float32, and bfloat16 where the CPU has the instructions."""
    if backend == "native" and call.dtype not in _onednn_dtypes():
        return (f"its GEMMs in {call.dtype}: oneDNN takes "
                f"{' or '.join(str(d).split('.')[-1] for d in _onednn_dtypes())} on this CPU")
    return None


# ---- the op: te_lab::linear and its backward, what torch.compile and the profiler see ----

def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], backend: str) -> Tensor:
    y = _IMPLEMENTATIONS[backend].forward(as_rows(x), weight, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def _forward_fake(x, weight, bias, backend):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _backward(dy: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_weight: bool, need_bias: bool,
              backend: str) -> tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = _IMPLEMENTATIONS[backend].backward(
        as_rows(dy), as_rows(x), weight, need_x, need_weight, need_bias)
    return (x.new_empty(_EMPTY) if dx is None else shaped_like(dx, x),
            x.new_empty(_EMPTY) if dweight is None else dweight,
            x.new_empty(_EMPTY) if dbias is None else dbias)


def _backward_fake(dy, x, weight, need_x, need_weight, need_bias, backend):
    return (x.new_empty(x.shape) if need_x else x.new_empty(_EMPTY),
            weight.new_empty(weight.shape) if need_weight else x.new_empty(_EMPTY),
            dy.new_empty(dy.shape[-1:]) if need_bias else x.new_empty(_EMPTY))


def _setup_context(ctx, inputs, output):
    x, weight, bias, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _gradients(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], (
        ctx.has_bias and ctx.needs_input_grad[2])
    dx, dweight, dbias = ctx.backward_op(dy, x, weight, need_x, need_weight, need_bias, ctx.backend)
    return (dx if need_x else None), (dweight if need_weight else None), (dbias if need_bias else None), None


LINEAR, _linear_op, _ = define_op(
    NAME, reference=linear_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    # As F.linear under autocast: x, weight and bias in the region's low-precision dtype.
    autocast=LIKE_LINEAR, backends=_IMPLEMENTATIONS,
    # Where oneDNN runs, whether it pays is measured per class of sizes (float32 calls,
    # _call); torch's own F.linear where it is not measured (TE_LAB_CHOICES=off, another dtype).
    cpu_preference="reference",
    cpu_measured=("native", "reference"),
    cpu_samples=_sample_products,
    native_supports=_native_supports,
    declines=_declines, costs=COSTS)


# ---- the public op ----

def _check_inputs(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    check_tensor(NAME, "x", x)
    check_tensor(NAME, "weight", weight)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{NAME}: weight has shape {tuple(weight.shape)}; expected (out_features, {x.shape[-1]}), "
                         f"its in_features being the last dimension of x")
    # Under autocast F.linear casts x, weight and bias to one dtype itself.
    same_dtype = not inputs_cast_by(LIKE_LINEAR, x.device)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if same_dtype and tensor.dtype != x.dtype:
            raise TypeError(f"{NAME}: {name} has dtype {tensor.dtype}; expected {x.dtype} like x")
        if tensor.device != x.device:
            raise ValueError(f"{NAME}: {name} is on {tensor.device}; expected {x.device} like x")
    if bias is not None:
        check_tensor(NAME, "bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{NAME}: bias has shape {tuple(bias.shape)}; expected ({weight.shape[0]},), "
                             f"the out_features of weight")


def _call(x: Tensor, weight: Tensor, requested: Optional[str]) -> Call:
    """The dispatcher's view of a call: in float32 its sizes, so that an automatic choice
    takes oneDNN only where it measured faster than the BLAS for these sizes and this kind
    of call on this machine; in other dtypes none (``reference`` unless ``native`` is
    forced, which declines only what oneDNN cannot run). The dtype is the one the GEMMs run
    in: under autocast, the region's."""
    dtype = LIKE_LINEAR.cast_dtype(x.device.type) or x.dtype
    if dtype != torch.float32:
        return Call(x.device, requested, dtype)
    return Call(x.device, requested, dtype, (x.numel() // max(x.shape[-1], 1), weight.shape[1], weight.shape[0]))


def runs_on_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`linear` of ``x`` and ``weight`` (backend chosen automatically, or by
    ``use_backend``) runs on oneDNN: for ops whose GEMMs run inside them (the chunks of
    fused_linear_cross_entropy)."""
    return choose(LINEAR, _call(x, weight, None))[0] == "native"


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, backend: Optional[str] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` (``x`` [..., in], ``weight`` [out, in], ``bias``
    [out]) on the backend that runs its GEMMs fastest here (see the module doc).
    ``backend`` forces ``"native"`` (oneDNN) or ``"reference"`` (``F.linear``)."""
    _check_inputs(x, weight, bias)
    return linear_of_module(x, weight, bias, backend)


def linear_of_module(x: Tensor, weight: Tensor, bias: Optional[Tensor], backend: Optional[str]) -> Tensor:
    """:func:`linear` without its argument checks, for an ``nn.Linear``'s own weight and
    bias (consistent by construction; ``F.linear`` still refuses an ``x`` that does not
    fit): a decode step calls several per layer, each on one row."""
    chosen = choose(LINEAR, _call(x, weight, backend))[0]
    if chosen == "reference":
        return run_reference(LINEAR, linear_reference, x, weight, bias)
    return _linear_op(x, weight, bias, chosen)
