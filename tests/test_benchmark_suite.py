"""The benchmark suite (te_lab.benchmarks): its smallest configuration end to end, the
JSON against its schema, every speedup against the recorded medians; the pieces it is
built from (paired ratios, interleaving, bytes from shapes, targets) on known inputs."""

import json
import statistics

import pytest
import torch

from te_lab.benchmarks import cases, end_to_end, harness, per_op, stats, suite, targets
from te_lab.benchmarks.end_to_end import CONTENDERS as MODEL_CONTENDERS
from te_lab.benchmarks.hand_written import MARKER
from te_lab.benchmarks.schema import RESULTS_SCHEMA
from te_lab.models import build_model, example_batch


def _timing(name, samples):
    return harness.Timing(name, first_call_ms=1.0, samples_ms=list(samples))


def test_speedup_is_the_ratio_of_medians_with_paired_spread():
    fast, slow = _timing("fast", [1.0, 2.0, 1.0, 1.0, 4.0]), _timing("slow", [3.0, 2.0, 3.0, 3.0, 2.0])
    result = stats.speedup(fast, over=slow)
    assert result.value == pytest.approx(3.0 / 1.0)
    per_round = [3.0, 1.0, 3.0, 3.0, 0.5]
    q1, q2, q3 = statistics.quantiles(per_round, n=4)
    assert (result.round_q1, result.round_median, result.round_q3) == pytest.approx((q1, q2, q3))
    # Resampling whole rounds can only reach ratios of medians of the paired samples.
    assert 0.5 <= result.interval_low <= result.value <= result.interval_high <= 3.0
    assert stats.speedup(fast, over=slow) == result  # seeded: the same every time


def test_speedup_refuses_unpaired_samples():
    with pytest.raises(ValueError, match="paired rounds, got 2 and 3"):
        stats.speedup(_timing("a", [1, 2]), over=_timing("b", [1, 2, 3]))


def test_interleaved_rotates_the_order_and_keeps_a_failing_contender_as_a_result():
    calls = []

    def broken():
        raise RuntimeError("no kernel for this shape\nsecond line")

    contenders = [harness.Contender(name, (lambda name=name: calls.append(name))) for name in "ab"]
    contenders.append(harness.Contender("broken", broken))
    timings, _ = harness.interleaved(contenders, torch.device("cpu"), rounds=3, warmup=1)
    # first call + 1 warm-up each, then rounds a b / b a / a b
    assert calls == ["a", "a", "b", "b", "a", "b", "b", "a", "a", "b"]
    assert [len(timings[name].samples_ms) for name in "ab"] == [3, 3]
    assert timings["broken"].samples_ms == [] and timings["broken"].first_call_ms is None
    assert timings["broken"].error.startswith("RuntimeError: no kernel for this shape (at ")


def test_backward_contender_times_the_backward_of_a_fresh_forward():
    x = torch.randn(4, 3, requires_grad=True)
    upstream = harness.upstream_gradients(torch.sin, (x,))
    contender = harness.op_contender("sin", torch.sin, (x,), "backward", upstream)
    contender.before()
    (grad,) = contender.step()
    torch.testing.assert_close(grad, torch.cos(x.detach()) * upstream[0])
    assert x.grad is None


def test_bytes_moved_come_from_shapes_and_dtypes():
    case = cases.rms_norm_case(torch.device("cpu"), torch.bfloat16, cases.Size(tokens=4, hidden=512))
    activation, weight, rstd = 4 * 512 * 2, 512 * 2, 4 * 4  # bf16 x and w, float32 rstd per row
    assert case.bytes_for("forward") == 2 * activation + weight + rstd  # read x, w; write y, rstd
    assert case.bytes_for("backward") == 3 * activation + 2 * weight + rstd  # read dy, x, w, rstd; write dx, dw
    assert case.bytes_for("forward+backward") == 5 * activation + 3 * weight + 2 * rstd
    flce = cases.fused_linear_cross_entropy_case(torch.device("cpu"), torch.float32, cases.Size(4, 512))
    tokens, hidden, vocab = 4, 512, cases.VOCAB
    # three products, the cross-entropy's 8 per logit, the stored gradients scaled by the
    # loss's gradient, and a few scalar ops averaging the 4 tokens' losses
    expected = 3 * 2 * tokens * hidden * vocab + 8 * tokens * vocab + (tokens + vocab) * hidden
    assert flce.flops_for("forward+backward") == pytest.approx(expected, abs=32)


def _op_record(te_lab_over_eager, te_lab_over_compile, compile_over_eager):
    def ratio(contender, over, value):
        return {"contender": contender, "over": over, "value": value, "interval_low": value - 0.1,
                "interval_high": value + 0.1, "round_median": value, "round_q1": value, "round_q3": value}

    contender = {"kind": "te_lab", "auto": True, "error": None, "name": "te_lab[native]"}
    return {"op": "layer_norm", "case": "layer_norm", "dtype": "float32", "mode": "forward",
            "size": {"tokens": 8, "hidden": 512}, "contenders": [contender, {"kind": "eager", "name": "eager",
                                                                           "auto": False, "error": None}],
            "speedups": [ratio("te_lab[native]", "eager", te_lab_over_eager),
                         ratio("te_lab[native]", "torch.compile", te_lab_over_compile),
                         ratio("torch.compile", "eager", compile_over_eager)]}


