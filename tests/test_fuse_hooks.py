"""Module hooks across fuse / unfuse: forward, forward-pre, backward and backward-pre
hooks keep firing while a module is fused (its twin shares the hook tables), hooks
registered while fused stay on the original after unfuse, probes fire none, and a
module with hooks inside it that its twin would never call stays unfused with the
hook named. The hand-made modules have cheap twins; one case fuses the demo Llama's
norms and LM head (two compiled kernels)."""

import collections

import pytest
import torch
from torch import nn

import te_lab
from sine_twin import FusedSine, Sine, sine_rule
from te_lab import models


class Block(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.fixture
def with_sine_rule():
    with sine_rule():
        yield


def count_hooks(module, calls):
    return [module.register_forward_pre_hook(lambda m, args: calls.update(["forward-pre"])),
            module.register_forward_hook(lambda m, args, out: calls.update(["forward"])),
            module.register_full_backward_pre_hook(lambda m, grad_out: calls.update(["backward-pre"])),
            module.register_full_backward_hook(lambda m, grad_in, grad_out: calls.update(["backward"]))]


def step(model):
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()


@pytest.mark.usefixtures("with_sine_rule")
def test_every_kind_of_hook_keeps_firing_while_fused_and_after_unfuse():
    model, calls = Block(Sine()), collections.Counter()
    original = model.inner
    handles = count_hooks(original, calls)
    te_lab.fuse(model)
    assert calls == {}  # probes fire no user hook
    assert isinstance(model.inner, FusedSine)
    step(model)
    assert calls == {"forward-pre": 1, "forward": 1, "backward-pre": 1, "backward": 1}
    with te_lab.unfused(model):
        assert model.inner is original
        step(model)
    assert calls == {"forward-pre": 2, "forward": 2, "backward-pre": 2, "backward": 2}
    handles[1].remove()  # a handle from before the swap removes the hook from the twin too
    step(model)
    assert calls["forward"] == 2 and calls["forward-pre"] == 3
    te_lab.unfuse(model)
    assert model.inner is original
    step(model)
    assert calls == {"forward-pre": 4, "forward": 2, "backward-pre": 4, "backward": 4}


@pytest.mark.usefixtures("with_sine_rule")
def test_hooks_registered_on_the_twin_stay_with_the_original_after_unfuse():
    model, calls = Block(Sine()), collections.Counter()
    original = model.inner
    te_lab.fuse(model)
    count_hooks(model.inner, calls)  # registered on what the model holds now: the twin
    step(model)
    te_lab.unfuse(model)
    assert model.inner is original
    step(model)
    assert calls == {"forward-pre": 2, "forward": 2, "backward-pre": 2, "backward": 2}
    assert te_lab.fuse(model).rows[0].status == "fused"  # hooks on the module itself never stop a fusion
    step(model)
    assert calls["forward"] == 3


@pytest.mark.usefixtures("with_sine_rule")
def test_a_hook_that_changes_the_output_changes_it_while_fused_too():
    model = Block(Sine())
    model.inner.register_forward_hook(lambda m, args, out: out * 2)
    x = torch.randn(3, 8)
    expected = model(x)
    report = te_lab.fuse(model, sample=x)
    assert report.rows[0].status == "fused" and isinstance(model.inner, FusedSine)
    torch.testing.assert_close(model(x), expected)


def test_hooks_inside_a_module_its_twin_would_not_call_keep_it_unfused():
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model = Block(mlp)
    mlp[0].register_forward_hook(lambda m, args, out: None)
    report = te_lab.fuse(model, only="mlp")
    (row,) = report.rows
    assert row.status == "skipped" and model.inner is mlp
    assert row.reason.startswith("has hooks inside that its fused twin would never fire: inner.0 (forward hook)")


def test_the_demo_llama_keeps_its_norm_hook_and_its_hooked_lm_head():
    model = models.llama("tiny", seed=0)
    calls = collections.Counter()
    model.model.norm.register_forward_hook(lambda m, args, out: calls.update(["norm"]))
    model.lm_head.register_forward_pre_hook(lambda m, args: calls.update(["lm_head"]))
    report = te_lab.fuse(model, only=["rmsnorm", "lm_head_loss"])
    head = next(row for row in report.rows if row.rule == "lm_head_loss")
    assert head.status == "skipped" and "lm_head (forward-pre hook)" in head.reason
    assert type(model.model.norm).__name__ == "FusedRMSNorm"
    calls.clear()
    batch = model.example_batch(2, 16)
    model(**batch).loss.backward()
    assert calls == {"norm": 1, "lm_head": 1}
