"""The fusion-opportunity finder (te_lab.opportunities) and compiled regions (fuse(regions=...)).

- On hand-made timelines: chains split where they should (a GEMM, a te_lab op, another
  module or phase), views neither join nor break them, and the fused-bytes formula.
- On a model with two custom layers no rule knows (a learnable-scale norm and a gated
  activation written as a chain of element-wise ops) beside standard ones, fed real-like
  activations (outlier channels of ~1e3): the custom layers' chains rank above the rest;
  fused as compiled regions they are verified against the float64 truth and each row's
  realized gain is within 30% of its estimate or its note says why.
- Compiled regions refused with their reason and the model left as it was: a forward with
  data-dependent control flow, a torch.compile backend that changes numbers, a dropout in
  training mode; bad arguments raise naming the argument.
- The families of tests/test_family_coverage.py: the finder raises nothing, its rows add up,
  and what it accounts for of the time outside GEMMs and attention does not exceed that
  time by more than 10%.
"""

import pytest
import torch
from torch import nn

import te_lab
from te_lab.modules.compiled_region import CompiledRegion
from te_lab.profiler.opportunities import _chains, fused_bytes, pattern_of
from te_lab.profiler.opportunity_table import Accounting, Opportunities, Opportunity
from te_lab.profiler.report import TimelineEvent

HIDDEN = 64


class ScaledNorm(nn.Module):
    """A research norm no rule knows: x / rms(x) * g * (1 + s)."""

    def __init__(self, hidden):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.s = nn.Parameter(torch.tensor([0.1]))

    def forward(self, x):
        r = x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        return x / r * self.g * (1 + self.s)


