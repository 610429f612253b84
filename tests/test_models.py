"""The demo models: structure, determinism, and the explicit math against torch's own
fused ops (and against Hugging Face's models where transformers is installed)."""

import pytest
import torch
import torch.nn.functional as F

import te_lab
from conftest import DEVICE, assert_close
from te_lab.models import (
    GPT2LM,
    HUGGINGFACE_MODEL_NAMES,
    MODEL_NAMES,
    PRESETS,
    LlamaLM,
    LMOutput,
    RMSNorm,
    build_model,
    example_batch,
    gpt2,
    huggingface,
    llama,
)
from te_lab.models.llama import apply_rotary

FAMILIES = [pytest.param(llama, id="llama"), pytest.param(gpt2, id="gpt2")]


def _rng_states():
    states = [torch.get_rng_state()]
    if DEVICE.type != "cpu":
        states.append(torch.get_device_module(DEVICE).get_rng_state(DEVICE))
    return states


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_shapes(family):
    model = family("tiny", device=DEVICE)
    batch = model.example_batch(batch=3, seq=10)
    assert batch["input_ids"].shape == (3, 10) and batch["input_ids"].device == DEVICE
    out = model(**batch)
    assert isinstance(out, LMOutput)
    assert out.logits.shape == (3, 10, model.config.vocab_size)
    assert out.loss.shape == ()
    assert model(batch["input_ids"]).loss is None


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_is_mean_next_token_cross_entropy_over_counted_labels(family):
    model = family("tiny", device=DEVICE)
    batch = model.example_batch(batch=2, seq=12)
    labels = batch["labels"].clone()
    labels[0, 3] = labels[1, 7] = -100
    out = model(batch["input_ids"], labels=labels)

    log_probs = out.logits.double().log_softmax(-1)[:, :-1]
    targets = labels[:, 1:]
    counted = targets != -100
    picked = log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    expected = -(picked * counted).sum() / counted.sum()
    assert_close(out.loss, expected.float())


