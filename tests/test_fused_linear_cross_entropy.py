"""Fused linear + cross-entropy: every backend against F.linear + the cross-entropy
reference, and the structure that makes it worth having: no [tokens, vocab] tensor."""

import pytest
import torch
import torch.nn.functional as F

from conftest import (
    DEVICE,
    DTYPES,
    LOSS_OPTIONS,
    TOLERANCES,
    assert_close,
    backend_params,
    fused_backends,
    grads_of,
    leaf,
)
from te_lab.kernels.cross_entropy import REDUCTIONS
from te_lab.kernels.fused_linear_cross_entropy import (
    CHUNK_LOGITS_BYTES,
    FUSED_LINEAR_CROSS_ENTROPY,
    default_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from te_lab.kernels.precision import error_budget

BACKENDS = backend_params(FUSED_LINEAR_CROSS_ENTROPY)
ALL_BACKENDS = [pytest.param("reference", id="reference")] + BACKENDS

# (leading shape, in_features, vocab, with bias): token counts that leave a partial last
# chunk, vocabularies that are not block multiples.
CASES = [((2, 7), 32, 1000, True), ((15,), 48, 4097, False)]
CHUNK = 4


def _inputs(lead, in_features, vocab, dtype, with_bias, ignore_index=-100):
    generator = torch.Generator().manual_seed(vocab + in_features)
    hidden = torch.randn(*lead, in_features, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(vocab, in_features, generator=generator) / in_features ** 0.5).to(DEVICE, dtype)
    bias = torch.randn(vocab, generator=generator).to(DEVICE, dtype) if with_bias else None
    labels = torch.randint(0, vocab, lead, generator=generator).to(DEVICE)
    labels.view(-1)[1::3] = ignore_index  # every third token is padding
    return hidden, weight, bias, labels


def _run(fn, hidden, weight, bias, labels, **kwargs):
    """The loss and the gradients of a random linear function of it w.r.t. every input."""
    inputs = [leaf(t) for t in (hidden, weight, bias) if t is not None]
    loss = fn(*inputs[:2], labels, *inputs[2:], **kwargs)
    return loss, grads_of([loss], inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label_smoothing, z_loss", LOSS_OPTIONS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_loss_and_gradients_match_reference(backend, dtype, reduction, label_smoothing, z_loss):
    options = dict(label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction)
    for lead, in_features, vocab, with_bias in CASES:
        hidden, weight, bias, labels = _inputs(lead, in_features, vocab, dtype, with_bias)
        loss, grads = _run(fused_linear_cross_entropy, hidden, weight, bias, labels,
                           chunk_size=CHUNK, backend=backend, **options)
        ref_loss, ref_grads = _run(fused_linear_cross_entropy_reference, hidden, weight, bias, labels, **options)
        assert loss.shape == ref_loss.shape and loss.dtype == ref_loss.dtype
        # The loss and the weight and bias gradients sum over the vocabulary or over every
        # token: long float32 reductions, compared with a 1e-4 atol.
        long_sum = {"atol": 1e-4} if dtype == torch.float32 else {}
        assert_close(loss, ref_loss, dtype, backend, **long_sum)
        for got, want in zip(grads, ref_grads):
            assert got.shape == want.shape and got.dtype == want.dtype == dtype
        # The unfused weight gradient is one matmul over all tokens, rounded once; the
        # fused one adds per-chunk matmuls, each rounded to half precision before the
        # float32 sum: in float16 (rtol 1e-3, one unit in the last place) that can put it
        # a second unit away, so half precision gets twice its rtol there.
        weight_sum = long_sum if dtype == torch.float32 else {"rtol": 2 * TOLERANCES[dtype]["rtol"]}
        for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
            assert_close(got, want, dtype, backend, **(weight_sum if name == "weight" else long_sum))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_strong_smoothing_z_loss_and_custom_ignore_index(backend, reduction):
    """Options large enough that each gradient term stands far above the float32 tolerance."""
    options = dict(label_smoothing=0.4, z_loss=0.3, ignore_index=7, reduction=reduction)
    hidden, weight, bias, labels = _inputs((9,), 16, 300, torch.float32, True, ignore_index=7)
    loss, grads = _run(fused_linear_cross_entropy, hidden, weight, bias, labels, chunk_size=CHUNK,
                       backend=backend, **options)
    ref_loss, ref_grads = _run(fused_linear_cross_entropy_reference, hidden, weight, bias, labels, **options)
    assert_close(loss, ref_loss, atol=1e-4)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, atol=1e-4)


def test_default_chunk_size_fits_the_budget_and_the_tokens():
    assert default_chunk_size(8192, 32000, 4) == 256  # 32 MB of float32 logits
    assert default_chunk_size(8192, 32000, 2) == 512
    assert default_chunk_size(200, 32000, 4) == 200
    assert default_chunk_size(5, 10**9, 4) == 1  # a row beyond the budget still makes a chunk
    for tokens, vocab, size in ((8192, 32000, 4), (100000, 151936, 2), (7, 50, 4)):
        chunk = default_chunk_size(tokens, vocab, size)
        assert 1 <= chunk <= tokens and chunk * vocab * size <= max(CHUNK_LOGITS_BYTES, vocab * size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_chunking_and_partial_gradients(backend):
    """Without chunk_size; a frozen head (the weight needs no gradient) and no bias; and no
    autograd at all: the loss is the same and every gradient asked for is right."""
    hidden, weight, _, labels = _inputs((6,), 24, 1000, torch.float32, False)
    x = leaf(hidden)
    loss = fused_linear_cross_entropy(x, weight, labels, label_smoothing=0.1, backend=backend)
    ref_x = leaf(hidden)
    ref_loss = fused_linear_cross_entropy_reference(ref_x, weight, labels, label_smoothing=0.1)
    loss.backward()
    ref_loss.backward()
    assert_close(loss, ref_loss, atol=1e-4)
    assert_close(x.grad, ref_x.grad)
    with torch.no_grad():
        assert_close(fused_linear_cross_entropy(hidden, weight, labels, label_smoothing=0.1, backend=backend),
                     ref_loss, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_hidden_weight_and_labels(backend):
    hidden, weight, bias, labels = _inputs((10,), 24, 50, torch.float32, True)
    strided = (hidden.t().contiguous().t(), weight.t().contiguous().t(),  # column-major
               torch.stack([labels, labels], -1)[:, 0])  # stride 2
    loss, grads = _run(fused_linear_cross_entropy, strided[0], strided[1], bias, strided[2], chunk_size=CHUNK,
                       backend=backend)
    ref_loss, ref_grads = _run(fused_linear_cross_entropy_reference, hidden, weight, bias, labels)
    assert_close(loss, ref_loss, atol=1e-4)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, atol=1e-4)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_all_ignored_batch_behaves_like_f_cross_entropy(backend):
    """Mean over no labelled token: nan loss, as F.cross_entropy; the gradients are zero."""
    hidden, weight, bias, _ = _inputs((5,), 8, 30, torch.float32, True)
    labels = torch.full((5,), -100, device=DEVICE)
    for reduction in REDUCTIONS:
        loss, grads = _run(fused_linear_cross_entropy, hidden, weight, bias, labels, reduction=reduction,
                           chunk_size=2, backend=backend)
        ref_loss, ref_grads = _run(fused_linear_cross_entropy_reference, hidden, weight, bias, labels,
                                   reduction=reduction)
        torch.testing.assert_close(loss, ref_loss, equal_nan=True)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want)
            assert not got.isnan().any()


def _allocations(fn):
    """Bytes of every allocation made while ``fn`` runs, in order (negative: freed).

    Read from torch.profiler's memory records, which see every allocation: a
    TorchDispatchMode would stop at the te_lab custom op (the chunk loop inside runs
    below it), and Inductor's generated code allocates without going through the
    dispatcher at all."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [event.nbytes() for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"]


def _peak(allocations):
    live = peak = 0
    for nbytes in allocations:
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.skipif(DEVICE.type != "cpu", reason="tracks the CPU allocator")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_tensor_of_tokens_by_vocab_is_allocated(backend, reduction):
    tokens, in_features, vocab = 64, 16, 1000
    hidden, weight, bias, labels = _inputs((tokens,), in_features, vocab, torch.float32, True)
    logits_bytes = tokens * vocab * 4

    def training_step(fn, **kwargs):
        x, w, b = leaf(hidden), leaf(weight), leaf(bias)
        return lambda: fn(x, w, labels, b, reduction=reduction, **kwargs).sum().backward()

    fused = _allocations(training_step(fused_linear_cross_entropy, chunk_size=8, backend=backend))
    unfused = _allocations(training_step(fused_linear_cross_entropy_reference))
    assert max(unfused) >= logits_bytes  # the tracker sees the unfused path's logits
    assert max(fused) < logits_bytes
    assert _peak(fused) < _peak(unfused) / 2


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_float64(backend, reduction):
    hidden, weight, bias, labels = _inputs((6,), 4, 7, torch.float64, True)
    inputs = tuple(leaf(t) for t in (hidden, weight, bias))

    def fn(hidden, weight, bias):
        return fused_linear_cross_entropy(hidden, weight, labels, bias, label_smoothing=0.1, z_loss=0.01,
                                          reduction=reduction, chunk_size=2, backend=backend)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_soft_capped_head_at_checkpoint_magnitudes_matches_the_float64_truth(backend, dtype, reduction):
    """Gemma 2's head: hidden states of a real checkpoint's final norm (an outlier channel
    of 1e3) and logits in the hundreds, capped at 30. The loss and every gradient are as
    close to the float64 truth as the budget allows against the unfused path's own error."""
    hidden, weight, bias, labels = _inputs((3, 5), 64, 1000, torch.float32, True)
    hidden = hidden * 20.0
    hidden[..., :2] *= 50.0
    hidden, weight, bias = (t.to(dtype) for t in (hidden, weight, bias))
    options = dict(softcap=30.0, label_smoothing=0.1, reduction=reduction)
    truth, truth_grads = _run(fused_linear_cross_entropy_reference, hidden.double(), weight.double(), bias.double(),
                              labels, **options)
    unfused, unfused_grads = _run(fused_linear_cross_entropy_reference, hidden, weight, bias, labels, **options)
    fused, fused_grads = _run(fused_linear_cross_entropy, hidden, weight, bias, labels, chunk_size=CHUNK,
                              backend=backend, **options)
    for name, got, eager, want in zip(("loss", "hidden", "weight", "bias"), (fused, *fused_grads),
                                      (unfused, *unfused_grads), (truth, *truth_grads)):
        budget = error_budget((eager.double() - want).abs().max().item(), want.abs().max().item(), dtype)
        error = (got.double() - want).abs().max().item()
        assert error <= budget, f"{name}: {error:.3g} from the float64 truth, budget {budget:.3g}"
    # Logits in the hundreds, where the cap changes the loss by far more than rounding.
    assert F.linear(hidden.double(), weight.double(), bias.double()).abs().max() > 100
    uncapped = fused_linear_cross_entropy_reference(hidden.double(), weight.double(), labels, bias.double(),
                                                    label_smoothing=0.1, reduction=reduction)
    assert (truth - uncapped).abs().max() > 1


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_float64_soft_capped(backend, reduction):
    hidden, weight, bias, labels = _inputs((6,), 4, 7, torch.float64, True)
    inputs = tuple(leaf(t * 4) for t in (hidden, weight, bias))

    def fn(hidden, weight, bias):
        return fused_linear_cross_entropy(hidden, weight, labels, bias, softcap=2.0, reduction=reduction,
                                          chunk_size=2, backend=backend)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])  # stored gradients; chunks rerun in backward
