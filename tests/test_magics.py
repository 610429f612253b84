"""te_lab's magics through IPython's own machinery: an InteractiveShell, run_line_magic /
run_cell_magic, asserting on what the magics store, on the model after them, and on
what they print; the user's mistakes raise UsageError."""

import pytest

IPython = pytest.importorskip("IPython")  # the Triton 3.2 test environment has no IPython

import torch  # noqa: E402
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

import te_lab  # noqa: E402
from te_lab import models  # noqa: E402

LAYERS = models.PRESETS["llama"]["tiny"].num_layers


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "te_lab")
    model = models.llama("tiny", seed=0)
    shell.user_ns.update(model=model, batch=model.example_batch(2, 16), nets={"big": models.gpt2("tiny", seed=1)},
                         number=3)
    yield shell
    shell.run_line_magic("unload_ext", "te_lab")
    InteractiveShell.clear_instance()


def fused_count(shell, name="model"):
    return len(te_lab.fusions(shell.user_ns[name]))


def test_load_unload_and_reload(shell):
    line_magics = shell.magics_manager.magics["line"]
    assert {"te_fuse", "te_unfuse", "te_profile", "te_status"} <= set(line_magics)
    assert "te_profile" in shell.magics_manager.magics["cell"]
    shell.run_line_magic("load_ext", "te_lab")  # a second load is harmless
    shell.run_line_magic("unload_ext", "te_lab")
    assert "te_fuse" not in shell.magics_manager.magics["line"]
    assert "te_profile" not in shell.magics_manager.magics["cell"]
    shell.run_line_magic("load_ext", "te_lab")
    shell.run_line_magic("reload_ext", "te_lab")
    assert "te_fuse" in shell.magics_manager.magics["line"]


def test_te_fuse_stores_the_report_and_fuses_the_model(shell, capsys):
    start = {name: id(m) for name, m in shell.user_ns["model"].named_modules()}
    state = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    assert shell.run_line_magic("te_fuse", "model --sample batch -o report -q") is None
    assert capsys.readouterr().out == ""
    report = shell.user_ns["report"]
    assert isinstance(report, te_lab.FusionReport) and len(report.fused) == 4 * LAYERS + 2
    assert fused_count(shell) == 4 * LAYERS + 2
    shell.run_line_magic("te_unfuse", "model")
    assert "restored 10 original module(s)" in capsys.readouterr().out
    assert {name: id(m) for name, m in shell.user_ns["model"].named_modules()} == start
    assert all(torch.equal(v, state[k]) for k, v in shell.user_ns["model"].state_dict().items())
    shell.run_line_magic("te_unfuse", "model")
    assert "nothing to restore" in capsys.readouterr().out


def test_te_fuse_displays_its_report_once(shell, capsys):
    shell.run_line_magic("te_fuse", "model")
    out = capsys.readouterr().out
    assert out.count("te_lab.fuse: 10 of 10 candidate modules fused") == 1


def test_te_fuse_evaluates_expressions_and_passes_every_option(shell):
    shell.run_line_magic("te_fuse", 'nets["big"] --only layernorm,mlp -q -o r1')
    assert {row.rule for row in shell.user_ns["r1"].fused} == {"layernorm", "mlp"}
    shell.run_line_magic("te_fuse", "model --exclude lm_head_loss,model.layers.0.* --no-verify -q -o r2")
    rows = shell.user_ns["r2"].rows
    assert not any(row.path.startswith("model.layers.0.") or row.rule == "lm_head_loss" for row in rows)
    assert {row.probe for row in rows} == {"none (verify=False)"}
    shell.run_line_magic("te_unfuse", "model")
    shell.run_line_magic("te_fuse", "model --dry-run --backend reference -q -o r3")
    assert {row.status for row in shell.user_ns["r3"].rows} == {"would-fuse"} and fused_count(shell) == 0
    assert {b for row in shell.user_ns["r3"].rows for b in row.backends.values()} == {"reference"}
    shell.run_line_magic("te_fuse", "model --only rmsnorm --auto -q -o r4")
    assert all(row.speedup is not None for row in shell.user_ns["r4"].rows)


