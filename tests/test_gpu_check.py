"""The GPU check's CPU-side logic (this machine has no GPU): it refuses cleanly and writes
nothing without one, checks exactly the ops that have a triton backend, keeps going past
a case or a stage that raises, and writes its tables; FusedAdamW's Triton kernel check
runs here through Triton's interpreter, and the bf16 training stage on a tiny model."""

import json

import pytest
import torch

from te_lab import device as devices
from te_lab.benchmarks import cases, generation
from te_lab.cli import main as te_lab_main
from te_lab.gpu_checks import gpu_check, training_check
from te_lab.kernels.registry import registered_ops


@pytest.mark.parametrize("run", [lambda out: gpu_check.main(["--out", str(out)]),
                                 lambda out: te_lab_main(["gpu-check", "--out", str(out)])],
                         ids=["module", "te-lab gpu-check"])
def test_without_a_gpu_it_refuses_and_writes_nothing(run, tmp_path, capsys):
    if devices.is_gpu(devices.default_device()):
        pytest.skip("this machine has a GPU: the check runs for real there")
    assert run(tmp_path / "out") == 1
    assert "gpu_check: no CUDA or MUSA GPU on this machine; nothing to check" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_it_checks_every_op_with_a_triton_backend_and_skips_those_without():
    ops = gpu_check.triton_ops()
    assert "linear" not in ops  # a oneDNN projection: no triton backend to force
    assert all("triton" in registered_ops()[op].backends() for op in ops)
    assert {"rms_norm", "glu", "rope", "attention", "cross_entropy", "fused_linear_cross_entropy"} <= set(ops)


def test_a_case_that_raises_is_a_row_and_the_next_cases_run(monkeypatch):
    checked = []

    def check_case(case):
        checked.append(case.name)
        if case.op == "rope":
            raise RuntimeError("triton: out of resources")
        return True, 1e-6, 1e-6

    monkeypatch.setattr(gpu_check, "check_case", check_case)
    monkeypatch.setattr(gpu_check, "check_adamw", lambda device, dtype, shapes: (False, 3.0, 1.0))
    rows = gpu_check.correctness(torch.device("cpu"), ["float32"], gpu_check.Size(8, 512), lambda _: None)
    assert len(checked) == len(rows) - 1  # every case was tried, then FusedAdamW
    (rope,) = [row for row in rows if row["error"] is not None]
    assert "RuntimeError: triton: out of resources" in rope["error"] and not rope["passed"]
    assert rows[-1]["case"].startswith("FusedAdamW step") and rows[-1]["passed"] is False
    table = gpu_check.correctness_markdown(rows)
    assert "| ERROR: RuntimeError: triton: out of resources" in table and "| FAIL | 3 | 1 |" in table
    assert not gpu_check.stage_passed("correctness", rows)


def test_a_stage_that_raises_is_recorded_and_the_next_stage_runs(tmp_path):
    ran = []

    def failing():
        raise MemoryError("CUDA out of memory")

    stages = [("correctness", lambda: ran.append("correctness") or [{"passed": True}], lambda rows: "## ok\n"),
              ("training", failing, lambda result: "never"),
              ("profile", lambda: ran.append("profile") or {"model": "m"}, lambda result: "## profiled\n")]
    assert gpu_check.run_stages(stages, tmp_path, "# header\n", lambda _: None) is False
    assert ran == ["correctness", "profile"]
    report = (tmp_path / "gpu-check.md").read_text()
    assert report.startswith("# header") and "## training: FAILED" in report and "MemoryError: CUDA out of memory" \
        in report and report.endswith("## profiled\n")
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["failures"][0]["stage"] == "training" and results["profile"] == {"model": "m"}


