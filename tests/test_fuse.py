"""te_lab.fuse / unfuse / unfused on te_lab's demo models and on small hand-made modules:
what gets swapped, that the swapped model computes what the original did (outputs,
losses, every gradient, 30 training steps), that the swap is invisible to state dicts
and optimizers, that probing leaves no trace, and that mistakes get clear errors."""

import copy

import pytest
import torch
from torch import nn

import te_lab
from conftest import TOLERANCES, assert_close
from te_lab import models
from te_lab.modules import FusedModule

LAYERS = models.PRESETS["llama"]["tiny"].num_layers


def fused_pair(family, **overrides):
    """A tiny demo model fused with its example batch, an unfused deep copy, and the batch."""
    model = getattr(models, family)("tiny", seed=0, **overrides)
    reference = copy.deepcopy(model)
    batch = model.example_batch(2, 16)
    report = te_lab.fuse(model, sample=batch)
    return model, reference, batch, report


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def fused_rows(report, rule):
    return [row for row in report.rows if row.rule == rule and row.status == "fused"]


def assert_same_training_signal(model, reference, batch):
    loss, grads = loss_and_grads(model, batch)
    expected_loss, expected_grads = loss_and_grads(reference, batch)
    assert_close(loss, expected_loss)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        # Weight gradients are sums over every token; fp32 needs 1e-4 there (docs/design.md).
        assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5), name


@pytest.mark.parametrize("family, expected", [
    ("llama", {"rmsnorm": 2 * LAYERS + 1, "gated_mlp": LAYERS, "attention": LAYERS, "rope": LAYERS,
               "lm_head_loss": 1}),
    ("gpt2", {"layernorm": 2 * LAYERS + 1, "mlp": LAYERS, "attention": LAYERS, "lm_head_loss": 1}),
])
def test_demo_models_fuse_every_layer_and_match(family, expected):
    model, reference, batch, report = fused_pair(family)
    assert {rule: counts.get("fused", 0) for rule, counts in report.counts().items()} == expected
    assert all(row.status == "fused" for row in report.rows), str(report)
    assert report.model_check is not None and report.model_check.within_tolerance
    # every layer: norms, MLP and attention are twins now
    blocks = model.model.layers if family == "llama" else model.transformer.h
    for block in blocks:
        twins = [child for child in block.children() if isinstance(child, FusedModule)]
        assert len(twins) == 4
    assert_same_training_signal(model, reference, batch)
    # without labels the forward is unchanged and returns the full logits
    with torch.no_grad():
        assert_close(model(batch["input_ids"]).logits, reference(batch["input_ids"]).logits)
    # with labels the LM head + loss is fused: no logits
    assert model(**batch).logits is None


def test_fusion_report_rows_carry_backends_kernels_and_errors():
    _, _, _, report = fused_pair("llama")
    attention = fused_rows(report, "attention")[0]
    assert attention.kernels == ["te_lab::attention", "te_lab::rope"]
    assert set(attention.backends) == {"attention", "rope"}
    assert attention.probe == "sample"
    for row in report.rows:
        assert row.output_max_abs is not None and row.output_max_abs <= TOLERANCES[torch.float32]["atol"]
        assert row.grad_max_rel is not None and row.grad_max_rel <= 1e-4
        # judged against the float64 truth, with the original's own error beside the twin's
        assert row.truth == "float64" and row.original_output_max_abs is not None
        # the backend column names what the probe ran, not how it would be chosen
        for backends in row.backends.values():
            assert set(backends.split("+")) <= {"cpp", "native", "inductor", "reference", "triton"}, backends
    text = str(report)
    assert "model.layers.1.mlp" in text and "FusedGatedMLP" in text and "(model)" in text
    assert f"attention: {LAYERS} of {LAYERS} fused" in text and "whichever measured" not in text
    html = report._repr_html_()
    assert html.count("<tr>") == len(report.rows) + 1 and "FusedAttention" in html
    restored = te_lab.FusionReport.from_dict(report.to_dict())
    assert restored.to_json() == report.to_json()


def test_unfuse_restores_the_original_objects():
    model = models.llama("tiny", seed=1)
    before = {name: id(module) for name, module in model.named_modules()}
    parameters = [id(p) for p in model.parameters()]
    report = te_lab.fuse(model)
    assert len(report.fused) == 4 * LAYERS + 2
    assert te_lab.is_fused(model)
    result = te_lab.unfuse(model)
    assert len(result.restored) == len(report.fused)
    assert {name: id(module) for name, module in model.named_modules()} == before
    assert [id(p) for p in model.parameters()] == parameters
    assert "forward" not in model.__dict__
    assert not te_lab.is_fused(model)
    assert "nothing to restore" in str(te_lab.unfuse(model))