def test_targets_say_plainly_what_was_missed():
    results = {"environment": {"device": "cpu"}, "models": [],
               "ops": [_op_record(1.3, 1.1, 0.8), _op_record(0.9, 0.93, 1.2)]}
    by_text = {t["target"]: t for t in targets.evaluate(results)}
    never_slower = by_text["every op (CPU, float32): never slower than the eager baseline, at every size"]
    assert never_slower["met"] is False and never_slower["measured"] == "met in 1 of 2 measurements"
    assert never_slower["detail"] == ["MISSED layer_norm T=8 H=512 float32 forward: te_lab[native] 0.90x [0.80-1.00]"]
    ahead = by_text["every op (CPU, float32): ahead of torch.compile where torch.compile loses to eager "
                    "(as on add + LayerNorm)"]
    assert ahead["met"] is True and ahead["measured"] == "met in 1 of 1 measurements"
    # 8 rows: below the 1024 rows from which torch.compile's steady state is a target.
    assert by_text["every op (CPU, float32): at least 0.95x torch.compile's steady state from 1024 rows up"][
        "met"] is None
    assert by_text["training step with fusion alone (te_lab::linear's routing off, CPU): at least 1.1x eager"][
        "met"] is None
    dispatch = targets.evaluate({**results, "dispatch": [
        {"case": "rms_norm", "tokens": 64, "hidden": 64, "overhead_per_call_us": 9.0},
        {"case": "glu[silu]", "tokens": 64, "hidden": 64, "overhead_per_call_us": 40.0}]})
    per_call = next(t for t in dispatch if t["target"].startswith("every op (CPU, float32): per call"))
    assert per_call["met"] is False and per_call["measured"] == "met in 1 of 2 measurements"
    assert per_call["detail"] == ["MISSED glu[silu] at 64 x 64: 40.0 us per call above its kernels"]
    assert by_text["training step (GPU): at least 1.4x eager"]["measured"] == "not measured on this device"


def test_the_moe_targets_read_the_block_at_1024_x_256_and_the_qwen3_moe_step_at_4_x_256():
    def moe(tokens, over_eager, over_compile):
        return {**_op_record(over_eager, over_compile, 1.0), "op": "moe", "case": "moe", "mode": "forward+backward",
                "size": {"tokens": tokens, "hidden": 256}}

    def step(batch, seq, over_eager):
        return {"model": "hf:qwen3_moe-mini", "mode": "train", "batch": batch, "seq": seq, "speedups": [
            {"contender": "te_lab", "over": "eager", "value": over_eager, "interval_low": over_eager - 0.1,
             "interval_high": over_eager + 0.1}]}

    results = {"environment": {"device": "cpu"}, "ops": [moe(1024, 3.4, 0.9), moe(256, 1.5, 0.5)],
               "models": [step(4, 256, 2.3), step(1, 16, 1.2)]}
    by_text = {t["target"]: t for t in targets.evaluate(results)}
    block = "MoE block, 32 experts of width 128, top-4, 1024 x 256 (CPU, float32, forward+backward): "
    over_eager = by_text[block + "at least 3x Hugging Face's eager experts"]
    assert over_eager["met"] is True and over_eager["measured"] == "met in 1 of 1 measurements"  # 256 rows: not it
    assert over_eager["detail"] == ["moe T=1024 H=256 float32 forward+backward: te_lab[native] 3.40x [3.30-3.50]"]
    assert by_text[block + "ahead of torch.compile of the same block"]["met"] is False
    model = by_text["training step of the 2-layer Qwen3-MoE (hf:qwen3_moe-mini) at 4 x 256 (CPU): at least 2x eager"]
    assert model["met"] is True and model["detail"] == ["hf:qwen3_moe-mini train: te_lab 2.30x [2.20-2.40] over eager"]
    unmeasured = {t["target"]: t for t in targets.evaluate({**results, "ops": [], "models": [step(1, 16, 1.2)]})}
    assert unmeasured[model["target"]]["met"] is None


def test_unknown_options_are_refused_with_what_was_expected(capsys):
    assert suite.main(["--profile", "smoke", "--dtypes", "float8"]) == 2
    assert "--dtypes: got 'float8'; expected one of float32, bfloat16, float16" in capsys.readouterr().err
    assert suite.main(["--ops", "rms_norm", "--json", "/nonexistent/folder/results.json"]) == 2


def _recorded_speedups_match_medians(record):
    medians = {c["name"]: c["median_ms"] for c in record["contenders"] if c["error"] is None}
    for contender in record["contenders"]:
        if contender["error"] is None:
            assert contender["median_ms"] == statistics.median(contender["samples_ms"])
    for ratio in record["speedups"]:
        assert ratio["value"] == pytest.approx(medians[ratio["over"]] / medians[ratio["contender"]], rel=1e-12)
    return medians


