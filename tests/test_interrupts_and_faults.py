"""Interrupts and faults leave the model whole: a twin that runs out of memory, or a
KeyboardInterrupt (the notebook's stop button) while fuse probes, undoes every swap that
fuse call made (the model's module objects, modes, hooks, gradients and RNG state as
before) and the message names the module; one mid-profile leaves the fused model fused,
the profiler stopped, the sampler thread joined and the profiler's hooks removed.
Hand-made modules with cheap twins: no compiled kernels."""

import threading

import pytest
import torch
from torch import nn

import te_lab
from sine_twin import FusedSine, Sine, sine_rule


class Model(nn.Module):
    def __init__(self, twin_fault=None):
        super().__init__()
        self.first, self.second, self.third = Sine(), Sine(), Sine()
        self.third.twin_fault = twin_fault

    def forward(self, x):
        return self.third(self.second(self.first(x)))


@pytest.fixture(autouse=True)
def with_sine_rule():
    with sine_rule():
        yield


def state_of(model):
    return dict(modules=[(name, id(module), module.training) for name, module in model.named_modules()],
                hooks={name: (dict(module._forward_hooks), dict(module._backward_hooks))
                       for name, module in model.named_modules()},
                grads={name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()},
                rng=torch.get_rng_state(), fused=te_lab.is_fused(model))


def assert_same_state(after, before):
    assert after["modules"] == before["modules"]
    assert after["hooks"] == before["hooks"]
    assert after["grads"].keys() == before["grads"].keys()
    for name, grad in after["grads"].items():
        assert (grad is None and before["grads"][name] is None) or torch.equal(grad, before["grads"][name]), name
    assert torch.equal(after["rng"], before["rng"]) and after["fused"] == before["fused"]


@pytest.mark.parametrize("fault", [torch.OutOfMemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("with_sample", [False, True], ids=["synthesized", "sample"])
def test_a_fault_while_probing_undoes_every_swap_and_names_the_module(fault, with_sample):
    model = Model(fault)
    model.second.register_forward_hook(lambda m, args, out: None)
    model.first.scale.grad = torch.full((8,), 3.0)  # gradients the user had, kept as they were
    model.train()
    sample = torch.randn(2, 8) if with_sample else None
    before = state_of(model)
    with pytest.raises(fault) as raised:
        te_lab.fuse(model, sample=sample)
    message = "\n".join([str(raised.value), *getattr(raised.value, "__notes__", [])])
    assert (f"te_lab.fuse: stopped by {fault.__name__} while processing third; every swap it had made is undone, "
            f"the model is as before") in message
    assert_same_state(state_of(model), before)
    assert all(type(module) is not FusedSine for module in model.modules())
    # Fusing again afterwards works, and the fault was the twin's: the others fuse.
    model.third.twin_fault = None
    report = te_lab.fuse(model)
    assert [row.status for row in report.rows] == ["fused"] * 3


def test_an_error_in_a_twin_that_is_not_a_fault_skips_only_that_module():
    model = Model(ValueError)
    report = te_lab.fuse(model)
    assert [row.status for row in report.rows] == ["fused", "fused", "skipped"]
    assert report.rows[2].reason == "probe raised ValueError: injected by the test"


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "te_lab-utilization-sampler" and t.is_alive()]


def test_an_interrupt_mid_profile_leaves_the_fused_model_whole():
    model = Model()
    te_lab.fuse(model)
    twins = {name: module for name, module in model.named_modules()}
    third = model.third
    calls = 0

    def interrupting(x):  # the fused twin's second call falls inside the first profiled step
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return FusedSine.forward(third, x)

    third.forward = interrupting
    inputs = torch.randn(2, 8)
    before = state_of(model)
    with pytest.raises(KeyboardInterrupt):
        te_lab.profile(model, inputs, steps=1, warmup=0)
    assert calls == 2
    assert_same_state(state_of(model), before)
    assert {name: module for name, module in model.named_modules()} == twins  # still fused, same twins
    assert not torch.autograd._profiler_enabled() and not sampler_threads()
    del third.forward
    # Nothing left behind stops the next profile.
    report = te_lab.profile(model, inputs, steps=1, warmup=0)
    assert report.modes["fused"].step_median_ms > 0
    assert_same_state(state_of(model), before)
