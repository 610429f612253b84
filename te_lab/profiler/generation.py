"""Generation profiled: prefill and decode apart, eager against fused.

A ``generate`` call runs one forward over the prompt (prefill), then one forward per new
token (decode), each a few rows at most: what a fused op costs around its kernels
decides there, where a training step's profile cannot show it.
``te_lab.profile_generation(run, model)`` runs ``run()`` (code that calls the fused
model's ``generate``, or any loop of forwards) with the model unfused and fused in turn,
interleaved, and splits each mode's forwards by phase: the model's first forward in a
run is the prefill, every later one a decode step. Per phase and mode it reports the
time per token (prefill: per prompt token; decode: per generated token; summed over the
batch's rows), the ops launched per token (top-level ATen and te_lab ops, counted in one
extra profiled run per mode) and each fused module's time, whose eager-over-fused ratio
is its gain. The result, a :class:`GenerationProfile`, is plain data with a lossless
JSON round trip.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from te_lab import device as devices
from te_lab.surgery import fusions, is_fused, unfused

from .chatter import without_profiler_chatter

PHASES = ("prefill", "decode")
MODES = ("eager", "fused")
RANGE_PREFIX = "te_lab.generation::"


@dataclass
class PhaseFigures:
    """One mode's figures for one phase, medians over the timed runs."""

    tokens: int  # per run: prompt tokens (prefill) or generated tokens (decode), every row counted
    forwards: int  # per run
    ms: float  # the phase's forwards, per run
    ms_per_token: float
    launches_per_token: float
    module_ms: dict[str, float] = field(default_factory=dict)  # fused module path -> ms per run


@dataclass
class GenerationProfile:
    """``phases[phase][mode]``: :class:`PhaseFigures`; ``runs``: timed runs per mode."""

    runs: int
    phases: dict[str, dict[str, PhaseFigures]]
    module_kinds: dict[str, str]  # fused module path -> its kind (attention, mlp, norm, ...)

    def speedup(self, phase: str) -> float:
        """Eager's time per token over fused's in ``phase`` (above 1: fused is faster)."""
        figures = self.phases[phase]
        return figures["eager"].ms_per_token / figures["fused"].ms_per_token

    def module_gains(self, phase: str) -> dict[str, float]:
        """Per module kind, eager's time over fused's in ``phase``."""
        totals = {mode: {} for mode in MODES}
        for mode in MODES:
            for path, ms in self.phases[phase][mode].module_ms.items():
                kind = self.module_kinds[path]
                totals[mode][kind] = totals[mode].get(kind, 0.0) + ms
        return {kind: totals["eager"][kind] / totals["fused"][kind] for kind in totals["fused"]
                if totals["fused"][kind] > 0 and kind in totals["eager"]}

    def summary(self) -> str:
        lines = [f"generation profile ({self.runs} runs per mode, eager and fused interleaved)"]
        for phase in PHASES:
            eager, fused = self.phases[phase]["eager"], self.phases[phase]["fused"]
            gains = ", ".join(f"{kind} {gain:.2f}x" for kind, gain in sorted(self.module_gains(phase).items()))
            lines.append(f"{phase}: {fused.tokens} tokens in {fused.forwards} forwards; per token eager "
                         f"{eager.ms_per_token:.3f} ms, fused {fused.ms_per_token:.3f} ms "
                         f"({self.speedup(phase):.2f}x); "
                         f"launches per token {eager.launches_per_token:.1f} -> {fused.launches_per_token:.1f}"
                         + (f"; modules: {gains}" if gains else ""))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GenerationProfile":
        data = json.loads(text)
        phases = {phase: {mode: PhaseFigures(**figures) for mode, figures in modes.items()}
                  for phase, modes in data["phases"].items()}
        return cls(runs=data["runs"], phases=phases, module_kinds=data["module_kinds"])


def _input_ids(args: tuple, kwargs: dict) -> torch.Tensor:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("te_lab.profile_generation: the model's forward was called without input_ids of shape "
                         "[batch, tokens]; expected a causal language model called with token ids")
    return ids


