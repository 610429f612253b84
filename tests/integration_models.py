"""What the integration tests (tests/test_integration_*.py) share: a tiny Llama scaled like
a pretrained checkpoint, token batches whose label counts differ per example (so loss
normalisation matters), an in-memory dataset, and reading what a Trainer logged and saved."""

from pathlib import Path

import torch

from te_lab.models.real_like import make_real_like

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 128, 64, 128, 2, 4, 2
EXAMPLES, SEQ = 8, 16


def llama(seed=0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64, attention_dropout=0.0)
    return make_real_like(transformers.LlamaForCausalLM(config))


def examples(count=EXAMPLES, seed=0):
    """Columns ``input_ids``, ``attention_mask``, ``labels``; example ``i`` has its first
    ``i`` positions unlabelled, so micro-batches hold different numbers of labels."""
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    for i in range(count):
        labels[i, : i % SEQ] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def dataset(count=EXAMPLES):
    """A ``datasets.Dataset`` with one column the model does not take (``text``), which
    Trainer's column removal must drop while keeping the others."""
    import datasets

    columns = {name: value.tolist() for name, value in examples(count).items()}
    columns["text"] = [f"example {i}" for i in range(count)]
    return datasets.Dataset.from_dict(columns)


def sample(batch=2):
    """The first ``batch`` examples, as ``te_lab.fuse``'s sample."""
    return {name: value[:batch] for name, value in examples().items()}


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def saved_weights(directory) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "model.safetensors"))


def assert_same_weights(actual: dict, expected: dict, rtol: float, atol: float) -> None:
    """Same names, and each tensor within ``rtol`` of its own scale (``atol`` absolute)."""
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
