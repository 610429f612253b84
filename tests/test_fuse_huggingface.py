"""te_lab.fuse on Hugging Face transformers models built from tiny random-init configs
(no downloads): Llama (GQA), GPT-2 and BERT. The fused model must compute what the
unfused deep copy computes (losses, logits, every parameter gradient, in train and
eval mode), the report must name every fused layer, unfuse must put the very same
module objects back, state dicts must not notice, greedy generation through the KV
cache must give the same tokens, padding masks and eager attention must keep the
numbers, and a bf16 model must stay within bf16 tolerance."""

import contextlib
import copy
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import te_lab
from conftest import DEVICE, TOLERANCES, assert_close
from te_lab.modules import (
    FusedAttention,
    FusedGatedMLP,
    FusedLayerNorm,
    FusedLMHeadLoss,
    FusedMLP,
    FusedQKVAttention,
    FusedResidualLayerNorm,
    FusedRMSNorm,
)

REPOSITORY = Path(__file__).resolve().parent.parent


transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 128, 64, 128, 4, 2, 2
BATCH, SEQ = 2, 16
ARCHITECTURES = ["llama", "gpt2", "bert"]
CAUSAL = ["llama", "gpt2"]
NO_DROPOUT = {
    "llama": dict(attention_dropout=0.0),
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}


def build(arch, layers=LAYERS, seed=0, **overrides):
    """A tiny random-init model; ``overrides`` go to its config."""
    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64, **overrides)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "gpt2":
        # GPT-2's default bos/eos id (50256) lies outside the tiny vocabulary.
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FFN, n_layer=layers, n_head=HEADS, n_positions=64,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, **overrides)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
            num_attention_heads=HEADS, max_position_embeddings=64, **overrides)
        model = transformers.BertForMaskedLM(config)
    return model.to(DEVICE)


def layer_count(model):
    config = model.config
    return config.n_layer if hasattr(config, "n_layer") else config.num_hidden_layers