def test_weights_learned_while_fused_survive_unfuse():
    model = models.llama("tiny", seed=2)
    norm = model.model.layers[0].input_layernorm
    te_lab.fuse(model)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(3.0)
        model.lm_head.weight.add_(1.0)
    te_lab.unfuse(model)
    assert model.model.layers[0].input_layernorm is norm
    torch.testing.assert_close(norm.weight, torch.full_like(norm.weight, 3.0))


def test_state_dict_round_trips_both_ways():
    model, reference, batch, _ = fused_pair("llama")
    fused_state = model.state_dict()
    plain_state = reference.state_dict()
    assert list(fused_state) == list(plain_state)
    for key, value in plain_state.items():
        assert torch.equal(fused_state[key], value), key
    # fused checkpoint -> fresh unfused model
    fresh = models.llama("tiny", seed=99)
    fresh.load_state_dict(fused_state, strict=True)
    with torch.no_grad():
        assert_close(fresh(**batch).loss, reference(**batch).loss)
    # unfused checkpoint -> fused model, which then computes the checkpoint's function
    other = models.llama("tiny", seed=5)
    model.load_state_dict(other.state_dict(), strict=True)
    with torch.no_grad():
        assert_close(model(**batch).loss, other(**batch).loss)


def test_optimizer_created_before_fuse_trains_the_same_tensors():
    model = models.llama("tiny", seed=3)
    reference = copy.deepcopy(model)
    batch = model.example_batch(2, 16)
    # SGD: the update is the gradient itself, so the comparison sees the gradients'
    # agreement directly (Adam's first step divides tiny gradients by themselves).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    te_lab.fuse(model, sample=batch)
    for net, opt in ((model, optimizer), (reference, reference_optimizer)):
        opt.zero_grad()
        net(**batch).loss.backward()
        opt.step()
    te_lab.unfuse(model)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p, q, rtol=1e-4, atol=1e-5), name


def test_thirty_training_steps_fused_match_unfused():
    model = models.llama("tiny", seed=4)
    reference = copy.deepcopy(model)
    te_lab.fuse(model, sample=model.example_batch(2, 32, seed=0))
    losses = {"fused": [], "unfused": []}
    for name, net in (("fused", model), ("unfused", reference)):
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
        for step in range(30):
            batch = net.example_batch(4, 32, seed=step % 2)  # two batches to memorize
            optimizer.zero_grad()
            loss = net(**batch).loss
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    assert losses["fused"][-1] < losses["fused"][0] - 0.1  # it did learn
    # Per-step losses agree; rounding differences compound over 30 Adam steps, so 1e-4.
    torch.testing.assert_close(torch.tensor(losses["fused"]), torch.tensor(losses["unfused"]), rtol=1e-4, atol=1e-4)


def test_probing_leaves_parameters_gradients_buffers_and_rng_untouched():
    model = models.llama("tiny", seed=6)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.train()
    torch.manual_seed(1234)
    expected_draw = torch.rand(3)
    torch.manual_seed(1234)
    te_lab.fuse(model, sample=model.example_batch(2, 16))
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(m.training for m in model.modules())
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]) and torch.equal(p.grad, torch.full_like(p, 0.5)), name
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name


def test_fuse_without_sample_synthesizes_probes():
    model = models.gpt2("tiny", seed=7)
    report = te_lab.fuse(model)
    assert len(report.fused) == len(report.rows) == 4 * LAYERS + 2
    assert {row.probe for row in report.rows} == {"synthesized"}
    assert report.model_check is None


def test_fusing_twice_leaves_fused_modules_alone():
    model = models.llama("tiny", seed=8)
    first = te_lab.fuse(model)
    twins = {name: id(m) for name, m in model.named_modules()}
    second = te_lab.fuse(model)
    assert second.rows == []
    assert len(second.already_fused) == len(first.fused)
    assert {name: id(m) for name, m in model.named_modules()} == twins
    assert "already fused" in str(second)
    assert len(te_lab.unfuse(model).restored) == len(first.fused)