def test_torch_compile_fullgraph(backend, reduction):
    hidden, weight, bias, labels = _inputs((2, 5), 16, 96, torch.float32, True)
    inputs = tuple(leaf(t) for t in (hidden, weight, bias))

    def lm_head_loss(hidden, weight, bias, labels):
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias, chunk_size=4, reduction=reduction,
                                          backend=backend)
        return (loss * 2).sum()

    explanation = torch._dynamo.explain(lm_head_loss)(*inputs, labels)
    assert explanation.graph_break_count == 0
    got = torch.compile(lm_head_loss, fullgraph=True)(*inputs, labels)
    want = (fused_linear_cross_entropy_reference(inputs[0], inputs[1], labels, inputs[2], reduction=reduction)
            * 2).sum()
    assert_close(got, want, atol=1e-4)
    for g, w in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        assert_close(g, w, atol=1e-4)


def test_profiler_sees_the_fused_op_and_its_backward():
    """A backward that frees the graph scales the stored gradients in place; one that keeps
    it (retain_graph) leaves them as they were, so a second backward gives the same."""
    backend = fused_backends(FUSED_LINEAR_CROSS_ENTROPY)[0]
    hidden, weight, bias, labels = (leaf(t) if t.is_floating_point() else t
                                    for t in _inputs((8,), 16, 64, torch.float32, True))
    with torch.profiler.profile() as prof:
        loss = fused_linear_cross_entropy(hidden, weight, labels, bias, backend=backend)
        kept = torch.autograd.grad(loss, [hidden, weight, bias], retain_graph=True)
    names = {event.name for event in prof.events()}
    assert {"te_lab::fused_linear_cross_entropy", "te_lab::fused_linear_cross_entropy_backward"} <= names
    assert "te_lab::fused_linear_cross_entropy_scale_" not in names
    with torch.profiler.profile() as prof:
        freed = torch.autograd.grad(loss * 3, [hidden, weight, bias])
    names = {event.name for event in prof.events()}
    assert "te_lab::fused_linear_cross_entropy_scale_" in names
    assert "te_lab::fused_linear_cross_entropy_backward" not in names
    for got, want in zip(freed, kept):
        assert_close(got, 3 * want)


