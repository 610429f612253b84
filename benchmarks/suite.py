"""te_lab's benchmark suite: every fused op and two models, against eager PyTorch,
torch.compile and (on GPUs, where installed) Liger-Kernel.

    python -m te_lab.benchmarks.suite [--quick | --profile smoke|quick|cpu|gpu] [--device cpu]
        [--ops rms_norm,glu] [--models llama-small,hf:llama-small] [--dtypes float32]
        [--json results.json] [--markdown RESULTS.md] [--html results.html]

A profile fixes the sizes, dtypes, modes, rounds and models; the options after it
override its parts. ``cpu`` (the default on the CPU) and ``gpu`` (the default on a GPU)
are the full runs; ``quick`` is a short check (minutes on a 2-core CPU); ``smoke`` is
the smallest configuration, for the tests. The markdown report goes to stdout (and to
``--markdown``), progress to stderr.

Per op: each registered fused op's cases (benchmarks/cases.py) at each size and dtype,
forward, backward and both, te_lab's backends against the eager baseline and
torch.compile of it (see per_op.py). End to end: each model's training step and
inference forward, eager, torch.compile, te_lab-fused and torch.compile of the fused
model (see end_to_end.py). Generation: prefill and decode tokens/s of the same four modes
(see generation.py; the ``cpu`` profile runs its full configuration, ``quick`` a small
one). Results are JSON (the schema in schema.py), markdown and a
self-contained HTML report; issue 9's targets are evaluated on them (targets.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from te_lab import device as devices
from te_lab.kernels import registered_ops

from . import dispatch, end_to_end, environment, generation, per_op
from .cases import OP_CASES, OPTIMIZER_OPS, SIZE_SYNTAX, Size
from .hand_written import write_keeping_hand_written
from .harness import describe_error
from .html_report import write_html
from .report import markdown
from .schema import SCHEMA_ID
from .targets import evaluate

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Profile:
    """``sizes`` maps an op to its sizes, ``"*"`` to every other op's; ``ops`` None is
    every registered op; ``dtypes`` None is every dtype the device supports."""

    name: str
    description: str
    sizes: dict[str, tuple[Size, ...]]
    ops: Optional[tuple[str, ...]] = None
    dtypes: Optional[tuple[str, ...]] = None
    modes: tuple[str, ...] = per_op.OP_MODES
    rounds: int = 7
    warmup: int = 2
    models: tuple[str, ...] = ("llama-small", "hf:llama-small")
    model_modes: tuple[str, ...] = end_to_end.MODEL_MODES
    batch: int = 2
    seq: int = 256
    model_rounds: int = 5
    model_warmup: int = 1
    dispatch: bool = False  # the dispatch benchmark (dispatch.py) at 64 x 64
    generation: Optional[generation.Config] = None  # the generation benchmark (generation.py)

    def model_batches(self) -> list[tuple[str, int, int]]:
        """(model, batch, seq) per entry of ``models``: ``name@BxS`` or the profile's batch x seq."""
        runs = []
        for entry in self.models:
            name, _, shape = entry.partition("@")
            batch, _, seq = shape.partition("x")
            if shape and not (batch.isdigit() and seq.isdigit()):
                raise ValueError(f"benchmark model {entry!r}: expected NAME or NAME@BATCHxSEQ, e.g. llama-tiny@2x64")
            runs.append((name, int(batch) if shape else self.batch, int(seq) if shape else self.seq))
        return runs

    def sizes_for(self, op: str) -> tuple[Size, ...]:
        return self.sizes.get(op, self.sizes["*"])