def token_ids(seed=1, high=VOCAB - 1):
    # high=VOCAB - 1 keeps GPT-2's eos id out of the prompt.
    return torch.randint(0, high, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def labels_for(arch, ids):
    if arch != "bert":
        return ids.clone()
    # Masked LM: only some positions carry a label.
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return labels


def fused_pair(arch, dtype=None, **overrides):
    """(fused model, unfused deep copy taken before fusing, report, ids, labels)."""
    model = build(arch, **overrides)
    if dtype is not None:
        model = model.to(dtype)
    reference = copy.deepcopy(model)
    ids = token_ids()
    labels = labels_for(arch, ids)
    report = te_lab.fuse(model, sample={"input_ids": ids, "labels": labels}, progress=False)
    return model, reference, report, ids, labels


def rows_by_path(report):
    return {row.path: row for row in report.rows}


def module_at(model, path):
    return model.get_submodule(path) if path else model


def attention_twins(model):
    return [m for m in model.modules() if isinstance(m, (FusedAttention, FusedQKVAttention))]


@contextlib.contextmanager
def counting_fallbacks(model):
    """Counts calls that fused attention twins hand back to their original modules, and
    the query lengths the twins are called with."""
    fallbacks, query_lengths, handles = [], [], []
    twins = attention_twins(model)
    assert twins, "no fused attention twin in the model"

    def counted(call_original):
        def call(args, kwargs):
            fallbacks.append(1)
            return call_original(args, kwargs)
        return call

    # Not a hook on the original: while fused, its hooks fire on the twin's calls too
    # (te_lab/surgery/hooks.py), so only the hand-back itself counts a fallback.
    for twin in twins:
        twin._call_original = counted(twin._call_original)
        handles.append(twin.register_forward_pre_hook(
            lambda _m, args, kwargs: query_lengths.append((args[0] if args else kwargs["hidden_states"]).shape[-2]),
            with_kwargs=True))
    try:
        yield fallbacks, query_lengths
    finally:
        for handle in handles:
            handle.remove()
        for twin in twins:
            del twin._call_original


def parameter_grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(model, reference):
    grads, expected = parameter_grads(model), parameter_grads(reference)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert grads.keys() == expected.keys() and len(grads) > 0
    for name, grad in grads.items():
        # fp32 tolerance even for the weight and embedding gradients, sums over every token
        # of the batch (docs/design.md allows 1e-4 there), its atol scaled by the gradient's
        # largest element: where te_lab's linear op runs the projections on oneDNN (measured
        # faster on a 2-core EPYC of family 26) they differ by up to 3e-7 of it, 1.9e-5 of 58.
        tolerance = dict(TOLERANCES[torch.float32])
        tolerance["atol"] *= max(1.0, float(expected[name].abs().max()))
        assert_close(grad, expected[name], **tolerance), name


# ---- 1. losses, logits and gradients ------------------------------------------------


@pytest.mark.parametrize("training", [pytest.param(True, id="train-no-dropout"), pytest.param(False, id="eval")])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fused_loss_logits_and_every_gradient_match_the_unfused_model(arch, training):
    model, reference, report, ids, labels = fused_pair(arch, **NO_DROPOUT[arch])
    assert report.fused, str(report)
    model.train(training)
    reference.train(training)

    # With labels.
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    out, expected = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    if arch in CAUSAL:
        assert out.logits is None  # lm_head_loss: the logits are never materialized
        assert expected.logits is not None
    else:
        assert_close(out.logits, expected.logits)
    assert_close(out.loss, expected.loss)
    out.loss.backward()
    expected.loss.backward()
    assert_same_grads(model, reference)

    # Without labels: the logits, and gradients through them (the fused LM head is bypassed).
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    out, expected = model(input_ids=ids), reference(input_ids=ids)
    assert out.loss is None and out.logits is not None
    assert_close(out.logits, expected.logits)
    upstream = torch.randn(expected.logits.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (out.logits * upstream).sum().backward()
    (expected.logits * upstream).sum().backward()
    assert_same_grads(model, reference)


# ---- 2. the report ---------------------------------------------------------------------


def expected_fusions(arch, layers):
    """path -> (rule, fused type) of every module te_lab must fuse."""
    if arch == "llama":
        per_layer = {"input_layernorm": ("rmsnorm", FusedRMSNorm),
                     "post_attention_layernorm": ("rmsnorm", FusedRMSNorm),
                     "mlp": ("gated_mlp", FusedGatedMLP), "self_attn": ("attention", FusedAttention)}
        prefix, extra = "model.layers", {"model.norm": ("rmsnorm", FusedRMSNorm),
                                         "": ("lm_head_loss", FusedLMHeadLoss)}
    elif arch == "gpt2":
        per_layer = {"ln_1": ("layernorm", FusedLayerNorm), "ln_2": ("layernorm", FusedLayerNorm),
                     "mlp": ("mlp", FusedMLP), "attn": ("attention", FusedQKVAttention)}
        prefix, extra = "transformer.h", {"transformer.ln_f": ("layernorm", FusedLayerNorm),
                                          "": ("lm_head_loss", FusedLMHeadLoss)}
    else:
        per_layer = {"attention.output": ("residual_layernorm", FusedResidualLayerNorm),
                     "output": ("residual_layernorm", FusedResidualLayerNorm),
                     "intermediate": ("mlp", FusedMLP)}
        prefix, extra = "bert.encoder.layer", {"bert.embeddings.LayerNorm": ("layernorm", FusedLayerNorm),
                                               "cls.predictions.transform.LayerNorm": ("layernorm", FusedLayerNorm)}
    expected = {f"{prefix}.{i}.{name}": value for i in range(layers) for name, value in per_layer.items()}
    return expected | extra, prefix, len(per_layer)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_report_names_every_fused_layer(arch):
    # Three layers and the default dropouts (GPT-2 and BERT: 0.1): probes run in eval mode.
    model = build(arch, layers=3)
    ids = token_ids()
    report = te_lab.fuse(model, sample={"input_ids": ids, "labels": labels_for(arch, ids)}, progress=False)
    layers = layer_count(model)
    assert layers == 3
    expected, prefix, per_layer = expected_fusions(arch, layers)
    rows = rows_by_path(report)
    assert len(rows) == len(report.rows), "one row per module"
    assert set(rows) == set(expected), str(report)

    for i in range(layers):
        in_layer = [row for row in report.rows if row.path.startswith(f"{prefix}.{i}.") and row.status == "fused"]
        assert len(in_layer) == per_layer, str(report)
    for path, (rule, fused_type) in expected.items():
        row = rows[path]
        assert (row.status, row.rule, row.fused_type) == ("fused", rule, fused_type.__name__), str(report)
        assert row.kernels and all(k.startswith("te_lab::") for k in row.kernels)
        assert row.probe == "sample"
        # The report describes what is in the model.
        if fused_type is FusedLMHeadLoss:
            assert isinstance(model.__dict__.get("forward"), FusedLMHeadLoss)
            assert row.kernels == ["te_lab::fused_linear_cross_entropy"]
        else:
            assert isinstance(module_at(model, path), fused_type)
        if arch == "llama" and rule == "attention":
            assert "te_lab::rope" in row.kernels and "te_lab::attention" in row.kernels
    assert report.model_check is not None and report.model_check.within_tolerance, str(report)

    counts = report.counts()
    if arch == "llama":
        assert counts == {"rmsnorm": {"fused": 2 * layers + 1}, "gated_mlp": {"fused": layers},
                          "attention": {"fused": layers}, "rope": {"fused": layers}, "lm_head_loss": {"fused": 1}}
    elif arch == "gpt2":
        assert counts == {"layernorm": {"fused": 2 * layers + 1}, "mlp": {"fused": layers},
                          "attention": {"fused": layers}, "lm_head_loss": {"fused": 1}}
    else:
        assert counts == {"residual_layernorm": {"fused": 2 * layers}, "mlp": {"fused": layers},
                          "layernorm": {"fused": 2}}


# ---- 3. identity and state -----------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_unfuse_restores_the_same_module_objects_and_state_dict_is_unchanged(arch):
    model = build(arch)
    reference = copy.deepcopy(model)
    modules_before = dict(model.named_modules())
    ids_before = {name: id(module) for name, module in modules_before.items()}
    state_before = model.state_dict()
    saved = {name: tensor.detach().clone() for name, tensor in state_before.items()}
    ids = token_ids()
    labels = labels_for(arch, ids)

    te_lab.fuse(model, sample={"input_ids": ids, "labels": labels}, progress=False)
    assert te_lab.is_fused(model)
    swapped = [name for name, module in model.named_modules() if ids_before.get(name) != id(module)]
    assert len(swapped) >= 3 * layer_count(model), swapped

    state_fused = model.state_dict()
    assert list(state_fused) == list(state_before)
    for name, tensor in state_fused.items():
        assert tensor.data_ptr() == state_before[name].data_ptr(), name  # the very same tensors
        assert torch.equal(tensor, saved[name]), name

    # A fused checkpoint loads strictly into a fresh, differently initialized unfused model ...
    fresh = build(arch, seed=7)
    assert not torch.equal(next(iter(fresh.state_dict().values())), next(iter(saved.values())))
    result = fresh.load_state_dict(state_fused, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    # ... and an unfused checkpoint into a fused model.
    fused_fresh = build(arch, seed=7)
    te_lab.fuse(fused_fresh, sample={"input_ids": ids, "labels": labels}, progress=False)
    fused_fresh.load_state_dict(reference.state_dict(), strict=True)
    for m in (model, reference, fresh, fused_fresh):
        m.eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=labels)
        for m in (model, fresh, fused_fresh):
            out = m(input_ids=ids, labels=labels)
            assert_close(out.loss, expected.loss)
            assert_close(m(input_ids=ids).logits, expected.logits)

    restored = te_lab.unfuse(model)
    assert len(restored.restored) > 0 and not te_lab.is_fused(model)
    modules_after = dict(model.named_modules())
    assert {name: id(module) for name, module in modules_after.items()} == ids_before
    assert all(modules_after[name] is module for name, module in modules_before.items())
    assert "forward" not in model.__dict__  # the LM head's fused forward is gone too
    state_after = model.state_dict()
    assert list(state_after) == list(state_before)
    assert all(torch.equal(state_after[name], saved[name]) for name in saved)


# ---- 4. generation through the KV cache ----------------------------------------------


@pytest.mark.parametrize("arch", CAUSAL)
def test_greedy_generation_through_the_fused_kv_cache_path_gives_the_same_tokens(arch):
    model, reference, report, ids, _ = fused_pair(arch)
    assert {row.rule for row in report.fused} >= {"attention"}
    model.eval()
    reference.eval()
    options = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids),
                   pad_token_id=0)
    with counting_fallbacks(model) as (fallbacks, query_lengths):
        tokens = model.generate(ids, **options)
    expected = reference.generate(ids, **options)
    assert tokens.shape == (BATCH, SEQ + 5)
    assert torch.equal(tokens, expected)
    assert torch.equal(tokens[:, :SEQ], ids)
    # Prefill over the prompt, then one token per step against the cache, all on the fused path.
    layers = layer_count(model)
    assert query_lengths == [SEQ] * layers + [1] * (4 * layers)
    assert not fallbacks


