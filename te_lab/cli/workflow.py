"""The job ``te-lab demo`` and ``te-lab profile`` run: build a model, fuse it with
probe verification, profile it eager against fused, print both reports and write the
files asked for. Progress goes to stderr (bars) and stdout (one line per stage)."""

from __future__ import annotations

import argparse
import sys

import torch

import te_lab
from te_lab import device as devices
from te_lab.models import build_model, example_batch

from .options import DTYPES, check_dtype_on_device

STAGES = 4


def _stage(number: int, text: str) -> None:
    print(f"[{number}/{STAGES}] {text}", flush=True)


def _progress_bar(description: str):
    """A ``progress(done, total)`` callback drawing a tqdm bar (on stderr)."""
    from tqdm import tqdm

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=description, leave=False)
        bar.total = total  # steps="auto" plans more steps as it learns how long one takes
        bar.update(done - bar.n)
        if done >= total:
            # tqdm redraws at most every 0.1 s: without a refresh a fast last step
            # would never show as complete.
            bar.refresh()
            bar.close()
    return progress


def fuse_and_profile(args: argparse.Namespace) -> int:
    """Run the job on the options of :func:`te_lab.cli.options.add_run_arguments`;
    the exit status is 1 when the fused model's output left the dtype's tolerance."""
    check_dtype_on_device(args.parser, args)
    device = devices.resolve(args.device)
    dtype = DTYPES[args.dtype]
    _stage(1, f"building {args.model} ({args.dtype}) on {device} ({devices.device_name(device)})")
    model = build_model(args.model, dtype=dtype, device=device)
    batch = example_batch(model, args.batch, args.seq)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"      {type(model).__name__}: {parameters / 1e6:.2f} M parameters; batch {args.batch} x {args.seq} "
          f"tokens; {torch.get_num_threads()} CPU threads", flush=True)

    _stage(2, "fusing: each candidate is probed against the module it replaces (forward and backward)")
    fusion = te_lab.fuse(model, sample=batch, progress=True)
    print(fusion, flush=True)

    timed = (f"timed pairs until the speedup's 95% interval is within ±3% (at most {args.budget:g} s)"
             if args.steps == "auto" else f"{args.steps} timed steps per mode")
    _stage(3, f"profiling eager against fused: {args.warmup} warm-up + {timed}, interleaved, then profiled steps")
    report = te_lab.profile(model, batch, steps=args.steps, warmup=args.warmup, budget_s=args.budget,
                            progress=_progress_bar("te_lab.profile"), trace_dir=args.trace_dir)
    print(report.summary(), flush=True)
    if args.opportunities is not None:
        print("\n".join(report.opportunity_lines(args.opportunities)), flush=True)

    _stage(4, "writing the reports")
    if args.html is not None:
        print(f"      static dashboard: {te_lab.to_html(report, args.html)} (opens offline in any browser)")
    if args.json is not None:
        args.json.write_text(report.to_json(indent=1), encoding="utf-8")
        print(f"      ProfileReport as JSON: {args.json} (te_lab.ProfileReport.from_json reads it back)")
    if args.trace_dir is not None:
        written = sorted(args.trace_dir.glob("*.pt.trace.json.gz"))
        print(f"      raw profiler traces: {len(written)} files in {args.trace_dir} (te_lab.open_trace reads them)")
    if args.html is None and args.json is None and args.trace_dir is None:
        print("      nothing to write (--html PATH, --json PATH, --trace-dir DIR)")
    if fusion.model_check is not None and not fusion.model_check.within_tolerance:
        print("te-lab: the fused model's output is outside the dtype's tolerance of the original's "
              "(see 'whole model on the sample' above)", file=sys.stderr)
        return 1
    return 0