PROFILES = {
    "smoke": Profile(
        "smoke", "the smallest configuration (tests): two ops, tiny sizes, the tiny demo Llama's training step",
        sizes={"*": (Size(32, 512),)}, ops=("rms_norm", "adamw"), dtypes=("float32",), rounds=3, warmup=1,
        models=("llama-tiny",), model_modes=("train",), batch=1, seq=16, model_rounds=3, model_warmup=0),
    "quick": Profile(
        "quick", "every op at one size, float32, forward+backward; the mini demo Llama's training step",
        sizes={"*": (Size(512, 1024),), "fused_linear_cross_entropy": (Size(512, 256),),
               "bias_act": (Size(256, 1024),), "linear": (Size(256, 1024),),
               # issue 26's MoE target: 32 experts of width 128, top-4, hidden 256, 1024 tokens
               "moe": (Size(1024, 256),)},
        dtypes=("float32",), modes=("forward+backward",), rounds=5, warmup=1,
        models=("llama-mini",), model_modes=("train",), batch=2, seq=128, model_rounds=5,
        generation=generation.Config(models=("llama-tiny",), batches=(1,), prompts=(128,), new_tokens=16, rounds=3,
                                     modes=("eager", "fused"))),
    "cpu": Profile(
        "cpu", "the full CPU run: every op from 64 x 64 to 2048 x 2048, float32, forward, backward and both; "
        "the dispatch benchmark; training steps of the tiny and mini demo Llamas, a Hugging Face Llama and "
        "Qwen3-MoE",
        # GEMM-bound cases stay small: one fp32 GFLOP takes ~30 ms on this project's 2-core CPUs.
        # The LM head's larger case has tokens x vocab well above hidden x vocab, as in training,
        # so its memory target measures the logits it never materializes.
        # The small sizes are where a notebook's models live and per-call costs dominate;
        # RoPE's and attention's smallest take whole heads of 128 (RoPE's GQA 4:1 needs 512).
        sizes={"*": (Size(64, 64), Size(256, 256), Size(512, 1024), Size(2048, 2048)),
               "bias_act": (Size(64, 64), Size(256, 256), Size(256, 1024), Size(512, 1024)),
               "linear": (Size(64, 64), Size(256, 256), Size(256, 1024), Size(512, 1024)),
               "rope": (Size(64, 512), Size(256, 512), Size(512, 1024), Size(2048, 2048)),
               "attention": (Size(64, 128), Size(256, 256), Size(512, 1024), Size(1024, 1024)),
               "fused_linear_cross_entropy": (Size(1024, 256), Size(256, 1024), Size(4096, 256)),
               "cross_entropy": (Size(64, 64), Size(256, 256), Size(512, 1024), Size(2048, 1024)),
               # 32 experts of width H/2, top-4: the 1024 x 256 case is issue 26's target
               "moe": (Size(256, 256), Size(1024, 256), Size(1024, 512)),
               "adamw": (Size(0, 1024), Size(0, 2048))},
        # float32: the CPU targets' dtype (bfloat16 on the CPU is checked by the tests; on CPUs
        # without AVX512-BF16 its GEMMs are emulated, which measures the emulation).
        dtypes=("float32",),
        # The training steps the CPU targets name (te_lab.models names, @batch x seq); the
        # 2-layer Qwen3-MoE at 4 x 256 is issue 26's.
        models=("llama-tiny@2x64", "llama-mini@2x128", "hf:llama-mini@4x256", "hf:qwen3_moe-mini@4x256"), batch=1,
        dispatch=True,
        generation=generation.FULL),
    "gpu": Profile(
        "gpu", "the full GPU run: every op at two sizes (hidden 2048-8192, 4096 tokens), bfloat16 (the GPU "
        "targets' dtype; --dtypes bfloat16,float16,float32 for all); "
        "the small demo and Hugging Face Llamas",
        sizes={"*": (Size(4096, 2048), Size(4096, 8192)),
               "attention": (Size(1024, 2048), Size(4096, 2048)),
               "bias_act": (Size(4096, 2048), Size(4096, 4096)),
               "linear": (Size(4096, 2048), Size(4096, 4096)),
               "fused_linear_cross_entropy": (Size(4096, 2048), Size(4096, 4096)),
               "moe": (Size(4096, 2048),),
               "adamw": (Size(0, 2048), Size(0, 8192))},
        # Sized for 5 minutes on one GPU by estimate, not yet by a run: the compile waits (one
        # torch.compile per case, size and dtype) dominate it.
        dtypes=("bfloat16",), rounds=10, warmup=3, batch=4, seq=1024, model_rounds=10, model_warmup=2),
}


