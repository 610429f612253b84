"""Bias + activation (and linear_act around it): every backend against the reference."""

import pytest
import torch

from conftest import DEVICE, DTYPES, TOLERANCES, assert_close, backend_params, leaf
from te_lab.kernels.activations import ACTIVATIONS
from te_lab.kernels.bias_act import BIAS_ACT, bias_act, bias_act_reference, linear_act, linear_act_reference

BACKENDS = backend_params(BIAS_ACT)

# Gradients whose elements are sums of many terms (the bias gradient over rows; in
# linear_act every gradient, through the GEMMs) cannot match the half-precision reference
# to one rounding: the reference rounds each term to the dtype before summing where the
# fused op sums in float32, and linear_act rounds x @ W before adding the bias where
# F.linear rounds x @ W + b once, so the two land on different sides of the exact sum. In
# float16 and bfloat16 those gradients must instead be as accurate as the reference: no
# further from the float64 result than ACCURACY_FACTOR times the reference's own error
# (plus the dtype's atol), the way FlashAttention's tests judge a fused kernel.
ACCURACY_FACTOR = 2
HALF_DTYPES = (torch.float16, torch.bfloat16)
# ReLU² squares its input: the half-precision reference's rounding of x + bias (and of
# relu(z) before squaring) comes out doubled, so every result of it is judged that way.
AMPLIFYING = ("relu_squared",)

# (leading shape, hidden): hidden sizes that are not powers of two or block multiples.
SHAPES = [((2, 3), 1000), ((5,), 4097)]


def _id(backend, dtype, activation, with_bias):
    return f"{backend}-{str(dtype).removeprefix('torch.')}-{activation}-{'bias' if with_bias else 'no-bias'}"


def _cases(inductor_cases):
    """(backend, dtype, activation, with_bias) params: every combination for the Triton
    kernels, ``inductor_cases`` for Inductor, whose every graph costs seconds to compile."""
    every_case = [(dtype, activation, with_bias)
                  for dtype in DTYPES for activation in ACTIVATIONS for with_bias in (True, False)]
    for param in BACKENDS:
        backend = param.values[0]
        for case in (inductor_cases if backend == "inductor" else every_case):
            yield pytest.param(backend, *case, id=_id(backend, *case), marks=param.marks)


# every activation in float32, one in the half types
BIAS_ACT_CASES = list(_cases(
    [(torch.float32, activation, True) for activation in ACTIVATIONS]
    + [(torch.float32, "gelu", False)]
    + [(dtype, "gelu", True) for dtype in DTYPES[1:]]
))
# the same Inductor graphs as above: linear_act runs bias_act on F.linear's output
LINEAR_ACT_CASES = list(_cases(
    [(torch.float32, "gelu", False)] + [(dtype, "gelu", True) for dtype in DTYPES]
))


def _inputs(lead, n, dtype, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*lead, n, device=DEVICE, dtype=dtype)
    bias = torch.randn(n, device=DEVICE, dtype=dtype) if with_bias else None
    return x, bias


def _linear_inputs(lead, n_in, n_out, dtype, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*lead, n_in, device=DEVICE, dtype=dtype)
    # nn.Linear's scale, so the pre-activations sit where the activations bend
    weight = (torch.randn(n_out, n_in, device=DEVICE) / n_in ** 0.5).to(dtype)
    bias = torch.randn(n_out, device=DEVICE, dtype=dtype) if with_bias else None
    return x, weight, bias


def _forward_backward(fn, tensors, upstream_dtype, *args, **kwargs):
    """The output and the gradients of every tensor input (``None`` ones skipped), for an
    upstream gradient drawn in ``upstream_dtype``: the same numbers on every run, also
    when a float64 run checks a half-precision one."""
    tensors = [None if t is None else leaf(t) for t in tensors]
    out = fn(*tensors, *args, **kwargs)
    generator = torch.Generator(device="cpu").manual_seed(0)
    upstream = torch.randn(out.shape, generator=generator).to(upstream_dtype).to(out.device, out.dtype)
    return [out, *torch.autograd.grad(out, [t for t in tensors if t is not None], upstream)]