def test_unfused_context_runs_the_originals_then_puts_the_twins_back():
    model, reference, batch, _ = fused_pair("llama")
    mlp_twin = model.model.layers[0].mlp
    with te_lab.unfused(model):
        assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
        assert not te_lab.is_fused(model)
        with torch.no_grad():
            output = model(**batch)
        assert output.logits is not None
        assert_close(output.loss, reference(**batch).loss)
    assert model.model.layers[0].mlp is mlp_twin
    assert model(**batch).logits is None



def test_the_gated_mlp_rules_old_name_is_accepted_with_a_deprecation_warning():
    model = models.llama("tiny", seed=9)
    with pytest.warns(DeprecationWarning, match="'swiglu_mlp' is now called 'gated_mlp'") as warned:
        report = te_lab.fuse(model, only=["swiglu_mlp"])
    assert [warning.filename for warning in warned] == [__file__]  # the caller's line, not te_lab's
    assert {row.rule for row in report.rows} == {"gated_mlp"} and len(report.fused) == LAYERS
    te_lab.unfuse(model)
    with pytest.warns(DeprecationWarning, match="gated_mlp"):
        report = te_lab.fuse(model, exclude="swiglu_mlp")
    assert "gated_mlp" not in {row.rule for row in report.rows} and report.fused

def test_only_and_exclude_select_rules_and_paths():
    model = models.llama("tiny", seed=9)
    report = te_lab.fuse(model, only="rmsnorm")
    assert {row.rule for row in report.rows} == {"rmsnorm"} and len(report.fused) == 2 * LAYERS + 1
    te_lab.unfuse(model)

    report = te_lab.fuse(model, exclude=["model.layers.0.*", "lm_head_loss"])
    assert not any(row.path.startswith("model.layers.0.") for row in report.rows)
    assert {row.rule for row in report.rows} == {"rmsnorm", "gated_mlp", "attention"}
    te_lab.unfuse(model)

    report = te_lab.fuse(model, only=["attention"], exclude="rope")
    assert [row.kernels for row in report.fused] == [["te_lab::attention"]] * LAYERS
    te_lab.unfuse(model)

    report = te_lab.fuse(model, only="rope")
    assert [row.kernels for row in report.fused] == [["te_lab::rope"]] * LAYERS
    assert report.counts()["rope"] == {"fused": LAYERS}


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(only="rmsnrom"), ValueError, "neither a rule name (valid: "),
    (dict(exclude=["rmsnorm", 3]), TypeError, "exclude entries must be strings"),
    (dict(only=42), TypeError, "only must be a rule name"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(auto=True, verify=False), ValueError, "auto=True"),
    (dict(sample=object()), TypeError, "sample must be a tensor"),
])
def test_bad_arguments_get_clear_errors(kwargs, error, message):
    model = models.llama("tiny", seed=10)
    with pytest.raises(error, match=None) as raised:
        te_lab.fuse(model, **kwargs)
    assert message in str(raised.value)
    assert not te_lab.is_fused(model)


def test_fuse_and_unfuse_refuse_non_modules():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        te_lab.fuse(lambda x: x)
    with pytest.raises(TypeError, match="got str"):
        te_lab.unfuse("model")


def test_sample_the_model_rejects_is_reported():
    model = models.llama("tiny", seed=11)
    with pytest.raises(ValueError, match="running the model on sample failed"):
        te_lab.fuse(model, sample={"tokens": torch.zeros(1, 4, dtype=torch.long)})


