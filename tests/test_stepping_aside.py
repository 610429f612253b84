"""A twin without side effects (norms, MLPs) measured against the module it replaces, per
class of call (training calls forward and backward, others forward alone): where the
original is measurably faster it runs every call of that class, with the original's
numbers; forced backends, measuring off, keep="all" and fuse's own probes keep the fused
forward; fuse decides the sample's training class and says so in its report."""

import copy

import pytest
import torch

import te_lab
from conftest import assert_close
from te_lab.kernels import measured_choice, use_backend
from te_lab.modules import FusedModule, stepping_aside
from te_lab.modules.mlp import FusedGatedMLP
from te_lab.modules.norms import FusedRMSNorm


@pytest.fixture
def fresh_decisions(monkeypatch):
    monkeypatch.setattr(stepping_aside, "_DECISIONS", {})
    monkeypatch.delenv("TE_LAB_BACKEND", raising=False)
    monkeypatch.delenv(measured_choice.CHOICES_ENV, raising=False)


def fused_llama(**options):
    model = te_lab.models.llama("tiny", seed=0).eval()
    reference = copy.deepcopy(model)
    batch = model.example_batch(1, 8)
    report = te_lab.fuse(model, sample=batch, progress=False, **options)
    stepping_aside._DECISIONS.clear()  # fuse decided the sample's training class
    return model, reference, batch, report


def timed(original, fused):
    """A stand-in for the interleaved timing: the medians given, and the classes measured."""
    measured = []

    def median_times_now(candidates):
        measured.append(sorted(candidates))
        return {"original": original, "fused": fused}
    return median_times_now, measured


def twins_of(model, kind):
    return [module for module in model.modules() if isinstance(module, kind)]


def counting_originals(twins):
    """Each twin's original forward, counted (an instance attribute, not a hook: hooks
    would keep the twin from measuring)."""
    calls = []
    for twin in twins:
        forward = twin.original.forward
        twin.original.forward = lambda *args, forward=forward, **kwargs: calls.append(1) or forward(*args, **kwargs)
    return calls


def test_a_slower_twin_steps_aside_per_class_of_call(fresh_decisions, monkeypatch):
    model, reference, batch, _ = fused_llama()
    mlps = twins_of(model, FusedGatedMLP)
    assert mlps
    fake, measured = timed(original=1.0, fused=2.0)
    monkeypatch.setattr(measured_choice, "median_times_now", fake)
    calls = counting_originals(mlps)
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
        expected = reference(ids).logits
    assert_close(logits, expected)
    # One measurement for every MLP of this structure at these rows (the layers share it),
    # one for the norms.
    assert measured == [["fused", "original"]] * 2 and len(calls) == len(mlps)
    assert sorted(key[0][0].__name__ for key in stepping_aside._DECISIONS) == ["FusedGatedMLP", "FusedRMSNorm"]
    with torch.no_grad():
        model(ids[:, :1])  # one row: a class of its own, measured once more
        model(ids)  # remembered
    assert len(measured) == 4 and len(calls) == 3 * len(mlps)
    # With gradients (training), a class of its own, measured forward and backward: the
    # original runs, and the gradients are the original's.
    model.train()
    reference.train()
    model(ids).logits.sum().backward()
    reference(ids).logits.sum().backward()
    assert len(measured) == 6 and len(calls) == 4 * len(mlps)
    assert {key[3] for key in stepping_aside._DECISIONS} == {False, True}
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert_close(ours.grad, theirs.grad), name


def test_a_training_sample_touches_no_gradient_and_needs_a_clear_margin(fresh_decisions, monkeypatch):
    model, _, batch, _ = fused_llama()
    mlp = twins_of(model, FusedGatedMLP)[0]
    x = torch.randn(1, 8, mlp.gate_proj.in_features, requires_grad=True)
    decision = stepping_aside.decide(mlp, (x,), {})  # measured for real: forward and backward
    assert decision.training and decision.rows == 8 and decision.original_us > 0 and decision.fused_us > 0
    assert decision.aside == (decision.original_us < (1 - stepping_aside.MARGIN) * decision.fused_us)
    assert all(p.grad is None for p in mlp.parameters()) and x.grad is None
    # within the margin the twin stays: near-equal timings never flip a verified twin
    monkeypatch.setattr(measured_choice, "median_times_now", timed(original=0.97, fused=1.0)[0])
    stepping_aside._DECISIONS.clear()
    assert not stepping_aside.decide(mlp, (x,), {}).aside


