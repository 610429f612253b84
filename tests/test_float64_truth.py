"""The probe's float64 truth (te_lab/surgery/truth.py) runs the original on float64 copies
of its tensors and leaves the tensors themselves untouched, so DDP's gradient hooks, which
sit on each parameter's gradient-accumulating autograd node, keep firing afterwards."""

import pytest
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


class GroupedExperts(nn.Module):
    """Hugging Face's grouped-GEMM MoE experts: rows sorted by expert, one torch._grouped_mm."""

    def __init__(self, experts=3, hidden=4, width=8):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden, width))

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.weight, offs=offs)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm arrived in torch 2.8")
def test_grouped_matmuls_run_in_float64_one_group_at_a_time_where_asked():
    torch.manual_seed(0)
    experts = GroupedExperts()
    x = torch.randn(7, 4)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # an empty group; the last row in none
    in_float32 = experts(x, offs)
    with float64_run([experts], grouped_mm=True) as stand_in:
        wide = x.double().requires_grad_()
        out = experts(wide, offs)
        weight = stand_in(experts.weight)
        out.sum().backward()
    assert out.dtype == torch.float64 and experts.weight.dtype == torch.float32
    expected = torch.cat([wide[:2] @ weight[0], wide[2:6] @ weight[2], torch.zeros(1, 8, dtype=torch.float64)])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out[:6].float(), in_float32[:6], rtol=1e-5, atol=1e-5)
    assert weight.grad is not None and torch.equal(weight.grad[1], torch.zeros(4, 8, dtype=torch.float64))
    torch.testing.assert_close(wide.grad[0], weight.detach()[0].sum(-1))
    # Unasked (a probe of an MoE block alone), the float64 run fails, and the probe compares with the original.
    with pytest.raises(RuntimeError), float64_run([experts]):
        experts(x.double(), offs)