@pytest.mark.slow
def test_smallest_configuration_end_to_end(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("plotly")
    paths = {kind: tmp_path / f"results.{kind}" for kind in ("json", "md", "html")}
    hand_written = f"{MARKER}\n\n## Why the misses\n\nMeasured by hand on a quiet machine.\n"
    paths["md"].write_text("# an older run's tables\n\n" + hand_written)
    status = suite.main(["--profile", "smoke", "--device", "cpu", "--json", str(paths["json"]),
                         "--markdown", str(paths["md"]), "--html", str(paths["html"])])
    assert status == 0
    results = json.loads(paths["json"].read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["environment"]["copy_bandwidth_gbs"] > 0

    timed_backends = {f"te_lab[{backend}]" for backend, _ in per_op.te_lab_backends("rms_norm", torch.device("cpu"))}
    rms_records = [r for r in results["ops"] if r["op"] == "rms_norm"]
    assert sorted(r["mode"] for r in rms_records) == sorted(per_op.OP_MODES)
    for record in results["ops"]:
        medians = _recorded_speedups_match_medians(record)
        names = {c["name"] for c in record["contenders"]}
        assert {"eager", "torch.compile"} <= set(medians), record["contenders"]
        if record["op"] == "rms_norm":
            assert names == {"eager", "torch.compile"} | timed_backends
            assert sum(c["auto"] for c in record["contenders"]) == 1
            contender = record["contenders"][0]
            assert contender["gbs"] == pytest.approx(record["bytes_moved"] / (contender["median_ms"] * 1e-3) / 1e9)
    adamw = next(r for r in results["ops"] if r["op"] == "adamw")
    assert adamw["mode"] == "step" and len(adamw["speedups"]) >= 3

    assert [r["mode"] for r in results["models"]] == ["train"]
    for record in results["models"]:
        medians = _recorded_speedups_match_medians(record)
        assert set(medians) == set(MODEL_CONTENDERS), [c["error"] for c in record["contenders"]]
        assert record["check"]["max_abs_difference"] < 1e-4  # eager and fused agree on the first step
        te_lab_row = next(c for c in record["contenders"] if c["name"] == "te_lab")
        assert te_lab_row["time_to_first_step_s"] == pytest.approx(record["fuse_s"] + te_lab_row["first_call_ms"] / 1e3)

    report = paths["md"].read_text()
    assert "an older run's tables" not in report and report.endswith("\n" + hand_written)  # the hand part is kept
    for target in results["targets"]:
        assert target["target"] in report
    assert "| llama-tiny | train | torch.compile(te_lab) |" in report
    page = paths["html"].read_text()
    assert "plotly" in page and "<script src=\"http" not in page  # plotly.js inlined: opens offline


@pytest.mark.parametrize("name", ["llama-tiny", "hf:llama-tiny"])
def test_inference_contender_runs_the_forward_without_autograd_in_eval_mode(name):
    # Hugging Face models run without a KV cache: one forward over the sequence
    expected_kwargs = {"use_cache": False} if name.startswith("hf:") else {}
    if expected_kwargs:
        pytest.importorskip("transformers")
    model = build_model(name)
    batch = example_batch(model, 1, 8)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    contender = end_to_end._inference_contender("eager", model, model, batch)
    _, logits = harness.timed_call(contender, torch.device("cpu"))
    assert not model.training and not logits.requires_grad
    assert seen == [{"input_ids": batch["input_ids"], **expected_kwargs}]
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=batch["input_ids"], **expected_kwargs).logits)


def test_a_case_that_breaks_is_recorded_and_the_run_goes_on(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    path = tmp_path / "results.json"
    # hidden 100 has no whole 128-wide heads: rope's case refuses it, attention's too
    assert suite.main(["--profile", "smoke", "--ops", "rope,attention", "--models", "none", "--sizes", "32x100",
                       "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["ops"] == [] and results["models"] == []
    assert [f["where"] for f in results["failures"]] == ["attention T=32 H=100 float32", "rope T=32 H=100 float32"]
    assert results["failures"][0]["error"].startswith("ValueError: op cases: hidden 100 must be a multiple of 128")


def test_the_automatic_contender_is_the_backend_the_measured_choice_runs(tmp_path, monkeypatch):
    from te_lab.kernels import measured_choice

    monkeypatch.setenv(measured_choice.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(measured_choice, "_decisions", {})
    monkeypatch.setattr(measured_choice, "_known", {})
    cpu = torch.device("cpu")
    case = cases.op_cases("layer_norm", cpu, torch.float32, cases.Size(64, 64))[0]
    automatic = per_op.automatic_backend(case, cpu)
    (decision,) = measured_choice.decisions().values()
    assert automatic == decision["choice"] in ("cpp", "native", "inductor")
    functions = per_op.case_functions(case, cpu)
    assert [name for name, (_, info) in functions.items() if info.auto] == [f"te_lab[{automatic}]"]
    # Ops whose choice does not depend on the inputs keep the registry's answer.
    attention_case = cases.op_cases("attention", cpu, torch.float32, cases.Size(64, 512))[0]
    assert per_op.automatic_backend(attention_case, cpu) is None
