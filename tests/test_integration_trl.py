"""A te_lab-fused model under TRL's SFTTrainer, on a small in-memory text dataset with a
word-level tokenizer built in memory (no downloads): the same losses and saved weights
as unfused. SFTTrainer installs its own chunked LM head over the model's forward, so
there te_lab's twins fuse the decoder (norms, attention, MLPs) and TRL computes the loss."""

import copy

import pytest
import torch

import te_lab
from integration_models import VOCAB, assert_same_weights, llama, saved_weights
from te_lab.modules import FusedAttention, FusedGatedMLP

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "rug", "fast", "slow", "and", "then", "slept"]


def tokenizer():
    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {word: i for i, word in enumerate(specials + WORDS)}
    assert len(vocab) <= VOCAB
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                                eos_token="<eos>")


def texts(count=8):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 12, (count,), generator=generator)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(n),), generator=generator))
            for n in lengths]


def run_sft(model, output_dir):
    args = trl.SFTConfig(output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                         use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, max_length=16,
                         bf16=False)  # SFTConfig's default is bf16 where the machine has it
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts()}),
                             processing_class=tokenizer())
    trainer.train()
    trainer.save_model(str(output_dir))
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow  # whole Trainer runs
def test_sft_trainer_trains_a_fused_model_as_unfused(tmp_path):
    unfused = llama()
    fused = copy.deepcopy(unfused)
    ids = tokenizer()(texts(2), return_tensors="pt", padding=True)["input_ids"]
    report = te_lab.fuse(fused, sample={"input_ids": ids, "labels": ids})
    assert len(report.fused) == 10, report
    fused_losses = run_sft(fused, tmp_path / "fused")
    unfused_losses = run_sft(unfused, tmp_path / "unfused")
    assert len(fused_losses) == 3 and len(set(unfused_losses)) == 3
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(unfused_losses), rtol=1e-5, atol=1e-5)
    assert_same_weights(saved_weights(tmp_path / "fused"), saved_weights(tmp_path / "unfused"), rtol=1e-5, atol=1e-5)
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)


@pytest.mark.slow  # whole Trainer runs
def test_the_trainer_callback_under_sft_trainer_leaves_trls_lm_head_and_says_so(tmp_path):
    model = llama()
    callback = te_lab.TrainerCallback(verbose=False)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                         use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=16, bf16=False)
    trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts()}),
                   processing_class=tokenizer(), callbacks=[callback]).train()
    (row,) = [row for row in callback.report.rows if row.rule == "lm_head_loss"]
    assert row.status == "skipped" and "forward is wrapped" in row.reason, row
    assert len(callback.report.fused) == 9, callback.report