# ---- 5. attention masks, eager attention ---------------------------------------------


def padding_mask(side):
    mask = torch.ones(BATCH, SEQ, dtype=torch.long, device=DEVICE)
    if side == "left":
        mask[0, :5] = 0
        mask[1, :2] = 0
    else:
        mask[0, -5:] = 0
        mask[1, -2:] = 0
    return mask


def assert_logits_match_where_not_padded(model, reference, ids, mask):
    model.eval()
    reference.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        expected = reference(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()
    assert_close(logits[kept], expected[kept])


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", CAUSAL)
def test_padding_masks_keep_the_logits_at_real_tokens(arch, side):
    model, reference, _, ids, _ = fused_pair(arch)
    mask = padding_mask(side)
    with counting_fallbacks(model) as (fallbacks, _):
        assert_logits_match_where_not_padded(model, reference, ids, mask)
    assert not fallbacks  # the masked calls ran on the fused attention


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_switched_to_eager_attention_after_fusing_still_matches(side):
    model, reference, report, ids, _ = fused_pair("llama")
    assert len([row for row in report.fused if row.rule == "attention"]) == LAYERS
    for m in (model, reference):
        m.config._attn_implementation = "eager"
    # Eager builds an additive float 4-D mask, which the fused attention takes as is.
    with counting_fallbacks(model) as (fallbacks, _):
        assert_logits_match_where_not_padded(model, reference, ids, padding_mask(side))
    assert not fallbacks


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_built_with_eager_attention_still_matches(side):
    model, reference, report, ids, labels = fused_pair("llama", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    fused_rules = [row.rule for row in report.fused]
    assert fused_rules.count("rmsnorm") == 2 * LAYERS + 1 and fused_rules.count("gated_mlp") == LAYERS
    assert_logits_match_where_not_padded(model, reference, ids, padding_mask(side))
    with torch.no_grad():
        assert_close(model(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss)


def test_llama_built_with_eager_attention_fuses_its_attention():
    _, _, report, _, _ = fused_pair("llama", attn_implementation="eager")
    rows = [row for row in report.rows if row.rule == "attention"]
    assert len(rows) == LAYERS and all(row.status == "fused" for row in rows), str(report)


@pytest.mark.xfail(strict=True, reason=(
    "known limitation (README): transformers 5 records attention weights with forward hooks on modules "
    "of class LlamaAttention (_can_record_outputs) and never passes output_attentions to the attention "
    "module, so a fused attention, which never forms the weights, cannot hand the call back; "
    "output_attentions=True returns no weights on a fused model"))
def test_fused_llama_returns_attention_weights_when_asked():
    model, reference, _, ids, _ = fused_pair("llama")
    for m in (model, reference):
        m.config._attn_implementation = "eager"
        m.eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, output_attentions=True).attentions
        attentions = model(input_ids=ids, output_attentions=True).attentions
    assert len(expected) == LAYERS
    assert len(attentions) == LAYERS
    for weights, reference_weights in zip(attentions, expected):
        assert_close(weights, reference_weights)


# ---- 6. bf16 ---------------------------------------------------------------------------


def test_bf16_llama_fuses_and_stays_within_bf16_tolerance():
    model, reference, report, ids, labels = fused_pair("llama", dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(row.status == "fused" for row in report.rows), str(report)
    assert report.counts() == {"rmsnorm": {"fused": 2 * LAYERS + 1}, "gated_mlp": {"fused": LAYERS},
                               "attention": {"fused": LAYERS}, "rope": {"fused": LAYERS},
                               "lm_head_loss": {"fused": 1}}, str(report)
    model.eval()
    reference.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
        assert logits.dtype == torch.bfloat16
        assert_close(logits, expected)
        loss = model(input_ids=ids, labels=labels).loss
        expected_loss = reference(input_ids=ids, labels=labels).loss
        assert_close(loss.float(), expected_loss.float(), dtype=torch.bfloat16)


# ---- the environment --------------------------------------------------------------------


def test_transformers_does_not_load_a_second_copy_of_te_lab_kernels():
    code = (
        "import importlib, os, sys, torch, te_lab, transformers\n"
        "rms_norm = importlib.import_module('te_lab.kernels.rms_norm')\n"
        "library = importlib.import_module('te_lab.kernels.custom_ops')._LIBRARY\n"
        "transformers.LlamaConfig\n"
        "from transformers.utils import is_kernels_available\n"
        "checkout_kernels = os.path.join(sys.argv[1], 'kernels')\n"
        "print(sorted(name for name, module in list(sys.modules.items()) if name.split('.')[0] == 'kernels'\n"
        "             and (getattr(module, '__file__', None) or '').startswith(checkout_kernels)))\n"
        "print(getattr(sys.modules.get('kernels'), '__file__', None))\n"
        "print(importlib.import_module('te_lab.kernels.custom_ops')._LIBRARY is library\n"
        "      and torch._C._dispatch_has_kernel_for_dispatch_key('te_lab::rms_norm', 'CompositeExplicitAutograd'),\n"
        "      is_kernels_available())\n")
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}

    def run_from(directory):
        # `python -c` puts the working directory first on sys.path, as `python -m pytest` does.
        result = subprocess.run([sys.executable, "-c", code, str(REPOSITORY)], cwd=directory, env=environment,
                                check=False, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-3:]

    submodules, kernels_file, verdicts = run_from(REPOSITORY)
    _, elsewhere_file, elsewhere_verdicts = run_from(tempfile.gettempdir())
    assert submodules == "[]"  # no op file of the checkout ran as a top-level `kernels`
    # `kernels` is what it is outside the checkout: the Hub package where one is installed
    # (transformers >= 5.25 depends on it), else an empty stand-in without __file__
    assert kernels_file == elsewhere_file
    assert kernels_file == "None" or not kernels_file.startswith(str(REPOSITORY / "kernels"))
    assert verdicts == elsewhere_verdicts  # transformers judges the Hub package as it does elsewhere
    assert verdicts.split()[0] == "True"  # te_lab's registration kept
