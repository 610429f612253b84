"""PEFT LoRA on a te_lab-fused model, with the real peft library: the rules recognize a
LoRA layer as a projection by structure and fuse the norm, RoPE, the attention core and
the activation around it, calling the adapter as it is; a LoRA run trains the same
adapters, and merge_and_unload gives the same merged model, as without te_lab."""

import copy

import pytest
import torch

import te_lab
from te_lab.models.real_like import make_real_like
from te_lab.modules import FusedAttention, FusedGatedMLP, FusedMLP, FusedQKVAttention
from te_lab.modules.linear_like import has_linear_weight, in_out_features, is_linear_like

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, HIDDEN, FFN, LAYERS, BATCH, SEQ = 128, 64, 128, 2, 2, 16
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
    return make_real_like(transformers.LlamaForCausalLM(config))


def gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FFN, n_layer=LAYERS, n_head=4,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return make_real_like(transformers.GPT2LMHeadModel(config))


def with_lora(model, targets, seed=1, **options):
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, **options)
    lora = peft.get_peft_model(model, config)
    # PEFT starts lora_B at zero; give it values so the adapters change the outputs from step 0.
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.02)
    return lora


def batch(seed=2):
    ids = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, : SEQ // 2] = -100  # a prompt without loss
    return {"input_ids": ids, "labels": labels}


def by_rule(report):
    """rule -> (fused, candidates)"""
    return {rule: (counts.get("fused", 0), sum(counts.values())) for rule, counts in report.counts().items()}


def lora_layer(module):
    return type(module).__module__.startswith("peft.")


def test_a_lora_layer_is_linear_like_by_structure_and_not_weight_readable():
    lora = with_lora(llama(), ["q_proj"])
    q_proj = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert lora_layer(q_proj)
    assert is_linear_like(q_proj) and not has_linear_weight(q_proj)
    assert in_out_features(q_proj) == (HIDDEN, HIDDEN)


def test_lora_llama_fuses_attention_and_mlp_in_every_layer_calling_the_adapters():
    lora = with_lora(llama(), LLAMA_TARGETS)
    adapters = {name: module for name, module in lora.named_modules() if lora_layer(module) and name.endswith("proj")}
    expected = copy.deepcopy(lora)
    sample = batch()
    report = te_lab.fuse(lora, sample=sample)
    counts = by_rule(report)
    assert counts["attention"] == (LAYERS, LAYERS) and counts["gated_mlp"] == (LAYERS, LAYERS), report
    assert counts["lm_head_loss"] == (1, 1) and counts["rmsnorm"] == (2 * LAYERS + 1, 2 * LAYERS + 1), report
    for layer in lora.base_model.model.model.layers:
        assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
    # the twins hold the very adapter modules, under the same names
    assert {name: module for name, module in lora.named_modules() if name in adapters} == adapters
    assert list(lora.state_dict()) == list(expected.state_dict())
    fused_out, unfused_out = lora(**sample), expected(**sample)
    torch.testing.assert_close(fused_out.loss, unfused_out.loss, rtol=1e-5, atol=1e-5)
    fused_out.loss.backward()
    unfused_out.loss.backward()
    grads = {name: p.grad for name, p in expected.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * len(LLAMA_TARGETS) * LAYERS
    for name, parameter in lora.named_parameters():
        if parameter.requires_grad:  # scale-wise, as the probe compares sums over tokens
            scale = grads[name].abs().max()
            assert (parameter.grad - grads[name]).abs().max() <= 1e-4 * scale + 1e-6, name


def test_a_lora_lm_head_is_a_skipped_row_with_its_reason():
    lora = with_lora(llama(), ["q_proj", "lm_head"])
    report = te_lab.fuse(lora, sample=batch())
    (row,) = [row for row in report.rows if row.rule == "lm_head_loss"]
    assert row.status == "skipped" and "standing in for a Linear" in row.reason, row
    assert by_rule(report)["attention"] == (LAYERS, LAYERS)


def test_lora_gpt2_fuses_around_conv1d_adapters():
    """GPT-2's Conv1D projections under LoRA (fan_in_fan_out): the qkv attention calls
    the adapted c_attn, and the MLP calls the adapted c_fc and fuses its activation."""
    lora = with_lora(gpt2(), ["c_attn", "c_fc"], fan_in_fan_out=True)
    expected = copy.deepcopy(lora)
    sample = batch()
    report = te_lab.fuse(lora, sample=sample)
    counts = by_rule(report)
    assert counts["attention"] == (LAYERS, LAYERS) and counts["mlp"] == (LAYERS, LAYERS), report
    for block in lora.base_model.model.transformer.h:
        assert isinstance(block.attn, FusedQKVAttention) and isinstance(block.mlp, FusedMLP)
        assert lora_layer(block.attn.c_attn) and lora_layer(block.mlp.c_fc)
    torch.testing.assert_close(lora(**sample).loss, expected(**sample).loss, rtol=1e-5, atol=1e-5)


def train(model, steps=3):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(**batch(seed=10 + step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_fused_lora_run_trains_and_merges_like_an_unfused_one():
    unfused = with_lora(llama(), LLAMA_TARGETS)
    fused = copy.deepcopy(unfused)
    te_lab.fuse(fused, sample=batch())
    fused_losses, unfused_losses = train(fused), train(unfused)
    assert unfused_losses[-1] != unfused_losses[0]  # the adapters did learn
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(unfused_losses), rtol=1e-5, atol=1e-5)
    merged_fused, merged_unfused = fused.merge_and_unload(), unfused.merge_and_unload()
    assert not any(lora_layer(module) for module in merged_fused.modules())
    fused_state, unfused_state = merged_fused.state_dict(), merged_unfused.state_dict()
    assert list(fused_state) == list(unfused_state)
    for name, value in unfused_state.items():
        torch.testing.assert_close(fused_state[name], value, rtol=1e-5, atol=1e-5 * float(value.abs().max()))
    ids = batch()["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged_fused(ids).logits, merged_unfused(ids).logits, rtol=1e-4, atol=1e-4)


def test_lora_added_after_fusing_lands_in_the_twins_and_unfuse_keeps_it():
    """get_peft_model on an already fused model: PEFT finds q_proj / up_proj under the same
    paths inside the twins and wraps them there; the twins call the adapters, and unfuse
    hands them to the original modules."""
    unfused = with_lora(llama(), ["q_proj", "up_proj"])
    fused_base = llama()
    te_lab.fuse(fused_base, sample=batch())
    fused = with_lora(fused_base, ["q_proj", "up_proj"])
    layer = fused.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and lora_layer(layer.self_attn.q_proj)
    assert isinstance(layer.mlp, FusedGatedMLP) and lora_layer(layer.mlp.up_proj)
    sample = batch()
    torch.testing.assert_close(fused(**sample).loss, unfused(**sample).loss, rtol=1e-5, atol=1e-5)
    te_lab.unfuse(fused)
    layer = fused.base_model.model.model.layers[0]
    assert not isinstance(layer.self_attn, FusedAttention) and lora_layer(layer.self_attn.q_proj)
    torch.testing.assert_close(fused(**sample).loss, unfused(**sample).loss, rtol=1e-5, atol=1e-5)
