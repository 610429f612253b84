"""torch.library.opcheck on every te_lab op and overload, on every backend that runs here:
the schemas tell the truth about aliasing and mutation, the fake outputs match the real
ones (shapes, strides, dtypes), and the autograd registrations hold.

Each registered fused op runs its public function forward and backward at small sizes
under a dispatch mode that records the ``te_lab::`` calls it makes, with the arguments
they received; every recorded call is then checked, and on the ``cpp`` backend the op's
C++ overload (``te_lab::<op>.cpp``) with the same arguments. The overloads no public call
reaches on its own are checked from samples of their own (``DIRECT_SAMPLES``).

The C++ overloads are eager entry points: te_lab.kernels.custom_ops sends every traced,
autocast or dispatch-mode call to the Python op instead, so they have no fake functions
and are checked for their schema and autograd registration only (``EAGER_ONLY_CHECKS``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICE, fused_backends
from te_lab.kernels import cpu_kernels
from te_lab.kernels.attention import attention
from te_lab.kernels.bias_act import bias_act, linear_act
from te_lab.kernels.cross_entropy import cross_entropy
from te_lab.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from te_lab.kernels.glu import glu
from te_lab.kernels.layer_norm import layer_norm
from te_lab.kernels.linear import linear
from te_lab.kernels.moe import CLAMPED_SWIGLU, moe
from te_lab.kernels.registry import registered_ops
from te_lab.kernels.rms_norm import rms_norm
from te_lab.kernels.rope import rope


def _randn(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE).requires_grad_(grad)


def _labels(tokens, vocab):
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)
    labels[1] = -100  # an ignored token
    return labels


def _outputs(result):
    return [t for t in (result if isinstance(result, tuple) else (result,)) if t.requires_grad]


def _rms_norm(backend):
    x, residual, weight = _randn(5, 24), _randn(5, 24), _randn(24)
    return rms_norm(x, weight, residual=residual, backend=backend), rms_norm(x, weight, backend=backend)


def _layer_norm(backend):
    x, residual, weight, bias = _randn(5, 24), _randn(5, 24), _randn(24), _randn(24)
    return (layer_norm(x, weight, bias, residual=residual, backend=backend), layer_norm(x, backend=backend),
            layer_norm(x, weight, bias, weight_offset=1.0, backend=backend))


def _glu(backend):
    return glu(_randn(2, 3, 40), _randn(2, 3, 40), "silu", backend=backend), glu(_randn(3, 80), None, "gelu_tanh",
                                                                                  backend=backend)


def _bias_act(backend):
    return bias_act(_randn(2, 3, 40), _randn(40), "gelu", backend=backend), linear_act(
        _randn(3, 16), _randn(24, 16), _randn(24), "silu", backend=backend)


def _rope(backend):
    q, k = _randn(2, 4, 7, 16), _randn(2, 2, 7, 16)
    cos, sin = _randn(7, 16, grad=False), _randn(7, 16, grad=False)
    q_weight, k_weight = _randn(16), _randn(16)
    # QK-norm with partial rotary, on q and k as Hugging Face's transposed projections give them
    q_hf, k_hf = _randn(2, 7, 4, 16).transpose(1, 2), _randn(2, 7, 2, 16).transpose(1, 2)
    return (rope(q, k, cos, sin, backend=backend),
            rope(q, k, cos, sin, interleaved=True, backend=backend),
            rope(q_hf, k_hf, cos[:, :8], sin[:, :8], q_norm_weight=q_weight, k_norm_weight=k_weight,
                         norm_weight_offset=1.0, backend=backend))


def _attention(backend):
    q, k, v = _randn(2, 4, 9, 16), _randn(2, 2, 9, 16), _randn(2, 2, 9, 16)
    mask = torch.rand(2, 1, 9, 9, device=DEVICE) > 0.2
    return attention(q, k, v, causal=True, backend=backend), attention(q, k, v, mask=mask, backend=backend)


def _cross_entropy(backend):
    return (cross_entropy(_randn(6, 50), _labels(6, 50), label_smoothing=0.1, z_loss=1e-3, backend=backend),
            cross_entropy(_randn(6, 50), _labels(6, 50), softcap=3.0, backend=backend))


def _fused_linear_cross_entropy(backend):
    hidden, weight, bias = _randn(6, 16), _randn(50, 16), _randn(50)
    labels = _labels(6, 50)
    summed = fused_linear_cross_entropy(hidden, weight, labels, bias, chunk_size=4, backend=backend)
    per_token = fused_linear_cross_entropy(hidden, weight, labels, reduction="none", chunk_size=4, backend=backend)
    capped = fused_linear_cross_entropy(hidden, weight, labels, bias, softcap=3.0, chunk_size=4, backend=backend)
    return summed, per_token, capped


def _moe(backend):
    x, logits = _randn(9, 16), _randn(9, 4)
    gate_up, down = _randn(4, 2 * 8, 16), _randn(4, 16, 8)
    transposed = _randn(4, 16, 2 * 8), _randn(4, 8, 16)  # gpt-oss's layout, with biases
    biases = _randn(4, 2 * 8), _randn(4, 16)
    return (moe(x, logits, gate_up, down, 2, backend=backend),
            moe(x, logits, *transposed, 2, "softmax_topk", True, *biases, transposed=True, interleaved=True,
                activation=CLAMPED_SWIGLU, backend=backend))


def _linear(backend):
    return (linear(_randn(2, 3, 16), _randn(24, 16), _randn(24), backend=backend),)


# Every registered op that defines te_lab:: ops: its public function(s), forward and
# backward at small sizes, with the variants that change what the ops receive (residual,
# bias, None for optional tensors, masks, reductions).
PUBLIC_CALLS = {
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "glu": _glu,
    "bias_act": _bias_act,
    "rope": _rope,
    "attention": _attention,
    "cross_entropy": _cross_entropy,
    "fused_linear_cross_entropy": _fused_linear_cross_entropy,
    "linear": _linear,
    "moe": _moe,
}


def _defines_ops(name):
    return hasattr(torch.ops.te_lab, name)


def _copy(value, grads=True):
    """``value`` with its tensors cloned, requiring gradients as they did where ``grads``."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(grads and value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v, grads) for v in value)
    if isinstance(value, dict):
        return {key: _copy(v, grads) for key, v in value.items()}
    return value