def _assert_as_accurate(got, want, exact, dtype):
    got_error = (got.double() - exact).abs().max().item()
    want_error = (want.double() - exact).abs().max().item()
    assert got_error <= ACCURACY_FACTOR * want_error + TOLERANCES[dtype]["atol"], (
        f"{got_error=:.3g} from the float64 result; the {dtype} reference's is {want_error:.3g}")


def _assert_matches_reference(fn, reference, tensors, summed, dtype, backend, *args):
    """``fn`` with ``backend`` against ``reference``: the output and every gradient within the
    dtype's tolerance, except half-precision gradients marked in ``summed``, which must be
    as accurate as the reference (see ACCURACY_FACTOR)."""
    got = _forward_backward(fn, tensors, dtype, *args, backend=backend)
    want = _forward_backward(reference, tensors, dtype, *args)
    exact = _forward_backward(reference, [None if t is None else t.double() for t in tensors], dtype, *args)
    assert len(got) == len(want) == 1 + sum(t is not None for t in tensors)
    for got_tensor, want_tensor, exact_tensor, is_sum in zip(got, want, exact, summed):
        assert got_tensor.shape == want_tensor.shape and got_tensor.dtype == want_tensor.dtype
        if is_sum and dtype in HALF_DTYPES:
            _assert_as_accurate(got_tensor, want_tensor, exact_tensor, dtype)
        else:
            assert_close(got_tensor, want_tensor, dtype, backend)


@pytest.mark.parametrize("backend, dtype, activation, with_bias", BIAS_ACT_CASES)
def test_forward_and_gradients_match_reference(backend, dtype, activation, with_bias):
    for lead, n in SHAPES:
        # y and dx are elementwise; dbias sums over rows
        summed = (True,) * 3 if activation in AMPLIFYING else (False, False, True)
        _assert_matches_reference(bias_act, bias_act_reference, _inputs(lead, n, dtype, with_bias),
                                  summed, dtype, backend, activation)


