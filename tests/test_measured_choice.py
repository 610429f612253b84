"""Machine-dependent choices: measured once, cached per machine, overridable."""

import importlib
import json
import time

import pytest
import torch

from te_lab import status
from te_lab.kernels import available_backends, measured_choice, registered_ops, use_backend
from te_lab.kernels.registry import describe_backend

linear = importlib.import_module("te_lab.kernels.linear")  # the module: te_lab.kernels.linear is the op


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(measured_choice.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(measured_choice.CHOICES_ENV, raising=False)
    measured_choice._decisions.clear()
    measured_choice._known.clear()
    yield tmp_path
    measured_choice._decisions.clear()
    measured_choice._known.clear()


def _counting(calls, name, seconds):
    """A candidate that computes for ``seconds`` of this thread's CPU time (not a sleep:
    on one thread a sample is timed by CPU time, in which waiting does not count)."""
    def run():
        calls[name] = calls.get(name, 0) + 1
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    return run


def test_the_faster_candidate_is_chosen_once_and_remembered_on_disk(fresh_cache):
    calls = {}
    candidates = lambda: {"slow": _counting(calls, "slow", 0.003), "fast": _counting(calls, "fast", 0.0)}  # noqa: E731
    assert measured_choice.choose("demo", (64,), candidates, default="slow") == "fast"
    # Warm-up calls, then interleaved rounds of equally many calls each (>= 1 per sample).
    assert calls["slow"] == calls["fast"] >= measured_choice.WARMUP + measured_choice.ROUNDS
    rounds = calls["slow"]
    assert measured_choice.choose("demo", (64,), candidates, default="slow") == "fast"
    assert calls == {"slow": rounds, "fast": rounds}  # not measured again
    # A new process reads the decision from the cache file, named by the machine.
    [cache] = fresh_cache.glob("choices-*.json")
    saved = json.loads(cache.read_text())
    assert saved["machine"] == measured_choice.machine_fingerprint()
    assert saved["decisions"]["demo (64,)"]["choice"] == "fast"
    assert saved["decisions"]["demo (64,)"]["median_us"]["slow"] >= 3000
    measured_choice._decisions.clear()
    measured_choice._known.clear()
    assert measured_choice.choose("demo", (64,), candidates, default="slow") == "fast"
    assert calls == {"slow": rounds, "fast": rounds}


@pytest.mark.parametrize("threads", [1, 2])
def test_on_one_thread_waiting_is_not_counted_against_a_candidate(threads):
    """On one thread a sample is timed by the thread's CPU time, so a candidate that merely
    waits (as one preempted by another process on a loaded machine does) is not charged
    for it; with more threads, by the wall clock, which counts what other threads do."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = measured_choice.median_times_now({"waits": lambda: time.sleep(0.002),
                                                  "computes": _counting({}, "computes", 0.0005)})
    finally:
        torch.set_num_threads(previous)
    assert min(times, key=times.get) == ("waits" if threads == 1 else "computes")


def test_measuring_off_keeps_the_default_and_bad_values_are_refused(fresh_cache, monkeypatch):
    calls = {}
    candidates = lambda: {"a": _counting(calls, "a", 0.0), "b": _counting(calls, "b", 0.0)}  # noqa: E731
    monkeypatch.setenv(measured_choice.CHOICES_ENV, "off")
    assert measured_choice.choose("demo", (8,), candidates, default="b") == "b"
    assert calls == {}
    monkeypatch.setenv(measured_choice.CHOICES_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"TE_LAB_CHOICES='sometimes': expected 'on' or 'off'"):
        measured_choice.choose("demo", (8,), candidates, default="b")


def test_size_classes_are_powers_of_two():
    assert [measured_choice.size_class(n) for n in (1, 2, 3, 255, 256, 257)] == [1, 2, 4, 256, 256, 512]


@pytest.mark.skipif(not linear.LINEAR.native_supports("cpu"), reason="this torch build has no oneDNN linear")
def test_linear_routing_follows_the_measurement_and_te_lab_info_shows_it(fresh_cache):
    x, weight = torch.randn(200, 256), torch.randn(256, 256)
    out = linear.linear(x, weight)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    key = "linear: CPU backend ('float32', 256, 256, 256)"
    decision = measured_choice.decisions()[key]
    assert set(decision["median_us"]) == {"native", "reference"}
    assert decision["choice"] == min(decision["median_us"], key=decision["median_us"].get)
    with torch.profiler.profile() as trace:
        linear.linear(x, weight)
    ran_onednn = "te_lab::linear" in {event.name for event in trace.events()}
    assert ran_onednn == (decision["choice"] == "native")
    assert any(line.strip().startswith(key + f": {decision['choice']}") for line in status.status_lines())
    # Forcing still overrides the measurement.
    with torch.profiler.profile() as trace:
        linear.linear(x, weight, backend="native")
    assert "te_lab::linear" in {event.name for event in trace.events()}


@pytest.mark.skipif(not linear.LINEAR.native_supports("cpu"), reason="this torch build has no oneDNN linear")
def test_reports_say_that_the_routing_is_measured_unless_forced():
    cpu = torch.device("cpu")
    assert describe_backend(linear.LINEAR, cpu) == "native or reference, whichever measured faster here for the sizes"
    with use_backend(linear="native"):
        assert describe_backend(linear.LINEAR, cpu) == "native"
    assert describe_backend(linear.LINEAR, cpu, "reference") == "reference"


@pytest.mark.parametrize("op_name, call, sizes", [
    pytest.param("layer_norm", lambda module, x: module.layer_norm(x, torch.ones(64), torch.zeros(64)),
                 "('float32', 64, 64)", id="layer_norm"),
    pytest.param("bias_act", lambda module, x: module.bias_act(x, torch.zeros(64), "silu"),
                 "('float32', 64, 64, 'silu')", id="bias_act"),
    pytest.param("rms_norm", lambda module, x: module.rms_norm(x, torch.ones(64)), "('float32', 64, 64)",
                 id="rms_norm"),
    pytest.param("glu", lambda module, x: module.glu(x, x, "gelu"), "('float32', 64, 64, 'gelu')", id="glu"),
    # q and k of 60 rows each: 120 rows rotated, the class of 128
    pytest.param("rope", lambda module, x: module.rope(x[None], x[None], torch.ones(x.shape[-2], 64),
                                                               torch.zeros(x.shape[-2], 64)),
                 "('float32', 128, 64, False, False)", id="rope"),
    pytest.param("cross_entropy",
                 lambda module, x: module.cross_entropy(x, torch.zeros(x.shape[:-1], dtype=torch.long)),
                 "('float32', 64, 64)", id="cross_entropy"),
    # 60 tokens in one chunk over a vocabulary of 32
    pytest.param("fused_linear_cross_entropy", lambda module, x: module.fused_linear_cross_entropy(
        x, torch.ones(32, 64), torch.zeros(x.shape[:-1], dtype=torch.long)), "('float32', 64, 32)", id="flce"),
])
def test_the_automatic_cpu_backend_is_the_measured_fastest_one(fresh_cache, monkeypatch, op_name, call, sizes):
    module = importlib.import_module(f"te_lab.kernels.{op_name}")
    op = registered_ops()[op_name]
    runnable = {name for name in op.cpu_measured if name in available_backends(op, torch.device("cpu"))}
    op_function = f"_{op_name}_op"
    ran = []
    original = getattr(module, op_function)
    monkeypatch.setattr(module, op_function, lambda *args: ran.append(args[-1]) or original(*args))
    x = torch.randn(3, 20, 64)  # 60 rows: the class of 64
    call(module, x)
    decision = measured_choice.decisions()[f"{op_name}: CPU backend {sizes}"]
    assert set(decision["median_us"]) == runnable and len(runnable) >= 2
    assert decision["choice"] == min(decision["median_us"], key=decision["median_us"].get)
    # The unfused math is a contender (the LM head's chunks choose between row kernels only).
    assert ("reference" in runnable) == (op_name != "fused_linear_cross_entropy")
    ran.clear()  # the samples ran the op too
    call(module, x)
    # The reference runs no te_lab op.
    assert ran == ([] if decision["choice"] == "reference" else [decision["choice"]])
    call(module, x[:, :2])  # 6 rows: a new class, measured too
    assert len([key for key in measured_choice.decisions() if key.startswith(op_name)]) == 2
    with use_backend(**{op_name: "inductor"}):
        call(module, x[:1, :1])
    # A forced backend is not measured; the report states the automatic choice as measured.
    assert ran[-1] == "inductor" and len([key for key in measured_choice.decisions() if key.startswith(op_name)]) == 2
    assert describe_backend(op, torch.device("cpu")) == (
        f"{' or '.join(op.cpu_measured)}, whichever measured faster here for the sizes")


def test_nothing_is_measured_under_a_mode_that_would_take_over_the_samples(fresh_cache):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    bias_act = importlib.import_module("te_lab.kernels.bias_act")
    with FakeTensorMode():
        fake = bias_act.bias_act(torch.randn(64, 256), torch.zeros(256), "gelu")
    assert fake.shape == (64, 256)
    graph = make_fx(lambda x: bias_act.bias_act(x, None, "silu"), tracing_mode="symbolic")(torch.randn(32, 128))
    x = torch.randn(32, 128)
    torch.testing.assert_close(graph(x), torch.nn.functional.silu(x))
    assert measured_choice.decisions() == {}


def test_a_first_measurement_inside_a_checkpointed_region_leaves_its_recomputation_alone(fresh_cache):
    """The samples' saved tensors are their own: a checkpoint around the measuring call
    counts only the region's, and its recomputation (the choice known by then) matches."""
    glu = importlib.import_module("te_lab.kernels.glu")
    gate = torch.randn(12, 64, requires_grad=True)

    def region(x):
        return glu.glu(x, x * 2, "silu") * 3

    out = torch.utils.checkpoint.checkpoint(region, gate, use_reentrant=False)
    assert list(measured_choice.decisions()) == ["glu: CPU backend ('float32', 16, 64, 'silu')"]
    (grad,) = torch.autograd.grad(out.sum(), gate)
    expected_gate = gate.detach().requires_grad_()
    (expected,) = torch.autograd.grad(region(expected_gate).sum(), expected_gate)
    torch.testing.assert_close(grad, expected)


def _fake_timings(times_us):
    """A stand-in for the interleaved timing: each candidate's median as given (the
    candidates' samples still run once each, so they are checked to work)."""
    def median_times_us(candidates):
        for run in candidates.values():
            run()
        return {name: times_us[name] for name in candidates}
    return median_times_us


def test_the_unfused_math_is_chosen_where_it_measured_faster_and_forward_only_calls_have_their_own_class(
        fresh_cache, monkeypatch):
    rms_norm = importlib.import_module("te_lab.kernels.rms_norm")
    op = registered_ops()["rms_norm"]
    assert "reference" in op.cpu_measured
    runnable = [name for name in op.cpu_measured if name in available_backends(op, torch.device("cpu"))]
    trained = []
    samples = op.cpu_samples
    monkeypatch.setattr(type(op), "cpu_samples", property(lambda self: lambda *args, **kwargs: (
        trained.append(kwargs["training"]) or samples(*args, **kwargs))), raising=False)
    ran = []
    original = rms_norm._rms_norm_op
    monkeypatch.setattr(rms_norm, "_rms_norm_op", lambda *args: ran.append(args[-1]) or original(*args))
    # Decode: one row, no gradients; the unfused math measured fastest.
    monkeypatch.setattr(measured_choice, "_median_times_us",
                        _fake_timings({"cpp": 30.0, "inductor": 40.0, "reference": 10.0}))
    x, weight = torch.randn(1, 1, 64), torch.rand(64) + 0.5
    with torch.no_grad():
        out = rms_norm.rms_norm(x, weight)
    torch.testing.assert_close(out, rms_norm.rms_norm_reference(x, weight))
    decision = measured_choice.decisions()["rms_norm: CPU backend ('float32', 1, 64, 'inference')"]
    assert decision == {"choice": "reference", "median_us": {name: {"cpp": 30.0, "inductor": 40.0,
                                                                    "reference": 10.0}[name] for name in runnable}}
    assert trained == [False]  # forward-only samples for a forward-only call
    ran.clear()
    with torch.no_grad():
        rms_norm.rms_norm(x, weight)
    assert ran == []  # the reference: no te_lab op
    # A training call of the same sizes is its own class, measured forward and backward.
    monkeypatch.setattr(measured_choice, "_median_times_us",
                        _fake_timings({"cpp": 10.0, "inductor": 40.0, "reference": 30.0}))
    rms_norm.rms_norm(x.requires_grad_(), weight)
    assert trained == [False, True]
    assert measured_choice.decisions()["rms_norm: CPU backend ('float32', 1, 64)"]["choice"] == "cpp"
    assert ran[-1] == "cpp"


def test_a_remembered_choice_still_yields_to_use_backend_the_environment_and_forget(fresh_cache, monkeypatch):
    rms_norm = importlib.import_module("te_lab.kernels.rms_norm")
    ran = []
    original = rms_norm._rms_norm_op
    monkeypatch.setattr(rms_norm, "_rms_norm_op", lambda *args: ran.append(args[-1]) or original(*args))
    monkeypatch.setattr(measured_choice, "_median_times_us",
                        _fake_timings({"cpp": 10.0, "inductor": 5.0, "reference": 30.0}))
    monkeypatch.delenv("TE_LAB_BACKEND", raising=False)
    x = torch.randn(4, 64)
    with torch.no_grad():
        rms_norm.rms_norm(x)
        ran.clear()  # the samples ran the op too
        rms_norm.rms_norm(x)  # remembered for these exact arguments
        with use_backend(rms_norm="reference"):
            rms_norm.rms_norm(x)
        monkeypatch.setenv("TE_LAB_BACKEND", "rms_norm=cpp")
        rms_norm.rms_norm(x)
        monkeypatch.delenv("TE_LAB_BACKEND")
        rms_norm.rms_norm(x)
        assert ran == ["inductor", "cpp", "inductor"]  # the reference ran no te_lab op
        measured_choice.forget("rms_norm")
        monkeypatch.setattr(measured_choice, "_median_times_us",
                            _fake_timings({"cpp": 10.0, "inductor": 50.0, "reference": 30.0}))
        rms_norm.rms_norm(x)
    assert ran[-1] == "cpp"
