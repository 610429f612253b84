"""The `moe` rule on the MoE families of transformers: Mixtral, Qwen3-MoE, OLMoE, gpt-oss,
DeepSeek-V3 and Llama 4, each a tiny model built from its config (2 layers, a few experts) with
activations at a real checkpoint's scale (tests/real_like.py). Every MoE block is fused,
the whole model's logits and every gradient stay within tolerance, the router's logits
and the auxiliary load-balancing loss are unchanged, the expert load is counted, and
near misses are skipped with their reason."""

import copy

import pytest
import torch
from torch import nn

import te_lab
from conftest import DEVICE, TOLERANCES
from te_lab.models.real_like import largest_activation, make_real_like
from te_lab.modules import FusedMoE, expert_load, imbalance, record_expert_load

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 128, 2, 12
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      head_dim=16),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]),
    # first_k_dense_replace=1: layer 0 has a dense MLP, layer 1 the MoE block with a shared expert
    # and group-limited routing (2 groups, the best 1 of them).
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    # A router returning (sigmoid top-k scores, logits), the scores scaling each expert's
    # input; a shared expert; the block returns (out [tokens, hidden], router logits).
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                        intermediate_size_mlp=128, pad_token_id=0, bos_token_id=1, eos_token_id=VOCAB - 1),
}
# Families whose causal LM adds the router's auxiliary loss under output_router_logits=True.
AUX_LOSS = ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"]


