"""Coverage of the causal-LM families transformers ships, as a test (issue 26).

Each family is built from a tiny config (2 layers, hidden 64, 4 query / 2 key-value heads,
sequence 16), scaled like a pretrained checkpoint (tests/real_like.py: outlier channels
of ~2e4), and fused on a sample. Then:

- every module a rule recognized is fused, or skipped for a reason listed here as one of
  the family's real limits; never "could not build" or "probe raised";
- attention and the dense MLP are fused in every layer (where the family has them);
- the whole model's logits and every parameter's gradient are as close to the float64
  truth as the docs/design.md error budget allows against the unfused model's own error.

The fraction of recognized modules fused is printed per family (``-s``) and asserted to
be 1 where the family has no listed limit.
"""

import copy
import fnmatch
import inspect
import re

import pytest
import torch

import te_lab
from te_lab.kernels.precision import error_budget
from te_lab.models.real_like import make_real_like

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
BATCH, SEQ = 2, 16
# model_type -> config overrides on TINY (token ids inside the tiny vocabulary, windows
# shorter than the sample so sliding-window layers do mask, no dropout); a key that is not a
# model type names a variant of one, given as the "model_type" override.
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=8),
    "ministral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma": {},
    "gemma2": dict(sliding_window=8),
    # Gemma 2's layout with soft-capped final logits.
    "vaultgemma": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "olmo": {},
    "olmo2": {},
    "phi": dict(partial_rotary_factor=0.5, pad_token_id=0),
    "phi3": dict(pad_token_id=0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "cohere": dict(use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "starcoder2": dict(sliding_window=8, bos_token_id=1, eos_token_id=2),
    "glm": dict(pad_token_id=0),
    "glm4": dict(pad_token_id=0),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "smollm3": dict(pad_token_id=0),
    "exaone4": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(logits_scaling=4.0),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=64, bos_token_id=127,
                 eos_token_id=127),
    # Multi-query query_key_value ([q heads | k | v]) and a `dense` output projection.
    "falcon": dict(head_dim=None, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Falcon's new decoder architecture: query_key_value interleaved per key-value group
    # ([2 groups, 2 query heads + k + v, head_dim]), a LayerNorm each for attention and MLP.
    "falcon_new_decoder": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2, head_dim=None,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # GPT-NeoX (Pythia): query_key_value interleaved per head ([heads, 3 * head_dim]), rotate-half
    # over the first quarter of each head (rotary_pct 0.25), a `dense` output projection.
    "gpt_neox": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Persimmon (Fuyu's language model): the same interleave, per-head LayerNorm q/k norms
    # (called as they are), half of each head rotated.
    "persimmon": dict(qk_layernorm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # A RoPE layer (complex frequencies, then a weightless qk_norm) with chunked attention
    # (chunks of 8), a no-RoPE layer with temperature tuning (floor_scale 4: the temperature
    # changes every 4 positions of the sample and of the generated tokens) and an MoE block.
    "llama4_text": dict(num_local_experts=4, interleave_moe_layer_step=2, intermediate_size_mlp=128,
                        no_rope_layers=[1, 0], attention_chunk_size=8, floor_scale=4, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2),
    # Partial rotary: tables of the rotated quarter of each head (partial_rotary_factor 0.25).
    "stablelm": {},
    # GPT-1: its attention's input is called x and it returns [output].
    "openai-gpt": {},
    # MoE families of other layouts: OLMoE (QK-norm over the projections), PhiMoE,
    # Granite-MoE (input_linear / output_linear experts), GLM-4-MoE (a shared expert).
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     n_group=1, topk_group=1, pad_token_id=0),
    # Cohere 2: sliding-window layers with RoPE beside full-attention layers without it.
    "cohere2": dict(sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "helium": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # ReLU-squared MLPs (hidden_act "relu2").
    "arcee": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "nemotron": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "deepseek_v3": dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1, head_dim=None),
}
# model_type -> {module-path glob: what keeps it unfused}: real limits, each asserted to
# be the row's reason (a regular expression searched in it).
KNOWN_LIMITS = {
    "deepseek_v3": {"*.self_attn": r"multi-head latent attention \(MLA.*\) is not covered yet"},
}
# Families whose attention is recognized but not fused yet (their rows say why).
ATTENTION_NOT_COVERED = ("deepseek_v3",)
# Reasons that are bugs of ours, never a real limit.
BUGS = ("could not build", "probe raised", "raised", "no rule applied")
ATTENTION_PATHS = ("*.self_attn", "*.attn")
DENSE_MLP_RULES = ("swiglu_mlp", "mlp", "geglu_mlp", "gated_mlp")


def build(model_type, **changes):
    """The family's tiny real-like model; ``changes`` override its config further."""
    overrides = dict(FAMILIES[model_type]) | changes
    config_type = overrides.pop("model_type", model_type)
    tiny = {} if model_type == "gpt2" else dict(TINY)
    if overrides.get("head_dim", 0) is None:
        tiny.pop("head_dim")
        overrides.pop("head_dim")
    config = transformers.AutoConfig.for_model(config_type, **(tiny | overrides))
    for name in ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "residual_dropout",
                 "hidden_dropout", "embedding_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return make_real_like(model).eval()


def sample_ids():
    return torch.randint(3, 120, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def layer_count(model):
    config = model.config
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    upstream = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (logits * upstream.to(logits.dtype)).sum().backward()
    grads = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double(), grads


def assert_within_budget(what, fused, unfused, truth):
    fused_error = (fused - truth).abs().max().item()
    unfused_error = (unfused - truth).abs().max().item()
    budget = error_budget(unfused_error, truth.abs().max().item(), torch.float32)
    assert fused_error <= budget, (f"{what}: fused {fused_error:.3g} from the float64 truth, unfused "
                                   f"{unfused_error:.3g}, budget {budget:.3g}")


def limit_for(model_type, path):
    for pattern, reason in KNOWN_LIMITS.get(model_type, {}).items():
        if fnmatch.fnmatchcase(path, pattern):
            return reason
    return None


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_is_fused_where_supported_and_matches_the_float64_truth(model_type):
    model = build(model_type)
    unfused = copy.deepcopy(model)
    truth_model = copy.deepcopy(model).double()
    # Hugging Face's grouped-GEMM experts take no float64; its per-expert loop does.
    truth_model.config._experts_implementation = "eager"
    ids = sample_ids()
    report = te_lab.fuse(model, sample={"input_ids": ids, "labels": ids}, progress=False)
    layers = layer_count(model)

    # Every recognized module fused, or skipped for a listed real limit.
    for row in report.rows:
        if row.status == "fused":
            continue
        assert not any(bug in (row.reason or "") for bug in BUGS), f"{row.path}: {row.reason}"
        limit = limit_for(model_type, row.path)
        assert limit is not None and re.search(limit, row.reason or ""), (
            f"{model_type} {row.path} ({row.rule}) skipped for an unlisted reason: {row.reason}")
    fused = sum(row.status == "fused" for row in report.rows)
    print(f"{model_type}: {fused}/{len(report.rows)} recognized modules fused")
    if model_type not in KNOWN_LIMITS:
        assert fused == len(report.rows), str(report)

    # Attention in every layer (or the family's stated gap), and the dense MLPs.
    attention_rows = [row for row in report.rows if row.rule == "attention"]
    assert len(attention_rows) == layers, str(report)
    if model_type not in ATTENTION_NOT_COVERED:
        assert all(row.status == "fused" for row in attention_rows), str(report)
    dense_mlps = [name for name, module in unfused.named_modules()
                  if name.endswith(".mlp") and any(child in module._modules for child in ("down_proj", "c_proj", "fc2"))
                  and not any(child in module._modules for child in ("experts", "router", "gate"))
                  or name.endswith(".mlp") and "gate_up_proj" in module._modules]
    fused_mlps = {row.path for row in report.rows if row.rule in DENSE_MLP_RULES and row.status == "fused"}
    assert set(dense_mlps) <= fused_mlps, f"dense MLPs left unfused: {sorted(set(dense_mlps) - fused_mlps)}"

    # The whole model against the float64 truth, next to the unfused model's own error.
    truth_logits, truth_grads = logits_and_grads(truth_model, ids)
    unfused_logits, unfused_grads = logits_and_grads(unfused, ids)
    fused_logits, fused_grads = logits_and_grads(model, ids)
    assert_within_budget("logits", fused_logits, unfused_logits, truth_logits)
    assert fused_grads.keys() == truth_grads.keys() and fused_grads
    for name, truth in truth_grads.items():
        assert_within_budget(f"grad of {name}", fused_grads[name], unfused_grads[name], truth)


# ---- greedy generation through the KV cache (issue 28) ---------------------------------

PROMPT, NEW_TOKENS = 12, 6
_FUSED_PAIRS = {}


def fused_pair(model_type):
    """(fused model, unfused copy, report), fused once per family for the cases below."""
    if model_type not in _FUSED_PAIRS:
        model = build(model_type)
        unfused = copy.deepcopy(model)
        ids = sample_ids()
        report = te_lab.fuse(model, sample={"input_ids": ids, "labels": ids}, progress=False)
        _FUSED_PAIRS[model_type] = model, unfused, report
    return _FUSED_PAIRS[model_type]


@pytest.mark.parametrize("model_type, scope, norms, kernels, variant", [
    # QK-norm over each head: the RMSNorms run inside te_lab's rope (one pass over q and k);
    # over the whole projection (OLMo 2): as te_lab's rms_norm; either unless the probe
    # preferred the module's own (then the row says so).
    ("qwen3", "head", "rope", {"te_lab::attention", "te_lab::rope"}, ""),
    ("qwen3_moe", "head", "rope", {"te_lab::attention", "te_lab::rope"}, ""),
    ("gemma3_text", "head", "rope", {"te_lab::attention", "te_lab::rope"}, ""),
    ("olmo2", "projection", "rms_norm", {"te_lab::attention", "te_lab::rope"}, ""),
    # Sinks on the fused attention op; RoPE tables with one value per pair.
    ("gpt_oss", None, None, {"te_lab::attention", "te_lab::rope"}, "rotary: rotate_half_pair_tables"),
    # Interleaved pairs with per-dim tables and LayerNorm q/k norms (called as they are) /
    # with rotate-half tables and partial rotary.
    ("cohere", "head", None, {"te_lab::attention", "te_lab::rope"}, "rotary: interleaved"),
    ("glm4", None, None, {"te_lab::attention", "te_lab::rope"}, "rotary: interleaved_rotate_half_tables"),
    # Soft-capped scores: the softmax runs on the reference math, so the attention op is not claimed.
    ("gemma2", None, None, {"te_lab::rope"}, ""),
])
def test_attention_rows_say_what_runs_fused(model_type, scope, norms, kernels, variant):
    model, _, report = fused_pair(model_type)
    rows = [row for row in report.rows if row.rule == "attention"]
    assert len(rows) == layer_count(model)
    for row in rows:
        assert row.status == "fused", row.reason
        twin = model.get_submodule(row.path)
        assert (twin.qk_norm_scope if twin.qk_norms else None) == scope
        # Where the fused rounding missed the probe's bar, the row says what runs unfused.
        own_norms, reference_rope = "q/k norms run as the module's own", "rotation on te_lab's reference math"
        notes = [note for note in row.variant.split("; ") if note]
        assert notes[:1] == ([variant] if variant else notes[:1]) and set(notes) - {variant} <= {own_norms,
                                                                                              reference_rope}
        fused_norms = None if own_norms in notes or reference_rope in notes else norms
        assert twin._norms_in_rope == (fused_norms == "rope"), row.path
        assert ("te_lab::rms_norm" in row.kernels) == (fused_norms == "rms_norm"), row.path
        expected = kernels - ({"te_lab::rope"} if reference_rope in notes else set())
        assert set(row.kernels) - {"te_lab::linear", "te_lab::rms_norm"} == expected, row.path


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.grad is not None}
    return output, grads


@pytest.mark.parametrize("model_type, variant", [("cohere", "logits scaled by 0.0625"),
                                                ("granite", "logits scaled by 0.25"),
                                                ("gemma2", "logits soft-capped at 30"),
                                                ("vaultgemma", "logits soft-capped at 30")])
def test_lm_heads_that_transform_their_logits_fuse_with_the_transform(model_type, variant):
    """Cohere multiplies its logits by logit_scale, Granite divides them by logits_scaling,
    Gemma 2 soft-caps them (final_logit_softcapping): the fused head + loss applies the
    scale (to the hidden states) or the cap (inside its chunks), and the training loss and
    every gradient are within the error budget of the float64 truth."""
    model, unfused, report = fused_pair(model_type)
    row = next(row for row in report.rows if row.rule == "lm_head_loss")
    assert row.status == "fused" and row.variant == variant, (row.status, row.reason, row.variant)
    ids = sample_ids()
    truth_model = copy.deepcopy(unfused).double()
    truth_model.config._experts_implementation = "eager"
    (truth, truth_grads), (eager, eager_grads), (fused, fused_grads) = (
        loss_and_grads(m, ids) for m in (truth_model, unfused, model))
    assert fused.logits is None and eager.logits is not None  # the fused head + loss ran
    assert_within_budget("loss", fused.loss.detach().double(), eager.loss.detach().double(),
                         truth.loss.detach())
    assert fused_grads.keys() == truth_grads.keys()
    for name, want in truth_grads.items():
        assert_within_budget(f"grad of {name}", fused_grads[name], eager_grads[name], want)


def left_padded_prompts(batch):
    """``batch`` prompts of PROMPT tokens; from the second on, each has a few more pad
    tokens on the left (a batch of 1 has none)."""
    ids = torch.randint(3, 120, (batch, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        pad = row % 5 + 1
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def attention_twins(model):
    from te_lab.modules import FusedAttention, FusedQKVAttention
    return [m for m in model.modules() if isinstance(m, (FusedAttention, FusedQKVAttention))]


GENERATING = sorted(set(FAMILIES) - set(ATTENTION_NOT_COVERED))


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("model_type", GENERATING)
def test_greedy_decoding_through_the_kv_cache_gives_the_unfused_tokens(model_type, cache, batch):
    """Prefill and one-token decode steps all run on the fused attention (no call handed
    back to the original), with GQA, left padding at batch 8 and, where the family has
    them, sliding windows shorter than the generated sequence."""
    model, unfused, _ = fused_pair(model_type)
    twins = attention_twins(model)
    assert len(twins) == layer_count(model)
    handed_back = []
    for twin in twins:
        twin._call_original = lambda args, kwargs, call=twin._call_original: handed_back.append(1) or call(args, kwargs)
    ids, mask = left_padded_prompts(batch)
    options = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                   cache_implementation=cache)
    try:
        with torch.no_grad():
            tokens = model.generate(ids, **options)
            expected = unfused.generate(ids, **options)
    finally:
        for twin in twins:
            del twin._call_original
    assert tokens.shape == expected.shape and tokens.shape[1] > PROMPT
    assert torch.equal(tokens, expected), (f"fused {tokens[:, PROMPT:].tolist()} != "
                                           f"unfused {expected[:, PROMPT:].tolist()}")
    assert not handed_back, f"{len(handed_back)} attention calls handed back to the original"


# ---- each twin computes its module's math (float64, no rounding to judge) ---------------

TWIN_CASES = [
    ("llama", ""),
    ("qwen3", ""),  # q/k RMSNorm per head, inside te_lab's rope
    ("gemma3_text", ""),  # the same with 1 + weight, a sliding-window layer
    ("olmo2", ""),  # q/k RMSNorm over the whole projection
    ("gpt_oss", "rotary: rotate_half_pair_tables"),  # attention sinks
    ("gemma2", ""),  # logit soft-capping
    ("cohere", "rotary: interleaved"),  # per-head LayerNorm q/k norms, called as they are
    ("glm4", "rotary: interleaved_rotate_half_tables"),  # partial rotary
    ("phi", ""),  # partial rotary, a `dense` output projection
    ("phi3", ""),  # one qkv_proj with grouped-query widths
    ("olmo", ""),
    ("starcoder2", ""),
    # Complex frequencies over interleaved pairs, then a weightless qk_norm (inside te_lab's rope).
    ("llama4_text", "rotary: interleaved_complex_tables"),
    # One query_key_value interleaved per key-value group / per head (partial rotary, and
    # Persimmon's per-head LayerNorm q/k norms).
    ("falcon_new_decoder", "q/k/v interleaved per key-value group"),
    ("gpt_neox", "q/k/v interleaved per head"),
    ("persimmon", "q/k/v interleaved per head"),
]


def decoder(model):
    """The decoder under the LM head: ``model``, GPT-NeoX's ``gpt_neox``, Falcon's ``transformer``."""
    return model.model if hasattr(model, "model") else model.base_model


def first_attention(model):
    """The first layer's attention (``self_attn``, GPT-NeoX's ``attention``, Falcon's
    ``self_attention``)."""
    base = decoder(model)
    layer = (base.layers if hasattr(base, "layers") else base.h)[0]
    return next(getattr(layer, name) for name in ("self_attn", "attention", "self_attention") if hasattr(layer, name))


def rotary_tables(model, attention, hidden, positions):
    """The model's (cos, sin) for ``attention``'s layer (Gemma 3 keeps one table per layer
    type), or its one complex tensor of frequencies (Llama 4)."""
    rotary = decoder(model).rotary_emb
    per_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_type = getattr(attention, "original", attention).layer_type if per_layer_type else None
    return rotary(hidden, positions, **({"layer_type": layer_type} if per_layer_type else {}))


@pytest.mark.parametrize("model_type, note", TWIN_CASES)
def test_attention_twin_computes_the_module_in_float64(model_type, note):
    """The rule's variant for the family, built on the first layer's attention of a float64
    model, against the module itself: output and the gradients of the input and of every
    parameter (sinks included) agree, on te_lab's fused backends."""
    from te_lab.surgery.attention_rules import match_attention
    from te_lab.surgery.rules import BuildOptions, Match

    model = build(model_type).double()
    module = first_attention(model)
    match = match_attention(module)
    assert isinstance(match, Match), match
    variant = next(v for v in match.variants if v.note == note)
    twin = variant.build(BuildOptions(backend=None, enabled_rules=frozenset({"attention", "rope", "rmsnorm"})))
    assert {"te_lab::attention", "te_lab::rope"} & set(twin.kernel_names())
    if model_type in ("qwen3", "gemma3_text", "llama4_text"):
        assert twin._norms_in_rope and "te_lab::rms_norm" not in twin.kernel_names()
    if model_type == "olmo2":
        assert "te_lab::rms_norm" in twin.kernel_names()
    hidden = torch.randn(2, 10, model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4)) * 3
    positions = torch.arange(10).expand(2, 10)
    tables = rotary_tables(model, module, hidden, positions)
    upstream = torch.randn(2, 10, model.config.hidden_size, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(5))
    parameters = [p for p in module.parameters() if p.requires_grad]

    def run(fn):
        x = hidden.clone().requires_grad_()
        out = fn(x, position_embeddings=tables, attention_mask=None)[0]
        return (out, *torch.autograd.grad((out * upstream).sum(), [x, *parameters]))

    # Scale-wise, at float32's tolerance: Hugging Face's norms and eager softmax round
    # through float32 even in a float64 model; a wrong twin misses by O(1).
    for got, want in zip(run(twin), run(module)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-9


def positions_of(tables, part: slice):
    """The rotary tables of some positions: (cos, sin) or one complex tensor."""
    return tuple(t[:, part] for t in tables) if isinstance(tables, tuple) else tables[:, part]


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "gpt_oss", "phi3", "llama4_text"])
def test_multi_token_calls_against_a_filled_cache_run_fused(model_type):
    """Chunked prefill: a second chunk of several tokens against the first chunk's cache
    (the mask the model builds, sliding windows and Llama 4's chunks included, and Llama
    4's temperature counting positions from the cache) and a direct call of a layer
    without a mask (SDPA's top-left causal) both run on the fused path and give the
    unfused numbers."""
    model, unfused, _ = fused_pair(model_type)
    twins = attention_twins(model)
    handed_back = []
    for twin in twins:
        twin._call_original = lambda args, kwargs, call=twin._call_original: handed_back.append(1) or call(args, kwargs)
    ids = torch.randint(3, 120, (2, 14), generator=torch.Generator().manual_seed(6))
    try:
        with torch.no_grad():
            logits = []
            for m in (model, unfused):
                cache = transformers.DynamicCache(config=m.config)
                m(input_ids=ids[:, :8], past_key_values=cache, use_cache=True)
                logits.append(m(input_ids=ids[:, 8:], past_key_values=cache, use_cache=True).logits)
            # The first layer's attention alone, 3 new tokens after 5 cached ones, no mask.
            outputs = []
            for m in (model, unfused):
                attention = m.model.layers[0].self_attn
                cache = transformers.DynamicCache(config=m.config)
                hidden = torch.randn(2, 8, m.config.hidden_size, generator=torch.Generator().manual_seed(7))
                tables = rotary_tables(m, attention, hidden, torch.arange(8).expand(2, 8))
                attention(hidden[:, :5], position_embeddings=positions_of(tables, slice(0, 5)), attention_mask=None,
                          past_key_values=cache)
                outputs.append(attention(hidden[:, 5:], position_embeddings=positions_of(tables, slice(5, None)),
                                         attention_mask=None, past_key_values=cache)[0])
    finally:
        for twin in twins:
            del twin._call_original
    scale = logits[1].abs().max()
    assert (logits[0] - logits[1]).abs().max() <= 1e-5 * scale + 1e-5
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-5 * outputs[1].abs().max() + 1e-5
    assert not handed_back, f"{len(handed_back)} attention calls handed back to the original"


# ---- Llama 4: complex frequencies + weightless qk_norm, and temperature-tuned no-RoPE layers ----

LLAMA4_ROPE_NOTE = "rotary: interleaved_complex_tables"
LLAMA4_NOPE_NOTE = "rotary: none; q temperature-tuned (floor_scale 4, attn_scale 0.1)"


def test_llama4_both_attention_layer_kinds_fuse_with_their_variant_named():
    """The RoPE layer rotates by complex frequencies and runs its weightless qk_norm inside
    te_lab's rope; the no-RoPE layer applies its temperature on q; both on the fused
    attention op, each row naming its variant (or, where the probe preferred them, the
    module's own norms / the reference rotation)."""
    model, _, report = fused_pair("llama4_text")
    rows = {row.path: row for row in report.rows if row.rule == "attention"}
    rope_row, nope_row = rows["model.layers.0.self_attn"], rows["model.layers.1.self_attn"]
    assert rope_row.status == "fused" and nope_row.status == "fused", (rope_row.reason, nope_row.reason)
    rope_twin, nope_twin = (model.get_submodule(path) for path in (rope_row.path, nope_row.path))

    own_norms, reference_rope = "q/k norms run as the module's own", "rotation on te_lab's reference math"
    notes = rope_row.variant.split("; ")
    assert notes[0] == LLAMA4_ROPE_NOTE and set(notes[1:]) <= {own_norms, reference_rope}, rope_row.variant
    assert rope_twin.rotary == "interleaved_complex_tables" and rope_twin.temperature is None
    assert rope_twin.qk_norms == ("qk_norm", "qk_norm") and rope_twin.qk_norm_scope == "head"
    assert rope_twin._norms_in_rope == (own_norms not in notes and reference_rope not in notes)
    assert {"te_lab::attention"} | ({"te_lab::rope"} if reference_rope not in notes else set()) \
        == set(rope_row.kernels) - {"te_lab::linear", "te_lab::rms_norm"}

    assert nope_row.variant == LLAMA4_NOPE_NOTE
    assert nope_twin.rotary == "none" and nope_twin.temperature == (4.0, 0.1) and nope_twin.qk_norms is None
    assert set(nope_row.kernels) - {"te_lab::linear"} == {"te_lab::attention"}


def test_llama4_no_rope_layer_twin_computes_the_temperature_in_float64():
    """The no-RoPE layer's twin against the module in float64, after 6 cached tokens (the
    temperature's positions come from the cache): output and every gradient agree."""
    from te_lab.surgery.attention_rules import match_attention
    from te_lab.surgery.rules import BuildOptions, Match

    model = build("llama4_text").double()
    module = model.model.layers[1].self_attn
    match = match_attention(module)
    assert isinstance(match, Match), match
    (variant,) = [v for v in match.variants if v.note == LLAMA4_NOPE_NOTE]
    twin = variant.build(BuildOptions(backend=None, enabled_rules=frozenset({"attention", "rope", "rmsnorm"})))
    hidden = torch.randn(2, 10, model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4)) * 3
    tables = rotary_tables(model, module, hidden, torch.arange(10).expand(2, 10))
    upstream = torch.randn(2, 4, model.config.hidden_size, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(5))
    parameters = [p for p in module.parameters() if p.requires_grad]

    def run(fn):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            fn(hidden[:, :6], position_embeddings=positions_of(tables, slice(0, 6)), attention_mask=None, cache=cache)
        x = hidden[:, 6:].clone().requires_grad_()
        out = fn(x, position_embeddings=positions_of(tables, slice(6, None)), attention_mask=None, cache=cache)[0]
        return (out, *torch.autograd.grad((out * upstream).sum(), [x, *parameters]))

    handed_back = []
    twin._call_original = lambda args, kwargs: handed_back.append(1)
    fused = run(twin)
    assert not handed_back
    for got, want in zip(fused, run(module)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-9


def _llama4_refused(report, path):
    (row,) = [row for row in report.rows if row.path == path]
    assert row.status == "skipped", f"{path} was fused: {row}"
    assert "from the float64 truth where the original's own error is" in row.reason, row.reason


@pytest.mark.parametrize("floor_scale", [4, 8192])
@pytest.mark.parametrize("wrong", ["no temperature", "attn_scale doubled", "floor dropped"])
def test_a_wrong_llama4_temperature_is_refused_by_the_probe(monkeypatch, wrong, floor_scale):
    """A twin whose temperature is missing or miscomputed is refused, also at Llama 4's real
    floor_scale (8192), where every position of a 16-token sample has temperature 1: the
    rule's stand-in cache puts the probe's positions across a multiple of floor_scale."""
    from te_lab.modules import FusedAttention

    model = build("llama4_text", floor_scale=floor_scale)
    original_init = FusedAttention.__init__

    def wrong_temperature(self, original, **options):
        original_init(self, original, **options)
        if self.temperature is not None and wrong != "floor dropped":
            self.temperature = None if wrong == "no temperature" else (self.temperature[0], 2 * self.temperature[1])

    monkeypatch.setattr(FusedAttention, "__init__", wrong_temperature)
    if wrong == "floor dropped":  # log1p((position + 1) / floor_scale): no floor
        def unfloored(self, q, named):
            floor_scale, attn_scale = self.temperature
            cache = self._cache(named)
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            positions = torch.arange(q.shape[-2], device=q.device) + past
            return (q * (torch.log1p((positions.float() + 1.0) / floor_scale) * attn_scale + 1.0).view(1, 1, -1, 1)
                    ).to(q.dtype)

        monkeypatch.setattr(FusedAttention, "_temperature_tuned", unfloored)
    report = fuse_attention_only(model)
    _llama4_refused(report, "model.layers.1.self_attn")
    assert next(row for row in report.rows if row.path == "model.layers.0.self_attn").status == "fused"


def fuse_attention_only(model):
    ids = sample_ids()
    return te_lab.fuse(model, sample={"input_ids": ids, "labels": ids}, only=["attention", "rope"], progress=False)


def test_a_llama4_twin_that_skips_the_qk_norm_is_refused_by_the_probe(monkeypatch):
    from te_lab.modules import FusedAttention

    model = build("llama4_text")
    original_init = FusedAttention.__init__

    def without_norm(self, original, **options):
        original_init(self, original, **{**options, "qk_norms": None, "qk_rms_norms": None})

    monkeypatch.setattr(FusedAttention, "__init__", without_norm)
    report = fuse_attention_only(model)
    _llama4_refused(report, "model.layers.0.self_attn")
    assert next(row for row in report.rows if row.path == "model.layers.1.self_attn").status == "fused"


# ---- fused projections that interleave q, k and v per head or per key-value group ----------

@pytest.mark.parametrize("model_type, layout, note", [
    ("falcon", "blocks", ""),  # one key-value head: [q heads | k | v]
    ("phi3", "blocks", ""),  # grouped-query widths, [q | k | v] blocks
    ("falcon_new_decoder", "grouped", "q/k/v interleaved per key-value group"),
    ("gpt_neox", "grouped", "q/k/v interleaved per head"),
    ("persimmon", "grouped", "q/k/v interleaved per head"),
])
def test_fused_qkv_projections_fuse_with_the_layout_the_probe_kept(model_type, layout, note):
    """The layout of one fused q/k/v projection is found by the probe (each candidate split
    tried), not read off the class or its attributes; the row names it where it is not
    [q | k | v] blocks."""
    model, _, report = fused_pair(model_type)
    rows = [row for row in report.rows if row.rule == "attention"]
    assert len(rows) == layer_count(model)
    for row in rows:
        assert row.status == "fused", row.reason
        assert model.get_submodule(row.path).qkv_layout == layout
        assert (note in row.variant.split("; ")) if note else "interleaved per" not in row.variant, row.variant


@pytest.mark.parametrize("model_type, wrong_layout", [("gpt_neox", "blocks"), ("falcon_new_decoder", "blocks"),
                                                      ("phi3", "grouped")])
def test_a_twin_splitting_the_fused_projection_wrongly_is_refused_by_the_probe(monkeypatch, model_type,
                                                                                wrong_layout):
    """A twin that reads an interleaved projection as [q | k | v] blocks (or blocks as
    interleaved per group), whatever layout the rule asked for, misses the float64 truth in
    every rotation and is refused."""
    from te_lab.modules import FusedAttention

    model = build(model_type)
    original_init = FusedAttention.__init__

    def wrong_split(self, original, **options):
        original_init(self, original, **{**options, "qkv_layout": wrong_layout})

    monkeypatch.setattr(FusedAttention, "__init__", wrong_split)
    report = fuse_attention_only(model)
    rows = [row for row in report.rows if row.rule == "attention"]
    assert len(rows) == layer_count(model)
    for row in rows:
        assert row.status == "skipped", f"{row.path} was fused: {row}"
        assert "from the float64 truth where the original's own error is" in row.reason, row.reason


def test_falcon_alibi_stays_refused_with_its_reason():
    model = build("falcon", alibi=True)
    report = fuse_attention_only(model)
    rows = [row for row in report.rows if row.rule == "attention"]
    assert len(rows) == layer_count(model)
    for row in rows:
        assert row.status == "skipped" and "ALiBi position biases (config.alibi) are not covered" in row.reason