class MeanAbsNorm(nn.Module):
    """Norm-shaped (weight [hidden], eps) but not RMSNorm nor LayerNorm: x / mean|x|."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.eps = 1e-6

    def forward(self, x):
        return x / (x.abs().mean(-1, keepdim=True) + self.eps) * self.weight


class GemmaNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.2, 0.2, hidden))
        self.eps = 1e-6

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class ReluMLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, norm, mlp=None):
        super().__init__()
        self.norm = norm
        self.mlp = mlp or nn.Identity()

    def forward(self, x):
        return self.mlp(self.norm(x))


def test_a_norm_with_an_unusual_formula_stays_unfused_with_the_measured_error():
    block = Block(MeanAbsNorm(32))
    report = te_lab.fuse(block, sample=torch.randn(2, 5, 32))
    (row,) = report.rows
    assert row.status == "skipped" and type(block.norm) is MeanAbsNorm
    assert "from the float64 truth where the original's own error is" in row.reason and "float32 bar" in row.reason


def test_gemma_scaling_is_found_by_the_probe():
    block = Block(GemmaNorm(32))
    x = torch.randn(2, 5, 32)
    expected = block(x)
    report = te_lab.fuse(block, sample=x)
    (row,) = report.rows
    assert row.status == "fused" and row.variant == "scales by 1 + weight (Gemma)"
    assert block.norm.weight_offset == 1.0
    assert_close(block(x), expected)


def test_an_mlp_with_an_activation_without_kernel_is_skipped_with_reason():
    block = Block(nn.LayerNorm(16), ReluMLP(16))
    report = te_lab.fuse(block)
    rows = {row.path: row for row in report.rows}
    assert rows["norm"].status == "fused"
    assert rows["mlp"].status == "skipped" and "activation ReLU has no fused kernel" in rows["mlp"].reason


class ResidualGeluMLP(nn.Module):
    """Bloom's MLP layout: the block adds its residual inside the MLP's forward."""

    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)

    def forward(self, x, residual):
        return self.fc2(self.act(self.fc1(x))) + residual


class ResidualBlock(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(hidden), ResidualGeluMLP(hidden)

    def forward(self, x):
        return self.mlp(self.norm(x), x)


class ResidualRMSNorm(nn.Module):
    """LaRA's and Nemotron-H's layout: an RMSNorm whose forward may add a residual first."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states, residual=None):
        if residual is not None:
            hidden_states = hidden_states + residual
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class NormWithResidualBlock(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm, self.fc = ResidualRMSNorm(hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.norm(self.fc(x), x)


def test_a_norm_called_with_an_argument_its_twin_does_not_take_is_skipped_with_the_argument_named():
    block = NormWithResidualBlock(16)
    x = torch.randn(2, 5, 16)
    expected = block(x)
    (row,) = te_lab.fuse(block, sample=x).rows
    assert row.status == "skipped" and type(block.norm) is ResidualRMSNorm
    assert row.reason.startswith("its forward takes `residual` beyond the input, which the fused FusedRMSNorm does "
                                 "not take"), row.reason
    assert_close(block(x), expected)


@pytest.mark.parametrize("verify", [True, False])
def test_an_mlp_whose_forward_takes_more_than_its_input_is_skipped_with_the_arguments_named(verify):
    block = ResidualBlock(16)
    x = torch.randn(2, 5, 16)
    expected = block(x)
    report = te_lab.fuse(block, sample=x, verify=verify)
    rows = {row.path: row for row in report.rows}
    assert rows["norm"].status == "fused" and type(block.mlp) is ResidualGeluMLP
    assert rows["mlp"].status == "skipped"
    assert "takes `residual` beyond the input, which the fused FusedMLP does not take" in rows["mlp"].reason
    assert_close(block(x), expected)


def test_the_model_itself_cannot_be_replaced():
    norm = nn.LayerNorm(8)
    (row,) = te_lab.fuse(norm).rows
    assert row.status == "skipped" and "is the model itself" in row.reason


def test_verify_false_swaps_without_probing():
    model = models.gpt2("tiny", seed=12)
    report = te_lab.fuse(model, verify=False)
    assert len(report.fused) == 4 * LAYERS + 2
    assert {row.probe for row in report.rows} == {"none (verify=False)"}
    assert all(row.output_max_abs is None for row in report.rows)


def test_auto_keeps_only_measured_wins():
    model = models.llama("tiny", seed=13)
    report = te_lab.fuse(model, only=["rmsnorm", "gated_mlp"], auto=True)
    assert len(report.rows) == 3 * LAYERS + 1
    for row in report.rows:
        assert row.time_original_ms > 0 and row.time_fused_ms > 0
        assert row.speedup == pytest.approx(row.time_original_ms / row.time_fused_ms)
        module = model.get_submodule(row.path)
        if row.speedup > 1:
            assert row.status == "fused" and isinstance(module, FusedModule)
        else:
            assert row.status == "kept-original-slower" and not isinstance(module, FusedModule)


def test_dropout_still_applies_in_training():
    model = models.gpt2("tiny", seed=14, dropout=0.5)
    batch = model.example_batch(2, 16)
    reference = copy.deepcopy(model).eval()
    te_lab.fuse(model, sample=batch)
    model.train()
    first, second = model(batch["input_ids"]).logits, model(batch["input_ids"]).logits
    assert not torch.allclose(first, second)
    model.eval()
    with torch.no_grad():
        assert_close(model(batch["input_ids"]).logits, reference(batch["input_ids"]).logits)


class Sine(nn.Module):
    def forward(self, x):
        return torch.sin(x)


class FusedSine(FusedModule):
    """A stand-in fused op for the custom-rule test: the same math through another path."""

    ops = ()

    def forward(self, x):
        return torch.cos(x - torch.pi / 2)

    def kernel_names(self):
        return ["custom::sine"]


def test_register_rule_adds_a_user_fusion_tried_first():
    def match(module):
        if isinstance(module, Sine):
            return te_lab.Match([te_lab.Variant(lambda options: FusedSine(module))],
                                lambda: te_lab.ProbeInputs((torch.randn(4, 8),)))
        return None

    rule = te_lab.FusionRule("sine", "other", "sin(x) as a shifted cos", match)
    te_lab.register_rule(rule)
    try:
        assert te_lab.rules()[0] is rule
        with pytest.raises(ValueError, match="already registered"):
            te_lab.register_rule(rule)
        with pytest.raises(ValueError, match="built-in"):
            te_lab.register_rule(te_lab.FusionRule("rmsnorm", "norm", "", match))
        block = Block(Sine())
        report = te_lab.fuse(block)
        (row,) = report.rows
        assert (row.rule, row.status, row.kernels) == ("sine", "fused", ["custom::sine"])
        assert isinstance(block.norm, FusedSine)
    finally:
        te_lab.unregister_rule("sine")
    assert "sine" not in [r.name for r in te_lab.rules()]
    with pytest.raises(ValueError, match="invalid-name|identifier"):
        te_lab.FusionRule("not a name", "other", "", match)
    with pytest.raises(ValueError, match="kind must be one of"):
        te_lab.FusionRule("fine", "weird", "", match)



def test_the_built_in_rules_are_tried_in_the_one_listed_order_and_the_list_holds_every_rule():
    import importlib
    import pkgutil

    import te_lab.surgery
    from te_lab.surgery.builtin_rules import BUILT_IN_RULES

    defined = {}
    for info in pkgutil.iter_modules(te_lab.surgery.__path__):
        module = importlib.import_module(f"te_lab.surgery.{info.name}")
        defined.update({id(value): value for value in vars(module).values() if isinstance(value, te_lab.FusionRule)})
    listed = {id(rule) for rule in BUILT_IN_RULES}
    assert len(listed) == len(BUILT_IN_RULES), "a rule is listed twice"
    assert sorted(rule.name for key, rule in defined.items() if key not in listed) == [], "defined but not listed"
    assert set(defined) == listed
    assert [rule for rule in te_lab.rules() if id(rule) in listed] == list(BUILT_IN_RULES)


def _forced_backend_params():
    from te_lab.kernels import BACKENDS

    return [pytest.param(name, id=name, marks=[pytest.mark.triton_interpreter] if name == "triton" else [])
            for name in BACKENDS]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("backend", _forced_backend_params())
def test_a_forced_backend_runs_every_op_that_has_it(family, backend):
    """Every op that implements the backend runs on it (Triton kernels through the
    interpreter on the CPU, compiled on GPUs); where the device cannot run it, the
    module stays unfused and the report says why, naming the op and the backend."""
    from conftest import DEVICE
    from te_lab.kernels import registered_ops
    from te_lab.kernels.registry import unavailable_reason

    model = getattr(models, family)("tiny", seed=0)
    reference = copy.deepcopy(model)
    batch = model.example_batch(2, 16)
    report = te_lab.fuse(model, sample=batch, backend=backend)
    assert report.backend == backend
    assert report.fused
    for row in report.rows:
        if row.status == "fused":
            for op_name, chosen in row.backends.items():
                if backend in registered_ops()[op_name].backends():
                    assert chosen == backend, (row.path, op_name)
        else:
            assert row.status == "skipped" and f"backend {backend!r}" in row.reason and "cannot run" in row.reason
            op = registered_ops()[{"rmsnorm": "rms_norm", "layernorm": "layer_norm"}[row.rule]]
            assert unavailable_reason(op, backend, DEVICE) is not None
    assert_same_training_signal(model, reference, batch)


class MergedGateUpMLP(nn.Module):
    """Phi-3's layout: one projection gives [gate | up]; the activation is a plain function."""

    def __init__(self, hidden, width):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.activation_fn = torch.nn.functional.silu

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class UpFirstMLP(nn.Module):
    """Three projections registered up, down, gate: the probe must find which is which."""

    def __init__(self, hidden, width):
        super().__init__()
        self.w_a = nn.Linear(hidden, width, bias=False)
        self.w_out = nn.Linear(width, hidden, bias=False)
        self.w_b = nn.Linear(hidden, width, bias=False)
        self.act = nn.GELU()

    def forward(self, x):
        return self.w_out(self.w_a(x) * self.act(self.w_b(x)))


class BiasFreeLayerNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.epsilon = 1e-5

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, self.epsilon)


@pytest.mark.parametrize("mlp, twin_note", [
    (MergedGateUpMLP(16, 24), "gate=gate_up_proj, up=(merged), down=down_proj"),
    (UpFirstMLP(16, 24), "gate=w_b, up=w_a, down=w_out"),
])
def test_gated_mlp_layouts_are_found_by_shape_and_probe(mlp, twin_note):
    block = Block(nn.Identity(), mlp)
    x = torch.randn(2, 5, 16)
    expected = block(x)
    (row,) = te_lab.fuse(block, sample=x).rows
    assert (row.rule, row.status, row.variant) == ("gated_mlp", "fused", twin_note)
    assert_close(block(x), expected)


def test_a_bias_free_layernorm_like_module_is_fused_as_layernorm():
    block = Block(BiasFreeLayerNorm(32))
    x = torch.randn(2, 5, 32)
    expected = block(x)
    (row,) = te_lab.fuse(block, sample=x).rows
    assert (row.rule, row.status, row.fused_type) == ("layernorm", "fused", "FusedLayerNorm")
    assert_close(block(x), expected)


class OneOffsetLayerNorm(nn.LayerNorm):
    """Nemotron's LayerNorm1P by structure: an nn.LayerNorm whose forward scales by 1 + weight."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class OneOffsetLayerNormLike(nn.Module):
    """The same outside torch.nn: weight, bias and eps, no base class to go by."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.5, 0.5, hidden))
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, hidden))
        self.eps = 1e-5

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], 1.0 + self.weight, self.bias, self.eps)


