"""The ``te-lab`` command: each command run for real through the installed console
script (in a subprocess, in a scratch directory), the files it writes read back, and
the mistakes a user makes rejected by name with the valid choices."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from servers import free_port, serving
from te_lab import ProfileReport, device as devices
from te_lab.benchmarks.schema import SCHEMA_ID
from te_lab.cli import build_parser, main
from te_lab.cli.lab import checkout_notebooks, jupyter_command
from te_lab.kernels import available_backends, cpu_kernels, registered_ops, select_backend
from te_lab.kernels.registry import describe_backend

REPO = Path(__file__).resolve().parent.parent
TE_LAB = Path(sys.executable).parent / "te-lab"
NOTEBOOKS = sorted(path.name for path in (REPO / "notebooks").glob("*.ipynb"))
SMALL_RUN = ["--seq", "16", "--steps", "2"]


def te_lab_command(*arguments: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    assert TE_LAB.exists(), f"{TE_LAB} is missing: reinstall te_lab (pip install -e .) to get the console script"
    return subprocess.run([str(TE_LAB), *arguments], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # fuses with Inductor backends
def test_demo_fuses_verifies_profiles_and_writes_the_dashboard(tmp_path):
    result = te_lab_command("demo", "--model", "llama-tiny", *SMALL_RUN, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    stages = [out.index(f"[{n}/4]") for n in range(1, 5)]
    assert stages == sorted(stages)
    assert "te_lab.fuse: 10 of 10 candidate modules fused in LlamaLM" in out
    assert "model.layers.1.mlp" in out and "(within tolerance)" in out
    assert "te_lab.profile: LlamaLM on" in out and "speedup" in out
    assert "te_lab.profile: 100%" in result.stderr  # the progress bar ran to the end
    report_file = tmp_path / "te_lab_report.html"
    text = report_file.read_text(encoding="utf-8")
    # the gains, ceiling, timeline, utilization and roofline charts, and the Opportunities chart of each mode
    assert text.count('class="plotly-graph-div"') == 7 and "te_lab profile: LlamaLM" in text
    assert "fusion ceiling:" in out and "of the step" in out  # the ceiling and the compute split, printed


def test_demo_defaults_are_the_mini_llama_and_te_lab_report_html():
    args = build_parser().parse_args(["demo"])
    assert (args.model, args.batch, args.seq, args.dtype, str(args.html), args.json) == (
        "llama-mini", 4, 128, "float32", "te_lab_report.html", None)


@pytest.mark.slow  # fuses with Inductor backends
def test_profile_a_hugging_face_model_writes_html_and_json_that_round_trip(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "out").mkdir()
    result = te_lab_command("profile", "--model", "hf:llama", "--batch", "1", *SMALL_RUN,
                            "--html", "out/report.html", "--json", "report.json", "--opportunities", "3",
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = ProfileReport.from_json((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report.environment.target == "LlamaForCausalLM"
    assert report.environment.input_shapes == [[1, 16], [1, 16]]
    assert len(report.modes["eager"].step_ms) == len(report.modes["fused"].step_ms) == 2
    # what was printed is the summary of the very report that was written
    assert report.summary() in result.stdout
    assert "candidate modules fused in LlamaForCausalLM" in result.stdout
    assert "\n".join(report.opportunity_lines(3)) in result.stdout  # --opportunities 3: the finder's top rows
    assert set(report.opportunities) == {"eager", "fused"} and report.opportunities["eager"].rows
    html = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert html.count('class="plotly-graph-div"') == 7
    assert report.ceiling is not None and 0 < report.ceiling.eager.compute_ms <= report.modes["eager"].step_median_ms
    for comparison in report.kinds:
        assert f'"{comparison.key}"' in html  # each op kind is a bar label in the gains chart


@pytest.mark.parametrize("arguments, message", [
    (["profile", "--model", "llama-7b"], "argument --model: unknown model 'llama-7b'; choose from llama-tiny"),
    (["profile", "--model", "hf:bert"], "hf:qwen2-tiny"),
    (["profile", "--model", "llama-tiny", "--device", "musa"], "argument --device: 'musa' is not available"),
    (["profile", "--model", "llama-tiny", "--device", "tpu"], "argument --device: 'tpu' is not a device string"),
    (["profile", "--model", "llama-tiny", "--dtype", "float64"],
     "argument --dtype: invalid choice: 'float64' (choose from"),
    (["profile", "--model", "llama-tiny", "--html", "report.txt"], "argument --html: expected a path ending in .html"),
    (["profile", "--model", "llama-tiny", "--json", "no/such/folder/r.json"],
     "argument --json: the folder of 'no/such/folder/r.json' does not exist"),
    (["demo", "--batch", "0"], "argument --batch: expected a positive integer, got '0'"),
    (["profile"], "the following arguments are required: --model"),
    (["fuse"], "argument COMMAND: invalid choice: 'fuse'"),
])
def test_mistakes_name_the_option_and_the_choices(arguments, message, capsys):
    with pytest.raises(SystemExit) as raised:
        main(arguments)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command, option", [
    ("demo", "--html"), ("profile", "--model"), ("bench", "--quick"), ("info", "--help"), ("lab", "--notebook-dir")])
def test_every_command_has_help(command, option, capsys):
    with pytest.raises(SystemExit) as raised:
        main([command, "--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: te-lab {command}") and option in out


def test_info_lists_devices_backends_triton_and_versions(tmp_path):
    result = te_lab_command("info", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    default = devices.default_device()
    assert f"(default {default}: " in result.stdout
    for name, op in registered_ops().items():
        # The automatic choice; on the CPU an op that measures its backends names those it chooses among.
        assert f"\n  {name}: {describe_backend(op, default)}" in result.stdout
        assert select_backend(op, default) in describe_backend(op, default)
    if default.type == "cpu" and "native" in available_backends(registered_ops()["linear"], default):
        # linear takes oneDNN (native) or F.linear (reference), whichever measured faster per class of sizes
        assert ("\n  linear: native or reference, whichever measured faster here for the sizes (also: native)\n"
                in result.stdout)
    assert f"triton backend on {default.type}: " in result.stdout
    assert f"cpp backend on cpu: built in {cpu_kernels.build_directory()}\n" in result.stdout
    assert "versions: torch 2." in result.stdout and "torch_musa " in result.stdout
    assert "  musa: " in result.stdout and "  cuda: " in result.stdout
    assert f"torch.distributed backend on {default}: {devices.distributed_backend(default)}" in result.stdout


@pytest.mark.slow  # the suite compiles its torch.compile contender
def test_bench_runs_the_benchmark_suite(tmp_path):
    result = te_lab_command("bench", "--profile", "smoke", "--ops", "rms_norm", "--models", "none",
                            "--json", "results.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["schema"] == SCHEMA_ID and results["config"]["profile"] == "smoke"
    assert results["command"].startswith("te-lab bench --profile smoke")
    assert {entry["op"] for entry in results["ops"]} == {"rms_norm"}
    assert result.stdout.startswith("# te_lab benchmark results")


def test_lab_serves_the_tutorial_notebooks(tmp_path):
    pytest.importorskip("jupyterlab")
    port = free_port()
    home = tmp_path / "home"
    environment = {**os.environ, "HOME": str(home), "JUPYTER_CONFIG_DIR": str(home / "config"),
                   "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTER_DATA_DIR": str(home / "data")}
    command = [str(TE_LAB), "lab", "--port", str(port), "--no-browser", "--",
               "--IdentityProvider.token=", "--ServerApp.password="]
    log = tmp_path / "lab.log"
    with serving(command, ready_url=f"http://127.0.0.1:{port}/api/status", log=log, env=environment, cwd=tmp_path):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents", timeout=10) as response:
            listing = json.load(response)
    assert sorted(entry["name"] for entry in listing["content"] if entry["type"] == "notebook") == NOTEBOOKS
    assert f"te-lab lab: JupyterLab on {REPO / 'notebooks'} at http://127.0.0.1:{port}/lab" in log.read_text()


def test_lab_outside_a_checkout_needs_a_notebook_dir(tmp_path, capsys):
    assert checkout_notebooks(REPO / "te_lab") == REPO / "notebooks"
    assert checkout_notebooks(tmp_path / "site-packages" / "te_lab") is None
    with pytest.raises(SystemExit):
        main(["lab", "--notebook-dir", str(tmp_path / "missing")])
    assert "argument --notebook-dir: " in capsys.readouterr().err
    args = build_parser().parse_args(["lab", "--port", "9999", "--", "--ServerApp.token=abc"])
    command = jupyter_command(args, tmp_path)
    assert command[:3] == [sys.executable, "-m", "jupyterlab"] and command[-1] == "--ServerApp.token=abc"
    assert f"--ServerApp.root_dir={tmp_path}" in command and "--ServerApp.port=9999" in command
