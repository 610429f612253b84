"""te_lab's magics through IPython's own machinery: an InteractiveShell, run_line_magic /
run_cell_magic, asserting on what the magics store, on the model after them, and on
what they print; the user's mistakes raise UsageError."""

import pytest

IPython = pytest.importorskip("IPython")  # the Triton 3.2 test environment has no IPython

import warnings  # noqa: E402

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


def test_te_fuse_returns_the_report_with_o_and_fuses_the_model(shell, capsys):
    start = {name: id(m) for name, m in shell.user_ns["model"].named_modules()}
    state = {k: v.clone() for k, v in shell.user_ns["model"].state_dict().items()}
    report = shell.run_line_magic("te_fuse", "model --sample batch -o -q")  # as %timeit -o returns its result
    assert capsys.readouterr().out == ""
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
    assert shell.run_line_magic("te_fuse", 'nets["big"] --only layernorm,mlp -q') is None  # no -o: no value
    assert {fusion.rule for fusion in te_lab.fusions(shell.user_ns["nets"]["big"])} == {"layernorm", "mlp"}
    rows = shell.run_line_magic("te_fuse", "model --exclude lm_head_loss,model.layers.0.* --no-verify -q -o").rows
    assert not any(row.path.startswith("model.layers.0.") or row.rule == "lm_head_loss" for row in rows)
    assert {row.probe for row in rows} == {"none (verify=False)"}
    shell.run_line_magic("te_unfuse", "model")
    dry = shell.run_line_magic("te_fuse", "model --dry-run --backend reference -q -o")
    assert {row.status for row in dry.rows} == {"would-fuse"} and fused_count(shell) == 0
    assert {b for row in dry.rows for b in row.backends.values()} == {"reference"}
    timed = shell.run_line_magic("te_fuse", "model --only rmsnorm --auto -q -o")
    assert all(row.speedup is not None for row in timed.rows)


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
    report = shell.run_line_magic("te_profile", "--model model --steps 1 --warmup 0 -o model(**batch)")
    assert isinstance(report, te_lab.ProfileReport) and report.modes["fused"].backward_median_ms > 0
    out = capsys.readouterr().out
    assert "te_lab.profile:" in out  # the text fallback outside a notebook
    # 1 timed step, the detail step, one profiled step and one clocked step (the CPU's module times), per mode;
    # then the opportunity finder's detail step, 2 profiled and 2 clocked steps, per mode
    assert "%te_profile: ran the statement 18 times (0 warm-up and 1 timed steps" in out
    assert "then 5 per mode for the opportunity finder" in out
    path = tmp_path / "cell.html"
    shell.user_ns["cell_runs"] = 0
    cell_report = shell.run_cell_magic("te_profile", f"--steps 1 --warmup 0 --no-opportunities --html {path} -o",
                                       "cell_runs += 1\nloss = model(**batch).loss\nloss.backward()\n"
                                       "model.zero_grad()\n")
    assert cell_report.modes["eager"].backward_median_ms is None  # the cell did its own backward
    assert any(c.key == "model.layers.0.mlp" and c.eager.backward_ms > 0 for c in cell_report.modules)
    out = capsys.readouterr().out
    assert path.exists() and f"static report written to {path}" in out
    assert shell.user_ns["cell_runs"] == 8 and "%te_profile: ran the cell 8 times" in out
    assert cell_report.opportunities is None and "opportunity finder" not in out
    fwd = shell.run_line_magic("te_profile", "--steps 1 --warmup 0 --no-backward -o model(batch['input_ids'])")
    assert fwd.modes["fused"].backward_median_ms is None
    assert shell.run_line_magic("te_profile", "--steps 1 --warmup 0 --no-backward model(batch['input_ids'])") is None


