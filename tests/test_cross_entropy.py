"""Softmax cross-entropy: every backend against the reference (F.cross_entropy + z-loss)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICE, DTYPES, LOSS_OPTIONS, assert_close, backend_params, fused_backends, grads_of, leaf
from te_lab.kernels.cross_entropy import (
    CROSS_ENTROPY,
    IMPLEMENTATIONS,
    REDUCTIONS,
    cross_entropy,
    cross_entropy_reference,
)
from te_lab.kernels.precision import error_budget

BACKENDS = backend_params(CROSS_ENTROPY)
ALL_BACKENDS = [pytest.param("reference", id="reference")] + BACKENDS

# (leading shape, vocab): vocabularies that are not powers of two or block multiples.
SHAPES = [((2, 3), 1000), ((5,), 4097)]


def _inputs(lead, vocab, dtype, ignore_index=-100, scale=2.0):
    generator = torch.Generator().manual_seed(vocab)
    logits = (scale * torch.randn(*lead, vocab, generator=generator)).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, lead, generator=generator).to(DEVICE)
    labels.view(-1)[1::3] = ignore_index  # every third token is padding
    return logits, labels


def _run(fn, logits, labels, **kwargs):
    """The loss and the gradient of a random linear function of it w.r.t. the logits."""
    logits = leaf(logits)
    loss = fn(logits, labels, **kwargs)
    return loss, grads_of([loss], [logits])[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label_smoothing, z_loss", LOSS_OPTIONS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loss_and_gradient_match_reference(backend, dtype, reduction, label_smoothing, z_loss):
    options = dict(label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction)
    for lead, vocab in SHAPES:
        logits, labels = _inputs(lead, vocab, dtype)
        loss, grad = _run(cross_entropy, logits, labels, backend=backend, **options)
        ref_loss, ref_grad = _run(cross_entropy_reference, logits, labels, **options)
        assert loss.shape == ref_loss.shape and loss.dtype == ref_loss.dtype == torch.float32
        assert grad.dtype == dtype
        # Both compute in float32 from the same logits; the loss sums over the whole
        # vocabulary (and over tokens), hence the 1e-4 atol of long float32 reductions.
        assert_close(loss, ref_loss, torch.float32, backend, atol=1e-4)
        assert_close(grad, ref_grad, dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_strong_smoothing_z_loss_and_custom_ignore_index(backend, reduction):
    """Options large enough that each gradient term stands far above the float32
    tolerance (at 0.1 and 1e-4 the smoothing and z-loss gradient terms are near it)."""
    options = dict(label_smoothing=0.4, z_loss=0.3, ignore_index=7, reduction=reduction)
    logits, labels = _inputs((6,), 300, torch.float32, ignore_index=7)
    loss, grad = _run(cross_entropy, logits, labels, backend=backend, **options)
    ref_loss, ref_grad = _run(cross_entropy_reference, logits, labels, **options)
    assert_close(loss, ref_loss, atol=1e-4)
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_running_max_grows_across_blocks(backend):
    """A vocabulary of several Triton blocks whose largest logit sits in the last one: the
    online sum of exp must be rescaled as the running max grows."""
    logits, labels = _inputs((3,), 3 * 4096 + 5, torch.float32)
    logits[:, -2] = 40.0
    loss, grad = _run(cross_entropy, logits, labels, backend=backend, z_loss=1e-3, label_smoothing=0.1)
    ref_loss, ref_grad = _run(cross_entropy_reference, logits, labels, z_loss=1e-3, label_smoothing=0.1)
    assert_close(loss, ref_loss, atol=1e-4)
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_all_ignored_batch_behaves_like_f_cross_entropy(backend):
    """Mean over no labelled token: nan loss, as F.cross_entropy; its gradient is zero (not nan)."""
    logits = torch.randn(4, 50, device=DEVICE)
    labels = torch.full((4,), -100, device=DEVICE)
    for reduction in REDUCTIONS:
        x, ref_x = leaf(logits), leaf(logits)
        loss = cross_entropy(x, labels, reduction=reduction, backend=backend)
        expected = F.cross_entropy(ref_x, labels, reduction=reduction)
        loss.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(loss, expected, equal_nan=True)
        torch.testing.assert_close(x.grad, ref_x.grad)
        assert not x.grad.isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_autograd_the_loss_is_the_same(backend):
    logits, labels = _inputs((5,), 1000, torch.float32)
    with torch.no_grad():
        loss = cross_entropy(logits, labels, backend=backend, label_smoothing=0.1)
    assert_close(loss, cross_entropy_reference(logits, labels, label_smoothing=0.1), atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_unbatched_logits(backend):
    wide, labels = _inputs((4,), 2 * 300, torch.float32)
    strided = wide[:, ::2]  # every other column: not contiguous in the vocabulary dimension
    strided_labels = torch.stack([labels, labels], -1).clamp(max=299)[:, 0]  # stride 2
    for logits, target in ((strided, strided_labels), (wide[2], labels[2])):
        loss, grad = _run(cross_entropy, logits, target, backend=backend, reduction="none")
        ref_loss, ref_grad = _run(cross_entropy_reference, logits, target, reduction="none")
        assert loss.shape == target.shape
        assert_close(loss, ref_loss, atol=1e-4)
        assert_close(grad, ref_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_twice_with_retained_graph(backend):
    """The stored gradient is scaled into a new tensor, never in place, so a retained
    graph gives the same gradient every time."""
    logits, labels = _inputs((4,), 100, torch.float32)
    x = leaf(logits)
    loss = cross_entropy(x, labels, backend=backend)
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    second = torch.autograd.grad(3 * loss, x)[0]
    assert_close(second, 3 * first)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_float64(backend, reduction):
    logits, labels = _inputs((4,), 9, torch.float64)
    x = leaf(logits)

    def fn(x):
        return cross_entropy(x, labels, label_smoothing=0.1, z_loss=0.01, reduction=reduction, backend=backend)

    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_soft_capped_logits_at_checkpoint_magnitudes_match_the_float64_truth(backend, dtype):
    """Gemma 2's final logit soft-capping (cap 30) on logits of a few hundred with outlier
    columns of 2e3, far into tanh's flat tails: loss and gradient as close to the float64
    truth as the budget allows against the reference's own rounding in ``dtype``."""
    logits, labels = _inputs((3, 5), 1000, torch.float32, scale=100.0)
    logits[..., :3] *= 20.0
    logits = logits.to(dtype)
    options = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    truth, truth_grad = _run(cross_entropy_reference, logits.double(), labels, **options)
    ref_loss, ref_grad = _run(cross_entropy_reference, logits, labels, **options)
    loss, grad = _run(cross_entropy, logits, labels, backend=backend, **options)
    for got, unfused, want in ((loss, ref_loss, truth), (grad, ref_grad, truth_grad)):
        budget = error_budget((unfused.double() - want).abs().max().item(), want.abs().max().item(), dtype)
        assert (got.double() - want).abs().max().item() <= budget
    # The cap matters: without it the loss is another number.
    assert (cross_entropy_reference(logits, labels, label_smoothing=0.1, z_loss=1e-4) - truth).abs() > 1.0


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_gradcheck_float64_soft_capped(backend):
    logits, labels = _inputs((4,), 9, torch.float64, scale=20.0)
    x = leaf(logits)

    def fn(x):
        return cross_entropy(x, labels, label_smoothing=0.1, softcap=5.0, reduction="none", backend=backend)

    assert torch.autograd.gradcheck(fn, (x,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    logits, labels = _inputs((2, 4), 96, torch.float32)
    x = leaf(logits)

    def lm_loss(x, labels):
        return cross_entropy(x, labels, label_smoothing=0.1, backend=backend) * 2

    explanation = torch._dynamo.explain(lm_loss)(x, labels)
    assert explanation.graph_break_count == 0
    got = torch.compile(lm_loss, fullgraph=True)(x, labels)
    want = cross_entropy_reference(x, labels, label_smoothing=0.1) * 2
    assert_close(got, want, atol=1e-4)
    assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_profiler_sees_the_fused_op_and_its_backward_once_each(backend):
    logits, labels = _inputs((8,), 64, torch.float32)
    x = leaf(logits)
    with torch.profiler.profile() as prof:
        loss = cross_entropy(x, labels, reduction="sum", backend=backend)
        loss.backward()
    names = [event.name for event in prof.events()]
    assert names.count("te_lab::cross_entropy") == 1 and names.count("te_lab::cross_entropy_backward") == 1
    if backend == "cpp":  # an eager call crosses into C++ once; its backward runs there
        assert "CrossEntropyFunction" in loss.grad_fn.next_functions[0][0].name()


@pytest.mark.skipif("cpp" not in fused_backends(CROSS_ENTROPY), reason="te_lab's C++ kernels are not built here")
@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["plain", "soft-capped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_chunk_kernel_writes_the_gradient_over_scratch_logits(dtype, softcap):
    """fused_linear_cross_entropy's chunks: the gradient takes the logits' memory, with the
    numbers a separate gradient gets."""
    logits, labels = _inputs((7,), 1031, dtype)
    options = (-100, 0.1, 1e-3, softcap, True)
    loss, grad = IMPLEMENTATIONS["cpp"].forward(logits, labels.long(), *options, False)
    scratch = logits.clone()
    scratch_loss, scratch_grad = IMPLEMENTATIONS["cpp"].forward(scratch, labels.long(), *options, True)
    assert scratch_grad.data_ptr() == scratch.data_ptr() != grad.data_ptr()
    assert torch.equal(scratch_loss, loss) and torch.equal(scratch_grad, grad)
    x = leaf(logits)
    [ref_grad] = torch.autograd.grad(cross_entropy_reference(x, labels, label_smoothing=0.1, z_loss=1e-3,
                                                             softcap=softcap or None, reduction="sum"), [x])
    assert_close(grad, ref_grad, dtype)


class _OpsCalled(TorchDispatchMode):
    """The names of the ops (``namespace.op.overload``) dispatched inside the block."""

    def __enter__(self):
        self.names = []
        super().__enter__()
        return self.names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif("cpp" not in fused_backends(CROSS_ENTROPY), reason="te_lab's C++ kernels are not built here")
def test_cpp_backward_scales_in_place_only_where_the_graph_is_not_kept():
    """The C++ autograd path keeps the forward's gradient in the graph only (its second
    output is empty) and scales it in place in a backward that releases the graph; with
    retain_graph each backward gets the same, correct numbers."""
    logits, labels = _inputs((6,), 50, torch.float32)
    x = leaf(logits)
    weights = torch.linspace(0.5, 2, 6)
    [want] = torch.autograd.grad((cross_entropy_reference(x, labels, reduction="none") * weights).sum(), [x])
    per_token, hidden = torch.ops.te_lab.cross_entropy.cpp(x, labels.long(), -100, 0.0, 0.0, 0.0, True)
    assert hidden.numel() == 0
    loss = (per_token * weights).sum()
    with _OpsCalled() as kept:
        first = torch.autograd.grad(loss, [x], retain_graph=True)[0]
        second = torch.autograd.grad(loss, [x], retain_graph=True)[0]
    with _OpsCalled() as released:
        last = torch.autograd.grad(loss, [x])[0]  # the graph is released: in place
    for got in (first, second, last):
        torch.testing.assert_close(got, want)
    assert kept.count("te_lab.cross_entropy_backward.cpp") == 2 and "cpp_in_place" not in str(kept)
    # the mutation goes through the overload whose schema declares it
    assert "te_lab.cross_entropy_backward.cpp_in_place" in released
    assert "te_lab.cross_entropy_backward.cpp" not in released
    # a call that records no graph returns the gradient, as the CPU kernel does
    with torch.no_grad():
        _, grad = torch.ops.te_lab.cross_entropy.cpp(x, labels.long(), -100, 0.0, 0.0, 0.0, True)
    [unweighted] = torch.autograd.grad(cross_entropy_reference(x, labels, reduction="sum"), [x])
    torch.testing.assert_close(grad, unweighted)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("bad_label", [8, -3])
def test_out_of_range_label_names_the_value_and_range(backend, bad_label):
    labels = torch.tensor([1, -100, bad_label, 2], device=DEVICE)
    with pytest.raises(ValueError) as raised:
        cross_entropy(torch.randn(4, 8, device=DEVICE), labels, backend=backend)
    for word in ("cross_entropy", "labels", str(bad_label), "[0, 8)", "-100"):
        assert word in str(raised.value)


@pytest.mark.parametrize(
    "logits, labels, kwargs, error, words",
    [
        (torch.ones(2, 8), torch.ones(2), {}, TypeError, ["cross_entropy", "labels", "torch.float32", "integer"]),
        (torch.ones(2, 8, dtype=torch.int64), torch.ones(2, dtype=torch.int64), {}, TypeError,
         ["cross_entropy", "logits", "torch.int64"]),
        (torch.ones(2, 8), torch.ones(3, dtype=torch.int64), {}, ValueError,
         ["cross_entropy", "labels", "(3,)", "(2,)"]),
        (torch.ones(2, 8), torch.ones(2, dtype=torch.int64, device="meta"), {}, ValueError,
         ["cross_entropy", "labels", "meta"]),
        (torch.ones(2, 8), torch.ones(2, dtype=torch.int64), dict(reduction="avg"), ValueError,
         ["cross_entropy", "reduction", "'avg'", "'mean'"]),
        (torch.ones(2, 8), torch.ones(2, dtype=torch.int64), dict(label_smoothing=1.5), ValueError,
         ["cross_entropy", "label_smoothing", "1.5", "[0, 1]"]),
        (torch.ones(2, 8), torch.ones(2, dtype=torch.int64), dict(z_loss=-1.0), ValueError,
         ["cross_entropy", "z_loss", "-1.0"]),
        (torch.ones(2, 8), torch.ones(2, dtype=torch.int64), dict(softcap=0.0), ValueError,
         ["cross_entropy", "softcap", "0.0", "> 0"]),
        (torch.ones(2, 8), torch.ones(2, dtype=torch.int64), dict(ignore_index=1.0), TypeError,
         ["cross_entropy", "ignore_index", "1.0"]),
        (torch.ones(2, 0), torch.ones(2, dtype=torch.int64), {}, ValueError, ["cross_entropy", "logits", "(2, 0)"]),
        (torch.ones(2, 8), torch.ones(2, dtype=torch.int64), dict(backend="native"), ValueError,
         ["cross_entropy", "'native'"]),
    ],
)
def test_bad_input_names_the_argument(logits, labels, kwargs, error, words):
    with pytest.raises(error) as raised:
        cross_entropy(logits, labels, **kwargs)
    for word in words:
        assert word in str(raised.value)