def build(arch, **overrides):
    config = transformers.AutoConfig.for_model(arch, **{**COMMON, **FAMILIES[arch], **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().to(DEVICE)
    return make_real_like(model)


def token_ids(seed=1):
    return torch.randint(0, VOCAB - 2, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def moe_blocks(model):
    return {path: module for path, module in model.named_modules() if hasattr(module, "experts")}


def fused_pair(arch, **overrides):
    """(fused model, unfused copy, report, ids): only the MoE blocks are fused."""
    model = build(arch, **overrides)
    reference = copy.deepcopy(model)
    ids = token_ids()
    report = te_lab.fuse(model, sample={"input_ids": ids}, only=["moe"], progress=False)
    return model, reference, report, ids


def assert_normwise(actual, expected, name="", rtol=TOLERANCES[torch.float32]["rtol"]):
    tolerance = TOLERANCES[torch.float32]
    error = float((actual.detach().double() - expected.detach().double()).abs().max())
    allowed = tolerance["atol"] + rtol * float(expected.detach().double().abs().max())
    assert error <= allowed, (name, error, allowed)


def assert_same_grads(model, reference):
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys() and grads
    for name, grad in grads.items():
        # 1e-4 (docs/design.md): each weight gradient sums over every token, through the whole
        # model's backward at activations of ~1e3, where the experts' sums in another order
        # leave float32 rounding of ~1e-5 of the largest value (measured up to 1.1e-5).
        assert_normwise(grad, expected[name], name, rtol=1e-4)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_every_moe_block_fuses_and_the_model_matches_unfused(arch):
    model, reference, report, ids = fused_pair(arch)
    blocks = moe_blocks(reference)
    assert blocks
    rows = {row.path: row for row in report.rows}
    for path in blocks:
        assert rows[path].status == "fused" and rows[path].rule == "moe", (path, rows[path].reason)
        assert isinstance(model.get_submodule(path), FusedMoE)
    out, expected = model(input_ids=ids), reference(input_ids=ids)
    assert largest_activation(reference, {"input_ids": ids}) > 500  # real-like scale, not unit-scale noise
    assert_normwise(out.logits, expected.logits, "logits")
    upstream = torch.randn(expected.logits.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    (out.logits * upstream).sum().backward()
    (expected.logits * upstream).sum().backward()
    assert_same_grads(model, reference)


@pytest.mark.parametrize("arch", AUX_LOSS)
def test_router_logits_and_the_auxiliary_loss_are_unchanged(arch):
    model, reference, report, ids = fused_pair(arch)
    assert report.fused
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    expected = reference(input_ids=ids, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == len(expected.router_logits) == len(moe_blocks(reference))
    for got, want in zip(out.router_logits, expected.router_logits):
        assert_normwise(got, want, "router_logits")
    assert float(expected.aux_loss) > 0
    assert_normwise(out.aux_loss, expected.aux_loss, "aux_loss")
    assert_normwise(out.loss, expected.loss, "loss")
    out.loss.backward()
    expected.loss.backward()
    assert_same_grads(model, reference)


def test_expert_load_counts_the_tokens_each_expert_receives():
    model, _, _, ids = fused_pair("qwen3_moe")
    routed = {}
    for path, block in moe_blocks(model).items():
        block.gate.register_forward_hook(lambda _m, _a, output, path=path: routed.setdefault(path, []).append(
            output[2].detach()))
    with pytest.raises(ValueError, match="no fused MoE block"):
        record_expert_load(build("qwen3_moe")).__enter__()
    model(input_ids=ids)  # not recording: nothing counted
    assert expert_load(model) == {}
    routed.clear()
    with record_expert_load(model):
        model(input_ids=ids)
        model(input_ids=token_ids(seed=3))
    model(input_ids=ids)  # after the block: counting stopped
    load = expert_load(model)
    assert set(load) == set(moe_blocks(model)) == set(routed)
    for path, counts in load.items():
        expected = torch.bincount(torch.cat([i.reshape(-1) for i in routed[path][:2]]), minlength=8)
        assert counts == expected.tolist()
        assert sum(counts) == 2 * BATCH * SEQ * 2  # two calls, top-2
        assert imbalance(counts) == pytest.approx(max(counts) / (sum(counts) / 8))
    assert imbalance([4, 4, 4, 4]) == 1.0 and imbalance([8, 0, 0, 0]) == 4.0
    with pytest.raises(ValueError, match="at least one routed token"):
        imbalance([0, 0])


def test_hooks_on_the_router_keep_firing_after_the_swap():
    model = build("mixtral")
    calls = []
    for block in moe_blocks(model).values():
        block.gate.register_forward_hook(lambda *_: calls.append(1))
    report = te_lab.fuse(model, sample={"input_ids": token_ids()}, only=["moe"], progress=False)
    assert {row.status for row in report.rows} == {"fused"}
    calls.clear()
    model(input_ids=token_ids())
    assert len(calls) == 2


def test_near_misses_are_skipped_with_their_reason():
    # Qwen2-MoE gates its shared expert with a sigmoid of its own projection.
    config = transformers.AutoConfig.for_model("qwen2_moe", **{**COMMON, "num_experts": 4, "num_experts_per_tok": 2,
                                                               "moe_intermediate_size": 32,
                                                               "shared_expert_intermediate_size": 32})
    report = te_lab.fuse(transformers.AutoModelForCausalLM.from_config(config), only=["moe"], progress=False)
    reasons = {row.reason for row in report.rows if row.rule == "moe"}
    assert len(reasons) == 1 and "shared_expert_gate" in reasons.pop()
    report = te_lab.fuse(build("mixtral", hidden_act="relu"), only=["moe"], progress=False)
    assert {row.status for row in report.rows} == {"skipped"}
    assert all("expert activation ReLU" in row.reason for row in report.rows)


class _ListedExperts(nn.Module):
    """An older MoE layout: a router Linear and a ModuleList of per-expert gated MLPs."""

    def __init__(self, hidden=16, width=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(hidden, width), "w2": nn.Linear(width, hidden)})
                                     for _ in range(experts))

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(1, -1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            mask = (chosen == index).to(x.dtype) * weights
            out = out + mask * expert["w2"](torch.relu(expert["w1"](x)))
        return out


def test_experts_in_a_module_list_are_skipped_with_the_reason():
    model = nn.Sequential(_ListedExperts())
    report = te_lab.fuse(model, sample=(torch.randn(2, 5, 16),), only=["moe"], progress=False)
    (row,) = [row for row in report.rows if row.rule == "moe"]
    assert row.status == "skipped" and "ModuleList of per-expert modules" in row.reason


class _ScaledMoE(nn.Module):
    """A Mixtral block that scales its output: it looks like one, computes something else."""

    def __init__(self, block):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts

    def forward(self, hidden_states):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, weights, indices = self.gate(x)
        return 1.5 * self.experts(x, indices, weights).view(hidden_states.shape)


def test_the_probe_refuses_a_block_that_computes_something_else():
    model = build("mixtral")
    layer = model.model.layers[0]
    layer.mlp = _ScaledMoE(layer.mlp)
    report = te_lab.fuse(model, sample={"input_ids": token_ids()}, only=["moe"], progress=False)
    rows = {row.path: row for row in report.rows}
    assert rows["model.layers.1.mlp"].status == "fused"
    assert rows["model.layers.0.mlp"].status == "skipped"
    assert "differs from the original's" in rows["model.layers.0.mlp"].reason


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_bf16_models_and_autocast_regions_fuse_every_moe_block(arch):
    """Expert outputs that cancel leave bf16 rounding far above the bf16 tolerance of the
    small sum: the twin computes as Hugging Face's experts do (activation op by op in bf16,
    each weighted output in the dtype of y * weight; under autocast in the weights' dtype),
    so the element-wise probe passes."""
    ids = token_ids()
    for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
        model = build(arch).to(dtype)
        reference = copy.deepcopy(model)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            report = te_lab.fuse(model, sample={"input_ids": ids}, only=["moe"], progress=False)
            assert {row.status for row in report.rows} == {"fused"}, str(report)
            out, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_scores_scale_each_experts_input_and_the_block_returns_the_router_logits(top_k):
    model, reference, report, _ = fused_pair("llama4_text", num_experts_per_tok=top_k)
    blocks = moe_blocks(reference)
    rows = {row.path: row for row in report.rows}
    x = torch.randn(2, 5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for path, original in blocks.items():
        assert "scores scale the inputs, returns router logits" in rows[path].variant
        twin = model.get_submodule(path)
        assert (twin.router_output, twin.top_k, twin.scales_input, twin.flat_output) == ("dense_scores", top_k, True,
                                                                                          True)
        inputs = [x.clone().requires_grad_() for _ in range(2)]
        (out, logits), (expected, expected_logits) = twin(inputs[0]), original(inputs[1])
        assert out.shape == expected.shape == (10, COMMON["hidden_size"])
        assert torch.equal(logits, expected_logits)
        assert_normwise(out, expected, path)
        # Scores well below 1: scaling the experts' outputs instead would be another function.
        with torch.no_grad():
            scores = original.router(x.reshape(10, -1))[1].topk(top_k, dim=-1).values.sigmoid()
        assert float(scores.min()) < 0.9
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        names = [name for name, _ in original.named_parameters()]
        assert names == [name for name, _ in twin.named_parameters()]
        grads = [torch.autograd.grad((y * upstream).sum(), [i, *module.parameters()]) for y, i, module in
                 ((out, inputs[0], twin), (expected, inputs[1], original))]
        for name, got, want in zip(["x", *names], *grads):
            assert_normwise(got, want, f"{path}: grad of {name}", rtol=1e-4)
