"""GPU check: compile and run every fused op's Triton kernels on a CUDA or MUSA GPU,
check them against the reference, and time them against eager and torch.compile.

    python benchmarks/gpu_check.py [--rows 16384] [--dtypes bfloat16,float32] [--rounds 10]

Correctness: forward output and every gradient are compared with the reference run in
float64 on the same inputs (the truth); the Triton result passes when its error is at
most twice the error of the reference run in the benchmark dtype, plus that dtype's
atol. Timing: forward + backward, interleaved medians, achieved GB/s against the
device's peak (the device layer's table, or its measured copy bandwidth).
Finishes in a few minutes on one GPU; on a machine without one it says so and exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cases import op_cases  # noqa: E402
from harness import fwd_bwd_step, interleaved, peak_memory_bytes  # noqa: E402
from report import print_table  # noqa: E402

from te_lab import device as devices  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def _outputs_and_grads(fn, inputs, dtype=None):
    """Outputs and input gradients of ``fn`` on copies of ``inputs`` (cast to ``dtype``),
    under the same seeded upstream gradients every time."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    generator = torch.Generator(device="cpu").manual_seed(0)
    upstream = [torch.randn(o.shape, generator=generator).to(o.device, o.dtype) for o in out]
    return [t.detach() for t in out] + list(torch.autograd.grad(out, leaves, upstream))


def check_case(case) -> tuple[bool, float, float]:
    """(passed, worst Triton error, worst reference-in-dtype error), both vs float64."""
    dtype = case.inputs[0].dtype
    triton = _outputs_and_grads(lambda *a: case.fused(*a, backend="triton"), case.inputs)
    in_dtype = _outputs_and_grads(lambda *a: case.fused(*a, backend="reference"), case.inputs)
    truth = _outputs_and_grads(lambda *a: case.fused(*a, backend="reference"), case.inputs, torch.float64)
    passed, worst_triton, worst_reference = True, 0.0, 0.0
    for got, ref, true in zip(triton, in_dtype, truth):
        error = (got.double() - true).abs().max().item()
        reference_error = (ref.double() - true).abs().max().item()
        passed &= error <= 2 * reference_error + ATOL[dtype]
        worst_triton, worst_reference = max(worst_triton, error), max(worst_reference, reference_error)
    return passed, worst_triton, worst_reference


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16384, help="rows of the activations (default 16384)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timed rounds (default 10)")
    args = parser.parse_args(argv)
    device = devices.default_device()
    if not devices.is_gpu(device):
        print("gpu_check: no CUDA or MUSA GPU on this machine; nothing to check", file=sys.stderr)
        return 1
    if not devices.triton_available(device):
        print(f"gpu_check: {devices.triton_unavailable_reason(device.type)}", file=sys.stderr)
        return 1
    peak = devices.peak(device)
    print(f"# te_lab GPU check: {devices.device_name(device)} ({device}), torch {torch.__version__}")
    print(f"peak memory bandwidth: {peak.memory_bandwidth_gbs:.0f} GB/s ({peak.source})\n")
    all_passed = True
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for case in op_cases(device, dtype, rows=args.rows):
            passed, error, reference_error = check_case(case)
            all_passed &= passed
            print(f"## {case.title}, {dtype_name}: {'PASS' if passed else 'FAIL'} "
                  f"(max error vs float64: triton {error:.3g}, eager {dtype_name} {reference_error:.3g})", flush=True)
            steps = {
                "eager": fwd_bwd_step(case.baseline, case.inputs),
                "torch.compile": fwd_bwd_step(torch.compile(case.baseline), case.inputs),
                "te_lab[triton]": fwd_bwd_step(lambda *a, case=case: case.fused(*a, backend="triton"),
                                               case.inputs),
            }
            timings = interleaved(steps, device, rounds=args.rounds)
            memory = ({name: peak_memory_bytes(step, device) for name, step in steps.items()}
                      if case.measure_memory else None)
            print_table(case, timings, peak_gbs=peak.memory_bandwidth_gbs, peak_label="peak", peak_memory=memory)
            print(flush=True)
    print("all checks passed" if all_passed else "SOME CHECKS FAILED")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