def test_te_profile_cell_warns_when_it_changes_the_parameters(shell, capsys):
    shell.run_line_magic("te_fuse", "model -q")
    shell.user_ns["optimizer"] = torch.optim.SGD(shell.user_ns["model"].parameters(), lr=1e-3)
    before = {name: p.detach().clone() for name, p in shell.user_ns["model"].named_parameters()}
    with pytest.warns(RuntimeWarning, match=r"changed \d+ of the models' parameters in place while it ran 8 times"):
        report = shell.run_cell_magic("te_profile", "--steps 1 --warmup 0 -o",
                                      "model(**batch).loss.backward()\noptimizer.step()\noptimizer.zero_grad()\n")
    assert any("moving model" in note for note in report.notes)
    assert any(not torch.equal(p, before[name]) for name, p in shell.user_ns["model"].named_parameters())
    # A cell that only reads the parameters gets no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        shell.run_cell_magic("te_profile", "--steps 1 --warmup 0", "model(**batch).loss.backward()\n"
                             "model.zero_grad()\n")


def test_te_profile_statements_go_through_the_input_transformers(shell, capsys):
    shell.run_line_magic("te_fuse", "model -q")
    shell.user_ns["seen"] = []
    # IPython syntax in the cell (a line magic) runs as it would in a cell of its own.
    shell.run_cell_magic("te_profile", "--steps 1 --warmup 0 --no-backward --no-opportunities",
                         "%time seen.append(1)\nmodel(batch['input_ids'])\n")
    assert len(shell.user_ns["seen"]) == 8  # detail, timed, profiled and clocked steps, two modes


def test_magics_taking_python_do_not_expand_variables(shell):
    # {name} is Python here (a set literal); IPython's expansion would substitute the name's
    # value first: nets[big.pop()] (a NameError) and seen.append(3) instead of {3}.
    shell.user_ns.update(key="big", seen=[], torch=torch)
    report = shell.run_line_magic("te_fuse", "nets[{key}.pop()] --only layernorm -q -o")
    assert {row.rule for row in report.fused} == {"layernorm"} and te_lab.is_fused(shell.user_ns["nets"]["big"])
    shell.run_line_magic("te_profile", '--model nets["big"] --steps 1 --warmup 0 --no-backward --no-opportunities '
                         'seen.append({number}) or nets["big"](torch.zeros(1, 4, dtype=torch.long))')
    assert shell.user_ns["seen"] == [{3}] * 8


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
    with pytest.raises(UsageError, match="warmup must be a non-negative integer, got 'x'"):
        shell.run_line_magic("te_profile", "--warmup x model(**batch)")
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


def test_te_opportunities_ranks_and_te_fuse_compiles_its_rows(shell, capsys):
    found = shell.run_line_magic("te_opportunities", "model --sample batch --top 3 -o")
    assert found.mode == "eager" and found.rows and found.top(3) == found.rows[:3]
    out = capsys.readouterr().out
    assert "fusion opportunities (eager step" in out and found.rows[0].label() in out
    shell.user_ns["found"] = found
    shell.user_ns["picked"] = next(row for row in found.rows if row.paths[0] != "(model)")
    report = shell.run_line_magic("te_fuse", "model --sample batch --regions-of [picked] -q -o")
    compiled = [row for row in report.rows if row.rule == "compiled_region"]
    assert {row.path for row in compiled} == set(shell.user_ns["picked"].paths)
    assert all(row.truth == "float64" and row.time_fused_ms > 0 for row in compiled)
    left = shell.run_line_magic("te_opportunities", "model --sample batch --against found --top 2 -o")
    assert left.mode == "fused"
    out = capsys.readouterr().out
    assert "fusion opportunities (fused step" in out and "realized" in out


@pytest.mark.parametrize("magic, line, message", [
    ("te_opportunities", "model", "the following arguments are required: --sample"),
    ("te_opportunities", "model --sample batch --top 0", "--top must be a positive integer"),
    ("te_opportunities", "model --sample batch --mode both", "invalid choice: 'both'"),
    ("te_opportunities", "model --sample batch --against 3", "against must be an earlier te_lab.opportunities"),
    ("te_fuse", "model --sample batch --regions a --regions-of b", "give --regions or --regions-of, not both"),
    ("te_fuse", "model --sample batch --regions nothing.here", "regions entry 'nothing.here' names no module"),
])
def test_te_opportunities_and_regions_mistakes_are_usage_errors(shell, magic, line, message):
    with pytest.raises(UsageError) as raised:
        shell.run_line_magic(magic, line)
    assert message in str(raised.value)
    assert fused_count(shell) == 0