@pytest.mark.parametrize("family", FAMILIES)
def test_seed_decides_the_weights(family):
    first, again, other = (family("tiny", seed=s, device=DEVICE).state_dict() for s in (0, 0, 1))
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
    assert any(not torch.equal(tensor, other[name]) for name, tensor in first.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_construction_and_example_batch_leave_the_global_rng_alone(family):
    before = _rng_states()
    model = family("tiny", seed=3, device=DEVICE)
    first = model.example_batch(seed=5)
    second = model.example_batch(seed=5)
    for state, now in zip(before, _rng_states()):
        assert torch.equal(state, now)
    assert torch.equal(first["input_ids"], second["input_ids"])
    assert torch.equal(first["labels"], first["input_ids"])
    assert not torch.equal(model.example_batch(seed=6)["input_ids"], first["input_ids"])


def _llama_attention_by_sdpa(attn, x, cos, sin, attn_mask=None):
    batch, seq, _ = x.shape

    def heads(proj, count):
        return proj(x).view(batch, seq, count, attn.head_dim).transpose(1, 2)

    q = apply_rotary(heads(attn.q_proj, attn.num_heads), cos, sin)
    k = apply_rotary(heads(attn.k_proj, attn.num_kv_heads), cos, sin)
    v = heads(attn.v_proj, attn.num_kv_heads)
    group = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def test_llama_attention_matches_sdpa_with_repeated_kv_heads():
    model = llama("tiny", device=DEVICE)
    attn = model.model.layers[0].self_attn
    assert attn.num_kv_heads < attn.num_heads
    batch, seq = 2, 9
    x = _randn(batch, seq, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(torch.arange(seq, device=DEVICE).expand(batch, seq))
    assert cos.shape == (batch, seq, attn.head_dim) and cos.dtype == torch.float32
    assert_close(attn(x, (cos, sin)), _llama_attention_by_sdpa(attn, x, cos, sin))

    # A given additive mask replaces the causal one: here causal plus the second
    # sequence's first two positions masked out as padding.
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=DEVICE).tril().expand(batch, 1, seq, seq).clone()
    allowed[1, :, :, :2] = False
    allowed[1, :, :2, :2] = torch.eye(2, dtype=torch.bool, device=DEVICE)  # padding rows see themselves
    additive = torch.zeros(allowed.shape, device=DEVICE).masked_fill(~allowed, float("-inf"))
    assert_close(attn(x, (cos, sin), additive), _llama_attention_by_sdpa(attn, x, cos, sin, additive))


def test_rotary_scores_depend_only_on_relative_position():
    model = llama("tiny", device=DEVICE)
    head_dim = model.config.head_dim
    q, k = _randn(1, 1, 1, head_dim, seed=1), _randn(1, 1, 1, head_dim, seed=2)

    def score(q_pos, k_pos):
        cos, sin = model.model.rotary_emb(torch.tensor([[q_pos, k_pos]], device=DEVICE))
        rotated_q = apply_rotary(q, cos[:, :1], sin[:, :1])
        rotated_k = apply_rotary(k, cos[:, 1:], sin[:, 1:])
        return (rotated_q * rotated_k).sum()

    # Angles up to ~50 radians: float32 sin/cos carry ~1e-5 absolute error there.
    assert_close(score(7, 3), score(50, 46), atol=1e-4)
    assert_close(apply_rotary(q, *model.model.rotary_emb(torch.tensor([[5]], device=DEVICE))).norm(), q.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    norm = RMSNorm(64, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _randn(64, seed=1))
    x = (3 * _randn(5, 7, 64)).to(dtype)
    expected = F.rms_norm(x.float(), (64,), norm.weight, eps=1e-6).to(dtype)
    actual = norm(x)
    assert actual.dtype == dtype
    assert_close(actual, expected)


def test_gpt2_attention_matches_sdpa():
    model = gpt2("tiny", device=DEVICE)
    attn = model.transformer.h[0].attn
    batch, seq = 2, 9
    x = _randn(batch, seq, model.config.hidden_size)
    q, k, v = (
        t.view(batch, seq, attn.num_heads, attn.head_dim).transpose(1, 2)
        for t in attn.c_attn(x).split(model.config.hidden_size, dim=-1)
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, -1)
    assert_close(attn(x), attn.c_proj(out))


def test_gpt2_ties_lm_head_to_token_embedding_and_llama_does_not():
    model = gpt2("tiny", device=DEVICE)
    assert model.lm_head.weight is model.transformer.wte.weight
    untied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert model.num_parameters() == untied - model.lm_head.weight.numel()

    plain = llama("tiny", device=DEVICE)
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight
    tied = llama("tiny", device=DEVICE, tie_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.num_parameters() == plain.num_parameters() - plain.lm_head.weight.numel()


@pytest.mark.parametrize("family", FAMILIES)
def test_later_tokens_do_not_change_earlier_logits(family):
    model = family("tiny", device=DEVICE)
    input_ids = model.example_batch(batch=1, seq=12)["input_ids"]
    changed = input_ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % model.config.vocab_size
    logits, changed_logits = model(input_ids).logits, model(changed).logits
    assert torch.equal(logits[:, :8], changed_logits[:, :8])
    assert not torch.allclose(logits[:, 8:], changed_logits[:, 8:])


def test_bad_names_are_reported_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"llama\(preset='huge'\).*'tiny', 'mini', 'small'"):
        llama("huge")
    with pytest.raises(ValueError, match=r"gpt2\(hidden=\.\.\.\).*hidden_size"):
        gpt2("tiny", hidden=32)
    with pytest.raises(ValueError, match=r"build_model\(name='llama-7b'\).*llama-tiny.*gpt2-small"):
        build_model("llama-7b")
    with pytest.raises(ValueError, match="num_kv_heads"):
        llama("tiny", num_kv_heads=3)


def test_hugging_face_names_and_batches():
    pytest.importorskip("transformers")
    assert HUGGINGFACE_MODEL_NAMES[:3] == ("hf:llama-tiny", "hf:llama-mini", "hf:llama-small")
    model = build_model("hf:qwen2", seed=3, num_layers=1)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_hidden_layers == 1
    assert model.config.hidden_size == PRESETS["llama"]["tiny"].hidden_size
    batch = example_batch(model, 3, 9, seed=4)
    assert batch["input_ids"].shape == (3, 9) and torch.equal(batch["input_ids"], batch["labels"])
    assert torch.equal(batch["input_ids"], llama("tiny").example_batch(3, 9, seed=4)["input_ids"])
    with pytest.raises(ValueError, match=r"build_model\(name='hf:bert'\).*hf:llama-tiny.*hf:gpt2-small"):
        build_model("hf:bert")
    with pytest.raises(ValueError, match=r"huggingface\(architecture='bert'\)"):
        huggingface("bert")
    with pytest.raises(ValueError, match=r"example_batch\(seq=0\): expected a positive int"):
        example_batch(model, 2, 0)


def test_the_qwen3_moe_preset_is_the_model_issue_26_measured():
    pytest.importorskip("transformers")
    model = build_model("hf:qwen3_moe-mini")
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and config.num_hidden_layers == 2
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.head_dim) == (256, 32, 4, 128, 32)
    for layer in model.model.layers:  # every layer's MLP is the MoE block
        assert layer.mlp.experts.gate_up_proj.shape == (32, 2 * 128, 256)
    tiny = build_model("hf:qwen3_moe")
    report = te_lab.fuse(tiny, sample=example_batch(tiny, 1, 8), only=["moe"], progress=False)
    assert [row.path for row in report.fused] == ["model.layers.0.mlp", "model.layers.1.mlp"], [
        (row.path, row.status, row.reason) for row in report.rows]


def test_build_model_names():
    assert MODEL_NAMES == ("llama-tiny", "llama-mini", "llama-small", "gpt2-tiny", "gpt2-mini", "gpt2-small")
    model = build_model("gpt2-tiny", seed=1, device=DEVICE, num_layers=1)
    assert isinstance(model, GPT2LM) and len(model.transformer.h) == 1
    assert isinstance(build_model("llama-tiny", device=DEVICE), LlamaLM)


@pytest.mark.parametrize("family, model_class", [("llama", LlamaLM), ("gpt2", GPT2LM)])
def test_small_presets_have_about_100m_parameters(family, model_class):
    with torch.device("meta"):
        model = model_class(PRESETS[family]["small"])
    assert 90e6 <= model.num_parameters() <= 130e6


def test_low_precision_model_keeps_float32_rotary_frequencies():
    model = llama("tiny", dtype=torch.bfloat16, device=DEVICE)
    reference = llama("tiny", device=DEVICE)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    out = model(**model.example_batch())
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32


def test_input_errors_name_the_argument():
    model = gpt2("tiny", device=DEVICE)
    with pytest.raises(ValueError, match="input_ids.*max_seq_len 128"):
        model(torch.zeros(1, 129, dtype=torch.long, device=DEVICE))
    mask = torch.ones(4, 4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="attention_mask.*additive float"):
        llama("tiny", device=DEVICE)(torch.zeros(1, 4, dtype=torch.long, device=DEVICE), attention_mask=mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_loads_into_hugging_face_and_computes_the_same(family):
    pytest.importorskip("transformers")
    model = family("tiny", device="cpu")
    state = model.state_dict()
    # huggingface() shapes its models like the demo preset of the same name.
    hf_model = build_model(f"hf:{family.__name__}-tiny", seed=1, device="cpu")
    if family is gpt2:
        # Hugging Face's GPT-2 projections are Conv1D: weights stored [in, out].
        conv1d_weights = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
        state = {k: v.t() if k.endswith(conv1d_weights) else v for k, v in state.items()}
    hf_model.load_state_dict(state, strict=True)
    batch = model.example_batch(seq=20)
    out, hf_out = model(**batch), hf_model(**batch)
    assert_close(out.logits, hf_out.logits)
    assert_close(out.loss, hf_out.loss)