@pytest.mark.parametrize("norm", [OneOffsetLayerNorm(32), OneOffsetLayerNormLike(32)], ids=["subclass", "norm-like"])
def test_layernorm_scaling_by_one_plus_weight_is_found_by_the_probe(norm):
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-1.5, 0.5, 32))
    block = Block(norm)
    x = torch.randn(2, 5, 32) * 50
    expected = block(x)
    (row,) = te_lab.fuse(block, sample=x).rows
    assert (row.rule, row.status, row.variant) == ("layernorm", "fused", "scales by 1 + weight")
    assert block.norm.weight_offset == 1.0
    assert_close(block(x), expected)


def test_a_plain_layernorm_is_offered_its_own_formula_only():
    from te_lab.surgery.norm_rules import match_layernorm
    assert len(match_layernorm(nn.LayerNorm(8)).variants) == 1
    assert len(match_layernorm(OneOffsetLayerNorm(8)).variants) == 2


def test_fuse_inside_inference_mode_is_refused():
    model = models.llama("tiny", seed=15)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        te_lab.fuse(model)


def test_a_fused_model_deep_copies_and_pickles_whole():
    import io

    model, reference, batch, _ = fused_pair("llama")
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for twin in (copied, loaded):
        with torch.no_grad():
            assert_close(twin(**batch).loss, reference(**batch).loss)
        assert len(te_lab.unfuse(twin).restored) == 4 * LAYERS + 2
        assert type(twin.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert te_lab.is_fused(model)  # the copies' unfuse did not touch the original


def test_progress_bar_shows_while_probing(capsys):
    model = models.llama("tiny", seed=16)
    te_lab.fuse(model, progress=True)
    assert "te_lab.fuse: building and probing" in capsys.readouterr().err
    te_lab.unfuse(model)
    te_lab.fuse(model, progress=False)
    assert "te_lab.fuse" not in capsys.readouterr().err


def test_a_dry_run_probes_everything_and_swaps_nothing():
    model = models.llama("tiny", seed=17)
    before = {name: id(m) for name, m in model.named_modules()}
    report = te_lab.fuse(model, sample=model.example_batch(2, 16), dry_run=True)
    assert {row.status for row in report.rows} == {"would-fuse"} and len(report.rows) == 4 * LAYERS + 2
    assert all(row.output_max_abs is not None for row in report.rows)
    assert {name: id(m) for name, m in model.named_modules()} == before and not te_lab.is_fused(model)
    assert "dry run: nothing was swapped" in str(report)
