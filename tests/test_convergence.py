"""Convergence: a fused model trains as its unfused original does, step for step.

The protocol is the one Liger-Kernel proves its kernels with: mini models (4 layers)
built from one seed, a copy fused and a copy left alone, both trained by AdamW on the
same batches for 32 steps; every step's loss, the final model's top-k log-probabilities
on a held-out batch and every final parameter are compared, float32 at docs/design.md's
tolerances and bfloat16 autocast at bfloat16's. One run adds gradient accumulation and
activation checkpointing; a model with dropout on is compared statistically (different
masks on each side, the curves' means compared against their noise).

The models are a demo Llama, a Hugging Face Qwen2 and a demo GPT-2 (hidden 64, vocab
256, 2 x 16 tokens a batch). Each model is fused once for the file and each test trains
copies; most of the time is the fused models' training steps, whose te_lab ops cost
more per call than this model's tiny tensors save.
"""

import copy
import math
import statistics
from dataclasses import dataclass

import pytest
import torch

import te_lab
from conftest import TOLERANCES
from te_lab import models

STEPS = 32
BATCHES = 4  # cycled over the steps, so the loss falls as the models learn them
BATCH, SEQ, TOP_K = 2, 16, 10
# At 3e-3 bfloat16-autocast runs of the same model drift apart chaotically within 32
# steps (loss 0.3 apart, fused or not: rounding differences compound); 1e-3 keeps the
# trajectories comparable while the loss still falls by more than 1.
LEARNING_RATE = 1e-3


def mini(family: str, **overrides):
    if family == "qwen2":
        pytest.importorskip("transformers")
        return models.huggingface("qwen2", "tiny", seed=0, num_layers=4, **overrides)
    return getattr(models, family)("tiny", seed=0, num_layers=4, **overrides)


def token_batches(vocab: int, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=generator) for _ in range(count)]


@dataclass
class Run:
    losses: torch.Tensor
    log_probs: torch.Tensor  # [tokens, vocab] of the final model on the held-out batch
    parameters: dict


def train(model, batches, held_out, *, steps=STEPS, autocast_dtype=None, accumulation=1, dropout_seed=None) -> Run:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    model.train()
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    losses = []
    for step in range(steps):
        step_loss = 0.0
        for micro in range(accumulation):
            ids = batches[(step * accumulation + micro) % len(batches)]
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                                         enabled=autocast_dtype is not None):
        logits = model(input_ids=held_out).logits
    return Run(torch.tensor(losses, dtype=torch.float64), torch.log_softmax(logits.double(), -1).flatten(0, 1),
               {name: p.detach().clone() for name, p in model.named_parameters()})


_PAIRS: dict = {}


def fused_pair(family: str, **overrides):
    """Fresh copies of a fused mini model and of its unfused original, its training
    batches and a held-out batch. Fusing (its probes and first compiles are most of a
    test's time) happens once per model for the whole file; each test trains copies."""
    key = (family, tuple(sorted(overrides.items())))
    if key not in _PAIRS:
        model = mini(family, **overrides)
        vocab = model.config.vocab_size
        batches, held_out = token_batches(vocab, BATCHES, seed=1), token_batches(vocab, 1, seed=2)[0]
        original = copy.deepcopy(model)
        report = te_lab.fuse(model, sample={"input_ids": batches[0], "labels": batches[0]})
        assert report.fused and report.model_check.within_tolerance, str(report)
        _PAIRS[key] = (model, original, batches, held_out)
    fused, unfused, batches, held_out = _PAIRS[key]
    return copy.deepcopy(fused), copy.deepcopy(unfused), batches, held_out


# Every step's loss is compared at docs/design.md's tolerance for the dtype. The final
# parameters and log-probabilities carry 32 steps of drift: AdamW divides each update by
# the root of the squared gradients' running mean, so a weight whose gradient is nearly
# zero moves by a full step either way on rounding noise (float32: up to ~6e-5 apart),
# and the log-probabilities come out of the whole network on those weights (float32:
# ~4e-4 apart; bfloat16 autocast: ~3e-2 on log-probabilities near -2).
FINAL_TOLERANCES = {
    torch.float32: {"parameters": dict(rtol=1e-4, atol=2e-4), "log_probs": dict(rtol=1e-4, atol=1e-3)},
    torch.bfloat16: {"parameters": TOLERANCES[torch.bfloat16], "log_probs": dict(rtol=1.6e-2, atol=3e-2)},
}


