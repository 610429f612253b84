"""Choices that depend on the machine, made by measuring on it, once.

Which of two ways of computing the same thing is faster is a property of the machine:
oneDNN's float32 GEMM ran twice as fast as MKL's on one AMD EPYC and 0.73x to 1.19x on
another of the same vendor, depending on the shapes. So such a choice is never made from
a vendor string: the first time it matters for a class of shapes, each candidate runs a
few interleaved rounds on inputs of that class, the fastest by median is kept, and the
decision (with its timings) is cached in memory and on disk per machine: the CPU model,
its vector ISA, torch's version and thread count name the cache file, so a change of any
of them measures anew. ``te-lab info`` lists the decisions; ``TE_LAB_BACKEND`` (or
``backend=``) still overrides them; ``TE_LAB_CHOICES=off`` keeps every choice at its
default without measuring, and ``TE_LAB_CHOICES_CACHE`` names another cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from te_lab.cache import cache_directory

from .torch_internals import dispatch_modes_active, function_modes_active, saved_tensors_hooks_enabled

CHOICES_ENV = "TE_LAB_CHOICES"
CACHE_ENV = "TE_LAB_CHOICES_CACHE"
WARMUP = 3
ROUNDS = 7
SAMPLE_SECONDS = 0.002

_decisions: dict[str, dict] = {}  # "<decision> <shape class>" -> choice and timings, as cached on disk
# (decision, shape class) -> choice: the per-call lookup; also a call's exact arguments ->
# the registry's settled answer (remember), so that clearing it forgets both.
_known: dict[tuple, str] = {}
REMEMBERED_CALLS = 8192  # past this many distinct calls (sizes that never repeat), start again


def cpu_model() -> str:
    """The CPU's model name as the OS reports it ("AMD EPYC 9B14", ...), or the platform's guess."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint() -> str:
    """What a measured choice holds for: CPU model, vector ISA, torch version, threads."""
    return (f"{cpu_model()} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads")


def size_class(size: int) -> int:
    """``size`` rounded up to a power of two: shapes in one class cost alike."""
    return 1 << max(int(size) - 1, 0).bit_length()


def _cache_file() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or cache_directory())
    digest = hashlib.sha1(machine_fingerprint().encode()).hexdigest()[:12]
    return root / f"choices-{digest}.json"


