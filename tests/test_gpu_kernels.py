"""te_lab's Triton kernels compiled for real GPUs on this CPU-only machine
(te_lab.gpu_checks.gpu_kernels): sm_90 and sm_80 under the newest Triton, sm_80 under
Triton 3.2 (the MUSA release; `make test-triton32` runs this file there too).

Heavier than the other tests: recording CI's scenarios takes seconds, compiling their
launches (about 50, each for every target, in two processes) a few minutes on CI's
2 cores. The full scenario set, for docs/gpu-kernels.md, is `python -m
te_lab.gpu_checks.gpu_kernels record` without --ci.
"""

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from te_lab.gpu_checks.kernel_compile import TARGETS, problems, spills, theoretical_occupancy
from te_lab.gpu_checks.kernel_lint import lint_kernels, lint_source
from te_lab.kernels.triton_support import HAS_TRITON

REPO = Path(__file__).resolve().parent.parent
KERNEL_MODULES = ["rms_norm", "layer_norm", "cross_entropy", "fused_linear_cross_entropy", "attention", "rope",
                  "glu", "bias_act", "adamw", "moe"]

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
# the first test to use the compile fixture waits for it: minutes, more on a busy machine
compiles = pytest.mark.timeout(1800)


def _gpu_kernels(*args):
    command = [sys.executable, "-m", "te_lab.gpu_checks.gpu_kernels", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=1500)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(records, compile results) of CI's scenarios for this Triton's targets."""
    folder = tmp_path_factory.mktemp("gpu-kernels")
    recorded = _gpu_kernels("record", "--ci", "--out", str(folder / "records.json"))
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    compiling = _gpu_kernels("compile", "--jobs", "2", "--records", str(folder / "records.json"),
                             "--out", str(folder / "results.json"))
    results = json.loads((folder / "results.json").read_text())
    return json.loads((folder / "records.json").read_text()), results, compiling


def _kernel_names():
    """Every Triton kernel the op files define (``*_kernel``: the jit functions launched with
    a grid; helpers they call are named otherwise), whether compiled or interpreted here."""
    names = set()
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"te_lab.kernels.{module_name}")
        for name, value in vars(module).items():
            function = getattr(value, "fn", None)
            if name.endswith("_kernel") and inspect.isfunction(function) and function.__module__ == module.__name__:
                names.add(name)
    return names


@pytest.mark.triton_interpreter
@needs_triton
@compiles
def test_every_kernel_is_launched_and_compiled_for_every_target(compiled):
    records, results, _ = compiled
    targets = {"sm_80"} if results["triton"].startswith("3.2.") else {"sm_90", "sm_80"}
    assert set(results["targets"]) == targets
    launched = {record["kernel"].split(":")[1] for record in records["records"]}
    assert _kernel_names() <= launched
    assert len(results["results"]) == len(records["records"]) * len(targets)
    errors = [f"{r['kernel']} {r['target']}: {r['error'][:200]}" for r in results["results"] if r["status"] != "ok"]
    assert errors == []


@pytest.mark.triton_interpreter
@needs_triton
@compiles
def test_no_spills_or_shared_memory_over_the_limit_at_realistic_sizes(compiled):
    _, results, compiling = compiled
    found = [f"{r['kernel']} {r['target']} ({r['scenarios'][0]}): {problem}"
             for r in results["results"] for problem in problems(r)]
    assert found == []
    assert compiling.returncode == 0, compiling.stderr


@pytest.mark.triton_interpreter
@needs_triton
@compiles
def test_tensor_cores_where_the_dtype_allows_them(compiled):
    """Half-precision attention and TF32-allowed float32 use mma (sm_80) or wgmma (sm_90);
    IEEE float32 multiplies on the FMA units; the norms have no dots at all."""
    _, results, _ = compiled

    def tensor_core_instructions(kernel, scenario):
        chosen = [r for r in results["results"] if r["kernel"] == kernel and scenario in r["scenarios"]]
        assert chosen, (kernel, scenario)
        return {r["target"]: r["mma"] + r["wgmma"] for r in chosen}

    for scenario in ("attention bf16 head_dim=128", "attention fp32 head_dim=64 causal tf32"):
        assert all(count > 0 for count in tensor_core_instructions("_attention_dq_kernel", scenario).values())
    assert set(tensor_core_instructions("_attention_dq_kernel", "attention fp32 head_dim=64 causal").values()) == {0}
    assert set(tensor_core_instructions("_rms_norm_backward_kernel", "rms_norm bf16 hidden=8192 +residual")
               .values()) == {0}


def test_theoretical_occupancy_follows_registers_warps_and_shared_memory():
    h100 = TARGETS[90]
    assert theoretical_occupancy(h100, 32, 4, 0) == (16, 1.0)  # warp-limited: 16 blocks of 4 warps
    # 255 registers round to 256 per thread: 64K registers hold 2 blocks of 4 warps
    assert theoretical_occupancy(h100, 255, 4, 0) == (2, 0.125)
    # 100 KB blocks: two fit in 228 KB of shared memory
    assert theoretical_occupancy(h100, 32, 4, 100 * 1024) == (2, 0.125)


def test_spills_and_problems_read_the_compile_result():
    ok = {"status": "ok", "stack_bytes": 0, "local_bytes": 0, "shared": 1000, "static_shared": 0,
          "shared_over_limit": False, "registers": 100, "realistic": True, "target": "sm_80"}
    assert not spills(ok) and problems(ok) == []
    spilling = dict(ok, stack_bytes=56, registers=255)
    assert spills(spilling) and problems(spilling) == [
        "spills: 56 B stack frame, 0 B local memory at 255 registers"]
    assert problems(dict(spilling, realistic=False)) == []
    assert problems({"status": "error", "error": "CompilationError: boom"}) == ["compile error: CompilationError: boom"]


def test_no_musa_rejected_construct_in_the_kernels():
    assert [str(finding) for finding in lint_kernels(REPO / "kernels")] == []


def test_the_lint_finds_annotated_assignments_in_kernels_only():
    source = '''
import triton
import triton.language as tl

@triton.jit
def kernel(X):
    total: tl.int32 = 0
    for i in range(4):
        step: tl.float32 = 1.0

def host_code():
    count: int = 0
'''
    found = lint_source(source, "example.py")
    assert [(finding.line, finding.function) for finding in found] == [(7, "kernel"), (9, "kernel")]
    assert "total: tl.int32 = 0" in found[0].construct


@needs_triton
def test_the_doc_lists_every_kernel_for_every_target():
    text = (REPO / "docs" / "gpu-kernels.md").read_text(encoding="utf-8")
    for kernel in _kernel_names():
        for target in ("sm_90", "sm_80"):
            assert f"| `{kernel}` | {target} |" in text, (kernel, target)
    assert "## Triton 3.2.0: sm_80" in text
    assert "Scenarios: every scenario of `te_lab.gpu_checks.kernel_scenarios`" in text  # the full set
