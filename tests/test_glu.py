"""SwiGLU / GeGLU (split and concatenated gate-up inputs): every backend against the reference."""

import pytest
import torch

from conftest import DEVICE, DTYPES, assert_close, backend_params, fused_backends, grads_of, leaf
from te_lab.kernels.activations import ACTIVATIONS
from te_lab.kernels.glu import GLU, geglu, glu, glu_reference, swiglu

BACKENDS = backend_params(GLU)

# (leading shape, N): gate and up are [*lead, N], or one concatenated [*lead, 2N].
# N is neither a power of two nor a multiple of any block.
SHAPES = [((2, 3), 1000), ((5,), 4097)]
LAYOUTS = ["split", "concatenated"]


def _inputs(lead, n, dtype, layout):
    """(gate, up) for the split layout, (gate_up, None) for the concatenated one."""
    torch.manual_seed(0)
    if layout == "concatenated":
        return torch.randn(*lead, 2 * n, device=DEVICE, dtype=dtype), None
    return torch.randn(*lead, n, device=DEVICE, dtype=dtype), torch.randn(*lead, n, device=DEVICE, dtype=dtype)


def _run(fn, gate, up, activation, **kwargs):
    """The forward output and the gradients of every input."""
    inputs = [leaf(t) for t in (gate, up) if t is not None]
    out = fn(*inputs, **({"up": None} if up is None else {}), activation=activation, **kwargs)
    return (out,), grads_of((out,), inputs)