def test_fuse_decides_the_samples_training_class_and_reports_it(fresh_decisions, monkeypatch):
    fake, measured = timed(original=1.0, fused=2.0)
    monkeypatch.setattr(measured_choice, "median_times_now", fake)
    model, _, batch, report = fused_llama()
    aside = [row for row in report.rows if row.steps_aside]
    assert {row.rule for row in aside} == {"rmsnorm", "gated_mlp"}
    assert all(row.status == "fused" and row.speedup == pytest.approx(0.5) for row in aside)
    assert all("steps aside at the sample's sizes" in row.reason for row in aside)
    assert f"{len(aside)} fused twin(s) step aside at the sample's sizes" in report.summary()
    # one measurement per layer structure (the norms, the MLPs), not one per layer
    assert len(measured) == 2
    # the probes judged the fused kernels, not the original the twins now hand calls to
    assert all(row.backends["glu"] in ("cpp", "inductor", "reference") for row in aside if row.rule == "gated_mlp")
    assert all(row.output_max_abs is not None for row in aside)


def test_keep_all_runs_every_twin_fused(fresh_decisions, monkeypatch):
    fake, measured = timed(original=1.0, fused=2.0)
    monkeypatch.setattr(measured_choice, "median_times_now", fake)
    model, _, batch, report = fused_llama(keep="all")
    assert measured == [] and not any(row.steps_aside for row in report.rows)
    calls = counting_originals(twins_of(model, FusedModule))
    model(batch["input_ids"]).logits.sum().backward()
    with torch.no_grad():
        model(batch["input_ids"])
    assert calls == [] and measured == []
    with pytest.raises(ValueError, match="te_lab.fuse: keep must be one of 'faster', 'all', got 'fastest'"):
        te_lab.fuse(te_lab.models.llama("tiny", seed=0), keep="fastest")


def test_hooks_on_the_twin_fire_once_and_do_not_stop_it_stepping_aside(fresh_decisions, monkeypatch):
    model, _, batch, _ = fused_llama()
    mlp = twins_of(model, FusedGatedMLP)[0]
    fired = []
    mlp.register_forward_hook(lambda *_: fired.append(1))
    monkeypatch.setattr(measured_choice, "median_times_now", timed(original=1.0, fused=2.0)[0])
    calls = counting_originals([mlp])
    with torch.no_grad():
        model(batch["input_ids"])
    assert fired == [1] and calls == [1]


def test_a_forced_backend_or_measuring_off_keeps_the_fused_forward(fresh_decisions, monkeypatch):
    model, _, batch, _ = fused_llama()
    norms = twins_of(model, FusedRMSNorm)
    monkeypatch.setattr(measured_choice, "median_times_now", timed(original=1.0, fused=2.0)[0])
    calls = counting_originals(norms)
    with torch.no_grad():
        with use_backend(rms_norm="reference"):
            model(batch["input_ids"])
        monkeypatch.setenv("TE_LAB_BACKEND", "reference")
        model(batch["input_ids"])
        monkeypatch.delenv("TE_LAB_BACKEND")
        monkeypatch.setenv(measured_choice.CHOICES_ENV, "off")  # measuring off: the default, fused
        model(batch["input_ids"])
        model.train()
        model(batch["input_ids"])
    with stepping_aside.running_fused():  # fuse's probes and checks
        model(batch["input_ids"]).logits.sum().backward()
    assert calls == []


def test_measured_for_real_the_outputs_stay_the_originals(fresh_decisions):
    """Whichever wins on this machine, a decode-shaped call gives the original's numbers."""
    model, reference, batch, _ = fused_llama()
    ids = batch["input_ids"][:, :1]
    with torch.no_grad():
        first, again, expected = model(ids).logits, model(ids).logits, reference(ids).logits
    assert_close(first, expected)
    assert torch.equal(first, again)
    # Decided per structure and rows, for the MLPs and the norms (the final norm's width is the layers').
    assert {key[0][0] for key in stepping_aside._DECISIONS} == {FusedGatedMLP, FusedRMSNorm}
    assert not any(twin.measured_against_original for twin in model.modules()
                   if isinstance(twin, FusedModule) and not isinstance(twin, (FusedGatedMLP, FusedRMSNorm)))


class Doubled(torch.nn.Module):
    """A child put in a twin's place after fusing, as PEFT puts its LoRA layers."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def test_stepping_aside_runs_the_child_put_in_the_twins_place(fresh_decisions, monkeypatch):
    model, reference, batch, _ = fused_llama()
    monkeypatch.setattr(measured_choice, "median_times_now", timed(original=1.0, fused=2.0)[0])
    for twin, plain in zip(twins_of(model, FusedGatedMLP), [m for m in reference.modules()
                                                           if type(m).__name__ == "LlamaMLP"]):
        twin.up_proj = Doubled(twin.up_proj)
        plain.up_proj = Doubled(plain.up_proj)
    ids = batch["input_ids"]
    model(ids).logits.sum().backward()  # the original runs: with the doubled up projection
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits)
    assert all(isinstance(twin.original.up_proj, Doubled) for twin in twins_of(model, FusedGatedMLP))