@pytest.mark.parametrize("backend, dtype, activation, with_bias", LINEAR_ACT_CASES)
def test_linear_act_matches_linear_then_activation(backend, dtype, activation, with_bias):
    for lead, n_in, n_out in (((2, 3), 96, 1000), ((5,), 64, 4097)):
        # y is elementwise; dx, dweight and dbias come out of GEMMs and row sums
        summed = (activation in AMPLIFYING, True, True, True)
        _assert_matches_reference(linear_act, linear_act_reference,
                                  _linear_inputs(lead, n_in, n_out, dtype, with_bias),
                                  summed, dtype, backend, activation)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_that_takes_no_gradient(backend):
    """The bias is added in backward but no bias sums are written."""
    x, bias = _inputs((3,), 1000, torch.float32, True)
    x = leaf(x)
    got = torch.autograd.grad(bias_act(x, bias, backend=backend).sum(), x)
    want = torch.autograd.grad(bias_act_reference(x, bias).sum(), x)
    assert_close(got[0], want[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_one_dimensional_inputs(backend):
    torch.manual_seed(1)
    x = torch.randn(6, 2 * 300, device=DEVICE)[:, ::2]  # every other column: not contiguous in the last dimension
    transposed = torch.randn(300, 4, device=DEVICE).t()  # rows are strided
    bias = torch.randn(2 * 300, device=DEVICE)[::2]
    for inp in (x, transposed, torch.randn(300, device=DEVICE)):
        got_x, got_bias, want_x, want_bias = (leaf(t) for t in (inp, bias, inp, bias))
        # y.sum()'s upstream gradient is an expanded scalar: strides of 0
        got = bias_act(got_x, got_bias, backend=backend)
        got.sum().backward()
        want = bias_act_reference(want_x, want_bias)
        want.sum().backward()
        assert_close(got, want)
        assert_close(got_x.grad, want_x.grad)
        assert_close(got_bias.grad, want_bias.grad)


@pytest.mark.parametrize("backend", [pytest.param("reference")] + BACKENDS)
def test_gradcheck_float64(backend):
    x, weight, bias = _linear_inputs((3,), 5, 7, torch.float64, True)
    assert torch.autograd.gradcheck(lambda h, bias: bias_act(h, bias, backend=backend),
                                    (leaf(x @ weight.t()), leaf(bias)))
    assert torch.autograd.gradcheck(lambda x, weight, bias: linear_act(x, weight, bias, backend=backend),
                                    (leaf(x), leaf(weight), leaf(bias)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    x, weight, bias = (leaf(t) for t in _linear_inputs((4,), 32, 96, torch.float32, True))

    def mlp_input(x, weight, bias):
        return (linear_act(x, weight, bias, backend=backend) * 2).sum()

    explanation = torch._dynamo.explain(mlp_input)(x, weight, bias)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(mlp_input, fullgraph=True)
    got = compiled(x, weight, bias)
    got_grads = torch.autograd.grad(got, (x, weight, bias))
    want = (linear_act_reference(x, weight, bias) * 2).sum()
    want_grads = torch.autograd.grad(want, (x, weight, bias))
    assert_close(got, want, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_profiler_sees_the_fused_op_and_its_backward_once_each(backend):
    x, weight, bias = (leaf(t) for t in _linear_inputs((8,), 32, 64, torch.float32, True))
    with torch.profiler.profile() as prof:
        y = linear_act(x, weight, bias, backend=backend)
        y.sum().backward()
    names = [event.name for event in prof.events()]
    assert names.count("te_lab::bias_act") == 1 and names.count("te_lab::bias_act_backward") == 1
    if backend == "cpp":  # an eager call crosses into C++ once; its backward runs there
        assert "BiasActFunction" in y.grad_fn.name()


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(bias=torch.ones(9)), ValueError, ["bias_act", "bias", "(9,)", "(8,)"]),
        (dict(bias=torch.ones(8, dtype=torch.float64)), TypeError, ["bias_act", "bias", "float64", "float32"]),
        (dict(bias=torch.ones(8, device="meta")), ValueError, ["bias_act", "bias", "meta", "cpu"]),
        (dict(bias=[1.0] * 8), TypeError, ["bias_act", "bias", "list"]),
        (dict(activation="relu"), ValueError, ["bias_act", "activation", "'relu'", "gelu_tanh"]),
        (dict(backend="cuda"), ValueError, ["bias_act", "backend", "'cuda'"]),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, words):
    with pytest.raises(error) as raised:
        bias_act(torch.ones(2, 8), **kwargs)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize(
    "weight, kwargs, error, words",
    [
        (torch.ones(4, 9), {}, ValueError, ["linear_act", "weight", "(4, 9)", "(out_features, 8)"]),
        (torch.ones(8), {}, ValueError, ["linear_act", "weight", "(8,)", "(out_features, 8)"]),
        (torch.ones(4, 8, dtype=torch.float16), {}, TypeError, ["linear_act", "weight", "float16", "float32"]),
        (torch.ones(4, 8, device="meta"), {}, ValueError, ["linear_act", "weight", "meta", "cpu"]),
        (torch.ones(4, 8), dict(bias=torch.ones(8)), ValueError, ["linear_act", "bias", "(8,)", "(4,)"]),
        (torch.ones(4, 8), dict(activation="tanh"), ValueError, ["linear_act", "activation", "'tanh'"]),
    ],
)
def test_linear_act_bad_input_names_the_argument(weight, kwargs, error, words):
    with pytest.raises(error) as raised:
        linear_act(torch.ones(2, 8), weight, **kwargs)
    for word in words:
        assert word in str(raised.value)


def test_integer_input_is_refused():
    with pytest.raises(TypeError, match="bias_act: x has dtype torch.int64"):
        bias_act(torch.ones(2, 8, dtype=torch.int64))