def _activations_for(backend, dtype):
    """Every activation, except on Inductor with half types: each activation there is
    another pair of graphs to compile (seconds each), and the half-type casts they test
    do not depend on the activation."""
    return ACTIVATIONS if backend != "inductor" or dtype == torch.float32 else ("silu",)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradients_match_reference(backend, dtype, layout):
    for activation in _activations_for(backend, dtype):
        for lead, n in SHAPES:
            gate, up = _inputs(lead, n, dtype, layout)
            outputs, grads = _run(glu, gate, up, activation, backend=backend)
            ref_outputs, ref_grads = _run(glu_reference, gate, up, activation)
            assert outputs[0].shape == (*lead, n)
            assert len(grads) == (1 if layout == "concatenated" else 2)
            for got, want in zip(outputs + grads, ref_outputs + ref_grads):
                assert got.shape == want.shape and got.dtype == want.dtype
                assert_close(got, want, dtype, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_and_geglu_pick_their_activation(backend):
    gate, up = _inputs((3,), 100, torch.float32, "split")
    assert_close(swiglu(gate, up, backend=backend), glu_reference(gate, up, "silu"))
    assert_close(geglu(gate, up, backend=backend), glu_reference(gate, up, "gelu"))
    assert_close(geglu(gate, up, approximate="tanh", backend=backend), glu_reference(gate, up, "gelu_tanh"))
    gate_up = torch.cat((gate, up), -1)
    assert_close(swiglu(gate_up, backend=backend), glu_reference(gate, up, "silu"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_one_dimensional_inputs(backend):
    torch.manual_seed(1)
    wide = torch.randn(6, 2 * 300, device=DEVICE)
    every_other = (wide[:, ::2], wide[:, 1::2])  # not contiguous in the last dimension
    halves = (wide[:, :300], wide[:, 300:])  # row-strided views, as chunk() gives
    transposed = (torch.randn(300, 4, device=DEVICE).t(), torch.randn(300, 4, device=DEVICE).t())
    one_dimensional = (torch.randn(300, device=DEVICE), torch.randn(300, device=DEVICE))
    for gate, up in (every_other, halves, transposed, one_dimensional):
        outputs, grads = _run(glu, gate, up, "silu", backend=backend)
        ref_outputs, ref_grads = _run(glu_reference, gate, up, "silu")
        for got, want in zip(outputs + grads, ref_outputs + ref_grads):
            assert_close(got, want)
    # concatenated: a transposed gate-up tensor, and a 1-D one
    for gate_up in (torch.randn(600, 5, device=DEVICE).t(), torch.randn(600, device=DEVICE)):
        outputs, grads = _run(glu, gate_up, None, "silu", backend=backend)
        ref_outputs, ref_grads = _run(glu_reference, gate_up, None, "silu")
        for got, want in zip(outputs + grads, ref_outputs + ref_grads):
            assert_close(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_gradcheck_float64(backend, layout):
    torch.manual_seed(2)
    gate, up = _inputs((3,), 7, torch.float64, layout)
    inputs = tuple(leaf(t) for t in (gate, up) if t is not None)
    for activation in ACTIVATIONS if backend != "inductor" else ("gelu_tanh",):
        assert torch.autograd.gradcheck(lambda *ts: glu(*ts, activation=activation, backend=backend), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph(backend):
    torch.manual_seed(3)
    gate, up = (leaf(torch.randn(4, 96, device=DEVICE)) for _ in range(2))
    gate_up = leaf(torch.randn(4, 192, device=DEVICE))

    def mlp(gate, up, gate_up, fn):
        return (fn(gate, up, activation="silu") * 2).sum() + fn(gate_up, None, activation="silu").sum()

    def fused(gate, up, gate_up):
        return mlp(gate, up, gate_up, lambda *args, **kwargs: glu(*args, **kwargs, backend=backend))

    explanation = torch._dynamo.explain(fused)(gate, up, gate_up)
    assert explanation.graph_break_count == 0
    got = torch.compile(fused, fullgraph=True)(gate, up, gate_up)
    got_grads = torch.autograd.grad(got, (gate, up, gate_up))
    want = mlp(gate, up, gate_up, glu_reference)
    want_grads = torch.autograd.grad(want, (gate, up, gate_up))
    assert_close(got, want, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, torch.float32)


def test_profiler_sees_the_fused_op_and_its_backward():
    backend = fused_backends(GLU)[0]
    gate_up = torch.randn(8, 128, device=DEVICE, requires_grad=True)
    with torch.profiler.profile() as prof:
        glu(gate_up, backend=backend).sum().backward()
    names = {event.name for event in prof.events()}
    assert {"te_lab::glu", "te_lab::glu_backward"} <= names


def test_gradient_of_one_input_only():
    backend = fused_backends(GLU)[0]
    gate, up = _inputs((3,), 50, torch.float32, "split")
    up = leaf(up)
    glu(gate, up, backend=backend).sum().backward()
    ref_up = leaf(up)
    glu_reference(gate, ref_up).sum().backward()
    assert gate.grad is None
    assert_close(up.grad, ref_up.grad)


@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        ((torch.ones(2, 8), torch.ones(2, 9)), {}, ValueError, ["glu", "up", "(2, 9)", "(2, 8)"]),
        ((torch.ones(2, 8), torch.ones(8)), {}, ValueError, ["glu", "up", "(8,)", "(2, 8)"]),
        ((torch.ones(2, 7),), {}, ValueError, ["glu", "gate", "(2, 7)", "even"]),
        ((torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float64)), {}, TypeError, ["glu", "up", "float64", "float32"]),
        ((torch.ones(2, 8), torch.ones(2, 8, device="meta")), {}, ValueError, ["glu", "up", "meta", "cpu"]),
        ((torch.ones(2, 8),), dict(activation="relu"), ValueError, ["glu", "activation", "'relu'", "'silu'"]),
        ((torch.ones(2, 8, dtype=torch.int64),), {}, TypeError, ["glu", "gate", "torch.int64", "float32"]),
        (([1.0] * 8,), {}, TypeError, ["glu", "gate", "list"]),
        ((torch.ones(2, 8),), dict(backend="native"), ValueError, ["glu", "'native'", "inductor"]),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, error, words):
    with pytest.raises(error) as raised:
        glu(*args, **kwargs)
    for word in words:
        assert word in str(raised.value)


def test_geglu_refuses_an_unknown_approximation():
    with pytest.raises(ValueError, match="geglu: approximate must be one of \\('none', 'tanh'\\), got 'erf'"):
        geglu(torch.ones(2, 8), approximate="erf")
