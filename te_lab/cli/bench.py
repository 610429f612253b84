"""``te-lab bench``: the benchmark suite (``te_lab.benchmarks.suite``), which declares
its own options (``add_arguments``) and runs (``run``)."""

from __future__ import annotations

from te_lab.benchmarks import suite


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "bench", help="the benchmark suite: te_lab against eager PyTorch and torch.compile",
        description="Per-op and end-to-end benchmarks: te_lab against the eager baseline and torch.compile "
                    "(and Liger-Kernel where installed), interleaved runs, medians and ratios; --quick finishes "
                    "in minutes on a 2-core CPU.")
    suite.add_arguments(parser)
    parser.set_defaults(run=suite.run)
