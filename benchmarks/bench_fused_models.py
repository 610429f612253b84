"""End-to-end model benchmark: a demo model's training step (forward + backward) and its
inference forward, eager (unfused) against te_lab-fused, interleaved, medians and ratios.

    python benchmarks/bench_fused_models.py [--models llama-tiny,llama-small] [--batch 2] [--seq 256]
                                            [--rounds 15] [--warmup 2] [--device cpu] [--threads N]

Each model is built once and fused once (``te_lab.fuse(model, sample=batch)``). Both
contenders run on that same model object and the same batch: "eager" inside
``te_lab.unfused(model)``, "te_lab" as fused. The context is entered and left outside the
timer, so the timed region holds exactly one step:

- train: ``model(**batch).loss.backward()``; then, untimed and in both contenders alike,
  ``model.zero_grad(set_to_none=True)``.
- inference: ``model(input_ids=...).logits`` under ``torch.no_grad()``, eval mode.

Rounds alternate which contender runs first. The ratio eager / te_lab is given as the
ratio of the medians, with a 95% bootstrap interval over rounds, and as the median (and
quartiles) of the per-round ratios; above 1 means te_lab is faster. ``(±)`` after a
median is half the interquartile range of that contender's samples. First-call times come after ``fuse``, which already ran the
model on the sample (probes, Inductor compiles), so they are not cold starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import Timing  # noqa: E402

import te_lab  # noqa: E402
from te_lab import device as devices  # noqa: E402
from te_lab.models import MODEL_NAMES, build_model  # noqa: E402

DEFAULT_MODELS = "llama-tiny,llama-small"
# A llama-small step takes seconds on a 2-core CPU; 15 rounds of it would take many minutes.
DEFAULT_ROUNDS = {"small": 5}
FALLBACK_ROUNDS = 15
CONTENDERS = ("eager", "te_lab")
BOOTSTRAP_RESAMPLES = 2000


@dataclass
class Contender:
    """``context`` is entered around each call (outside the timer); ``step`` is what is
    timed; ``after`` runs untimed after every call."""

    name: str
    context: Callable[[], ContextManager]
    step: Callable[[], object]
    after: Callable[[], None] = lambda: None


@dataclass
class PairedTimings:
    timings: dict[str, Timing]
    round_ratios: list[float] = field(default_factory=list)  # eager / te_lab, one per round
    first_outputs: dict[str, object] = field(default_factory=dict)

    @property
    def ratio_of_medians(self) -> float:
        return self.timings["eager"].median_ms / self.timings["te_lab"].median_ms

    def ratio_interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """Bootstrap interval of the ratio of medians, resampling whole rounds (so each
        eager sample stays paired with the te_lab sample measured beside it)."""
        eager, fused = self.timings["eager"].samples_ms, self.timings["te_lab"].samples_ms
        generator = random.Random(0)
        ratios = []
        for _ in range(BOOTSTRAP_RESAMPLES):
            picks = [generator.randrange(len(eager)) for _ in eager]
            ratios.append(statistics.median(eager[i] for i in picks) / statistics.median(fused[i] for i in picks))
        ratios.sort()
        tail = (1 - confidence) / 2
        return ratios[int(tail * len(ratios))], ratios[min(len(ratios) - 1, int((1 - tail) * len(ratios)))]

    @property
    def ratio_quartiles(self) -> tuple[float, float, float]:
        if len(self.round_ratios) < 4:
            median = statistics.median(self.round_ratios)
            return min(self.round_ratios), median, max(self.round_ratios)
        q1, q2, q3 = statistics.quantiles(self.round_ratios, n=4)
        return q1, q2, q3


def _call(contender: Contender, device: torch.device, timed: bool, keep: bool = False):
    """(elapsed ms or None, the step's output if ``keep``). Outputs not kept are dropped
    at once, so no call runs while the previous call's logits are still alive."""
    with contender.context():
        if not timed:
            contender.step()
            contender.after()
            return None, None
        devices.synchronize(device)
        with devices.Timer(device) as timer:
            output = contender.step()
        contender.after()
    return timer.elapsed_ms, (output if keep else None)


def interleave_pairs(contenders: list[Contender], device: torch.device, *, rounds: int, warmup: int,
                     progress: Callable[[str], None]) -> PairedTimings:
    """harness.interleaved, but entering each contender's context outside the timer and
    keeping the per-round ratio of the two contenders."""
    timings, first_outputs = {}, {}
    for contender in contenders:
        progress(f"first call: {contender.name}")
        elapsed, first_outputs[contender.name] = _call(contender, device, timed=True, keep=True)
        timings[contender.name] = Timing(contender.name, elapsed)
        for _ in range(warmup):
            _call(contender, device, timed=False)
    for round_index in range(rounds):
        progress(f"round {round_index + 1}/{rounds}")
        order = contenders if round_index % 2 == 0 else contenders[::-1]
        for contender in order:
            elapsed, _ = _call(contender, device, timed=True)
            timings[contender.name].samples_ms.append(elapsed)
    ratios = [e / f for e, f in zip(timings["eager"].samples_ms, timings["te_lab"].samples_ms)]
    return PairedTimings(timings, ratios, first_outputs)


def train_contenders(model: torch.nn.Module, batch: dict) -> list[Contender]:
    def step():
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()

    def after():
        model.zero_grad(set_to_none=True)

    def in_train_mode(context):
        @contextlib.contextmanager
        def entered():
            with context():
                model.train()
                yield

        return entered

    return [Contender("eager", in_train_mode(lambda: te_lab.unfused(model)), step, after),
            Contender("te_lab", in_train_mode(contextlib.nullcontext), step, after)]


def inference_contenders(model: torch.nn.Module, batch: dict) -> list[Contender]:
    input_ids = batch["input_ids"]

    def step():
        return model(input_ids=input_ids).logits

    def in_inference(context):
        @contextlib.contextmanager
        def entered():
            with context(), torch.no_grad():
                model.eval()
                yield

        return entered

    return [Contender("eager", in_inference(lambda: te_lab.unfused(model)), step),
            Contender("te_lab", in_inference(contextlib.nullcontext), step)]


def _counts_line(report) -> str:
    return "; ".join(f"{rule}: " + ", ".join(f"{status} {n}" for status, n in by_status.items())
                     for rule, by_status in report.counts().items())


def _rounds_for(name: str, requested) -> int:
    if requested is not None:
        return requested
    return DEFAULT_ROUNDS.get(name.split("-", 1)[1], FALLBACK_ROUNDS)


def _ratio_cell(paired: PairedTimings) -> str:
    low, high = paired.ratio_interval()
    q1, q2, q3 = paired.ratio_quartiles
    quartile_label = "IQR" if len(paired.round_ratios) >= 4 else "range"
    return (f"{paired.ratio_of_medians:.3f}x [{low:.3f}–{high:.3f}] "
            f"| {q2:.3f}x ({quartile_label} {q1:.3f}–{q3:.3f})")


def _verdict(paired: PairedTimings) -> str:
    low, high = paired.ratio_interval()
    if low > 1:
        return "te_lab faster"
    if high < 1:
        return "te_lab SLOWER"
    return "no clear difference (interval contains 1)"


def print_model_table(results: dict[str, PairedTimings], tokens: int) -> None:
    print("| mode | contender | first call ms | median ms (±) | tokens/s | eager/te_lab: ratio of medians [95% CI] "
          "| eager/te_lab per round: median (spread) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for mode, paired in results.items():
        for name in CONTENDERS:
            timing = paired.timings[name]
            ratio = _ratio_cell(paired) if name == "te_lab" else " | "
            print(f"| {mode} | {name} | {timing.first_call_ms:.1f} | {timing.median_ms:.2f} (±{timing.spread_ms:.2f}) "
                  f"| {tokens / (timing.median_ms * 1e-3):,.0f} | {ratio} |")


def print_summary(summary: list[tuple[str, str, int, PairedTimings]]) -> None:
    print("## Summary: eager / te_lab (above 1: te_lab faster)\n")
    print("| model | mode | rounds | eager median ms | te_lab median ms | ratio of medians [95% CI] "
          "| per-round median (spread) | verdict |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for model_name, mode, rounds, paired in summary:
        verdict = _verdict(paired)
        print(f"| {model_name} | {mode} | {rounds} | {paired.timings['eager'].median_ms:.2f} "
              f"| {paired.timings['te_lab'].median_ms:.2f} | {_ratio_cell(paired)} | {verdict} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated names from {', '.join(MODEL_NAMES)} (default {DEFAULT_MODELS})")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (default 2)")
    parser.add_argument("--seq", type=int, default=256,
                        help="tokens per sequence (default 256; capped at the model's max_seq_len)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"interleaved timed rounds per mode (default {FALLBACK_ROUNDS}; "
                             f"{DEFAULT_ROUNDS['small']} for *-small models)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender and mode (default 2)")
    parser.add_argument("--device", default=None, help="device (default: te_lab's default device)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before running (default: leave torch's choice)")
    parser.add_argument("--modes", default="train,inference", help="train, inference or both (default both)")
    args = parser.parse_args(argv)
    names = [name for name in args.models.split(",") if name]
    unknown = [name for name in names if name not in MODEL_NAMES]
    if unknown:
        parser.error(f"--models: unknown model {unknown[0]!r}; expected one of {', '.join(MODEL_NAMES)}")
    modes = [mode for mode in args.modes.split(",") if mode]
    if any(mode not in ("train", "inference") for mode in modes):
        parser.error(f"--modes: expected train and/or inference, got {args.modes!r}")
    device = devices.resolve(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(f"# te_lab end-to-end model benchmark: {devices.device_name(device)} ({device}), "
          f"{devices.multiprocessor_count(device)} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, float32")
    print("eager = te_lab.unfused(model); te_lab = fused; same model object and batch; "
          "interleaved rounds, order alternating\n")
    progress = lambda message: print(f"  .. {message}", file=sys.stderr, flush=True)  # noqa: E731
    summary = []
    for name in names:
        model = build_model(name, device=device)
        seq = args.seq
        if seq > model.config.max_seq_len:
            print(f"note: --seq {seq} exceeds {name}'s max_seq_len {model.config.max_seq_len}; "
                  f"using {model.config.max_seq_len}")
            seq = model.config.max_seq_len
        batch = model.example_batch(args.batch, seq)
        tokens = args.batch * seq
        rounds = _rounds_for(name, args.rounds)
        print(f"## {name}: {model.num_parameters():,} parameters, batch {args.batch} x seq {seq} = {tokens} tokens, "
              f"{rounds} rounds, {args.warmup} warm-up calls", flush=True)
        progress(f"{name}: fusing")
        devices.synchronize(device)
        start = time.perf_counter()
        report = te_lab.fuse(model, sample=batch, progress=False)
        devices.synchronize(device)
        fuse_s = time.perf_counter() - start
        print(f"fuse: {fuse_s:.2f} s; per rule: {_counts_line(report)}")
        for row in report.rows:
            if row.status != "fused":
                print(f"  not fused: {row.label} ({row.rule}): {row.status}: {row.reason}")
        if report.model_check is not None and not report.model_check.within_tolerance:
            print("  WARNING: the fused model differs from the original on the sample beyond tolerance")

        results = {}
        builders = {"train": ("train fwd+bwd", train_contenders), "inference": ("inference fwd", inference_contenders)}
        for mode in modes:
            label, build = builders[mode]
            progress(f"{name}: {label}")
            results[label] = interleave_pairs(build(model, batch), device, rounds=rounds, warmup=args.warmup,
                                              progress=progress)
            summary.append((name, label, rounds, results[label]))
        checks = []
        if "train fwd+bwd" in results:
            eager_loss, fused_loss = (float(results["train fwd+bwd"].first_outputs[n]) for n in CONTENDERS)
            checks.append(f"train loss eager {eager_loss:.6f} vs te_lab {fused_loss:.6f} "
                          f"(|diff| {abs(eager_loss - fused_loss):.2g})")
        if "inference fwd" in results:
            eager_logits, fused_logits = (results["inference fwd"].first_outputs[n] for n in CONTENDERS)
            checks.append(f"inference logits max |diff| {(eager_logits - fused_logits).abs().max().item():.2g}")
        for paired in results.values():
            paired.first_outputs.clear()  # the logits of a large model are not small
        print("check: " + "; ".join(checks) + "\n")
        print_model_table(results, tokens)
        print(flush=True)
        del model, batch, results
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
