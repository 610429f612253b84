"""The LM head and its cross-entropy loss, without the [tokens, vocab] logits in memory.

    logits = hidden @ weight.T (+ bias)
    logits = softcap * tanh(logits / softcap)       (only with a soft-cap: Gemma 2)
    loss   = cross_entropy(logits, labels)          (see te_lab.kernels.cross_entropy)

Tokens are processed in chunks of ``chunk_size``. For each chunk the forward pass runs
the head's matmul on the vendor BLAS, the cross-entropy row kernel of the chosen backend
(which soft-caps the logits where asked and returns the per-token loss gradient
d loss / d logits, through the cap, along with the loss), and
then the three gradient products while the chunk's logits are at hand:

    grad_hidden[chunk] = dlogits @ weight
    grad_weight       += dlogits.T @ hidden[chunk]
    grad_bias         += dlogits.sum(0)

so only one chunk of logits (and, on backends that cannot overwrite them, one chunk of
their gradient) is ever alive. The backward pass scales the stored gradients by the
upstream gradient of the summed loss. With ``reduction="none"`` the upstream gradient
differs per token and must weight each token's outer product in ``grad_weight``, which
the forward pass cannot know: there the forward pass computes the losses only and the
backward pass runs the chunks again with the per-token weights (the matmuls run twice).

Backends are those of the chunk's cross-entropy (``triton``, ``inductor``, ``cpp``) and
``reference`` (``F.linear`` then ``F.cross_entropy``, which materialises the logits).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .autocast import LIKE_LINEAR, inputs_cast_by, register_autocast_rule
from .checks import check_label_tensor, check_labels_in_range, check_tensor
from .costs.fused_linear_cross_entropy import COSTS
from .cross_entropy import (
    IMPLEMENTATIONS as CHUNK_IMPLEMENTATIONS,
    check_loss_options,
    cross_entropy_reference,
    mean_over_labelled,
    measured_rows,
)
from .linear import matmul_nt, runs_on_onednn
from .op_declaration import define_op, run_reference
from .precision import compute_dtype
from .registry import select_measured_backend
from .torch_internals import backward_keeps_graph, dispatch_modes_active

NAME = "fused_linear_cross_entropy"

# The default chunk holds about this many bytes of logits: large enough that the three
# matmuls per chunk stay efficient, small enough to be a minor share of a training step's
# memory (the [tokens, vocab] logits of an LLM batch take gigabytes). Measured on the
# 2-core CPU (fp32, vocab 32000, fwd+bwd, 1 thread), 32 MB chunks against 128 MB ones:
# peak memory 30% instead of 68% of the unfused path's at 2048 x 1024, 34% instead of 75%
# at 1024 x 256, and 3-13% faster: each chunk's new buffers cost page faults.
CHUNK_LOGITS_BYTES = 32 * 2**20


def fused_linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, labels: Tensor,
                                         bias: Optional[Tensor] = None, *, ignore_index: int = -100,
                                         label_smoothing: float = 0.0, reduction: str = "mean",
                                         z_loss: float = 0.0, softcap: Optional[float] = None) -> Tensor:
    """The unfused PyTorch math: ``F.linear`` then the cross-entropy reference (which
    soft-caps the logits first where ``softcap`` is given)."""
    return cross_entropy_reference(F.linear(hidden, weight, bias), labels, ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, reduction=reduction, z_loss=z_loss,
                                   softcap=softcap)


def default_chunk_size(tokens: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk: the largest power of two whose logits fit CHUNK_LOGITS_BYTES
    (at least 1), never more than ``tokens``."""
    fitting = max(CHUNK_LOGITS_BYTES // max(vocab * element_size, 1), 1)
    return max(min(1 << (fitting.bit_length() - 1), tokens), 1)


def _chunked_loss_and_gradients(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                                ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
                                chunk_size: int, token_weights: Optional[Tensor], need_hidden: bool, need_weight: bool,
                                need_bias: bool, backend: str):
    """Per-token losses and the gradients of ``sum(token_weights * losses)`` (all weights 1
    when None) that are needed, chunk by chunk; None where not needed. The weight and bias
    gradients are sums over every token: they are accumulated and returned in the compute
    precision (float32 for half-precision weights), for the caller to round once.

    The products run where te_lab's ``linear`` would run them (oneDNN on CPUs where it
    beats the BLAS); the first chunk writes the weight gradient, so it needs no zeros, and
    later chunks add to it in place."""
    chunk_cross_entropy = CHUNK_IMPLEMENTATIONS[backend]
    onednn = runs_on_onednn(hidden[:chunk_size], weight)

    def product(a: Tensor, b: Tensor, bias_: Optional[Tensor] = None) -> Tensor:  # a @ b^T
        return matmul_nt(a, b, bias_) if onednn else F.linear(a, b, bias_)

    tokens = hidden.shape[0]
    acc = compute_dtype(hidden)
    compute_grad = need_hidden or need_weight or need_bias
    losses = torch.empty(tokens, dtype=acc, device=hidden.device)
    # Contiguous, so each chunk's rows are a block the matmul can write with out=; a single
    # oneDNN chunk's product is the gradient itself (a second buffer would cost its page faults).
    one_onednn_chunk = onednn and 0 < tokens <= chunk_size
    grad_hidden = (torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
                   if need_hidden and not one_onednn_chunk else None)
    grad_weight = None
    grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_bias else None
    for start in range(0, tokens, chunk_size):
        stop = min(start + chunk_size, tokens)
        chunk = hidden[start:stop]
        logits = product(chunk, weight, bias)
        losses[start:stop], dlogits = chunk_cross_entropy.forward(
            logits, labels[start:stop], ignore_index, label_smoothing, z_loss, softcap, compute_grad, True)
        del logits  # freed before the products allocate theirs (unless dlogits was written over it)
        if not compute_grad:
            continue
        if token_weights is not None:
            dlogits.mul_(token_weights[start:stop, None])
        if need_hidden and one_onednn_chunk:
            grad_hidden = product(dlogits, weight.t())  # one chunk: its product is the gradient
        elif need_hidden and onednn:
            grad_hidden[start:stop] = product(dlogits, weight.t())
        elif need_hidden:
            torch.mm(dlogits, weight, out=grad_hidden[start:stop])
        if need_weight and grad_weight is None:
            # On the BLAS, which reads the transposed logits in place: oneDNN copies a transposed
            # first operand into a contiguous [vocab, tokens] buffer first (30 ms at 1024 x 8000).
            grad_weight = torch.mm(dlogits.t(), chunk).to(acc)
        elif need_weight and grad_weight.dtype == dlogits.dtype:
            # In place: a oneDNN product would be a new [vocab, in] tensor per chunk, which
            # costs more memory (and page faults) than its faster GEMM saves.
            grad_weight.addmm_(dlogits.t(), chunk)
        elif need_weight:  # half-precision products, float32 accumulation across chunks
            grad_weight.add_(torch.mm(dlogits.t(), chunk))
        if need_bias:
            grad_bias.add_(dlogits.sum(0, dtype=acc))
    if need_weight and grad_weight is None:  # no tokens
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    return losses, grad_hidden, grad_weight, grad_bias


def _cpu_samples(dtype: torch.dtype, rows: int, vocab: int, *, training: bool = True):
    """Per CPU backend, one chunk's row kernels as a training step runs them (loss and
    gradient of ``rows`` x ``vocab`` scratch logits, refilled first, since a backend may
    write the gradient over them) or, without ``training``, the loss alone; on constant
    inputs (the caller's RNG is left alone). The chunk's matmuls cost the same on every
    backend and are left out. ``reference`` is no contender here: the choice is between
    row kernels of the chunked loss, not between fusing and not."""
    filled = torch.linspace(-4, 4, rows * vocab, dtype=dtype).view(rows, vocab)
    logits = torch.empty_like(filled)
    labels = torch.arange(rows) % vocab

    def sample(backend):
        def run():
            logits.copy_(filled)
            CHUNK_IMPLEMENTATIONS[backend].forward(logits, labels, -100, 0.0, 0.0, 0.0, training, True)
        return run

    return {name: sample(name) for name in FUSED_LINEAR_CROSS_ENTROPY.cpu_measured}


# ---- the op: te_lab::fused_linear_cross_entropy and its backward, what torch.compile and the profiler see ----

_EMPTY = (0,)


def _or_empty(tensor: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty(_EMPTY) if tensor is None else tensor


def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int,
             label_smoothing: float, z_loss: float, softcap: float, summed: bool, chunk_size: int,
             need_hidden: bool, need_weight: bool, need_bias: bool,
             backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The summed loss (``summed``) or the per-token losses of hidden [tokens, in] and labels
    [tokens], with the needed gradients of the summed loss (empty tensors otherwise). The
    weight and bias gradients stay in the compute precision until the backward pass has
    scaled them, so a half-precision gradient is rounded once, as the unfused path's is."""
    check_labels_in_range(NAME, labels, weight.shape[0], ignore_index)
    # Per-token losses get their gradients in the backward pass (see the module doc).
    losses, grad_hidden, grad_weight, grad_bias = _chunked_loss_and_gradients(
        hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, chunk_size, None,
        summed and need_hidden, summed and need_weight, summed and need_bias, backend)
    return ((losses.sum() if summed else losses), _or_empty(grad_hidden, hidden),
            _or_empty(grad_weight, weight), _or_empty(grad_bias, weight))


def _forward_fake(hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, summed,
                  chunk_size, need_hidden, need_weight, need_bias, backend):
    loss = hidden.new_empty(() if summed else (hidden.shape[0],), dtype=compute_dtype(hidden))
    return (loss,
            hidden.new_empty(hidden.shape) if summed and need_hidden else hidden.new_empty(_EMPTY),
            weight.new_empty(weight.shape, dtype=loss.dtype) if summed and need_weight else weight.new_empty(_EMPTY),
            bias.new_empty(bias.shape, dtype=loss.dtype) if summed and need_bias else weight.new_empty(_EMPTY))


def _backward(
        dloss: Tensor, grad_hidden: Optional[Tensor], grad_weight: Optional[Tensor], grad_bias: Optional[Tensor],
        hidden: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], labels: Optional[Tensor],
        ignore_index: int, label_smoothing: float, z_loss: float, softcap: float, chunk_size: int,
        need_hidden: bool, need_weight: bool, need_bias: bool, dtype: torch.dtype,
        backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """A summed loss (``dloss`` 0-d) scales the gradients stored by the forward pass; per-token
    losses (``dloss`` [tokens]) run the chunks again with ``dloss`` weighting each token.
    ``dtype`` is the inputs' (hidden, weight and bias share it), which the gradients take."""
    if dloss.dim() == 0:
        # out= rounds the product to the inputs' dtype in the same pass, with no temporary.
        return tuple(dloss.new_empty(_EMPTY) if stored is None
                     else torch.mul(stored, dloss, out=stored.new_empty(stored.shape, dtype=dtype))
                     for stored in (grad_hidden, grad_weight, grad_bias))
    _, *gradients = _chunked_loss_and_gradients(
        hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, chunk_size, dloss,
        need_hidden, need_weight, need_bias, backend)
    return tuple(dloss.new_empty(_EMPTY) if grad is None else grad.to(dtype) for grad in gradients)


def _backward_fake(dloss, grad_hidden, grad_weight, grad_bias, hidden, weight, bias, labels, ignore_index,
                   label_smoothing, z_loss, softcap, chunk_size, need_hidden, need_weight, need_bias, dtype, backend):
    if dloss.dim() == 0:
        shapes_of = (grad_hidden, grad_weight, grad_bias)
    else:
        shapes_of = (hidden if need_hidden else None, weight if need_weight else None,
                     bias if need_bias else None)
    return tuple(dloss.new_empty(_EMPTY) if like is None else like.new_empty(like.shape, dtype=dtype)
                 for like in shapes_of)


@torch.library.custom_op("te_lab::fused_linear_cross_entropy_scale_",
                         mutates_args=("grad_hidden", "grad_weight", "grad_bias"))
def _scale_stored_gradients_op(dloss: Tensor, grad_hidden: Optional[Tensor], grad_weight: Optional[Tensor],
                               grad_bias: Optional[Tensor]) -> None:
    """A summed loss's backward where nothing reads the stored gradients again: they are
    scaled by ``dloss`` in place and handed on, sparing a new [vocab, in_features] tensor
    (and, on the CPU, its page faults, which cost ~15x the multiply itself)."""
    for stored in (grad_hidden, grad_weight, grad_bias):
        if stored is not None:
            stored.mul_(dloss)


@_scale_stored_gradients_op.register_fake
def _(dloss, grad_hidden, grad_weight, grad_bias):
    return None


def _scales_in_place(stored: tuple, dtype: torch.dtype) -> bool:
    """Whether this backward may scale the stored gradients in place: the graph is freed
    after it (no ``retain_graph``/``create_graph``, so nothing reads them again), they
    already have the inputs' dtype, and nothing traces it: no compiler, and no dispatch
    mode or tensor subclass (AOT autograd's functionalization cannot have a backward
    mutate what the forward saved). Where torch cannot tell whether the graph is kept, the
    stored gradients are scaled into new tensors."""
    return (not torch.compiler.is_compiling() and backward_keeps_graph() is False
            and not dispatch_modes_active()
            and all(tensor is None or (type(tensor) is Tensor and tensor.dtype == dtype) for tensor in stored))


def _setup_context(ctx, inputs, output):
    (hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss, softcap, summed, chunk_size,
     need_hidden, need_weight, need_bias, backend) = inputs
    _, grad_hidden, grad_weight, grad_bias = output
    ctx.summed = summed
    if summed:
        ctx.save_for_backward(grad_hidden if need_hidden else None, grad_weight if need_weight else None,
                              grad_bias if need_bias else None)
    else:
        ctx.save_for_backward(hidden, weight, bias, labels)
    ctx.options = (ignore_index, label_smoothing, z_loss, softcap, chunk_size, need_hidden, need_weight, need_bias,
                   hidden.dtype, backend)
    ctx.set_materialize_grads(False)


def _gradients(ctx, dloss, _dgrad_hidden, _dgrad_weight, _dgrad_bias):
    need_hidden, need_weight, need_bias = ctx.options[5:8]
    if dloss is None or not (need_hidden or need_weight or need_bias):
        return (None,) * 14
    stored = ctx.saved_tensors if ctx.summed else (None,) * 3
    inputs = (None,) * 4 if ctx.summed else ctx.saved_tensors
    if ctx.summed and _scales_in_place(stored, ctx.options[8]):
        _scale_stored_gradients_op(dloss, *stored)
        grad_hidden, grad_weight, grad_bias = stored
    else:
        grad_hidden, grad_weight, grad_bias = ctx.backward_op(dloss, *stored, *inputs, *ctx.options)
    return ((grad_hidden if need_hidden else None), (grad_weight if need_weight else None),
            (grad_bias if need_bias else None)) + (None,) * 11


FUSED_LINEAR_CROSS_ENTROPY, _fused_linear_cross_entropy_op, _ = define_op(
    NAME, reference=fused_linear_cross_entropy_reference, forward=_forward, forward_fake=_forward_fake,
    backward=_backward, backward_fake=_backward_fake, setup_context=_setup_context, gradients=_gradients,
    # As F.linear then F.cross_entropy under autocast: hidden, weight and bias in the region's
    # low-precision dtype for the matmuls, the loss in float32 (which the chunks compute anyway).
    autocast=LIKE_LINEAR,
    # The cpp backend is Python around cross_entropy's C++ row kernels: no C++ overload.
    backends=CHUNK_IMPLEMENTATIONS,
    # The matmuls are most of the time; the chunks' row kernels are chosen by measuring
    # them at the chunk's size. Measured on the 2-core CPU (fp32, forward and backward):
    # chunks through the C++ row kernel, which writes the gradient over the chunk's
    # logits, took 66 ms at 1024 tokens x 256 hidden x 8000 vocab against Inductor's 78 ms
    # and the unfused path's 100 ms; 0.97 s at 4096 x 256 x 32000 (Inductor 0.99 s,
    # unfused 2.7 s).
    cpu_preference="cpp", cpu_measured=("cpp", "inductor"), cpu_samples=_cpu_samples, costs=COSTS)
# The in-place scaling mutates its arguments: a torch.library.custom_op of its own.
register_autocast_rule("fused_linear_cross_entropy_scale_")


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None, *,
                               ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                               z_loss: float = 0.0, softcap: Optional[float] = None,
                               chunk_size: Optional[int] = None, backend: Optional[str] = None) -> Tensor:
    """Cross-entropy of ``F.linear(hidden, weight, bias)`` against ``labels``, computed in
    chunks of ``chunk_size`` tokens so the [tokens, vocab] logits never exist in full.

    ``hidden`` [..., in_features], ``weight`` [vocab, in_features] and ``bias`` [vocab]
    share a dtype; ``labels`` [...] are integers. Options and result are those of
    :func:`te_lab.kernels.cross_entropy.cross_entropy` (``softcap``: the logits become
    ``softcap * tanh(logits / softcap)`` before the loss, Gemma 2's final logit
    soft-capping, forward and backward inside the chunks). ``chunk_size`` defaults to the
    largest power of two whose logits fit in ``CHUNK_LOGITS_BYTES``. ``backend`` forces
    ``"triton"``, ``"cpp"``, ``"inductor"`` or ``"reference"``.
    """
    check_tensor(NAME, "hidden", hidden)
    check_tensor(NAME, "weight", weight, min_dim=2)
    if weight.dim() != 2:
        raise ValueError(f"{NAME}: weight has shape {tuple(weight.shape)}; expected 2 dimensions [vocab, in_features]")
    vocab, in_features = weight.shape
    if in_features != hidden.shape[-1]:
        raise ValueError(
            f"{NAME}: weight has shape {tuple(weight.shape)}; expected in_features {hidden.shape[-1]} "
            f"(the last dimension of hidden, shape {tuple(hidden.shape)})"
        )
    if vocab == 0:
        raise ValueError(f"{NAME}: weight has shape {tuple(weight.shape)}; expected a vocabulary of at least 1")
    if bias is not None:
        check_tensor(NAME, "bias", bias)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"{NAME}: bias has shape {tuple(bias.shape)}; expected ({vocab},), the rows of weight")
    # One dtype throughout, as F.linear requires (under autocast it casts to one itself).
    same_dtype = not inputs_cast_by(LIKE_LINEAR, hidden.device)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if same_dtype and tensor is not None and tensor.dtype != hidden.dtype:
            raise TypeError(f"{NAME}: {name} has dtype {tensor.dtype}; expected {hidden.dtype} like hidden")
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{NAME}: {name} is on {tensor.device}; expected {hidden.device} like hidden")
    check_label_tensor(NAME, labels, hidden.shape[:-1], hidden, "hidden")
    cap = check_loss_options(NAME, ignore_index, label_smoothing, reduction, z_loss, softcap)
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"{NAME}: chunk_size must be a positive int or None, got {chunk_size!r}")
    tokens = hidden.shape[:-1].numel()
    chunk = min(chunk_size, max(tokens, 1)) if chunk_size else default_chunk_size(tokens, vocab, hidden.element_size())
    chosen = select_measured_backend(FUSED_LINEAR_CROSS_ENTROPY, hidden.device, backend, hidden.dtype,
                                     (measured_rows(chunk, vocab), vocab))
    if chosen == "reference":
        if not torch.compiler.is_compiling():  # the check reads a device value: a graph break
            check_labels_in_range(NAME, labels, vocab, ignore_index)
        return run_reference(FUSED_LINEAR_CROSS_ENTROPY, fused_linear_cross_entropy_reference, hidden, weight,
                             labels, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
                             reduction=reduction, z_loss=z_loss, softcap=softcap)
    flat_hidden = hidden.reshape(-1, in_features)
    flat_labels = labels.reshape(-1).long()
    grad_enabled = torch.is_grad_enabled()
    summed = reduction != "none"
    loss, _, _, _ = _fused_linear_cross_entropy_op(
        flat_hidden, weight, bias, flat_labels, ignore_index, float(label_smoothing), float(z_loss), cap, summed, chunk,
        grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad, chosen)
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss
    return mean_over_labelled(loss, flat_labels, ignore_index)
