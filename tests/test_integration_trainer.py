"""A te_lab-fused model under Hugging Face's Trainer and the model API the Trainer and
its users call: the fused forward looks like the original to introspection (Trainer keeps
the dataset's columns), ``num_items_in_batch`` normalises the loss as unfused,
gradient checkpointing works whether enabled before or after fusing,
``enable_input_require_grads`` / ``get_input_embeddings`` / ``save_pretrained`` /
``from_pretrained`` / ``generate`` work, and Trainer runs (gradient accumulation,
checkpointing, bf16 autocast on the CPU) log the same losses and save the same weights
as unfused."""

import copy
import inspect

import pytest
import torch

import te_lab
from integration_models import (
    assert_same_weights,
    dataset,
    examples,
    llama,
    logged_losses,
    sample,
    saved_weights,
)
from te_lab.modules import FusedAttention, FusedLMHeadLoss

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")


def fused_llama(seed=0):
    model = llama(seed)
    te_lab.fuse(model, sample=sample())
    return model


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(actual, expected, rtol=1e-4):
    """Scale-wise, as the probe compares gradients (sums over tokens; docs/design.md)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert (actual[name] - value).abs().max() <= rtol * value.abs().max() + 1e-6, name


def test_the_fused_forward_looks_like_the_original_to_introspection():
    model = llama()
    signature = inspect.signature(model.forward)
    te_lab.fuse(model, sample=sample())
    assert isinstance(model.__dict__["forward"], FusedLMHeadLoss)
    assert inspect.signature(model.forward) == signature
    assert inspect.unwrap(model.forward) is inspect.unwrap(type(model).forward)
    assert model.forward.__wrapped__ == type(model).forward.__get__(model)


def test_num_items_in_batch_normalises_like_unfused_across_accumulated_micro_batches():
    """Two micro-batches with different label counts, each loss a sum over the count of
    both (what Trainer passes): their sum is the mean over the whole batch, fused as unfused."""
    unfused = llama()
    fused = copy.deepcopy(unfused)
    te_lab.fuse(fused, sample=sample())
    batch = examples(4)
    halves = [{name: value[i:i + 2] for name, value in batch.items()} for i in (0, 2)]
    total = int((batch["labels"][:, 1:] != -100).sum())
    for model in (fused, unfused):
        for half in halves:
            model(**half, num_items_in_batch=torch.tensor(total)).loss.backward()
    assert_same_grads(grads(fused), grads(unfused))
    with torch.no_grad():
        parts = [fused(**half, num_items_in_batch=total).loss for half in halves]
        whole = unfused(**batch).loss
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


def test_shift_labels_are_the_targets_as_given_like_unfused():
    """Context parallelism passes pre-shifted targets (``shift_labels``); the fused loss
    must score them as they are, as Hugging Face's loss does."""
    unfused = llama()
    fused = copy.deepcopy(unfused)
    te_lab.fuse(fused, sample=sample())
    batch = sample()
    targets = torch.roll(batch["labels"], -2, dims=-1)  # not the labels shifted by one
    with torch.no_grad():
        expected = unfused(**batch, shift_labels=targets).loss
        torch.testing.assert_close(fused(**batch, shift_labels=targets).loss, expected, rtol=1e-5, atol=1e-5)
        assert (fused(**batch).loss - expected).abs() > 1e-3


@pytest.mark.parametrize("when", ["before", "after"])
def test_gradient_checkpointing_enabled_before_or_after_fusing(when):
    unfused = llama()
    fused = copy.deepcopy(unfused)
    if when == "before":
        fused.gradient_checkpointing_enable()
    te_lab.fuse(fused, sample=sample())
    if when == "after":
        fused.gradient_checkpointing_enable()
    assert isinstance(fused.model.layers[0].self_attn, FusedAttention)
    calls = []
    fused.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    fused.train()
    unfused.train()
    loss = fused(**sample()).loss
    loss.backward()
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    unfused(**sample()).loss.backward()
    torch.testing.assert_close(loss, unfused(**sample()).loss, rtol=1e-5, atol=1e-5)
    assert_same_grads(grads(fused), grads(unfused))


def test_enable_input_require_grads_and_get_input_embeddings_on_a_fused_model():
    model = fused_llama()
    embeddings = model.get_input_embeddings()
    assert embeddings is model.model.embed_tokens
    embeddings.weight.requires_grad_(False)
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable()
    model.train()
    seen = []
    embeddings.register_forward_hook(lambda module, inputs, output: seen.append(output.requires_grad))
    model(**sample()).loss.backward()
    assert seen[0] is True
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_save_pretrained_round_trip_is_unfused_refusable_and_generates_the_same(tmp_path):
    model = fused_llama()
    model.eval()
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert not te_lab.is_fused(loaded) and "forward" not in loaded.__dict__
    assert_same_weights(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**sample()).loss, model(**sample()).loss, rtol=1e-5, atol=1e-5)
    prompt = sample()["input_ids"][:1, :4]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = loaded.generate(prompt, **options)
    assert torch.equal(model.generate(prompt, **options), expected)
    report = te_lab.fuse(loaded, sample=sample())
    assert len(report.fused) == len(report.rows) == 10, report
    assert torch.equal(loaded.generate(prompt, **options), expected)