class GatedTanh(nn.Module):
    """A gated activation as a chain of element-wise ops."""

    def forward(self, x):
        a, b = x.chunk(2, -1)
        return a * torch.sigmoid(1.702 * a) * torch.tanh(b) + 0.1 * b


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = ScaledNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = GatedTanh()
        self.down = nn.Linear(2 * hidden, hidden)
        self.out_norm = nn.LayerNorm(hidden)

    def forward(self, x):
        return self.out_norm(x + self.down(self.act(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, hidden=HIDDEN, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def real_like_input(batch=4, seq=32):
    """Activations like a pretrained model's: a few outlier channels of ~1e3."""
    x = torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(0))
    x[..., :3] *= 1e3
    return x


def net():
    torch.manual_seed(0)
    return Net().eval()


# ---- hand-made timelines ------------------------------------------------------------------


def event(name, start, duration, path="m.act", phase="forward", shapes=((4, 8),), sizes=(128,), read=128,
          written=128, lane="thread 1"):
    return TimelineEvent("eager", name, start, duration, lane, path, phase, [list(s) for s in shapes],
                         read, written, list(sizes))


def test_chains_split_at_compute_te_lab_ops_and_module_or_phase_changes():
    timeline = [
        event("aten::mul", 0, 2), event("aten::view", 2, 1), event("aten::add", 3, 2),  # chain 1 (view skipped)
        event("aten::mm", 5, 10),                                                        # compute: ends it
        event("aten::sigmoid", 15, 2),                                                   # single op
        event("te_lab::rms_norm", 17, 3),                                                # te_lab op: ends it
        event("aten::exp", 20, 2), event("aten::mul", 22, 2),                            # chain 2
        event("aten::mul", 24, 2, path="m.norm"), event("aten::sub", 26, 2, path="m.norm"),  # chain 3: other module
        event("aten::mul", 28, 2, path="m.norm", phase="backward"),                      # single: other phase
        event("aten::add", 30, 2, path=""),                                              # outside modules
    ]
    accounting = Accounting()
    chains = _chains(timeline, accounting, event_cost_us=0.0)
    assert [[e.name for e in chain] for chain in chains] == [
        ["aten::mul", "aten::add"], ["aten::exp", "aten::mul"], ["aten::mul", "aten::sub"]]
    assert accounting.chain_ops_ms == pytest.approx(12e-3)
    assert accounting.single_ops_ms == pytest.approx(4e-3)
    assert accounting.compute_ms == pytest.approx(10e-3)
    assert accounting.te_lab_ops_ms == pytest.approx(3e-3)
    assert accounting.views_ms == pytest.approx(1e-3)
    assert accounting.outside_modules_ms == pytest.approx(2e-3)


def test_fused_bytes_count_the_chains_external_inputs_and_its_last_output():
    x, weight = (4, 8), (8,)
    chain = [
        event("aten::pow", 0, 1, shapes=(x,), sizes=(128,), written=128),
        event("aten::mul", 1, 1, shapes=(x, weight), sizes=(128, 32), written=128),  # running value + a weight
        event("aten::add", 2, 1, shapes=(x, x), sizes=(128, 128), written=128),      # same shape: taken as running
    ]
    assert fused_bytes(chain) == 128 + 32 + 128


def test_layer_indices_become_a_pattern():
    assert pattern_of("model.layers.7.mlp.act") == "model.layers.*.mlp.act"
    assert pattern_of("blocks.0") == "blocks.*"
    assert pattern_of("3.norm") == "*.norm"
    assert pattern_of("model.h2o") == "model.h2o"


def test_realized_gains_are_shared_by_estimate_and_explained():
    rows = [Opportunity("eager", "layers.*.act", "GatedTanh", "forward", ["aten::mul", "aten::tanh"], 2, 4.0, 4,
                        100, 10, 1.0, 100.0, paths=["layers.0.act", "layers.1.act"]),
            Opportunity("eager", "layers.*.act", "GatedTanh", "forward", ["aten::exp", "aten::add"], 2, 2.0, 4,
                        100, 10, 1.0, 100.0, paths=["layers.1.act", "layers.0.act"])]
    before = Opportunities("eager", rows, module_ms={"layers.0.act": [5.0, 0.0], "layers.1.act": [5.0, 0.0]})

    def after(first, second):
        return Opportunities("fused", [], module_ms={"layers.0.act": [first, 0.0], "layers.1.act": [second, 0.0]})

    realized = before.realized(after(3.0, 2.5))
    # 4.5 ms saved over both modules, shared 3:1 by the estimated gains (3 and 1 ms)
    assert [row.realized_gain_ms for row in realized.rows] == pytest.approx([3.375, 1.125])
    assert all("within 30%" in row.note for row in realized.rows)
    more = before.realized(after(0.5, 0.5)).rows[0]
    assert more.realized_gain_ms == pytest.approx(6.75) and "saved more than the chain's time" in more.note
    less = before.realized(after(4.0, 4.0)).rows[0]
    assert less.realized_gain_ms == pytest.approx(1.5) and "the bound costs only the bytes" in less.note
    slower = before.realized(after(6.0, 5.0)).rows[0]
    assert slower.realized_gain_ms == pytest.approx(-0.75) and "no faster" in slower.note
    assert before.rows[0].realized_gain_ms is None  # the original is left as it was
    unmeasured = before.realized(Opportunities("fused", []))
    assert all(row.realized_gain_ms is None and "not measured" in row.note for row in unmeasured.rows)
    assert Opportunities.from_dict(realized.to_dict()) == realized


# ---- the finder on a model --------------------------------------------------------------


@pytest.fixture(scope="module")
def found():
    return te_lab.opportunities(net(), real_like_input(), steps=2)


def test_the_custom_layers_chains_rank_above_the_rest(found):
    assert found.mode == "eager" and found.rows
    custom = [row for row in found.rows if row.module_type in ("ScaledNorm", "GatedTanh")]
    assert {(row.module, row.phase) for row in custom} == {
        (f"layers.*.{name}", phase) for name in ("norm", "act") for phase in ("forward", "backward")}
    ranks = [found.rows.index(row) for row in custom]
    others = [index for index, row in enumerate(found.rows) if row not in custom]
    assert max(ranks) < min(others, default=len(found.rows))
    for row in custom:
        assert row.instances == 2 and set(row.paths) == {f"layers.{i}.{row.module.split('.')[-1]}" for i in range(2)}
        assert row.launches == row.instances * len(row.pattern)
        assert 0 < row.bytes_fused < row.bytes_unfused
        assert row.fused_by == ""  # no te_lab rule knows these layers
        assert 0 <= row.estimated_gain_ms <= row.time_ms
    forward_act = next(row for row in custom if row.module == "layers.*.act" and row.phase == "forward")
    assert {"aten::sigmoid", "aten::tanh"} <= set(forward_act.pattern) and "aten::chunk" not in forward_act.pattern


def test_the_rows_and_the_accounting_add_up(found):
    assert found.chains_ms == pytest.approx(sum(row.time_ms for row in found.rows))
    a = found.accounting
    parts = a.chain_ops_ms + a.single_ops_ms + a.te_lab_ops_ms + a.outside_modules_ms + a.views_ms
    assert a.compute_ms > 0 and a.chain_ops_ms > 0
    assert parts <= 1.1 * a.non_compute_ms
    assert "fusion opportunities (eager step" in found.summary() and "layers.*.act" in found.summary()
    assert Opportunities.from_dict(found.to_dict()) == found


def test_compiled_regions_are_verified_and_realize_their_estimate_or_say_why(found):
    model, x = net(), real_like_input()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    targets = [row for row in found.rows if row.module_type in ("ScaledNorm", "GatedTanh")]
    report = te_lab.fuse(model, sample=x, regions=targets, progress=False)
    regions = [row for row in report.rows if row.rule == "compiled_region"]
    assert {row.path for row in regions} == {f"layers.{i}.{name}" for i in range(2) for name in ("norm", "act")}
    for row in regions:
        assert row.truth == "float64" and row.time_original_ms > 0 and row.time_fused_ms > 0
        assert row.status in ("fused", "kept-original-slower")
    fused = [row.path for row in regions if row.status == "fused"]
    for path in fused:
        assert isinstance(model.get_submodule(path), CompiledRegion)
    assert set(model.state_dict()) == set(state)
    with torch.no_grad():
        reference = net()(x)
        assert torch.allclose(model(x), reference, rtol=1e-4, atol=1e-3 * reference.abs().max().item())
    after = te_lab.opportunities(model, x, steps=2, against=found)
    realized = found.realized(after)
    for row in realized.rows:
        if set(row.paths) <= set(fused):
            assert row.realized_gain_ms is not None and row.note.startswith("realized")
            assert "within 30%" in row.note or ": " in row.note  # else the note says why
    if len(fused) == len(regions):
        assert not [row for row in after.rows if row.module_type in ("ScaledNorm", "GatedTanh")]
    te_lab.unfuse(model)
    assert not any(isinstance(module, CompiledRegion) for module in model.modules())


def test_a_fully_fused_llama_leaves_rows_that_name_what_covers_them():
    transformers = pytest.importorskip("transformers")
    from te_lab.models.real_like import make_real_like
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = make_real_like(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    eager = te_lab.opportunities(model, sample, steps=1)
    assert any(row.fused_by.startswith("rule rmsnorm matches") for row in eager.rows)
    te_lab.fuse(model, sample=sample, progress=False)
    left = te_lab.opportunities(model, sample, steps=1)
    assert left.mode == "fused"
    fusing = ("rule rmsnorm matches", "rule gated_mlp matches", "rule attention matches", "rule lm_head_loss matches")
    assert not any(row.fused_by.startswith(fusing) for row in left.rows)  # what the rules fuse is fused
    assert any(row.fused_by.startswith("inside te_lab's fused") for row in left.rows)


# ---- compiled regions refused ------------------------------------------------------------


class Branchy(nn.Module):
    """Data-dependent control flow: Dynamo cannot capture it as one graph."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2 + 1
        return x - 1


class WithDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(x * torch.sigmoid(x))


class Holder(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.proj(x))


def perturbing_backend(graph_module, example_inputs):
    """A torch.compile backend that gets the numbers wrong (by 1%)."""
    def run(*args):
        outputs = graph_module(*args)
        return type(outputs)(o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                             for o in outputs) if isinstance(outputs, (tuple, list)) else outputs * 1.01
    return run


@pytest.mark.parametrize("inner, options, reason", [
    (Branchy(), None, "probe raised"),
    (GatedTanh(), {"backend": perturbing_backend}, "float64"),
])
def test_a_region_that_cannot_compile_or_changes_numbers_is_refused(inner, options, reason):
    torch.manual_seed(0)
    model = Holder(inner)
    x = real_like_input(2, 8)
    if isinstance(inner, GatedTanh):
        model.proj = nn.Linear(HIDDEN, 2 * HIDDEN)
    report = te_lab.fuse(model, sample=x, regions=["inner"], region_options=options, progress=False)
    row = next(row for row in report.rows if row.path == "inner")
    assert row.status == "skipped" and row.rule == "compiled_region"
    assert reason in row.reason or (reason == "float64" and "error" in row.reason), row.reason
    assert model.inner is inner


def test_a_region_with_dropout_in_training_mode_is_refused():
    model = Holder(WithDropout()).train()
    report = te_lab.fuse(model, sample=real_like_input(2, 8), regions=[WithDropout], progress=False)
    row = next(row for row in report.rows if row.path == "inner")
    assert row.status == "skipped" and "dropout in training mode" in row.reason and "p=0.1" in row.reason
    assert isinstance(model.inner, WithDropout)


def test_region_arguments_are_checked():
    model, x = Holder(GatedTanh()), real_like_input(2, 8)
    with pytest.raises(ValueError, match="sample="):
        te_lab.fuse(model, regions=["inner"])
    with pytest.raises(ValueError, match="regions entry 'nothing.here' names no module"):
        te_lab.fuse(model, sample=x, regions="nothing.here")
    with pytest.raises(TypeError, match="regions entries must be"):
        te_lab.fuse(model, sample=x, regions=[3])
    with pytest.raises(ValueError, match="region_options: unknown key.*'fullgraph'"):
        te_lab.fuse(model, sample=x, regions=["inner"], region_options={"fullgraph": False})
    with pytest.raises(ValueError, match="region_options is given without regions"):
        te_lab.fuse(model, sample=x, region_options={"mode": "default"})
    assert isinstance(model.inner, GatedTanh)


def test_opportunities_arguments_are_checked():
    model, x = net(), real_like_input(2, 8)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        te_lab.opportunities(lambda t: t, x)
    with pytest.raises(ValueError, match="sample is required"):
        te_lab.opportunities(model, None)
    with pytest.raises(ValueError, match="mode must be 'eager', 'fused' or None, got 'both'"):
        te_lab.opportunities(model, x, mode="both")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        te_lab.opportunities(model, x, steps=0)
    with pytest.raises(TypeError, match="against must be an earlier"):
        te_lab.opportunities(model, x, against=[])
    with pytest.raises(ValueError, match="backward=False"):  # nothing to differentiate: frozen, integer input
        te_lab.opportunities(nn.Embedding(10, 8).requires_grad_(False), torch.arange(4))


# ---- the families of the coverage test ----------------------------------------------------


def _family_types():
    from test_family_coverage import FAMILIES
    return sorted(FAMILIES)


@pytest.mark.parametrize("model_type", _family_types())
def test_the_finder_runs_on_every_family_and_its_totals_add_up(model_type):
    from test_family_coverage import build, sample_ids
    model = build(model_type)
    ids = sample_ids()
    found = te_lab.opportunities(model, {"input_ids": ids, "labels": ids}, steps=1, warmup=1)
    a = found.accounting
    assert a.step_ms > 0 and a.compute_ms > 0
    assert a.chain_ops_ms + a.single_ops_ms + a.te_lab_ops_ms + a.outside_modules_ms + a.views_ms \
        <= 1.1 * a.non_compute_ms
    for row in found.rows:
        assert row.launches == row.instances * len(row.pattern) and row.instances >= 1
        assert len(row.pattern) >= 2 and row.paths
        assert row.bytes_fused <= row.bytes_unfused


def test_on_a_gpu_module_times_are_the_profiled_kernel_times_whole():
    """Host clocks time a GPU's launches, not its kernels: there the rows' modules take
    their profiled regions' times, the nested regions added back."""
    from types import SimpleNamespace

    from te_lab.profiler.opportunities import profiled_module_ms
    from te_lab.profiler.report import Region

    def run(scale):
        return SimpleNamespace(trace=SimpleNamespace(regions={
            "layers.0": Region(1.0 * scale, 2.0 * scale), "layers.0.act": Region(0.5 * scale, 1.0 * scale),
            "layers.1": Region(3.0 * scale, 4.0 * scale)}))

    times = profiled_module_ms([run(1), run(3), run(2)], ["layers.0", "layers.0.act", "(model)"])
    assert times == {"layers.0": [3.0, 6.0], "layers.0.act": [1.0, 2.0], "(model)": [9.0, 14.0]}