class _RecordTeLabCalls(TorchDispatchMode):
    """Every te_lab:: op dispatched inside the block, with copies of its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "te_lab":
            # The backward ops have no backward of their own: te_lab has no double backward.
            grads = not func.name().endswith("_backward")
            self.calls.append((func, _copy(args, grads), _copy(kwargs, grads)))
        return func(*args, **kwargs)


# What opcheck checks of an eager-only C++ overload: that the schema tells the truth about
# aliasing and mutation, and that its autograd kernel is where autograd looks for it.
EAGER_ONLY_CHECKS = ("test_schema", "test_autograd_registration")


def _record(name, backend):
    with _RecordTeLabCalls() as recorder:
        outputs = [t for result in PUBLIC_CALLS[name](backend) for t in _outputs(result)]
        torch.autograd.backward([t.float().sum() for t in outputs])
    return recorder.calls


# Known failures whose fixes lie in files this test does not own, with what fails (none now).
KNOWN_FAILURES: dict = {}


def _params():
    return [
        pytest.param(name, backend, id=f"{name}-{backend}",
                     marks=([pytest.mark.triton_interpreter] if backend == "triton" else [])
                     + ([pytest.mark.xfail(reason=KNOWN_FAILURES[name, backend], strict=True)]
                        if (name, backend) in KNOWN_FAILURES else []))
        for name, op in registered_ops().items() if name in PUBLIC_CALLS
        for backend in fused_backends(op)
    ]


@pytest.mark.parametrize("name, backend", _params())
def test_every_call_of_the_public_op_passes_opcheck(name, backend):
    calls = _record(name, backend)
    names = {func.name() for func, _, _ in calls}
    assert f"te_lab::{name}" in names
    if _defines_ops(f"{name}_backward") and name != "fused_linear_cross_entropy":
        assert f"te_lab::{name}_backward" in names
    for func, args, kwargs in calls:
        torch.library.opcheck(func, args, kwargs)
        cpp = getattr(func.overloadpacket, "cpp", None)
        if backend == "cpp" and cpp is not None and args[-1] == "cpp":
            torch.library.opcheck(cpp, _copy(args[:-1]), kwargs, test_utils=EAGER_ONLY_CHECKS)


def _cross_entropy_grad():
    logits, labels = torch.randn(6, 50), _labels(6, 50)
    _, grad = torch.ops.te_lab.cross_entropy.cpp(logits, labels, -100, 0.1, 1e-3, 0.0, True)
    return grad


# Overloads that no public call reaches through the dispatcher by itself: the C++ ones
# that C++ autograd or a chunk's kernels call, and the in-place scaling of the LM head's
# stored gradients (reached only once autograd releases the graph).
DIRECT_SAMPLES = {
    "te_lab::cross_entropy_backward.cpp": lambda: (_cross_entropy_grad(), torch.rand(6)),
    "te_lab::cross_entropy_backward.cpp_in_place": lambda: (_cross_entropy_grad(), torch.rand(6)),
    "te_lab::cross_entropy_over_logits.cpp": lambda: (torch.randn(6, 50), _labels(6, 50), -100, 0.1, 1e-3, 3.0),
    "te_lab::fused_linear_cross_entropy_scale_.default": lambda: (torch.tensor(0.5), torch.randn(6, 16),
                                                                  torch.randn(50, 16), None),
}


def _overload(qualified):
    name, overload = qualified.removeprefix("te_lab::").split(".")
    return getattr(getattr(torch.ops.te_lab, name), overload)


@pytest.mark.parametrize("qualified", DIRECT_SAMPLES)
def test_overloads_called_directly_pass_opcheck(qualified):
    op = _overload(qualified)
    if op._overloadname.startswith("cpp") and cpu_kernels.unavailable_reason() is not None:
        pytest.skip(f"{qualified} has no kernels here: {cpu_kernels.unavailable_reason()}")
    eager_only = {"test_utils": EAGER_ONLY_CHECKS} if op._overloadname.startswith("cpp") else {}
    torch.library.opcheck(op, DIRECT_SAMPLES[qualified](), **eager_only)


def test_every_te_lab_overload_has_a_check():
    """A new op or overload cannot go unchecked: each one defined in the te_lab namespace
    is a registered op's (checked through its public function) or has a direct sample."""
    ops = {name for name in registered_ops() if _defines_ops(name)}
    assert ops <= set(PUBLIC_CALLS), f"add a public call to PUBLIC_CALLS for {sorted(ops - set(PUBLIC_CALLS))}"
    through_public_calls = {f"te_lab::{name}{suffix}.{overload}" for name in ops
                            for suffix in ("", "_backward") for overload in ("default", "cpp")}
    defined = {f"{schema.name}.{schema.overload_name or 'default'}" for schema in torch._C._jit_get_all_schemas()
               if schema.name.startswith("te_lab::")}
    unchecked = defined - through_public_calls - set(DIRECT_SAMPLES)
    assert not unchecked, f"add a sample to DIRECT_SAMPLES for {sorted(unchecked)}"