def run_trainer(model, output_dir, **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0, **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    trainer.save_model(str(output_dir))
    return trainer


@pytest.mark.slow  # whole Trainer runs
@pytest.mark.parametrize("arguments, rtol", [
    (dict(gradient_accumulation_steps=2), 1e-5),
    (dict(gradient_checkpointing=True), 1e-5),
    # bf16 autocast: both compute in bf16, with different roundings
    (dict(bf16=True), 1.6e-2),
], ids=["accumulation", "checkpointing", "bf16"])
def test_trainer_runs_fused_as_unfused(tmp_path, arguments, rtol):
    unfused = llama()
    fused = copy.deepcopy(unfused)
    te_lab.fuse(fused, sample=sample())
    fused_run = run_trainer(fused, tmp_path / "fused", **arguments)
    unfused_run = run_trainer(unfused, tmp_path / "unfused", **arguments)
    fused_losses, unfused_losses = logged_losses(fused_run), logged_losses(unfused_run)
    assert len(fused_losses) == 3 and len(set(unfused_losses)) == 3
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(unfused_losses), rtol=rtol, atol=rtol)
    # AdamW moves each weight by about the learning rate (1e-3) per step whatever the size of its gradient,
    # so under bf16 an element whose gradient is rounding noise may go the other way at each of the 3 steps
    assert_same_weights(saved_weights(tmp_path / "fused"), saved_weights(tmp_path / "unfused"), rtol=rtol,
                        atol=1e-5 if rtol < 1e-3 else 6e-3)
    assert te_lab.is_fused(fused) and isinstance(fused.model.layers[0].self_attn, FusedAttention)


def run_trainer_with_callback(model, output_dir, callback, **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0, **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[callback])
    trainer.train()
    trainer.save_model(str(output_dir))
    return trainer


@pytest.mark.slow  # whole Trainer runs
@pytest.mark.parametrize("arguments, rtol", [(dict(), 1e-5), (dict(bf16=True), 1.6e-2)], ids=["fp32", "bf16"])
def test_the_trainer_callback_fuses_at_train_begin_and_trains_as_unfused(tmp_path, capsys, arguments, rtol):
    unfused = llama()
    model = copy.deepcopy(unfused)
    callback = te_lab.TrainerCallback()
    fused_run = run_trainer_with_callback(model, tmp_path / "fused", callback, **arguments)
    assert "te_lab.fuse: 10 of 10 candidate modules fused in LlamaForCausalLM" in capsys.readouterr().out
    assert len(callback.report.fused) == 10 and callback.report.model_check.loss_before is not None
    assert te_lab.is_fused(model) and isinstance(model.model.layers[1].self_attn, FusedAttention)
    if arguments.get("bf16"):  # fused beneath accelerate's autocast, which still wraps the fused forward
        assert te_lab.fusions(model)[0].replaces_forward and model.__dict__["forward"] is not None
        assert isinstance(model.__dict__["_original_forward"], FusedLMHeadLoss)
    unfused_run = run_trainer(unfused, tmp_path / "unfused", **arguments)
    torch.testing.assert_close(torch.tensor(logged_losses(fused_run)), torch.tensor(logged_losses(unfused_run)),
                               rtol=rtol, atol=rtol)
    # AdamW's bf16 noise, as in test_trainer_runs_fused_as_unfused
    assert_same_weights(saved_weights(tmp_path / "fused"), saved_weights(tmp_path / "unfused"), rtol=rtol,
                        atol=1e-5 if rtol < 1e-3 else 6e-3)


@pytest.mark.slow  # whole Trainer runs
def test_the_trainer_callback_profiles_a_training_step_into_html(tmp_path, capsys):
    model = llama()
    html = tmp_path / "step.html"
    callback = te_lab.TrainerCallback(only=["rmsnorm", "gated_mlp"], profile_html=html, profile_steps=2)
    run_trainer_with_callback(model, tmp_path / "out", callback)
    assert {row.rule for row in callback.report.fused} == {"rmsnorm", "gated_mlp"}
    report = callback.profile_report
    assert set(report.modes) == {"eager", "fused"} and len(report.modes["fused"].step_ms) >= 2
    assert html.exists() and "plotly" in html.read_text()
    assert f"profile of a training step written to {html}" in capsys.readouterr().out


def test_the_trainer_callback_checks_its_arguments():
    with pytest.raises(ValueError, match="profile_steps must be a positive int"):
        te_lab.TrainerCallback(profile_steps=0)
    with pytest.raises(TypeError, match="profile_html must be a path"):
        te_lab.TrainerCallback(profile_html=3)