def _names(text: str) -> tuple[str, ...]:
    return () if text.strip().lower() == "none" else tuple(name.strip() for name in text.split(",") if name.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options (``te-lab bench`` adds these to its subcommand)."""
    parser.add_argument("--quick", action="store_true", help="the 'quick' profile: minutes on a 2-core CPU")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None,
                        help="sizes, dtypes, modes, rounds and models to run (default: 'cpu' on the CPU, "
                             "'gpu' on a GPU; the options below override parts of it)")
    parser.add_argument("--device", default=None, help="device (default: te_lab's default device)")
    parser.add_argument("--ops", default=None, help="comma-separated fused ops to run, or 'none' "
                        "(default: the profile's; every registered op)")
    parser.add_argument("--models", default=None, help="comma-separated models (te_lab.models.build_model "
                        "names, e.g. llama-small,hf:llama-small), or 'none'")
    parser.add_argument("--dtypes", default=None, help=f"comma-separated dtypes from {', '.join(DTYPES)}")
    parser.add_argument("--sizes", default=None, help="comma-separated TOKENSxHIDDEN sizes for every op, e.g. "
                        "512x1024,2048x2048 (default: the profile's, per op)")
    parser.add_argument("--modes", default=None, help="comma-separated per-op modes from "
                        f"{', '.join(per_op.OP_MODES)}")
    parser.add_argument("--model-modes", default=None, help="comma-separated from train, inference")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds per op case")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per contender before the rounds")
    parser.add_argument("--model-rounds", type=int, default=None, help="interleaved timed rounds per model mode")
    parser.add_argument("--batch", type=int, default=None, help="sequences per batch for the models")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence for the models")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--json", default=None, help="write the results (JSON) here")
    parser.add_argument("--markdown", default=None, help="write the markdown report here (it also goes to stdout)")
    parser.add_argument("--html", default=None, help="write the self-contained HTML report here")


def _error(where: str, given, expected: str) -> SystemExit:
    print(f"te_lab.benchmarks.suite: {where}: got {given!r}; expected {expected}", file=sys.stderr)
    return SystemExit(2)


def _size(text: str) -> Size:
    try:
        return Size.parse(text)
    except ValueError:
        raise _error("--sizes", text, SIZE_SYNTAX) from None


def resolve_profile(args: argparse.Namespace, device: torch.device) -> Profile:
    name = "quick" if args.quick else args.profile or ("gpu" if devices.is_gpu(device) else "cpu")
    if args.quick and args.profile not in (None, "quick"):
        raise _error("--quick with --profile", args.profile, "one of them")
    profile = PROFILES[name]
    overrides = {}
    if args.ops is not None:
        overrides["ops"] = _names(args.ops)
    if args.models is not None:
        overrides["models"] = _names(args.models)
    if args.sizes is not None:
        overrides["sizes"] = {"*": tuple(_size(text) for text in _names(args.sizes))}
    for option in ("dtypes", "modes", "model_modes"):
        if getattr(args, option) is not None:
            overrides[option] = _names(getattr(args, option))
    for option in ("rounds", "warmup", "model_rounds", "batch", "seq"):
        if getattr(args, option) is not None:
            overrides[option] = getattr(args, option)
    profile = replace(profile, **overrides)
    known_ops = tuple(registered_ops())
    for option, values, allowed in (("--ops", profile.ops or (), known_ops), ("--dtypes", profile.dtypes or (), DTYPES),
                                    ("--modes", profile.modes, per_op.OP_MODES),
                                    ("--model-modes", profile.model_modes, end_to_end.MODEL_MODES)):
        unknown = [value for value in values if value not in allowed]
        if unknown:
            raise _error(option, unknown[0], f"one of {', '.join(allowed)}")
    for option in ("rounds", "model_rounds", "batch", "seq"):
        if getattr(profile, option) < 1:
            raise _error(f"--{option.replace('_', '-')}", getattr(profile, option), "a positive int")
    return profile


def _dtypes(profile: Profile, device: torch.device) -> list[torch.dtype]:
    names = profile.dtypes or DTYPES
    return [getattr(torch, name) for name in names if devices.supports_dtype(getattr(torch, name), device)]


def _ops(profile: Profile) -> list[str]:
    registered = list(registered_ops())
    missing = [op for op in registered if op not in OP_CASES and op not in OPTIMIZER_OPS]
    if missing:
        raise RuntimeError(f"te_lab.benchmarks: no benchmark case for the registered op(s) {', '.join(missing)}; "
                           "add one to benchmarks/cases.py")
    return [op for op in registered if profile.ops is None or op in profile.ops]


def _command_line() -> str:
    program = sys.argv[0]
    if program.endswith("suite.py"):
        program = "python -m te_lab.benchmarks.suite"
    return " ".join([os.path.basename(program) if "/" in program else program] + [shlex.quote(a) for a in sys.argv[1:]])


def _progress_printer():
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True)

    return progress


def collect(profile: Profile, device: torch.device, progress) -> dict:
    """Run ``profile`` on ``device``; the results object (schema.py), targets included."""
    progress("measuring the copy bandwidth")
    env = environment.describe(device)
    results = {"schema": SCHEMA_ID, "command": _command_line(),
               "config": {"profile": profile.name, "description": profile.description,
                          "ops": list(profile.ops) if profile.ops is not None else None,
                          "dtypes": [str(d).removeprefix("torch.") for d in _dtypes(profile, device)],
                          "modes": list(profile.modes), "rounds": profile.rounds, "warmup": profile.warmup,
                          "models": list(profile.models), "model_modes": list(profile.model_modes),
                          "batch": profile.batch, "seq": profile.seq, "model_rounds": profile.model_rounds,
                          "model_warmup": profile.model_warmup,
                          "sizes": {op: [[s.tokens, s.hidden] for s in sizes] for op, sizes in profile.sizes.items()}},
               "environment": env, "ops": [], "models": [], "failures": []}

    def attempt(where: str, measure) -> list[dict]:
        # One op or model that breaks mid-run is a result of its own, not the end of a long run.
        try:
            return measure()
        except Exception as error:
            results["failures"].append({"where": where, "error": describe_error(error)})
            progress(f"{where} failed: {results['failures'][-1]['error']}")
            return []

    for dtype in _dtypes(profile, device):
        for op in _ops(profile):
            for size in profile.sizes_for(op):
                results["ops"] += attempt(f"{op} {size} {str(dtype).removeprefix('torch.')}", lambda: per_op.run_op(
                    op, size, dtype, profile.modes, device, ceilings=environment.ceilings(env, dtype),
                    rounds=profile.rounds, warmup=profile.warmup, progress=progress))
    if profile.dispatch:
        results["dispatch"] = [dispatch.as_record(result) for result in
                               attempt("dispatch", lambda: dispatch.run(device, progress=progress))]
    for model, batch, seq in profile.model_batches():
        results["models"] += attempt(model, lambda: end_to_end.run_model(
            model, device, batch=batch, seq=seq, rounds=profile.model_rounds,
            warmup=profile.model_warmup, modes=profile.model_modes, progress=progress))
    if profile.generation is not None:
        results["generation"] = [record for model in profile.generation.models
                                 for batch in profile.generation.batches for prompt in profile.generation.prompts
                                 for record in attempt(f"generation {model} batch {batch} prompt {prompt}", lambda: [
                                     generation.run_config(model, batch, prompt, profile.generation, device=device,
                                                           progress=progress)])]
    results["targets"] = evaluate(results)
    return results


def run(args: argparse.Namespace) -> int:
    """Run the suite with parsed ``args`` (see :func:`add_arguments`); the exit status."""
    try:
        device = devices.resolve(args.device)
    except (TypeError, ValueError) as error:
        print(f"te_lab.benchmarks.suite: --device: {error}", file=sys.stderr)
        return 2
    try:
        profile = resolve_profile(args, device)
    except SystemExit as exit_status:
        return int(exit_status.code)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for option in ("json", "markdown", "html"):
        path = getattr(args, option)
        if path is not None and not pathlib.Path(path).resolve().parent.is_dir():
            print(f"te_lab.benchmarks.suite: --{option}: the folder of {path!r} does not exist", file=sys.stderr)
            return 2
    progress = _progress_printer()
    progress(f"profile {profile.name} on {device}: {profile.description}")
    results = collect(profile, device, progress)
    text = markdown(results)
    print(text)
    if args.markdown:
        write_keeping_hand_written(args.markdown, text)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if args.html:
        write_html(results, args.html)
    progress("done")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.benchmarks.suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
