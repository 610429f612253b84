"""The tutorial notebooks run top to bottom in a real kernel with no error output, print
what their text says they show (each notebook's checks below read the numbers it
prints), and are committed without stale outputs."""

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # the Triton 3.2 test environment has no notebook stack
nbclient = pytest.importorskip("nbclient")

from conftest import DEVICE  # noqa: E402
from te_lab.kernels import registered_ops  # noqa: E402
from te_lab.kernels.registry import describe_backend  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
NUMBER = r"([-+0-9.e]+)"


def number_after(label: str, text: str) -> float:
    match = re.search(re.escape(label) + r"\s*" + NUMBER, text)
    assert match, f"the notebook printed no {label!r}"
    return float(match.group(1))


def check_quickstart(text: str) -> None:
    assert "te_lab.fuse: 10 of 10 candidate modules fused" in text
    assert "restored 10 original module(s)" in text


def check_huggingface(text: str) -> None:
    assert "te_lab.fuse: 10 of 10 candidate modules fused in LlamaForCausalLM" in text
    assert "(within tolerance)" in text
    # float32 through sums over long rows: 1e-4 (docs/design.md's tolerance table)
    assert number_after("logits max abs diff:", text) <= 1e-4
    assert number_after("loss diff:", text) <= 1e-4
    assert number_after("worst max abs diff / max abs =", text) <= 1e-4
    assert "gradients of all 21 parameters" in text
    assert "same Parameter objects under the same names as before fusing: True" in text
    assert "greedy generation of 8 tokens, fused == original: True" in text
    assert "restored 10 original module(s) in LlamaForCausalLM" in text


def check_reading_the_dashboard(text: str) -> None:
    from_medians = number_after("speedup from the medians:", text)
    assert from_medians == number_after("the report's:", text) and from_medians > 0
    saved = re.search(r"launches: eager (\d+) - fused (\d+) = (\d+); the report's launches saved: (\d+)", text)
    eager, fused, difference, reported = map(int, saved.groups())
    assert eager - fused == difference == reported and fused < eager
    assert "speedup      = eager step median / fused step median" in text
    for mode in ("eager", "fused"):  # the module times are scaled to add up to the unprofiled step
        added = re.search(rf"{mode}: profiled / unprofiled step [\d.]+x; modules \+ \(other\) = ([\d.]+) ms of a "
                          rf"([\d.]+) ms step; compiles in measured steps: 0", text)
        assert added and float(added[1]) == pytest.approx(float(added[2]), rel=0.10), mode
    assert "effective parallelism (eager):" in text and "bandwidth ceiling:" in text
    for kind in ("norm", "mlp", "attention", "loss"):
        assert re.search(rf"\n{kind} +eager ", text), kind
    auto = re.search(r"auto: (\d+) candidates: (\d+) fused, (\d+) kept-original-slower", text)
    candidates, kept_fused, kept_original = map(int, auto.groups())
    assert candidates == 10 and kept_fused + kept_original == candidates


def check_training(text: str) -> None:
    assert "te_lab.fuse: 10 of 10 candidate modules fused in LlamaLM" in text
    assert number_after("float32: largest loss difference over 8 steps:", text) <= 1e-4
    if "does not support bfloat16" not in text:
        assert number_after("largest relative loss difference", text) <= 1.6e-2  # bfloat16's rtol
    assert "after 4 steps, overlapped parameters equal the plain step's: True; losses equal: True" in text
    assert "refused: max_grad_norm=1.0 cannot be combined with overlapped updates" in text
    updates = re.search(r"(\d+) parameter updates, (\d+) of them done before backward's last gradient", text)
    total, early = map(int, updates.groups())
    assert total == 21 and 0 < early < total


