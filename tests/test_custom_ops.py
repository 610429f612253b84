"""te_lab's operators: eager calls skip the dispatcher, yet profiles, dispatch modes and
the dispatcher itself see the same op."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from te_lab.kernels import layer_norm
from te_lab.kernels.custom_ops import custom_op


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=generator, requires_grad=True)
    weight = torch.randn(32, generator=generator, requires_grad=True)
    bias = torch.randn(32, generator=generator, requires_grad=True)
    return x, weight, bias


def _events(fn):
    with torch.profiler.profile(record_shapes=True) as trace:
        fn()
    return trace.events()


def test_an_eager_call_shows_the_op_with_its_shapes_and_links_its_backward():
    x, weight, bias = _inputs()
    events = _events(lambda: layer_norm(x, weight, bias, backend="native").sum().backward())
    forward = [e for e in events if e.name == "te_lab::layer_norm"]
    assert len(forward) == 1  # one event: the op, not the op and a wrapper
    assert forward[0].sequence_nr >= 0 and forward[0].input_shapes[0] == [4, 32]
    [node] = [e for e in events if e.name.startswith("autograd::engine::evaluate_function: ")
              and "layer_norm" in e.name]
    assert node.sequence_nr == forward[0].sequence_nr
    assert not node.name.split(": ", 1)[1].startswith("te_lab::")  # the node is not an op
    def descendants(event):
        for child in event.cpu_children:
            yield child
            yield from descendants(child)

    assert [e.name for e in descendants(node) if e.name.startswith("te_lab::")] == ["te_lab::layer_norm_backward"]


def test_without_gradients_the_profiler_still_records_the_op():
    x, weight, bias = _inputs()
    with torch.no_grad():
        events = _events(lambda: layer_norm(x, weight, bias, backend="native"))
    assert [e.name for e in events].count("te_lab::layer_norm") == 1


def test_dispatch_modes_see_the_te_lab_op():
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, weight, bias = _inputs()
    with Spy():
        out = layer_norm(x, weight, bias, backend="native")
    assert "te_lab.layer_norm.default" in seen
    out.sum().backward()
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (32,), weight, bias))


def test_the_direct_and_the_dispatched_calls_compute_the_same_gradients():
    x, weight, bias = _inputs()
    direct = torch.autograd.grad(layer_norm(x, weight, bias, backend="native").sum(), (x, weight, bias))
    dispatched = torch.autograd.grad(
        torch.ops.te_lab.layer_norm(x, None, weight, bias, 1e-5, 0.0, "native")[0].sum(), (x, weight, bias))
    for a, b in zip(direct, dispatched):
        torch.testing.assert_close(a, b)


def test_ops_that_mutate_their_arguments_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="mutate their arguments are defined with torch.library.custom_op"):
        custom_op("te_lab::scale_in_place_", mutates_args=("x",))
    with pytest.raises(ValueError, match="expected a name 'te_lab::<op>', got 'other::op'"):
        custom_op("other::op")(lambda x: x)
