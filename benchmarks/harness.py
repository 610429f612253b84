"""Interleaved timing of contenders, as docs/design.md asks: warm up, run A B C A B C ...,
report medians and ratios, never one absolute time. The first call of each contender
is timed on its own (it includes torch.compile's and Inductor's compile waits).

On GPUs (:data:`GPU_SAMPLING`) each sample is one pair of device events around several
calls, its time the pair's over the calls (a single short kernel is near the events'
resolution and launch cost), and the L2 cache is flushed before each sample
(:func:`te_lab.device.flush_cache`: a 16 MB tensor fits in an H200's 60 MB L2), so a
sample's first call reads its inputs from memory; the calls after it find what the one
before left in L2, as back-to-back calls in a model do."""

from __future__ import annotations

import contextlib
import statistics
import traceback
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch

from te_lab import device as devices
from te_lab.profiler.attribution import peak_live_bytes


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Sampling:
    """How each timed sample is taken: ``calls`` calls between one pair of timer
    readings (the sample is their mean), after an L2 flush when ``flush_cache``."""

    calls: int = 1
    flush_cache: bool = False

    def __post_init__(self):
        if not isinstance(self.calls, int) or self.calls < 1:
            raise ValueError(f"Sampling(calls={self.calls!r}): expected a positive integer")


ONE_CALL = Sampling()
GPU_SAMPLING = Sampling(calls=10, flush_cache=True)


def op_sampling(device: torch.device) -> Sampling:
    """The sampling of per-op benchmarks on ``device``: GPU_SAMPLING on GPUs, one call
    per sample on the CPU (whose timer resolution is far below an op's time)."""
    return GPU_SAMPLING if devices.is_gpu(device) else ONE_CALL


@dataclass
class Contender:
    """One way of doing the same work. ``step`` is what is timed; ``before`` and ``after``
    run untimed around every call (a backward-only contender runs its forward in
    ``before``), and ``context`` is entered around all three, outside the timer (a
    model's ``te_lab.unfused`` block, ``torch.no_grad``)."""

    name: str
    step: Callable[[], object]
    before: Callable[[], None] = _nothing
    after: Callable[[], None] = _nothing
    context: Callable[[], ContextManager] = contextlib.nullcontext


@dataclass
class Timing:
    """One contender's measurements, in milliseconds; ``samples_ms[i]`` comes from round
    ``i``, so two contenders' samples pair up round by round. ``error`` is set (and the
    samples stay empty) when the contender's first call raised."""

    name: str
    first_call_ms: Optional[float]
    samples_ms: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread_ms(self) -> float:
        """Half the interquartile range: how noisy the median is."""
        if len(self.samples_ms) < 4:
            return 0.0
        quartiles = statistics.quantiles(self.samples_ms, n=4)
        return (quartiles[2] - quartiles[0]) / 2


def timed_call(contender: Contender, device: torch.device, sampling: Sampling = ONE_CALL) -> tuple[float, object]:
    """(milliseconds per call, last output) of ``sampling.calls`` calls of
    ``contender.step`` timed together; ``before`` (once per call, all first), the cache
    flush, ``after`` and the context stay outside the timer."""
    with contender.context():
        for _ in range(sampling.calls):
            contender.before()
        if sampling.flush_cache:
            devices.flush_cache(device)
        devices.synchronize(device)
        with devices.Timer(device) as timer:
            for _ in range(sampling.calls):
                output = contender.step()
        for _ in range(sampling.calls):
            contender.after()
    return timer.elapsed_ms / sampling.calls, output


def describe_error(error: BaseException) -> str:
    """One line: the exception's type, the first line of its message, where it was raised."""
    last = traceback.extract_tb(error.__traceback__)[-1:] or [None]
    where = f" (at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last[0] else ""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}{where}"


def interleaved(contenders: list[Contender], device: torch.device, *, rounds: int, warmup: int,
                progress: Callable[[str], None] = lambda _: None,
                keep_first_outputs: bool = False,
                sampling: Sampling = ONE_CALL) -> tuple[dict[str, Timing], dict[str, object]]:
    """Time each contender ``rounds`` times, interleaved, after ``warmup`` untimed calls
    each; each round's sample is taken as ``sampling`` says. The order rotates every
    round so no contender always runs first. A contender whose first call raises is kept
    with its error and left out of the rounds.

    Returns the timings and, with ``keep_first_outputs``, each contender's first output
    (other outputs are dropped at once, so no call runs while the previous one's
    results are still alive)."""
    timings, first_outputs = {}, {}
    for contender in contenders:
        progress(f"first call: {contender.name}")
        try:
            elapsed, output = timed_call(contender, device)
        except Exception as error:  # a contender that cannot run is a result, not a crash
            timings[contender.name] = Timing(contender.name, None, error=describe_error(error))
            progress(f"{contender.name} failed: {timings[contender.name].error}")
            continue
        timings[contender.name] = Timing(contender.name, elapsed)
        if keep_first_outputs:
            first_outputs[contender.name] = output
        del output
        for _ in range(warmup):
            timed_call(contender, device)
    running = [contender for contender in contenders if timings[contender.name].error is None]
    for round_index in range(rounds):
        progress(f"round {round_index + 1}/{rounds}")
        shift = round_index % max(len(running), 1)
        for contender in running[shift:] + running[:shift]:
            timings[contender.name].samples_ms.append(timed_call(contender, device, sampling)[0])
    return timings, first_outputs


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def upstream_gradients(fn: Callable, inputs: tuple) -> list[torch.Tensor]:
    """Fixed random upstream gradients, one per output of ``fn(*inputs)`` (run once
    without autograd); every contender of a case backpropagates the same ones."""
    with torch.no_grad():
        return [torch.randn_like(out) for out in _as_tuple(fn(*inputs))]


def op_contender(name: str, fn: Callable, inputs: tuple, mode: str, upstream: list[torch.Tensor]) -> Contender:
    """A contender running ``fn(*inputs)`` in ``mode``:

    - ``"forward"``: the forward as training runs it (inputs require grad, so autograd
      saves what the backward needs); the graph is dropped untimed.
    - ``"backward"``: the forward runs untimed in ``before``; the gradients of every
      input for the ``upstream`` gradients are timed.
    - ``"forward+backward"``: both, timed together.

    Gradients are returned, not accumulated into ``.grad`` (which would add work that
    is not the op's)."""
    if mode == "forward":
        return Contender(name, lambda: fn(*inputs))
    if mode == "forward+backward":
        return Contender(name, lambda: torch.autograd.grad(_as_tuple(fn(*inputs)), inputs, upstream))
    if mode != "backward":
        raise ValueError(f"op_contender(mode={mode!r}): expected 'forward', 'backward' or 'forward+backward'")
    pending = []

    def run_forward():
        pending.append(_as_tuple(fn(*inputs)))

    return Contender(name, lambda: torch.autograd.grad(pending.pop(), inputs, upstream), before=run_forward)


def peak_memory_bytes(contender: Contender, device: torch.device) -> int:
    """Peak bytes allocated while ``contender.step`` runs, above what was allocated before
    it: the allocator's statistics on GPUs, the profiler's record of every allocation and
    free on the CPU (which has no allocator statistics)."""
    with contender.context():
        contender.before()
        if devices.is_gpu(device):
            devices.synchronize(device)
            before = devices.memory_allocated(device)
            devices.reset_peak_memory_stats(device)
            contender.step()
            devices.synchronize(device)
            peak = devices.max_memory_allocated(device) - before
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        profile_memory=True) as prof:
                contender.step()
            peak = peak_live_bytes(prof)
        contender.after()
    return peak
