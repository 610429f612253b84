"""fuse's verdict on models that look like pretrained checkpoints (tests/real_like.py:
outlier channels, activations of 1e3-1e4), where two correct float32 computations of the
same math differ by more than any fixed tolerance: every correct twin is kept (judged by
its error against the original run in float64, beside the original's own), the whole
model computes as before, and a twin with a real bug (a wrong epsilon, a wrong scale, a
dropped residual, a transposed weight) is still refused at that scale."""

import copy

import pytest
import torch
import torch.nn.functional as F

import te_lab
from te_lab.models.real_like import largest_activation, make_real_like

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 256, 2, 48


def build(arch: str, hidden: int = 256, intermediate: int = 512):
    """A 2-layer model of ``arch`` made real-like; hidden 256 x 512 routes the Llama
    projections through te_lab's linear op (the oneDNN path) where it measures faster."""
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=128, attention_dropout=0.0)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=128, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_inner=intermediate, n_layer=2, n_head=4,
                                         n_positions=128, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif arch == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertModel(config)
    # GPT-2's LayerNorms with biases damp the outliers: it needs a larger push to look real
    return make_real_like(model, projection_scale=3000.0 if arch == "gpt2" else 300.0)


def sample(labels: bool = True) -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_real_like_model_keeps_every_correct_twin(arch):
    model = build(arch)
    assert largest_activation(model, sample(labels=False)) > 1e3  # it looks like a checkpoint
    reference = copy.deepcopy(model)
    report = te_lab.fuse(model, sample=sample(), progress=False)
    refused = {row.label: row.reason for row in report.rows if row.status != "fused"}
    assert not refused, refused
    for row in report.rows:
        assert row.truth == "float64"
        assert row.output_max_abs is not None and row.original_output_max_abs is not None
    assert report.model_check.within_tolerance, report.summary()
    with torch.no_grad():
        loss, expected_loss = model(**sample()).loss, reference(**sample()).loss
        logits, expected_logits = model(**sample(False)).logits, reference(**sample(False)).logits
    assert abs(float(loss) - float(expected_loss)) <= 1e-5 * abs(float(expected_loss))
    # scale-aware: the logits of a real-like model reach 1e2-1e3
    assert float((logits - expected_logits).abs().max()) <= 1e-5 * float(expected_logits.abs().max()) + 1e-5


def _refused(report, path: str) -> str:
    (row,) = [row for row in report.rows if row.label == path]
    assert row.status == "skipped", f"{path} was fused: {row}"
    assert "from the float64 truth where the original's own error is" in row.reason
    return row.reason


def test_a_wrong_epsilon_is_refused_at_real_scale(monkeypatch):
    model = build("llama")
    original_init = te_lab.modules.FusedRMSNorm.__init__

    def wrong_eps(self, original, *, eps, **options):
        original_init(self, original, eps=1e-2, **options)

    monkeypatch.setattr(te_lab.modules.FusedRMSNorm, "__init__", wrong_eps)
    report = te_lab.fuse(model, sample=sample(), only=["rmsnorm"], progress=False)
    # the first norm reads the embeddings, whose scale makes epsilon count
    _refused(report, "model.layers.0.input_layernorm")


def test_a_wrong_attention_scale_is_refused_at_real_scale(monkeypatch):
    model = build("llama")
    original_init = te_lab.modules.FusedAttention.__init__

    def wrong_scale(self, original, **options):
        original_init(self, original, **{**options, "scaling": options["scaling"] * 1.02})

    monkeypatch.setattr(te_lab.modules.FusedAttention, "__init__", wrong_scale)
    report = te_lab.fuse(model, sample=sample(), only=["attention"], progress=False)
    for layer in range(2):
        _refused(report, f"model.layers.{layer}.self_attn")


def test_a_transposed_weight_is_refused_at_real_scale(monkeypatch):
    model = build("llama", intermediate=256)  # square projections, so a transpose still runs
    from te_lab.modules import mlp

    monkeypatch.setattr(mlp, "project", lambda module, x, backend: F.linear(x, module.weight.t(), module.bias))
    report = te_lab.fuse(model, sample=sample(), only=["gated_mlp"], progress=False)
    for layer in range(2):
        _refused(report, f"model.layers.{layer}.mlp")


def test_a_dropped_residual_is_refused_at_real_scale(monkeypatch):
    model = build("bert")
    from te_lab.modules import norms

    layer_norm = norms.layer_norm
    # the twin unpacks (normed, sum) from a call with a residual; the broken one drops the add
    monkeypatch.setattr(norms, "layer_norm",
                        lambda *args, residual=None, **kwargs: (layer_norm(*args, **kwargs), None))
    ids = sample(labels=False)
    report = te_lab.fuse(model, sample=ids, only=["residual_layernorm"], progress=False)
    rows = [row for row in report.rows if row.rule == "residual_layernorm"]
    assert rows and all(row.status == "skipped" for row in rows), report
    assert all("from the float64 truth" in row.reason for row in rows)
