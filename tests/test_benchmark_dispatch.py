"""The dispatch benchmark (benchmarks/dispatch.py) and the suite's model entries."""

import pytest
import torch

from te_lab.benchmarks import dispatch
from te_lab.benchmarks.cases import Size, op_cases
from te_lab.benchmarks.harness import upstream_gradients
from te_lab.benchmarks.suite import PROFILES
from te_lab.kernels import rms_norm

CPU = torch.device("cpu")


def _prefer_cpp(candidates):
    """The measured choice's timing, faked: the C++ kernels fastest (every sample still runs once)."""
    for run in candidates.values():
        run()
    return {name: (1.0 if name == "cpp" else 2.0) for name in candidates}


@pytest.fixture
def cpp_measured_fastest(monkeypatch, tmp_path):
    """Automatic choices measured afresh (in a cache of their own) with the C++ kernels
    timed fastest: the ops run their kernels, whatever this machine would pick."""
    from te_lab.kernels import measured_choice

    monkeypatch.setattr(measured_choice, "_median_times_us", _prefer_cpp)
    monkeypatch.setenv(measured_choice.CACHE_ENV, str(tmp_path))
    measured_choice._known.clear()
    measured_choice._decisions.clear()
    yield measured_choice
    measured_choice._known.clear()
    measured_choice._decisions.clear()


def _fused(case):
    return lambda *inputs: case.fused(*inputs, backend=None)


def test_recorded_kernels_replay_the_ops_forward_and_backward_with_their_own_arguments(cpp_measured_fastest):
    [case] = op_cases("rms_norm", CPU, torch.float32, Size(16, 64))
    fused = _fused(case)
    calls = dispatch.recorded_kernels(fused, case.inputs, upstream_gradients(fused, case.inputs))
    assert [op.name for op, _ in calls] == ["rms_norm", "rms_norm_backward"]
    (forward_op, forward_args), _ = calls
    # Replaying the implementation computes what the public op computes.
    replayed, _, _ = forward_op.__wrapped__(*forward_args)
    x, weight = case.inputs
    torch.testing.assert_close(replayed, rms_norm(x.detach(), weight.detach()))


def test_the_bias_act_case_times_the_op_alone_not_linear_acts_gemm(cpp_measured_fastest):
    """The per-op suite times linear_act (a GEMM, then bias + GELU); its GEMM is no te_lab
    op, so a kernels-alone replay would leave it out and count it as overhead. The
    dispatch benchmark's case is the op itself, and its replay is the whole step."""
    [suite_case] = op_cases("bias_act", CPU, torch.float32, Size(16, 64))
    [case] = op_cases("bias_act", CPU, torch.float32, Size(16, 64), dispatch=True)
    assert len(suite_case.inputs) == 3 and [tuple(t.shape) for t in case.inputs] == [(16, 64), (64,)]
    x, bias = case.inputs
    torch.testing.assert_close(case.fused(x, bias, backend=None), torch.nn.functional.gelu(x + bias))
    fused = _fused(case)
    calls = dispatch.recorded_kernels(fused, case.inputs, upstream_gradients(fused, case.inputs))
    assert [op.name for op, _ in calls] == ["bias_act", "bias_act_backward"]
    (forward_op, forward_args), _ = calls
    torch.testing.assert_close(forward_op.__wrapped__(*forward_args), torch.nn.functional.gelu(x + bias))


def test_a_case_reports_medians_and_the_overhead_per_call_from_them():
    [case] = op_cases("rms_norm", CPU, torch.float32, Size(16, 64))
    result = dispatch.run_case(case, Size(16, 64), CPU, rounds=3, calls=2)
    record = dispatch.as_record(result)
    assert record["phase"] == "training"
    # reference runs no te_lab op: then there is nothing to replay
    assert record["te_lab_op_calls"] == (0 if record["backend"] == "reference" else 2)
    us = record["median_us"]
    assert set(us) == {"te_lab", "kernels", "autograd", "eager"} and all(v > 0 for v in us.values())
    if record["te_lab_op_calls"]:
        assert record["overhead_per_call_us"] == pytest.approx((us["te_lab"] - us["kernels"] - us["autograd"]) / 2)
    assert record["te_lab_vs_eager"]["interval_low"] <= record["te_lab_vs_eager"]["interval_high"]
    [row] = dispatch.markdown([record])[2:]
    assert row.startswith("| rms_norm | training | 16x64 |")


@pytest.mark.parametrize("phase, tokens", [("decode", 1), ("prefill", dispatch.PREFILL_TOKENS)])
def test_decode_and_prefill_rows_time_the_forward_without_gradients_and_no_autograd(cpp_measured_fastest, phase,
                                                                                    tokens):
    [case] = op_cases("rms_norm", CPU, torch.float32, Size(tokens, 64), dispatch=True)
    record = dispatch.as_record(dispatch.run_case(case, Size(tokens, 64), CPU, rounds=3, calls=2, phase=phase))
    # The choice made is the one for calls without gradients.
    key = f"rms_norm: CPU backend ('float32', {tokens}, 64, 'inference')"
    assert cpp_measured_fastest.decisions()[key]["choice"] == "cpp"
    assert (record["phase"], record["tokens"], record["hidden"]) == (phase, tokens, 64)
    assert record["backend"] == "cpp" and record["te_lab_op_calls"] == 1  # the forward op alone
    us = record["median_us"]
    assert set(us) == {"te_lab", "kernels", "eager"} and all(v > 0 for v in us.values())
    assert record["overhead_per_call_us"] == pytest.approx(us["te_lab"] - us["kernels"])
    [row] = dispatch.markdown([record])[2:]
    assert row.startswith(f"| rms_norm | {phase} | {tokens}x64 | cpp |")
    assert row.split(" | ")[6] == "-"  # no autograd round trip without gradients


def test_model_entries_carry_their_own_batch_and_sequence():
    cpu = PROFILES["cpu"]
    assert cpu.model_batches() == [("llama-tiny", 2, 64), ("llama-mini", 2, 128), ("hf:llama-mini", 4, 256),
                                   ("hf:qwen3_moe-mini", 4, 256)]
    assert PROFILES["quick"].model_batches() == [("llama-mini", 2, 128)]
    from dataclasses import replace
    with pytest.raises(ValueError, match=r"expected NAME or NAME@BATCHxSEQ"):
        replace(cpu, models=("llama-tiny@2by64",)).model_batches()