def assert_converge_alike(fused: Run, unfused: Run, dtype: torch.dtype):
    torch.testing.assert_close(fused.losses, unfused.losses, **TOLERANCES[dtype])
    assert unfused.losses[-1] < unfused.losses[0] - 0.5  # the models did learn the batches
    top = unfused.log_probs.topk(TOP_K, dim=-1).indices
    torch.testing.assert_close(fused.log_probs.gather(-1, top), unfused.log_probs.gather(-1, top),
                               **FINAL_TOLERANCES[dtype]["log_probs"])
    assert fused.parameters.keys() == unfused.parameters.keys()
    for name, parameter in fused.parameters.items():
        learned = ~gradient_free(name, parameter)
        torch.testing.assert_close(parameter[learned], unfused.parameters[name][learned],
                                   **FINAL_TOLERANCES[dtype]["parameters"], msg=lambda message: f"{name}: {message}")


def gradient_free(name: str, parameter: torch.Tensor) -> torch.Tensor:
    """The elements whose gradient is zero in exact arithmetic: a key projection's bias
    (Qwen2's ``k_proj.bias``, the middle third of GPT-2's ``c_attn.bias``) adds the same
    amount to every score of a query, which softmax ignores. Their gradient is rounding
    noise alone, which AdamW normalizes into full steps, so they wander differently in
    any two runs (bfloat16 autocast: by up to ~steps x lr)."""
    free = torch.zeros_like(parameter, dtype=torch.bool)
    if name.endswith("k_proj.bias"):
        free[:] = True
    elif name.endswith("c_attn.bias"):
        third = parameter.shape[0] // 3
        free[third:2 * third] = True
    return free


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16-autocast"])
def test_fused_training_converges_as_unfused(family, dtype):
    fused, unfused, batches, held_out = fused_pair(family)
    assert te_lab.is_fused(fused) and not te_lab.is_fused(unfused)
    autocast_dtype = None if dtype == torch.float32 else dtype
    assert_converge_alike(train(fused, batches, held_out, autocast_dtype=autocast_dtype),
                          train(unfused, batches, held_out, autocast_dtype=autocast_dtype), dtype)


def test_accumulation_with_checkpointing_converges_as_unfused():
    """16 optimizer steps of 2 micro-batches each (32 forward and backward passes, each
    layer's forward run twice by the checkpointing)."""
    fused, unfused, batches, held_out = fused_pair("qwen2")
    for each in (fused, unfused):
        each.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_converge_alike(train(fused, batches, held_out, steps=STEPS // 2, accumulation=2),
                          train(unfused, batches, held_out, steps=STEPS // 2, accumulation=2), torch.float32)


def test_with_dropout_fused_and_unfused_learn_alike_statistically():
    """Each side draws its own masks (another seed), so the curves differ step by step;
    their means over the second half must agree within 4 standard errors of the
    per-step differences, and both must learn."""
    fused, unfused, batches, held_out = fused_pair("gpt2", dropout=0.1)
    fused_run = train(fused, batches, held_out, dropout_seed=11)
    unfused_run = train(unfused, batches, held_out, dropout_seed=12)
    differences = (fused_run.losses - unfused_run.losses)[STEPS // 2:].tolist()
    standard_error = statistics.stdev(differences) / math.sqrt(len(differences))
    assert abs(statistics.mean(differences)) <= 4 * standard_error + 1e-3, differences
    for run in (fused_run, unfused_run):
        assert run.losses[-STEPS // 4:].mean() < run.losses[:STEPS // 4].mean() - 0.5
    assert not torch.equal(fused_run.losses, unfused_run.losses)  # the masks did differ


def test_the_demo_gpt2_twins_draw_dropout_masks_in_the_originals_order():
    """What docs/api.md says: from one seed, a fused and an unfused forward in train mode
    draw the same masks (the twins make the same RNG calls in the same order)."""
    fused, unfused, batches, _ = fused_pair("gpt2", dropout=0.1)
    ids = batches[0]
    outputs = []
    for each in (fused, unfused):
        each.train()
        torch.manual_seed(13)
        outputs.append(each(input_ids=ids).logits)
    torch.testing.assert_close(outputs[0], outputs[1], **TOLERANCES[torch.float32])