def check_custom_fusion(text: str) -> None:
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert f"{dtype}: forward max abs err" in text
    assert "automatic choice 'triton'" in text if DEVICE.type != "cpu" else "automatic choice 'reference'" in text
    assert "rules, in the order they are tried: squared_relu, rmsnorm" in text
    assert "2 of 2 candidate modules fused in Sequential" in text and "(backend triton)" in text
    assert "squared_relu: 2 of 2 fused" in text  # the report's rows grouped by rule
    assert len(re.findall(r"SquaredReLU -> FusedSquaredReLU +triton ", text)) == 2
    assert "te_lab.profile: Sequential on" in text
    assert "restored 2 original module(s) in Sequential: 0.act, 1.act" in text
    assert "squared_relu still registered as a rule: False" in text


def check_musa_and_gpus(text: str) -> None:
    assert f"default device: {DEVICE} (" in text
    for name, op in registered_ops().items():
        assert f"\n  {name}: {describe_backend(op, DEVICE)}" in text
    assert "MTT S4000: 768 GB/s" in text
    assert number_after("max abs diff against the reference", text) <= 1e-2
    if DEVICE.type == "cpu":
        assert "No GPU here:" in text and "torch.distributed backend: gloo" in text
        assert "rms_norm on cpu (torch.float32)" in text
    else:
        assert f"running on {DEVICE}:" in text


def check_lora_trainer(text: str) -> None:
    assert "te_lab.fuse: 10 of 10 candidate modules fused in PeftModelForCausalLM" in text
    for rule, count in (("attention", 2), ("gated_mlp", 2), ("lm_head_loss", 1)):
        assert f"{rule}: fused in {count} of {count} candidates" in text
    assert number_after("largest loss difference over 12 steps:", text) <= 1e-4
    assert number_after("last unfused", text) < number_after("loss: first", text)  # the adapters learned
    assert "profile of a training step written to lora_step.html" in text
    assert re.search(r"step time median: unfused [\d.]+ ms, fused [\d.]+ ms", text)
    assert re.search(r"peak memory of a step +[\d.]+ MB +[\d.]+ MB", text)
    assert "same parameter names after merging: True" in text
    # 12 AdamW steps amplify float32 rounding (weights of about 0.1; tests/test_convergence.py allows 1e-3)
    assert number_after("merged weights, largest abs difference:", text) <= 1e-4
    assert number_after("merged logits, largest abs difference:", text) <= 1e-4


# what a notebook needs beyond the notebook stack
REQUIRES = {"02_huggingface": "transformers", "07_lora_trainer": "peft"}
def check_fusion_opportunities(text: str) -> None:
    assert re.search(r"custom layers' rows: 4 ; ranked first: True", text)
    assert "no te_lab rule for them: True" in text
    compiled = re.findall(r"layers\.\d\.(?:norm|act) +(fused|kept-original-slower) +verified against the float64 "
                          r"truth", text)
    assert len(compiled) == 4
    realized = re.findall(r"estimated ([-0-9.]+) ms, realized ([-0-9.]+) ms", text)
    assert len(realized) == 4 and all(float(estimated) > 0 for estimated, _ in realized)
    assert "fusion opportunities, what fusion left (fused step)" in text
    assert "fusion opportunities, eager step, realized by fusing" in text
    assert re.search(r"restored \d+ original module\(s\)", text)


CHECKS = {"01_quickstart": check_quickstart, "02_huggingface": check_huggingface,
          "03_reading_the_dashboard": check_reading_the_dashboard, "04_training": check_training,
          "05_custom_fusion": check_custom_fusion,
          "06_musa_and_gpus": check_musa_and_gpus, "07_lora_trainer": check_lora_trainer,
          "08_fusion_opportunities": check_fusion_opportunities}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") and cell.get("execution_count") is None
               for cell in notebook.cells if cell.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_prints_what_it_teaches(path, tmp_path):
    assert path.stem in CHECKS, f"{path.name} has no content checks in {Path(__file__).name}"
    if path.stem in REQUIRES:
        pytest.importorskip(REQUIRES[path.stem])
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, "\n".join(f"{o.ename}: {o.evalue}" for o in errors)
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    CHECKS[path.stem](text)
