"""No vacuous verification: a probe that compares nothing (zero elements, or NaN /
infinity from the original) is inconclusive. fuse then probes on synthesized inputs and
says so in the row; a twin is never reported verified by a comparison of nothing.

Most cases use a hand-made module with a cheap twin (no compiled kernels); one runs the
demo Llama on an empty batch, as the issue found it."""

import math

import pytest
import torch
from torch import nn

import te_lab
from sine_twin import FusedSine, Sine, sine_rule
from te_lab import models
from te_lab.surgery.probe import compare, inconclusive_reason


class Cosine(FusedSine):
    """A wrong twin: cos(x) where sin(x) is meant. It agrees with the original only where
    the comparison proves nothing (NaN against NaN, no elements at all)."""

    def forward(self, x):
        return torch.cos(x) * self.scale


class Holder(nn.Module):
    def __init__(self, scale=1.0):
        super().__init__()
        self.inner = Sine(scale=scale)

    def forward(self, x):
        return self.inner(x)


@pytest.fixture(params=[FusedSine, Cosine], ids=["right-twin", "wrong-twin"])
def twin_rule(request):
    with sine_rule(request.param):
        yield request.param


@pytest.mark.parametrize("sample, why", [
    (torch.full((2, 8), float("nan")), "the original's output holds NaN or infinity"),
    (torch.full((2, 8), float("inf")), "the original's output holds NaN or infinity"),
    (torch.zeros(0, 8), "the original's output has no elements"),
], ids=["nan", "inf", "empty"])
def test_an_inconclusive_sample_falls_back_to_synthesized_inputs(twin_rule, sample, why):
    model = Holder()
    report = te_lab.fuse(model, sample=sample)
    (row,) = report.rows
    if twin_rule is FusedSine:
        assert row.status == "fused" and row.probe == "synthesized"
        assert row.reason == f"verified on synthesized inputs: the sample's probe was inconclusive ({why})"
        assert math.isfinite(row.output_max_abs) and math.isfinite(row.grad_max_abs)
        assert type(model.inner) is FusedSine
    else:
        # Today's NaN == NaN (and empty) comparisons called this twin verified with error 0.
        assert row.status == "skipped" and type(model.inner) is Sine
        assert "from the float64 truth where the original's own error is" in row.reason
        assert f"(on synthesized inputs, after the sample's probe was inconclusive: {why})" in row.reason


def test_a_module_that_is_not_finite_on_any_input_stays_unfused(twin_rule):
    model = Holder(scale=float("nan"))
    report = te_lab.fuse(model, sample=torch.randn(2, 8))
    (row,) = report.rows
    assert row.status == "skipped" and type(model.inner) is Sine
    if twin_rule is Cosine:  # the weight's gradient (sum of sin vs cos terms) is finite and tells them apart
        assert row.reason.startswith("grad of scale is ") and "from the float64 truth" in row.reason
        return
    assert row.reason == ("probe inconclusive: the original's output holds NaN or infinity (on synthesized "
                          "inputs, after the sample's probe was inconclusive: the original's output holds NaN or "
                          "infinity)")
    without_sample = te_lab.fuse(model).rows[0]
    assert without_sample.status == "skipped"
    assert without_sample.reason == "probe inconclusive: the original's output holds NaN or infinity"


def test_a_gradient_that_is_not_finite_makes_the_probe_inconclusive():
    finite, nan = torch.ones(3), torch.tensor([1.0, float("nan"), 2.0])
    outputs = [compare("output", finite, finite)]
    grads = [compare("grad of weight", nan, nan, normwise=True)]
    assert outputs[0].within_tolerance and not outputs[0].inconclusive
    assert grads[0].inconclusive == "the original's grad of weight holds NaN or infinity"
    assert inconclusive_reason(outputs, grads) == "the original's grad of weight holds NaN or infinity"
    assert inconclusive_reason(outputs) == ""
    assert inconclusive_reason([compare("output", torch.ones(0), torch.ones(0))]) == \
        "the original's output has no elements"
    assert inconclusive_reason([]) == "the original returned no tensor"


def test_an_empty_batch_verifies_nothing_on_it_and_the_model_check_says_inconclusive():
    model = models.llama("tiny", seed=0)
    batch = {name: value[:0] for name, value in model.example_batch(2, 16).items()}
    report = te_lab.fuse(model, sample=batch)
    fused = report.fused
    assert fused and all(row.probe == "synthesized" and "sample's probe was inconclusive" in row.reason
                         for row in fused), str(report)
    assert not any(row.probe == "sample" and row.status == "fused" for row in report.rows)
    check = report.model_check
    assert check is not None and not check.within_tolerance
    assert check.inconclusive == "the original's loss holds NaN or infinity"  # the mean over no tokens
    assert "INCONCLUSIVE: the original's loss holds NaN or infinity" in report.summary()
