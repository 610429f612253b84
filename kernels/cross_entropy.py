"""Softmax cross-entropy over the vocabulary, with its gradient computed in the forward pass.

Per token with logits x (vocabulary N), label t, smoothing e and z-loss weight z:

    lse  = log(sum_j exp(x_j))
    loss = (1 - e) * (lse - x_t) + e * (lse - mean_j x_j) + z * lse**2
    d loss / d x_j = exp(x_j - lse) * (1 + 2 z lse) - e / N - (1 - e) * [j == t]

which is ``F.cross_entropy(logits.float(), labels, label_smoothing=e)`` per token plus
PaLM's z-loss. With a soft-cap c (Gemma 2's ``final_logit_softcapping``) the logits are
first squashed into (-c, c), x_j = c * tanh(l_j / c) for the given logits l, and the
gradient is carried through it: d loss / d l_j = d loss / d x_j * (1 - (x_j / c)**2).
Tokens whose label is ``ignore_index`` have loss and gradient 0. The
forward pass writes that gradient (in the logits' dtype) beside the losses and keeps it
for the backward pass, which is then a scale by the upstream gradient: the logits are
never read again. The Triton kernel reads each row once for the online max and sum of
exp and once more, from cache, to write the gradient. The reduction (mean over
non-ignored tokens, sum, none) is plain torch math on the per-token losses, so autograd
hands the backward one upstream gradient per token.

Backends: ``triton`` (one program per row looping over the vocabulary in blocks),
``cpp`` (te_lab's C++ CPU kernel, kernels/cpp/cross_entropy.cpp: three passes over each
row, one exp per element), ``inductor`` (torch.compile of the formula above) and
``reference``. There is no
``native`` backend: ATen's ``F.cross_entropy`` is ``log_softmax`` followed by
``nll_loss``, which writes the log-probabilities in the forward pass and reads them back
in the backward pass; no ATen kernel computes the loss and its gradient in one pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from te_lab import device as devices

from .checks import check_choice, check_label_tensor, check_labels_in_range, check_tensor
from .costs.cross_entropy import COSTS
from .inductor_compiled import inductor_compiled
from .measured_choice import op_sample, size_class
from .op_declaration import define_op, run_reference
from .precision import compute_dtype, triton_compute_dtype
from .registry import select_measured_backend
from .triton_support import HAS_TRITON, num_warps_for, tl, triton

NAME = "cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


# ---- argument checks, shared with fused_linear_cross_entropy ----

def check_loss_options(op: str, ignore_index, label_smoothing, reduction, z_loss, softcap=None) -> float:
    """Raises on a bad option; returns the soft-cap as the ops take it (0.0: none)."""
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, (int, float)) or isinstance(label_smoothing, bool) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or isinstance(z_loss, bool) or not z_loss >= 0.0:
        raise ValueError(f"{op}: z_loss must be a number >= 0, got {z_loss!r}")
    check_choice(op, "reduction", reduction, REDUCTIONS)
    if softcap is None:
        return 0.0
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not 0.0 < softcap < float("inf"):
        raise ValueError(f"{op}: softcap must be a finite number > 0 or None, got {softcap!r}")
    return float(softcap)


def mean_over_labelled(total: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    """``total`` divided by the number of non-ignored labels. With none, like
    F.cross_entropy: the loss is nan and every gradient is zero (not nan)."""
    count = (labels != ignore_index).sum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)


# ---- reference ----

def soft_capped(logits: Tensor, softcap: Optional[float]) -> Tensor:
    """``softcap * tanh(logits / softcap)`` (Gemma 2's final logit soft-capping); the
    logits themselves where ``softcap`` is None or 0."""
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def cross_entropy_reference(logits: Tensor, labels: Tensor, *, ignore_index: int = -100,
                            label_smoothing: float = 0.0, reduction: str = "mean",
                            z_loss: float = 0.0, softcap: Optional[float] = None) -> Tensor:
    """The unfused PyTorch math: F.cross_entropy on the logits in float32 (float64 stays
    float64), soft-capped first where ``softcap`` is given, plus
    ``z_loss * logsumexp(logits)**2`` per non-ignored token."""
    vocab = logits.shape[-1]
    x = soft_capped(logits.reshape(-1, vocab).to(compute_dtype(logits)), softcap)
    flat_labels = labels.reshape(-1).long()
    per_token = F.cross_entropy(x, flat_labels, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, reduction="none")
    if z_loss:
        labelled = flat_labels != ignore_index
        per_token = per_token + torch.where(labelled, z_loss * torch.logsumexp(x, -1) ** 2, 0.0)
    if reduction == "none":
        return per_token.view(labels.shape)
    if reduction == "sum":
        return per_token.sum()
    return mean_over_labelled(per_token.sum(), flat_labels, ignore_index)


# ---- inductor: the formula, compiled ----

def _forward_math(logits: Tensor, labels: Tensor, ignore_index: int, label_smoothing: float,
                  z_loss: float, softcap: float, compute_grad: bool):
    x = logits.to(compute_dtype(logits))
    if softcap:
        capped = torch.tanh(x / softcap)
        x = capped * softcap
    vocab = x.shape[-1]
    labelled = labels != ignore_index
    target = torch.where(labelled, labels, 0)
    row_max = x.amax(-1, keepdim=True)
    lse = row_max + torch.log(torch.exp(x - row_max).sum(-1, keepdim=True))
    loss = ((1 - label_smoothing) * (lse - x.gather(-1, target[:, None]))
            + label_smoothing * (lse - x.sum(-1, keepdim=True) / vocab)
            + z_loss * lse * lse)
    loss = torch.where(labelled, loss.squeeze(-1), 0.0)
    if not compute_grad:
        return loss, None
    classes = torch.arange(vocab, device=x.device)
    # (1 - e) multiplies the one-hot mask rather than filling torch.where: torch 2.13's
    # Inductor bakes a symbolic float given to torch.where in as its first call's value.
    grad = (torch.exp(x - lse) * (1 + 2 * z_loss * lse) - label_smoothing / vocab
            - (1 - label_smoothing) * (classes == target[:, None]).to(x.dtype))
    if softcap:
        grad = grad * (1 - capped * capped)
    return loss, torch.where(labelled[:, None], grad, 0.0).to(logits.dtype)


class _Inductor:
    _compiled = staticmethod(inductor_compiled(_forward_math))

    @staticmethod
    def forward(logits, labels, ignore_index, label_smoothing, z_loss, softcap, compute_grad, logits_are_scratch):
        # The gradient is always a new tensor: writing it over scratch logits would take a
        # second compiled graph per dtype, for one chunk-sized buffer that is small beside
        # the chunk's matmuls. Contiguous rows keep strided inputs from compiling another graph.
        return _Inductor._compiled(logits.contiguous(), labels, ignore_index, label_smoothing,
                                   z_loss, softcap, compute_grad)


# ---- triton: one program per row ----

# Blocks of at most 4096 columns (8 values per thread at 16 warps): a 32000-word vocabulary
# takes 8 blocks, and a row (128 KB in float32) is still in cache when it is re-read for
# the gradient.
_MAX_BLOCK = 4096

if HAS_TRITON:

    @triton.jit
    def _soft_capped(x, softcap, SOFTCAP: tl.constexpr):
        """(softcap * tanh(x / softcap), 1 - tanh^2, its derivative) with SOFTCAP, else (x, 1);
        tanh as 2 sigmoid(2z) - 1 (Triton 3.2 has none)."""
        if SOFTCAP:
            t = 2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0
            return t * softcap, 1.0 - t * t
        else:
            return x, 1.0

    @triton.jit
    def _cross_entropy_forward_kernel(X, LABELS, LOSS, GRAD, x_stride, grad_stride, n_cols, ignore_index,
                                      label_smoothing, z_loss, softcap, HAS_GRAD: tl.constexpr,
                                      SOFTCAP: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * x_stride
        grad_row = GRAD + row * grad_stride
        cols = tl.arange(0, BLOCK)
        label = tl.load(LABELS + row)
        if label == ignore_index:
            tl.store(LOSS + row, tl.zeros((), ACC))
            if HAS_GRAD:
                for start in range(0, n_cols, BLOCK):
                    tl.store(grad_row + start + cols, tl.zeros((BLOCK,), GRAD.dtype.element_ty),
                             mask=start + cols < n_cols)
            return
        # Online log-sum-exp: rescale the running sum whenever the running max grows.
        row_max = tl.full((), float("-inf"), ACC)
        sum_exp = tl.zeros((), ACC)
        row_sum = tl.zeros((), ACC)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x, _ = _soft_capped(tl.load(x_row + start + cols, mask=mask, other=0.0).to(ACC), softcap, SOFTCAP)
            x = tl.where(mask, x, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            row_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
            row_max = new_max
        lse = row_max + tl.log(sum_exp)
        x_label, _ = _soft_capped(tl.load(x_row + label).to(ACC), softcap, SOFTCAP)
        loss = ((1.0 - label_smoothing) * (lse - x_label) + label_smoothing * (lse - row_sum / n_cols)
                + z_loss * lse * lse)
        tl.store(LOSS + row, loss)
        if HAS_GRAD:
            # Every column is read before it is written, so GRAD may be X itself.
            prob_scale = 1.0 + 2.0 * z_loss * lse
            uniform = label_smoothing / n_cols
            for start in range(0, n_cols, BLOCK):
                offsets = start + cols
                mask = offsets < n_cols
                x, slope = _soft_capped(tl.load(x_row + offsets, mask=mask, other=0.0).to(ACC), softcap, SOFTCAP)
                grad = tl.exp(x - lse) * prob_scale - uniform
                grad = tl.where(offsets == label, grad - (1.0 - label_smoothing), grad) * slope
                tl.store(grad_row + offsets, grad.to(GRAD.dtype.element_ty), mask=mask)


class _Triton:
    @staticmethod
    def forward(logits, labels, ignore_index, label_smoothing, z_loss, softcap, compute_grad, logits_are_scratch):
        rows, vocab = logits.shape
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        labels = labels.contiguous()  # the kernel reads label i at LABELS + i
        loss = torch.empty(rows, dtype=compute_dtype(logits), device=logits.device)
        grad = None
        if compute_grad:
            grad = logits if logits_are_scratch else torch.empty_like(logits, memory_format=torch.contiguous_format)
        if rows == 0:
            return loss, grad
        block = min(triton.next_power_of_2(vocab), _MAX_BLOCK)
        with devices.device_guard(logits.device):
            _cross_entropy_forward_kernel[(rows,)](
                logits, labels, loss, logits if grad is None else grad, logits.stride(0),
                0 if grad is None else grad.stride(0), vocab, ignore_index, label_smoothing, z_loss, softcap,
                HAS_GRAD=compute_grad, SOFTCAP=softcap != 0.0, ACC=triton_compute_dtype(logits), BLOCK=block,
                num_warps=num_warps_for(block))
        return loss, grad


# ---- cpp: te_lab's C++ kernels (kernels/cpp/cross_entropy.cpp) ----

class _Cpp:
    """fused_linear_cross_entropy's chunks on the C++ kernels, whose scratch logits take the
    gradient in place (te_lab::cross_entropy's own calls go to its C++ overload)."""

    @staticmethod
    def forward(logits, labels, ignore_index, label_smoothing, z_loss, softcap, compute_grad, logits_are_scratch):
        if compute_grad and logits_are_scratch and logits.is_contiguous():
            loss = torch.ops.te_lab.cross_entropy_over_logits.cpp(logits, labels, ignore_index, label_smoothing,
                                                                   z_loss, softcap)
            return loss, logits
        loss, grad = torch.ops.te_lab.cross_entropy.cpp(logits, labels, ignore_index, label_smoothing, z_loss,
                                                        softcap, compute_grad)
        return loss, (grad if compute_grad else None)


# The per-backend row kernels: ``forward(logits [rows, vocab], labels int64 [rows],
# ignore_index, label_smoothing, z_loss, softcap (0.0: none), compute_grad, logits_are_scratch)`` returns the
# per-row losses (float32, float64 for float64 logits) and, when ``compute_grad``, the
# per-row loss gradient in the logits' dtype. ``logits_are_scratch`` tells a backend that
# the caller no longer needs the logits, so the gradient may be written over them.
# fused_linear_cross_entropy runs its chunks through these same kernels.
IMPLEMENTATIONS = {"inductor": _Inductor, "cpp": _Cpp}
if HAS_TRITON:
    IMPLEMENTATIONS["triton"] = _Triton

# Logits elements a CPU backend's measuring sample holds at most (16 MB in float32): a
# sample of more rows only repeats the same rows' work.
SAMPLE_ELEMENTS = 1 << 22


def measured_rows(rows: int, vocab: int) -> int:
    """The rows a measured CPU choice over ``rows`` x ``vocab`` logits samples and is
    decided for: ``rows``, up to SAMPLE_ELEMENTS in all."""
    return max(min(rows, SAMPLE_ELEMENTS // size_class(vocab)), 1)


def _cpu_samples(dtype: torch.dtype, rows: int, vocab: int, *, training: bool = True):
    """One call (a training call, forward and backward, or a forward alone; through the
    public op) per CPU backend over ``rows`` x ``vocab`` logits, on constant inputs (the
    caller's RNG is left alone)."""
    with torch.inference_mode(False), torch.enable_grad():
        logits = torch.linspace(-4, 4, rows * vocab, dtype=dtype).view(rows, vocab).requires_grad_()
        labels = torch.arange(rows) % vocab
    return {name: op_sample(lambda name=name: cross_entropy(logits, labels, backend=name), (logits,), None,
                            training=training)
            for name in CROSS_ENTROPY.cpu_measured}


# ---- the op: te_lab::cross_entropy and its backward, what torch.compile and the profiler see ----

_EMPTY = (0,)


def _forward(logits: Tensor, labels: Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
             softcap: float, compute_grad: bool, backend: str) -> tuple[Tensor, Tensor]:
    """Per-token losses of logits [tokens, vocab] (soft-capped first where ``softcap`` is
    not 0) and, when ``compute_grad``, their gradient (an empty tensor otherwise)."""
    check_labels_in_range(NAME, labels, logits.shape[-1], ignore_index)
    loss, grad = IMPLEMENTATIONS[backend].forward(logits, labels, ignore_index, label_smoothing, z_loss, softcap,
                                                  compute_grad, False)
    return loss, (logits.new_empty(_EMPTY) if grad is None else grad)


def _forward_fake(logits, labels, ignore_index, label_smoothing, z_loss, softcap, compute_grad, backend):
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(_EMPTY)
    return logits.new_empty(logits.shape[0], dtype=compute_dtype(logits)), grad


def _backward(grad_logits: Tensor, dloss: Tensor) -> Tensor:
    """The stored gradient scaled by each token's upstream gradient: one multiply, the
    same on every backend (an elementwise ATen kernel is already a single pass)."""
    # out= keeps the logits' dtype: the product is computed in the loss's precision and
    # rounded once.
    return torch.mul(grad_logits, dloss[:, None], out=torch.empty_like(grad_logits))


def _backward_fake(grad_logits, dloss):
    return grad_logits.new_empty(grad_logits.shape)


def _setup_context(ctx, inputs, output):
    _, grad = output
    ctx.save_for_backward(grad)
    ctx.set_materialize_grads(False)


def _gradients(ctx, dloss, _dgrad):
    if dloss is None:
        return (None,) * 8
    (grad,) = ctx.saved_tensors
    return (ctx.backward_op(grad, dloss),) + (None,) * 7


CROSS_ENTROPY, _cross_entropy_op, _ = define_op(
    NAME, reference=cross_entropy_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    # F.cross_entropy is on autocast's float32 list: the logits are cast to float32 and the
    # gradient cast back. This op already computes in float32 and writes the gradient in the
    # logits' dtype, the same numbers, so casting first would only add a float32 copy of
    # the [tokens, vocab] logits: no autocast rule.
    backends=IMPLEMENTATIONS, cpp=True,
    # The C++ kernels' other entry points: the backward (the C++ autograd formula calls it),
    # the same scaling written into the stored gradient once the graph is freed, and the
    # forward that writes the gradient over scratch logits (fused_linear_cross_entropy's chunks).
    cpp_overloads={
        "cross_entropy_backward.cpp": "(Tensor grad_logits, Tensor dloss) -> Tensor",
        "cross_entropy_backward.cpp_in_place": "(Tensor(a!) grad_logits, Tensor dloss) -> Tensor(a!)",
        "cross_entropy_over_logits.cpp": "(Tensor(a!) logits, Tensor labels, int ignore_index, float label_smoothing,"
                                         " float z_loss, float softcap) -> Tensor"},
    cpu_preference="cpp", cpu_measured=("cpp", "inductor", "reference"), cpu_samples=_cpu_samples, costs=COSTS)


def reduce_loss(per_token: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """Per-token losses [tokens] reduced like F.cross_entropy; ``labels`` has the shape
    "none" returns."""
    if reduction == "none":
        return per_token.view(labels.shape)
    if reduction == "sum":
        return per_token.sum()
    return mean_over_labelled(per_token.sum(), labels, ignore_index)


def cross_entropy(logits: Tensor, labels: Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                  reduction: str = "mean", z_loss: float = 0.0, softcap: Optional[float] = None,
                  backend: Optional[str] = None) -> Tensor:
    """Fused softmax cross-entropy of ``logits`` [..., vocab] against integer ``labels`` [...].

    Same result as ``F.cross_entropy(logits.float(), labels, ignore_index=...,
    label_smoothing=..., reduction=...)`` with the vocabulary as the last dimension,
    plus ``z_loss * logsumexp(logits)**2`` per non-ignored token, reduced the same way.
    ``softcap`` (a number > 0) soft-caps the logits first, ``softcap * tanh(logits / softcap)``
    (Gemma 2's ``final_logit_softcapping``). The loss is float32 (float64 for float64 logits);
    ``reduction="none"`` returns one loss per label (0 where ignored). ``backend`` forces
    ``"triton"``, ``"cpp"``, ``"inductor"`` or ``"reference"`` (see :mod:`te_lab.kernels.registry`).
    """
    check_tensor(NAME, "logits", logits)
    check_label_tensor(NAME, labels, logits.shape[:-1], logits, "logits")
    cap = check_loss_options(NAME, ignore_index, label_smoothing, reduction, z_loss, softcap)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(f"{NAME}: logits has shape {tuple(logits.shape)}; expected a vocabulary of at least 1")
    rows = logits.numel() // vocab
    chosen = select_measured_backend(CROSS_ENTROPY, logits.device, backend, logits.dtype,
                                     (measured_rows(rows, vocab), vocab))
    if chosen == "reference":
        if not torch.compiler.is_compiling():  # the check reads a device value: a graph break
            check_labels_in_range(NAME, labels, vocab, ignore_index)
        return run_reference(CROSS_ENTROPY, cross_entropy_reference, logits, labels, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, reduction=reduction, z_loss=z_loss, softcap=softcap)
    flat_labels = labels.reshape(-1).long()
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    per_token, _ = _cross_entropy_op(logits.reshape(-1, vocab), flat_labels, ignore_index,
                                     float(label_smoothing), float(z_loss), cap, compute_grad, chosen)
    return reduce_loss(per_token, labels, ignore_index, reduction)
