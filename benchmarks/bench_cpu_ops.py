"""Per-op CPU benchmark: forward + backward of each fused op against the eager baseline
and torch.compile of that baseline, interleaved, medians and ratios.

    python benchmarks/bench_cpu_ops.py [--rounds 15] [--ops rms_norm,glu] [--rows 4096]

Every available CPU backend of te_lab is a contender of its own; ``te_lab`` is what
automatic selection picks. Achieved bandwidth is the bytes each op must move (see
cases.py) over the median time, shown against this machine's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import adamw_case, op_cases  # noqa: E402
from harness import fwd_bwd_step, interleaved, peak_memory_bytes  # noqa: E402
from report import print_table  # noqa: E402

from te_lab import device as devices  # noqa: E402
from te_lab.kernels import available_backends, registered_ops, select_backend  # noqa: E402


def contenders_for(case, device):
    op = registered_ops()[case.op]
    auto = select_backend(op, device)
    steps = {
        "eager": fwd_bwd_step(case.baseline, case.inputs),
        "torch.compile": fwd_bwd_step(torch.compile(case.baseline), case.inputs),
    }
    for backend in available_backends(op, device):
        if backend in ("reference", "triton"):
            continue
        label = f"te_lab[{backend}]" + (" (auto)" if backend == auto else "")
        fused = (lambda backend: lambda *args: case.fused(*args, backend=backend))(backend)
        steps[label] = fwd_bwd_step(fused, case.inputs)
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender (default 2)")
    parser.add_argument("--rows", type=int, default=4096, help="rows of the activations (default 4096)")
    parser.add_argument("--ops", default="", help="comma-separated op names to run (default: all)")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    wanted = set(filter(None, args.ops.split(",")))
    copy_gbs = devices.measure_copy_bandwidth(device)
    print(f"# te_lab CPU benchmark: {devices.device_name(device)}, {devices.multiprocessor_count(device)} cores, "
          f"torch {torch.__version__}, float32, fwd+bwd")
    print(f"measured copy bandwidth: {copy_gbs:.1f} GB/s\n")
    selected = [(case, contenders_for(case, device)) for case in op_cases(device, torch.float32, rows=args.rows)
                if not wanted or case.op in wanted]
    if not wanted or "adamw" in wanted:
        optimizer = adamw_case(device, torch.float32)
        selected.append((optimizer, optimizer.steps))
    for case, steps in selected:
        print(f"## {case.title}", flush=True)
        timings = interleaved(steps, device, rounds=args.rounds, warmup=args.warmup,
                              progress=lambda message: print(f"  .. {message}", file=sys.stderr, flush=True))
        memory = ({name: peak_memory_bytes(step, device) for name, step in steps.items()}
                  if case.measure_memory else None)
        print_table(case, timings, peak_gbs=copy_gbs, peak_label="copy", peak_memory=memory)
        print(flush=True)


if __name__ == "__main__":
    main()
