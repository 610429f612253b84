"""te_lab.profiler.module_clock: modules timed by hooks inside a step, without the
profiler (the CPU module times of te_lab.profile). Known sleeps in a module's forward and
in its backward are what the hooks must find, each in its own phase; a module called
twice counts twice; a forward recomputed in the backward (checkpointing) is not forward
time; nested keyed modules come off their parent's time."""

import time

import pytest
import torch
from torch import nn

from te_lab.profiler.module_clock import ModuleClock, own_times

FORWARD_S, BACKWARD_S = 0.02, 0.03


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        return grad * 2


class Slow(nn.Module):
    """A linear whose forward sleeps FORWARD_S and whose backward sleeps BACKWARD_S."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(FORWARD_S)
        return SleepInBackward.apply(self.linear(x)).relu()


def test_a_modules_forward_and_backward_are_timed_in_the_step():
    slow, fast = Slow(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with ModuleClock({"slow": slow, "fast": fast}) as times:
        fast(slow(torch.tanh(x))).sum().backward()
        measured = times.take()
    slow_forward, slow_backward = measured["slow"]
    assert FORWARD_S * 1e3 <= slow_forward < (FORWARD_S + 0.015) * 1e3
    assert BACKWARD_S * 1e3 <= slow_backward < (BACKWARD_S + 0.015) * 1e3
    fast_forward, fast_backward = measured["fast"]
    assert 0 < fast_forward < 5 and 0 < fast_backward < 5  # no sleep of the other module in them
    assert times.take() == {"slow": (0.0, 0.0), "fast": (0.0, 0.0)}  # take starts over


def test_a_module_called_twice_counts_both_calls_and_hooks_go_with_the_block():
    slow = Slow()
    x = torch.randn(4, 8, requires_grad=True)
    with ModuleClock({"slow": slow}) as times:
        slow(slow(x)).sum().backward()
        forward, backward = times.take()["slow"]
    assert forward >= 2 * FORWARD_S * 1e3 and backward >= 2 * BACKWARD_S * 1e3
    assert not slow._forward_hooks and not slow._forward_pre_hooks


def test_a_module_without_gradients_has_no_backward_time():
    slow = Slow()
    with ModuleClock({"slow": slow}) as times, torch.no_grad():
        slow(torch.randn(4, 8))
        forward, backward = times.take()["slow"]
    assert forward >= FORWARD_S * 1e3 and backward == pytest.approx(0.0)


def test_what_the_hooks_spend_is_measured_and_outside_the_modules_times():
    slow, fast = Slow(), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with ModuleClock({"slow": slow, "fast": fast}) as times:
        start = time.perf_counter()
        fast(slow(torch.tanh(x))).sum().backward()
        step_ms = (time.perf_counter() - start) * 1e3
        measured = times.take()
    # a few hook calls and a walk over a handful of autograd nodes: well under a ms, not nothing
    assert 0 < times.hooks_ms < 1.0
    assert sum(map(sum, measured.values())) + times.hooks_ms <= step_ms
    times.take()
    assert times.hooks_ms == 0.0  # take starts over


class Parent(nn.Module):
    """A Slow inside a module that sleeps FORWARD_S itself in its forward."""

    def __init__(self):
        super().__init__()
        self.child = Slow()

    def forward(self, x):
        time.sleep(FORWARD_S)
        return self.child(x)


def test_a_nested_keyed_modules_time_comes_off_its_parents():
    parent = Parent()
    modules = {"parent": parent, "child": parent.child}
    with ModuleClock(modules) as times:
        parent(torch.randn(4, 8, requires_grad=True)).sum().backward()
        measured = times.take()
    own = own_times(measured, modules)
    assert own["child"] == measured["child"]
    assert FORWARD_S * 1e3 <= own["parent"][0] < (FORWARD_S + 0.015) * 1e3  # its own sleep, not the child's
    assert own["parent"][1] < 0.5 * BACKWARD_S * 1e3 < own["child"][1]  # the backward's sleep is the child's


def test_a_forward_recomputed_in_the_backward_is_not_forward_time():
    slow = Slow()
    x = torch.randn(4, 8, requires_grad=True)
    with ModuleClock({"slow": slow}) as times:
        torch.utils.checkpoint.checkpoint(slow, x, use_reentrant=False).sum().backward()
        forward, backward = times.take()["slow"]
    # one forward sleep; the recomputation's sleep runs inside the backward pass
    assert FORWARD_S * 1e3 <= forward < (FORWARD_S + 0.015) * 1e3
    assert backward >= BACKWARD_S * 1e3
