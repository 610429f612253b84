"""Expert load in live profiles (issue 26, item 3): profiling a fused Qwen3-MoE records the
tokens routed to each expert of every fused MoE block in one fused step's forward (the
last warm-up step's), and
the report carries them (object, JSON, summary) with each layer's imbalance and the
overall one; the dashboard draws them as a heatmap layer x expert, only where the report
has them; the static export adds the chart."""

import pytest
import torch

import te_lab
from te_lab.modules import FusedMoE, expert_load, record_expert_load
from te_lab.profiler import ProfileReport, profile_statement
from te_lab.profiler.expert_load import ExpertLoad, LayerLoad

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, EXPERTS, TOP_K = 128, 2, 12, 8, 2


def moe_model():
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, moe_intermediate_size=32, norm_topk_prob=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def routed_by_the_router(model, ids) -> dict:
    """Layer path -> tokens per expert of one forward, read off each router's own top-k
    indices (a hook on the router), not through te_lab's counting."""
    routed, handles = {}, []
    for path, block in model.named_modules():
        if isinstance(block, FusedMoE):
            handles.append(block.gate.register_forward_hook(
                lambda _m, _a, output, path=path: routed.__setitem__(path, output[2].detach().reshape(-1))))
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return {path: torch.bincount(indices, minlength=EXPERTS).tolist() for path, indices in routed.items()}


@pytest.fixture(scope="module")
def fused():
    model = moe_model()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    te_lab.fuse(model, sample={"input_ids": ids}, only=["moe"], progress=False)
    return model, ids


@pytest.fixture(scope="module")
def report(fused):
    model, ids = fused
    return te_lab.profile(model, {"input_ids": ids, "labels": ids}, steps=2, warmup=1)


def test_the_profile_records_one_fused_steps_tokens_per_expert(fused, report):
    model, ids = fused
    expected = routed_by_the_router(model, ids)
    load = report.expert_load
    assert [layer.layer for layer in load.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"] == list(expected)
    for layer in load.layers:
        # one fused step: every token counted once per expert it went to, neither more steps nor the backward
        assert layer.tokens_per_expert == expected[layer.layer]
        assert layer.routed == sum(layer.tokens_per_expert) == BATCH * SEQ * TOP_K
        assert layer.imbalance == pytest.approx(max(layer.tokens_per_expert) / (BATCH * SEQ * TOP_K / EXPERTS))
    assert load.imbalance == pytest.approx(sum(max(layer.tokens_per_expert) for layer in load.layers)
                                           / (2 * BATCH * SEQ * TOP_K / EXPERTS))
    assert "busiest expert's tokens / the mean" in report.formulas["expert_load"]
    assert expert_load(model) == {}  # the profile leaves no counts behind


def test_the_report_carries_the_load_in_json_and_in_its_summary(report):
    loaded = ProfileReport.from_json(report.to_json())
    assert loaded.expert_load == report.expert_load
    assert loaded.to_dict()["expert_load"]["layers"][0]["tokens_per_expert"] == \
        report.expert_load.layers[0].tokens_per_expert
    summary = report.summary()
    layer = report.expert_load.layers[1]
    busiest = max(range(EXPERTS), key=layer.tokens_per_expert.__getitem__)
    row = next(line for line in summary.splitlines() if line.startswith("model.layers.1.mlp ") and "tokens)" in line)
    assert row.split() == ["model.layers.1.mlp", str(EXPERTS), str(BATCH * SEQ * TOP_K), str(busiest),
                           f"({max(layer.tokens_per_expert)}", "tokens)", f"{layer.imbalance:.2f}x"]
    overall = next(line for line in summary.splitlines() if line.startswith("overall"))
    assert overall.split() == ["overall", f"{report.expert_load.imbalance:.2f}x"]


def test_a_statement_profile_records_it_and_a_users_counts_survive(fused):
    model, ids = fused
    with record_expert_load(model):
        with torch.no_grad():
            model(input_ids=ids)
    before = expert_load(model)
    report = profile_statement(lambda: model(input_ids=ids, labels=ids).loss, {"model": model}, steps=1, warmup=1)
    assert [layer.tokens_per_expert for layer in report.expert_load.layers] == list(before.values())
    assert expert_load(model) == before


def test_without_a_warm_up_step_there_is_no_load_and_the_notes_say_why(fused):
    model, ids = fused
    report = te_lab.profile(model, {"input_ids": ids}, steps=1, warmup=0)
    assert report.expert_load is None
    notes = "\n".join(report.notes)
    assert "expert load: not recorded: the fused mode's last warm-up step counts it, and warmup=0" in notes


def test_imbalance_per_layer_and_overall():
    load = ExpertLoad.from_counts({"a": [4, 4, 4, 4], "b": [8, 0, 0, 0]})
    assert load.layers == [LayerLoad("a", [4, 4, 4, 4], 1.0), LayerLoad("b", [8, 0, 0, 0], 4.0)]
    assert load.imbalance == (4 + 8) / (4 + 2)  # the busiest experts summed over the layers' means summed


def test_the_dashboard_draws_the_heatmap_only_where_the_report_has_load(report):
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from te_lab.widgets import Dashboard
    from te_lab.widgets.plots import PLOTLY_MIME

    dashboard = Dashboard(report)
    assert dashboard.tabs.titles[-1] == "Expert load" and len(dashboard.tabs.children) == 6
    (heatmap,) = dashboard.expert_load.outputs[0]["data"][PLOTLY_MIME]["data"]
    assert heatmap["type"] == "heatmap"
    assert heatmap["z"] == [layer.tokens_per_expert for layer in report.expert_load.layers]
    assert heatmap["y"] == [f"{layer.layer} ({layer.imbalance:.2f}x)" for layer in report.expert_load.layers]
    title = dashboard.expert_load.outputs[0]["data"][PLOTLY_MIME]["layout"]["title"]["text"]
    assert f"imbalance {report.expert_load.imbalance:.2f}x overall" in title

    without = ProfileReport.from_dict({**report.to_dict(), "expert_load": None})
    dashboard.update(without)  # a report without load: the tab goes, its chart holds nothing
    assert "Expert load" not in dashboard.tabs.titles and len(dashboard.tabs.children) == 5
    assert dashboard.expert_load.outputs == ()


def test_the_static_export_adds_the_heatmap(report, tmp_path):
    pytest.importorskip("plotly")
    text = te_lab.to_html(report, tmp_path / "moe.html").read_text(encoding="utf-8")
    assert text.count('class="plotly-graph-div"') == 6 + 2 and "Expert load" in text and '"heatmap"' in text
