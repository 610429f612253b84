"""The probe's float64 truth (te_lab/surgery/truth.py) runs the original on float64 copies
of its tensors and leaves the tensors themselves untouched, so DDP's gradient hooks, which
sit on each parameter's gradient-accumulating autograd node, keep firing afterwards."""

import torch
from torch import nn

from te_lab.surgery.truth import float64_run


def _accumulator(parameter: nn.Parameter):
    return parameter.expand_as(parameter).grad_fn.next_functions[0][0]


def test_the_float64_run_leaves_each_parameters_gradient_hooks_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    before = {name: (p, p.detach().clone(), _accumulator(p)) for name, p in model.named_parameters()}
    fired = []
    for name, (_, _, node) in before.items():  # as DDP's reducer hooks the node
        node.register_hook(lambda *_, name=name: fired.append(name))
    x = torch.randn(2, 4)
    with float64_run([model]) as stand_in:
        weight = stand_in(model[0].weight)
        assert weight is model[0].weight and weight.dtype == torch.float64 and weight.requires_grad
        assert stand_in(x) is x  # not the model's: itself
        out = model(x.double())
        assert out.dtype == torch.float64
        grad, = torch.autograd.grad(out.square().sum(), weight)
    expected = nn.functional.layer_norm(x.double() @ before["0.weight"][1].double().T + before["0.bias"][1].double(),
                                        (3,), before["1.weight"][1].double(), before["1.bias"][1].double())
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert grad.dtype == torch.float64 and grad.abs().sum() > 0
    for name, p in model.named_parameters():
        original, values, node = before[name]
        assert p is original and p.dtype == torch.float32 and torch.equal(p, values)
        assert _accumulator(p) is node, f"{name}: the float64 run replaced its gradient accumulator"
    model(x).sum().backward()
    assert sorted(fired) == sorted(before)


def test_a_tensor_two_modules_share_gets_one_float64_copy():
    head, embedding = nn.Linear(4, 6, bias=False), nn.Embedding(6, 4)
    head.weight = embedding.weight
    with float64_run([nn.ModuleList([embedding, head])]) as stand_in:
        assert head.weight is embedding.weight is stand_in(embedding.weight)
    assert head.weight.dtype == torch.float32 and head.weight is embedding.weight