def test_timing_table_shows_times_bandwidth_and_ratios_or_the_error():
    record = {"title": "RMSNorm", "contenders": [
        {"name": "eager", "error": None, "median_ms": 0.2, "gbs": 800.0, "fraction_of_peak_bandwidth": 800 / 4800},
        {"name": "te_lab[triton]", "error": None, "median_ms": 0.05, "gbs": 3200.0,
         "fraction_of_peak_bandwidth": 3200 / 4800},
        {"name": "liger", "error": "ImportError: no liger", "median_ms": None}],
        "speedups": [{"contender": "te_lab[triton]", "over": "eager", "value": 4.0}]}
    table = gpu_check.timing_markdown([record, {"title": "rope", "error": "RuntimeError: boom", "contenders": []}])
    assert "| RMSNorm | te_lab[triton] | 0.0500 | 3200 | 67% | 4.00x |" in table
    assert "| RMSNorm | eager | 0.2000 | 800 | 17% | - |" in table
    assert "| RMSNorm | liger | ERROR: ImportError: no liger |" in table and "| rope | ERROR: RuntimeError: boom |" \
        in table


def test_a_result_passes_within_twice_eagers_error_plus_the_dtypes_tolerance():
    truth = [torch.tensor([4.0, -1.0], dtype=torch.float64)]
    eager = [truth[0] + 0.005]
    # bfloat16 at 4.0 rounds in steps of 1/32: one rounding more than eager's must pass
    budget = 2 * 0.005 + 1e-2 + 1.6e-2 * 4.0
    assert gpu_check.compare_to_truth([truth[0] + 0.03], eager, truth, torch.bfloat16) == (
        True, pytest.approx(0.03), pytest.approx(0.005))
    assert gpu_check.compare_to_truth([truth[0] + budget * 1.01], eager, truth, torch.bfloat16)[0] is False
    # every tensor on its own: a good output does not excuse a bad gradient
    assert gpu_check.compare_to_truth([truth[0], truth[0] + 1.0], eager * 2, truth * 2, torch.bfloat16)[0] is False


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_adamw_triton_kernel_is_checked_against_torch_adamw(dtype):
    if not devices.triton_available(torch.device("cpu")):
        pytest.skip(devices.triton_unavailable_reason("cpu"))
    passed, triton_error, torch_error = gpu_check.check_adamw(torch.device("cpu"), dtype, [(64, 16), (16,)])
    assert passed
    if dtype == torch.float32:
        # three real steps (lr 1e-3 moves each weight by about 1e-3 a step), agreeing with float64 far closer
        assert 0 < triton_error < 1e-6 and torch_error < 1e-6


def test_fused_adamw_check_steps_copies_and_leaves_the_start_alone(monkeypatch):
    stepped = []

    class CountingAdamW(torch.optim.AdamW):
        def __init__(self, params, lr, backend=None):
            super().__init__(params, lr=lr, foreach=False)

        def step(self):
            stepped.append([p.detach().clone() for group in self.param_groups for p in group["params"]])
            return super().step()

    monkeypatch.setattr(gpu_check, "FusedAdamW", CountingAdamW)
    passed, error, torch_error = gpu_check.check_adamw(torch.device("cpu"), torch.float32, [(8, 4)])
    # the stand-in is torch's own AdamW: identical to the float32 run, each run from the same start
    # (runs sharing one start tensor would each step it further: float32 would trail float64 by ~3e-3)
    assert passed and error == torch_error < 1e-6 and len(stepped) == gpu_check.ADAMW_STEPS
    assert not torch.equal(stepped[0][0], stepped[-1][0])