@pytest.mark.parametrize("line, message", [
    ("missing_model", "could not be evaluated: NameError"),
    ("number", "is a int, not a torch.nn.Module"),
    ("model --only rmsnrom", "neither a rule name"),
    ("model --backend cuda", "invalid choice"),
    ("model --sample undefined_batch", "--sample 'undefined_batch' could not be evaluated"),
    ("model --sample number", "sample must be a tensor"),
    ("", "the following arguments are required: model"),
])
def test_te_fuse_mistakes_are_usage_errors(shell, line, message):
    with pytest.raises(UsageError, match=None) as raised:
        shell.run_line_magic("te_fuse", line)
    assert message in str(raised.value)
    assert fused_count(shell) == 0


def test_te_profile_line_and_cell_forms(shell, tmp_path, capsys):
    shell.run_line_magic("te_fuse", "model --sample batch -q")
    shell.run_line_magic("te_profile", "--model model --steps 1 --warmup 0 -o line_report model(**batch)")
    report = shell.user_ns["line_report"]
    assert isinstance(report, te_lab.ProfileReport) and report.modes["fused"].backward_median_ms > 0
    assert "te_lab.profile:" in capsys.readouterr().out  # the text fallback outside a notebook
    path = tmp_path / "cell.html"
    shell.run_cell_magic("te_profile", f"--steps 1 --warmup 0 --html {path} -o cell_report",
                         "loss = model(**batch).loss\nloss.backward()\nmodel.zero_grad()\n")
    cell_report = shell.user_ns["cell_report"]
    assert cell_report.modes["eager"].backward_median_ms is None  # the cell did its own backward
    assert any(c.key == "model.layers.0.mlp" and c.eager.backward_ms > 0 for c in cell_report.modules)
    assert path.exists() and f"static report written to {path}" in capsys.readouterr().out
    shell.run_line_magic("te_profile", "--steps 1 --warmup 0 --no-backward -o fwd model(batch['input_ids'])")
    assert shell.user_ns["fwd"].modes["fused"].backward_median_ms is None


def test_te_profile_mistakes_and_user_errors(shell):
    with pytest.raises(UsageError, match="no fused model in the namespace"):
        shell.run_line_magic("te_profile", "model(**batch)")
    shell.run_line_magic("te_fuse", "model -q")
    with pytest.raises(UsageError, match="give the statement"):
        shell.run_line_magic("te_profile", "--model model")
    with pytest.raises(UsageError, match="has no te_lab fusions"):
        shell.run_line_magic("te_profile", '--model nets["big"] model(**batch)')
    with pytest.raises(UsageError, match="steps must be a positive integer"):
        shell.run_line_magic("te_profile", "--steps 0 model(**batch)")
    with pytest.raises(UsageError, match="--html must name an .html file"):
        shell.run_line_magic("te_profile", "--html out.txt model(**batch)")
    with pytest.raises(NameError):  # the user's own statement fails as it would without the magic
        shell.run_line_magic("te_profile", "--steps 1 --warmup 0 undefined_function(model)")


def test_te_status(shell, capsys):
    shell.run_line_magic("te_fuse", "model -q")
    shell.run_line_magic("te_status", "")
    out = capsys.readouterr().out
    assert "devices: cpu" in out and "rms_norm:" in out and "attention:" in out
    assert "torch 2." in out and "transformers" in out
    assert "model (10 fused modules)" in out
    with pytest.raises(UsageError, match="takes no arguments"):
        shell.run_line_magic("te_status", "model")


def test_help_comes_from_the_argument_declarations(shell):
    for name in ("te_fuse", "te_unfuse", "te_profile"):
        doc = shell.magics_manager.magics["line"][name].__doc__
        usage = doc.split("\n\n")[1]  # IPython puts the argparse usage first
        assert usage.strip().startswith(f"%{name} ")
        assert "Example::" in doc and ("options:" in doc or "positional arguments:" in doc)
    assert "--sample" in shell.magics_manager.magics["line"]["te_fuse"].__doc__
