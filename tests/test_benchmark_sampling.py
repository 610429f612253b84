"""How the benchmark harness takes a sample: on GPUs, several calls between one pair of
device events, after an L2 flush (checked here with a stand-in timer and flush: this
machine has no GPU); one call per sample on the CPU."""

import pytest
import torch

from te_lab import device as devices
from te_lab.benchmarks import harness


class StepCountingTimer:
    """A timer that reads 1 ms per step call made inside it."""

    def __init__(self, log):
        self.log = log

    def __call__(self, device):
        timer = self

        class Timer:
            def __enter__(self):
                self.start = len(timer.log)
                timer.log.append("timer start")
                return self

            def __exit__(self, *exc):
                timer.log.append("timer end")
                self.elapsed_ms = float(timer.log[self.start:].count("step"))
        return Timer()


def test_a_sample_is_the_mean_of_several_calls_after_a_flush(monkeypatch):
    log = []
    monkeypatch.setattr(devices, "Timer", StepCountingTimer(log))
    monkeypatch.setattr(devices, "flush_cache", lambda device: log.append("flush"))
    monkeypatch.setattr(devices, "synchronize", lambda device: log.append("sync"))
    contender = harness.Contender("op", step=lambda: log.append("step") or len(log),
                                  before=lambda: log.append("before"), after=lambda: log.append("after"))
    sampling = harness.Sampling(calls=3, flush_cache=True)
    elapsed, output = harness.timed_call(contender, torch.device("cpu"), sampling)
    assert elapsed == pytest.approx(1.0)  # 3 ms over 3 calls
    # the forwards a backward contender needs, then the flush, all outside the event pair
    assert log == ["before"] * 3 + ["flush", "sync", "timer start"] + ["step"] * 3 + ["timer end"] + ["after"] * 3
    assert output == log.index("timer end")  # the last call's output


def test_interleaved_samples_the_rounds_as_told_and_the_first_call_alone(monkeypatch):
    log = []
    monkeypatch.setattr(devices, "Timer", StepCountingTimer(log))
    monkeypatch.setattr(devices, "flush_cache", lambda device: log.append("flush"))
    contender = harness.Contender("op", step=lambda: log.append("step"))
    timings, _ = harness.interleaved([contender], torch.device("cpu"), rounds=2, warmup=1,
                                     sampling=harness.Sampling(calls=4, flush_cache=True))
    assert timings["op"].first_call_ms == 1.0 and timings["op"].samples_ms == [1.0, 1.0]
    # first call and warm-up: one call each, no flush; each round: a flush, then 4 calls
    assert log.count("flush") == 2 and log.count("step") == 1 + 1 + 2 * 4


def test_gpus_sample_several_calls_after_a_flush_and_the_cpu_one_call():
    assert harness.op_sampling(torch.device("cpu")) == harness.Sampling(calls=1, flush_cache=False)
    gpu = harness.op_sampling(torch.device("cuda", 0))
    assert gpu.calls > 1 and gpu.flush_cache


@pytest.mark.parametrize("calls", [0, -1, 2.5])
def test_sampling_refuses_a_call_count_that_is_not_positive(calls):
    with pytest.raises(ValueError, match=rf"Sampling\(calls={calls!r}\): expected a positive integer"):
        harness.Sampling(calls=calls)
