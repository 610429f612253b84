"""``te-lab gpu-check``: the GPU check (``te_lab.gpu_checks.gpu_check``), which declares its
own options (``add_arguments``) and runs (``run``)."""

from __future__ import annotations

from te_lab.gpu_checks import gpu_check


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "gpu-check", help="on a CUDA or MUSA GPU: every Triton kernel checked and timed, a bf16 training check and "
                          "a profile, into one folder",
        description="Every op's Triton kernels against float64 truth in float32 and bfloat16, their times against "
                    "eager, torch.compile and Liger-Kernel with GB/s beside the device's peak, a Hugging Face Llama "
                    "bf16 training step fused against unfused, and a te_lab profile with its HTML and raw traces, "
                    "all in --out. Refuses, writing nothing, on a machine without a GPU that Triton drives.")
    gpu_check.add_arguments(parser)
    parser.set_defaults(run=gpu_check.run)