class _PhaseRecorder:
    """Forward hooks on the model and its fused modules' paths: each forward's phase,
    tokens and time, and (while ``ranges``) a profiler range per phase."""

    def __init__(self, model: nn.Module, paths: list[str], device: torch.device):
        self.model, self.paths, self.device = model, paths, device
        self.ranges = False
        self.reset()

    def reset(self) -> None:
        self.forwards = {phase: 0 for phase in PHASES}
        self.tokens = {phase: 0 for phase in PHASES}
        self.ms = {phase: 0.0 for phase in PHASES}
        self.module_ms = {phase: {} for phase in PHASES}
        self._phase = None
        self._open: dict[str, float] = {}

    @contextlib.contextmanager
    def installed(self):
        handles = [self.model.register_forward_pre_hook(self._model_start, with_kwargs=True),
                   self.model.register_forward_hook(self._model_end)]
        for path in self.paths:  # the module at the path now: the twin, or the original while unfused
            module = self.model.get_submodule(path)
            handles += [module.register_forward_pre_hook(lambda *_, path=path: self._module_start(path)),
                        module.register_forward_hook(lambda *_, path=path: self._module_end(path))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _model_start(self, _module, args, kwargs):
        self._phase = "prefill" if sum(self.forwards.values()) == 0 else "decode"
        ids = _input_ids(args, kwargs)
        # The prefill reads every prompt token; a decode step yields one token per row
        # (whether it reads one, through a KV cache, or the whole sequence again).
        self.tokens[self._phase] += ids.numel() if self._phase == "prefill" else ids.shape[0]
        if self.ranges:
            self._range = torch.profiler.record_function(RANGE_PREFIX + self._phase)
            self._range.__enter__()
        devices.synchronize(self.device)
        self._started = time.perf_counter()

    def _model_end(self, *_):
        devices.synchronize(self.device)
        self.ms[self._phase] += (time.perf_counter() - self._started) * 1000
        self.forwards[self._phase] += 1
        if self.ranges:
            self._range.__exit__(None, None, None)

    def _module_start(self, path: str) -> None:
        self._open[path] = time.perf_counter()

    def _module_end(self, path: str) -> None:
        elapsed = (time.perf_counter() - self._open.pop(path)) * 1000
        table = self.module_ms[self._phase]
        table[path] = table.get(path, 0.0) + elapsed


def _launches(events) -> dict[str, int]:
    """Top-level ATen and te_lab ops under each phase's ranges."""
    counts = {phase: 0 for phase in PHASES}
    for event in events:
        if not event.name.startswith(("aten::", "te_lab::")):
            continue
        parent, phase = event.cpu_parent, None
        while parent is not None:
            if parent.name.startswith(("aten::", "te_lab::")):
                break  # an op inside another op: not a launch of its own
            if parent.name.startswith(RANGE_PREFIX):
                phase = parent.name.removeprefix(RANGE_PREFIX)
                break
            parent = parent.cpu_parent
        if phase is not None:
            counts[phase] += 1
    return counts


def profile_generation(run: Callable[[], Any], model: nn.Module, *, runs: int = 3) -> GenerationProfile:
    """Profile ``run()`` (code that generates with the fused ``model``) eager against fused,
    prefill and decode apart (see the module doc); ``runs`` timed runs per mode after one
    warm-up run and one profiled run each."""
    if not isinstance(model, nn.Module) or not is_fused(model):
        raise ValueError("te_lab.profile_generation: model is not a model with te_lab fusions; fuse it first "
                         "(te_lab.fuse)")
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
        raise ValueError(f"te_lab.profile_generation: runs must be a positive int, got {runs!r}")
    installed = [fusion for fusion in fusions(model) if fusion.path]  # the LM head's fusion is the model itself
    kinds = {fusion.path: fusion.kind for fusion in installed}
    device = next(model.parameters()).device

    def in_mode(mode: str):
        return unfused(model) if mode == "eager" else contextlib.nullcontext()

    samples = {mode: [] for mode in MODES}
    launches = {}
    for mode in MODES:
        with in_mode(mode):
            recorder = _PhaseRecorder(model, list(kinds), device)
            with recorder.installed():
                run()  # warm-up: measured choices, compiling
                recorder.ranges = True
                recorder.reset()
                trace = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                with without_profiler_chatter():  # torch's start / stop lines on fd 2
                    trace.start()
                try:
                    run()
                finally:
                    with without_profiler_chatter():
                        trace.stop()
                counts = _launches(trace.events())
                launches[mode] = {phase: counts[phase] / max(recorder.tokens[phase], 1) for phase in PHASES}
    for index in range(runs):
        for mode in (MODES if index % 2 == 0 else MODES[::-1]):
            with in_mode(mode):
                recorder = _PhaseRecorder(model, list(kinds), device)
                with recorder.installed():
                    run()
                samples[mode].append(recorder)
    phases = {}
    for phase in PHASES:
        phases[phase] = {}
        for mode in MODES:
            recorders = samples[mode]
            ms = statistics.median(r.ms[phase] for r in recorders)
            tokens = recorders[0].tokens[phase]
            paths = recorders[0].module_ms[phase]
            phases[phase][mode] = PhaseFigures(
                tokens=tokens, forwards=recorders[0].forwards[phase], ms=ms, ms_per_token=ms / max(tokens, 1),
                launches_per_token=launches[mode][phase],
                module_ms={path: statistics.median(r.module_ms[phase].get(path, 0.0) for r in recorders)
                           for path in paths})
    return GenerationProfile(runs=runs, phases=phases, module_kinds=kinds)

