"""A twin without side effects (norms, MLPs) measured against the module it replaces, for
calls without gradients in eval mode (decode steps): the faster of the two runs every call
of that class, and nothing else changes (training calls, forced backends, modes)."""

import copy

import pytest
import torch

import te_lab
from conftest import assert_close
from te_lab.kernels import measured_choice, use_backend
from te_lab.modules import FusedModule, base
from te_lab.modules.mlp import FusedGatedMLP
from te_lab.modules.norms import FusedRMSNorm


@pytest.fixture
def fresh_decisions(monkeypatch):
    monkeypatch.setattr(base, "_STEPS_ASIDE", {})
    monkeypatch.delenv("TE_LAB_BACKEND", raising=False)
    monkeypatch.delenv(measured_choice.CHOICES_ENV, raising=False)


def fused_llama():
    model = te_lab.models.llama("tiny", seed=0).eval()
    reference = copy.deepcopy(model)
    batch = model.example_batch(1, 8)
    te_lab.fuse(model, sample=batch, progress=False)
    base._STEPS_ASIDE.clear()  # fuse's whole-model check (without gradients) decided some
    return model, reference, batch


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


def test_a_slower_twin_steps_aside_for_calls_without_gradients_only(fresh_decisions, monkeypatch):
    model, reference, batch = fused_llama()
    mlps = twins_of(model, FusedGatedMLP)
    assert mlps
    measured = []
    monkeypatch.setattr(measured_choice, "fastest_now",
                        lambda candidates: measured.append(sorted(candidates)) or "original")
    calls = counting_originals(mlps)
    ids = batch["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
        expected = reference(ids).logits
    assert_close(logits, expected)
    # One measurement for every MLP of this structure at these rows (the layers share it),
    # one for the norms.
    assert measured == [["fused", "original"]] * 2 and len(calls) == len(mlps)
    assert sorted(key[0][0].__name__ for key in base._STEPS_ASIDE) == ["FusedGatedMLP", "FusedRMSNorm"]
    with torch.no_grad():
        model(ids[:, :1])  # one row: a class of its own, measured once more
        model(ids)  # remembered
    assert len(measured) == 4 and len(calls) == 3 * len(mlps)
    # With gradients (training), the fused forward runs, unmeasured.
    model(ids).logits.sum().backward()
    assert len(measured) == 4 and len(calls) == 3 * len(mlps)


def test_hooks_on_the_twin_fire_once_and_do_not_stop_it_stepping_aside(fresh_decisions, monkeypatch):
    model, _, batch = fused_llama()
    mlp = twins_of(model, FusedGatedMLP)[0]
    fired = []
    mlp.register_forward_hook(lambda *_: fired.append(1))
    monkeypatch.setattr(measured_choice, "fastest_now", lambda candidates: "original")
    calls = counting_originals([mlp])
    with torch.no_grad():
        model(batch["input_ids"])
    assert fired == [1] and calls == [1]


def test_a_forced_backend_or_training_mode_keeps_the_fused_forward(fresh_decisions, monkeypatch):
    model, _, batch = fused_llama()
    norms = twins_of(model, FusedRMSNorm)
    monkeypatch.setattr(measured_choice, "fastest_now", lambda candidates: "original")
    calls = counting_originals(norms)
    with torch.no_grad():
        with use_backend(rms_norm="reference"):
            model(batch["input_ids"])
        monkeypatch.setenv("TE_LAB_BACKEND", "reference")
        model(batch["input_ids"])
        monkeypatch.delenv("TE_LAB_BACKEND")
        model.train()
        model(batch["input_ids"])
        model.eval()
        monkeypatch.setenv(measured_choice.CHOICES_ENV, "off")  # measuring off: the default, fused
        model(batch["input_ids"])
    assert calls == []


def test_measured_for_real_the_outputs_stay_the_originals(fresh_decisions):
    """Whichever wins on this machine, a decode-shaped call gives the original's numbers."""
    model, reference, batch = fused_llama()
    ids = batch["input_ids"][:, :1]
    with torch.no_grad():
        first, again, expected = model(ids).logits, model(ids).logits, reference(ids).logits
    assert_close(first, expected)
    assert torch.equal(first, again)
    # Decided per structure and rows, for the MLPs and the norms (the final norm's width is the layers').
    assert {key[0][0] for key in base._STEPS_ASIDE} == {FusedGatedMLP, FusedRMSNorm}
    assert not any(twin.measured_against_original for twin in model.modules()
                   if isinstance(twin, FusedModule) and not isinstance(twin, (FusedGatedMLP, FusedRMSNorm)))