def test_in_place_scaling_op_passes_opcheck():
    stored = [torch.randn(4, 3), torch.randn(5, 3), None]
    torch.library.opcheck(torch.ops.te_lab.fused_linear_cross_entropy_scale_, (torch.tensor(0.5), *stored))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_out_of_range_label_names_the_value_and_range(backend):
    hidden, weight, _, _ = _inputs((4,), 8, 10, torch.float32, False)
    labels = torch.tensor([1, -100, 10, 2], device=DEVICE)
    with pytest.raises(ValueError) as raised:
        fused_linear_cross_entropy(hidden, weight, labels, backend=backend)
    for word in ("fused_linear_cross_entropy", "labels", "10", "[0, 10)", "-100"):
        assert word in str(raised.value)


H, W, Y = torch.ones(3, 8), torch.ones(5, 8), torch.zeros(3, dtype=torch.int64)


@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        ((H.long(), W, Y), {}, TypeError, ["fused_linear_cross_entropy", "hidden", "torch.int64"]),
        ((H, torch.ones(8), Y), {}, ValueError, ["fused_linear_cross_entropy", "weight", "(8,)", "2"]),
        ((H, torch.ones(5, 6), Y), {}, ValueError,
         ["fused_linear_cross_entropy", "weight", "(5, 6)", "in_features 8", "(3, 8)"]),
        ((H, W.double(), Y), {}, TypeError, ["fused_linear_cross_entropy", "weight", "float64", "float32"]),
        ((H, W, Y, torch.ones(4)), {}, ValueError, ["fused_linear_cross_entropy", "bias", "(4,)", "(5,)"]),
        ((H, W, Y, torch.ones(5).half()), {}, TypeError, ["fused_linear_cross_entropy", "bias", "float16"]),
        ((H, W, Y.float()), {}, TypeError, ["fused_linear_cross_entropy", "labels", "torch.float32", "integer"]),
        ((H, W, Y[:2]), {}, ValueError, ["fused_linear_cross_entropy", "labels", "(2,)", "(3,)"]),
        ((H, W, Y), dict(reduction="avg"), ValueError, ["fused_linear_cross_entropy", "reduction", "'avg'"]),
        ((H, W, Y), dict(chunk_size=0), ValueError, ["fused_linear_cross_entropy", "chunk_size", "0"]),
        ((H, W, Y), dict(label_smoothing=-0.1), ValueError, ["fused_linear_cross_entropy", "label_smoothing"]),
        ((H, W, Y), dict(softcap=-30.0), ValueError, ["fused_linear_cross_entropy", "softcap", "-30.0"]),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, error, words):
    with pytest.raises(error) as raised:
        fused_linear_cross_entropy(*args, **kwargs)
    for word in words:
        assert word in str(raised.value)