def test_timing_runs_the_suites_cases_with_te_labs_triton_backend_only(monkeypatch):
    calls = []

    def run_op(op, size, dtype, modes, device, *, ceilings, rounds, warmup, progress, backends):
        calls.append((op, dtype, modes, backends))
        if op == "glu":
            raise RuntimeError("triton: out of shared memory")
        return [{"op": op, "title": op, "contenders": []}]

    monkeypatch.setattr(gpu_check.per_op, "run_op", run_op)
    monkeypatch.setattr(gpu_check.environment, "describe", lambda device: {
        "copy_bandwidth_gbs": 1.0, "peak": {"memory_bandwidth_gbs": 2.0, "fp32_tflops": None, "bf16_tflops": None}})
    records = gpu_check.timing(torch.device("cpu"), gpu_check.Size(8, 512), rounds=2, warmup=1, progress=print)
    assert [op for op, *_ in calls] == gpu_check.triton_ops() + ["adamw"]
    assert {(dtype, modes, backends) for _, dtype, modes, backends in calls} == {
        (torch.bfloat16, ("forward+backward",), ("triton",))}
    (failed,) = [r for r in records if r.get("error")]
    assert failed["op"] == "glu" and "out of shared memory" in failed["error"]
    assert not gpu_check.stage_passed("timing", records)


def test_te_lab_contenders_can_be_limited_to_some_backends():
    from te_lab.benchmarks import per_op

    cpu = torch.device("cpu")
    every = [backend for backend, _ in per_op.te_lab_backends("layer_norm", cpu)]
    assert len(every) > 1 and per_op.te_lab_backends("layer_norm", cpu, (every[-1],)) == [
        (backend, auto) for backend, auto in per_op.te_lab_backends("layer_norm", cpu) if backend == every[-1]]


def test_gpu_check_says_clearly_that_it_needs_a_gpu(capsys):
    if devices.is_gpu(devices.default_device()):
        pytest.skip("this machine has a GPU: the check runs for real there")
    assert gpu_check.main([]) == 1
    assert "gpu_check: no CUDA or MUSA GPU on this machine; nothing to check" in capsys.readouterr().err


def test_gpu_check_compares_triton_kernels_with_float64_truth():
    if not devices.triton_available(torch.device("cpu")):
        pytest.skip(devices.triton_unavailable_reason("cpu"))
    (case,) = cases.op_cases("rms_norm", torch.device("cpu"), torch.float32, cases.Size(tokens=8, hidden=512))
    passed, triton_error, reference_error = gpu_check.check_case(case)
    assert passed and 0 <= triton_error <= 2 * reference_error + 1e-5


@pytest.mark.slow
def test_autocast_training_check_trains_fused_and_unfused_side_by_side():
    # The check's machinery, on fused twins running te_lab's reference math: the kernels'
    # own autocast behaviour is tests/test_autocast.py's, and each Inductor backend would
    # compile a bfloat16 graph of its own here.
    result = training_check.autocast_training_check(torch.device("cpu"), model="llama-tiny", steps=3, batch=1, seq=16,
                                                    backend="reference")
    unfused, fused = result["losses"]["unfused"], result["losses"]["fused"]
    assert len(unfused) == len(fused) == 3
    assert unfused[-1] < unfused[0]  # it trains
    assert result["within_tolerance"], result["losses"]
    assert result["max_loss_difference"] == max(abs(f - u) for f, u in zip(fused, unfused))
    medians = result["median_step_ms"]
    assert result["fused_speedup"]["value"] == pytest.approx(medians["unfused"] / medians["fused"], rel=1e-12)


def test_the_generation_stage_tabulates_every_mode_and_fails_only_on_a_mode_that_broke():
    """gpu-check's generation stage is the generation benchmark on the GPU; run here on the
    CPU at a tiny size, its table and verdict are what the GPU run writes."""
    tiny = generation.Config(models=("llama-tiny",), batches=(1,), prompts=(8,), new_tokens=3, rounds=1,
                             modes=("eager", "fused"))
    records = generation.run(tiny, device=torch.device("cpu"))
    table = gpu_check.generation_markdown(records)
    assert table.startswith("## Generation") and "| llama-tiny | 1 | 8 | fused |" in table
    assert gpu_check.stage_passed("generation", records)
    records[0]["modes"]["fused"]["error"] = "RuntimeError: compile failed"
    assert not gpu_check.stage_passed("generation", records)
    assert generation.GPU_CHECK.modes == generation.MODES  # the GPU run compares every mode