def _load() -> dict:
    try:
        return json.loads(_cache_file().read_text())["decisions"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _save() -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(json.dumps({"machine": machine_fingerprint(), "decisions": _decisions}, indent=1))
        temporary.replace(path)
    except OSError:
        pass  # a read-only home: the decisions still hold for this process


def measuring_enabled() -> bool:
    value = os.environ.get(CHOICES_ENV, "").strip().lower()
    if value not in ("", "on", "off"):
        raise ValueError(f"{CHOICES_ENV}={value!r}: expected 'on' or 'off'")
    return value != "off"


def _clock() -> Callable[[], float]:
    """What a sample is timed with: where torch runs on one thread, the calling thread's CPU
    time (every kernel runs on it, and time spent waiting for a core on a loaded machine
    does not count: timed by the wall clock on a machine shared with other jobs, a one-row
    rope measured 893 us per call on ``cpp`` against 164 on ``inductor``, whose kernel takes
    several times ``cpp``'s); else wall time, which counts what the other threads add."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _median_times_us(candidates: Mapping[str, Callable[[], object]]) -> dict[str, float]:
    """Median microseconds per call of each candidate over interleaved rounds; a sample
    repeats the call until it spans about SAMPLE_SECONDS, so small products are timed
    above the clock's noise."""
    clock = _clock()
    names = list(candidates)
    for run in candidates.values():
        run()  # a first call may compile (an Inductor graph): not part of any timing
    # A call's cost is its fastest warm-up call: on a loaded machine one call may wait a
    # scheduler slice (tens of ms) for a thread, and sizing samples on that would leave
    # one call per sample, all noise.
    fastest = {name: float("inf") for name in names}
    for _ in range(WARMUP):
        for name, run in candidates.items():
            start = clock()
            run()
            fastest[name] = min(fastest[name], clock() - start)
    per_round = sum(fastest.values())
    calls = max(1, min(1000, int(SAMPLE_SECONDS * len(names) / max(per_round, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for round_index in range(ROUNDS):
        # Alternate which candidate goes first, so neither always runs on a warmer cache.
        for name in (names if round_index % 2 == 0 else names[::-1]):
            run = candidates[name]
            start = clock()
            for _ in range(calls):
                run()
            samples[name].append((clock() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def op_sample(call: Callable[[], object], inputs: tuple, upstream, *, training: bool) -> Callable[[], None]:
    """One sample of an op for a measured choice: with ``training``, ``call()`` (the public
    op on a backend) and the gradients of ``inputs`` for ``upstream``, through autograd,
    as a training step runs it; otherwise ``call()`` alone without gradients, as a decode
    step runs it. Either way outside any ``inference_mode`` the caller is in."""
    if training:
        def forward_and_backward():
            with torch.inference_mode(False), torch.enable_grad():
                torch.autograd.grad(call(), inputs, upstream)
        return forward_and_backward

    def forward():
        with torch.inference_mode(False), torch.no_grad():
            call()
    return forward


def _keep(tensor):
    return tensor


def _own_saved_tensors():
    """The samples' autograd saves its tensors as usual, unseen by saved-tensor hooks
    around the caller: a checkpointed region's forward that measures would otherwise
    count the samples' saved tensors, and its recomputation, which finds the choice
    made, would save fewer (torch.utils.checkpoint's CheckpointError)."""
    if not saved_tensors_hooks_enabled():
        return contextlib.nullcontext()  # no hooks can be active
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)


def known(decision: str, shape_class: tuple) -> Optional[str]:
    """The choice already made in this process for ``decision`` at ``shape_class``, if any."""
    return _known.get((decision, shape_class))


def remembered(call: tuple) -> Optional[str]:
    """The dispatcher's settled answer for a call with exactly these arguments (see
    :func:`te_lab.kernels.registry.choose`), if remembered."""
    return _known.get(call)


def remember(call: tuple, choice: str) -> None:
    if len(_known) >= REMEMBERED_CALLS:
        _known.clear()  # the decisions themselves stay in _decisions and come back by lookup
    _known[call] = choice


def choose(decision: str, shape_class: tuple, candidates: Callable[[], Mapping[str, Callable[[], object]]],
           default: str, allowed: Optional[tuple[str, ...]] = None) -> str:
    """The fastest of the candidates (``candidates()`` gives name -> a callable running one
    sample; it is called only to measure) for ``decision`` at ``shape_class``: measured
    the first time, then remembered. Returns
    ``default`` without measuring where measuring is off, and, unless already decided,
    under torch.compile's tracing or a dispatch or function mode. ``allowed`` names the
    candidates this process can run: a decision cached for another (a process that had
    a backend this one lacks) is measured anew, and a single one is chosen unmeasured."""
    choice = _known.get((decision, shape_class))
    if choice is not None:
        return choice
    if allowed is not None and len(allowed) == 1:
        _known[(decision, shape_class)] = allowed[0]
        return allowed[0]
    if torch.compiler.is_compiling() or dispatch_modes_active() or function_modes_active():
        # No file I/O or timing inside a traced graph, nor under a mode (fake tensors,
        # make_fx's tracing, a FLOP counter), which would take over the samples' tensors.
        return default
    key = f"{decision} {shape_class}"
    if not _decisions:
        _decisions.update(_load())
    if key in _decisions and (allowed is None or _decisions[key]["choice"] in allowed):
        _known[(decision, shape_class)] = _decisions[key]["choice"]
        return _decisions[key]["choice"]
    if not measuring_enabled():
        return default
    with _own_saved_tensors():
        times = _median_times_us(candidates())
    choice = min(times, key=times.get)
    _decisions[key] = {"choice": choice, "median_us": {name: round(t, 1) for name, t in times.items()}}
    _known[(decision, shape_class)] = choice
    _save()
    return choice


def median_times_now(candidates: Mapping[str, Callable[[], object]]) -> dict[str, float]:
    """Median microseconds per sample of each of ``candidates`` (name -> a callable running
    one sample), timed now as a decision is (first calls, warm-up, interleaved rounds) and
    kept nowhere: for a choice that depends on code outside te_lab, such as a twin against
    the module it replaces (:mod:`te_lab.modules.stepping_aside`), which a cache file would
    outlive."""
    with _own_saved_tensors():
        return _median_times_us(candidates)


def decisions() -> dict[str, dict]:
    """Every decision known in this process (measured or read from the cache)."""
    if not _decisions:
        _decisions.update(_load())
    return dict(_decisions)


def forget(prefix: Optional[str] = None) -> None:
    """Drop the remembered decisions (those whose key starts with ``prefix``), here and on disk."""
    _decisions.update(_load())
    for key in [key for key in _decisions if prefix is None or key.startswith(prefix)]:
        del _decisions[key]
    _known.clear()
    _save()
