"""GPU check: compile and run every fused op's Triton kernels on a CUDA or MUSA GPU and
check them against the reference, then train a demo Llama fused and unfused in bf16.

    python -m te_lab.benchmarks.gpu_check [--tokens 4096 --hidden 2048] [--dtypes bfloat16,float32]
                                          [--training-model llama-mini] [--training-steps 20]

Correctness: forward output and every gradient are compared with the reference run in
float64 on the same inputs (the truth); the Triton result passes when its error is at
most twice the error of the reference run in the benchmark dtype, plus that dtype's
atol. Training: ``training_check.autocast_training_check`` (loss curves side by side
within bf16's tolerance, step time as interleaved medians). Timing of the ops against
eager, torch.compile and Liger is the suite's (``python -m te_lab.benchmarks.suite
--profile gpu``). On a machine without a GPU that Triton drives it says so and exits 1.
"""

from __future__ import annotations

import argparse
import sys

import torch

from te_lab import device as devices
from te_lab.kernels.precision import TOLERANCES

from .cases import OP_CASES, OpCase, Size, op_cases
from .training_check import autocast_training_check, print_training_check


def _outputs_and_grads(fn, inputs, dtype=None):
    """Outputs and input gradients of ``fn`` on copies of ``inputs`` (cast to ``dtype``),
    under the same seeded upstream gradients every time."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    generator = torch.Generator(device="cpu").manual_seed(0)
    upstream = [torch.randn(o.shape, generator=generator).to(o.device, o.dtype) for o in out]
    return [t.detach() for t in out] + list(torch.autograd.grad(out, leaves, upstream))


def check_case(case: OpCase) -> tuple[bool, float, float]:
    """(passed, worst Triton error, worst reference-in-dtype error), both vs float64."""
    dtype = case.inputs[0].dtype
    triton = _outputs_and_grads(lambda *a: case.fused(*a, backend="triton"), case.inputs)
    in_dtype = _outputs_and_grads(lambda *a: case.fused(*a, backend="reference"), case.inputs)
    truth = _outputs_and_grads(lambda *a: case.fused(*a, backend="reference"), case.inputs, torch.float64)
    passed, worst_triton, worst_reference = True, 0.0, 0.0
    for got, ref, true in zip(triton, in_dtype, truth):
        error = (got.double() - true).abs().max().item()
        reference_error = (ref.double() - true).abs().max().item()
        passed &= error <= 2 * reference_error + TOLERANCES[dtype]["atol"]
        worst_triton, worst_reference = max(worst_triton, error), max(worst_reference, reference_error)
    return passed, worst_triton, worst_reference


def unavailable_reason(device: torch.device):
    """Why this check cannot run on ``device``, or None."""
    if not devices.is_gpu(device):
        return "no CUDA or MUSA GPU on this machine; nothing to check"
    if not devices.triton_available(device):
        return devices.triton_unavailable_reason(device.type)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens (rows) of the activations (default 4096)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes")
    parser.add_argument("--training-model", default="llama-mini", help="demo model of the bf16 training check")
    parser.add_argument("--training-steps", type=int, default=20, help="steps of the training check (default 20)")
    args = parser.parse_args(argv)
    device = devices.default_device()
    reason = unavailable_reason(device)
    if reason is not None:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return 1
    print(f"# te_lab GPU check: {devices.device_name(device)} ({device}), torch {torch.__version__}\n")
    all_passed = True
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for op in OP_CASES:
            for case in op_cases(op, device, dtype, Size(args.tokens, args.hidden)):
                passed, error, reference_error = check_case(case)
                all_passed &= passed
                print(f"- {case.title}, {dtype_name}: {'PASS' if passed else 'FAIL'} (max error vs float64: "
                      f"triton {error:.3g}, eager {dtype_name} {reference_error:.3g})", flush=True)
    print()
    training = autocast_training_check(device, model=args.training_model, steps=args.training_steps,
                                       progress=lambda message: print(f"  .. {message}", file=sys.stderr, flush=True))
    print_training_check(training)
    all_passed &= training["within_tolerance"]
    print("all checks passed" if all_passed else "SOME CHECKS FAILED")
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
