"""``te-lab demo``: the main job on a model big enough to show something and small
enough to finish in about a minute on a 2-core CPU."""

from __future__ import annotations

from pathlib import Path

from .options import add_run_arguments
from .workflow import fuse_and_profile

DEFAULT_MODEL, DEFAULT_BATCH, DEFAULT_SEQ = "llama-mini", 4, 128
REPORT = Path("te_lab_report.html")


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "demo", help="fuse, verify and profile the demo Llama; write te_lab_report.html",
        description=f"Build the demo Llama ({DEFAULT_MODEL}: hidden 256, 4 layers; random weights, no download), "
                    f"fuse it (every swap probe-verified), profile it eager against fused, print the fusion "
                    f"report and the profile summary, and write the static dashboard to {REPORT}.")
    add_run_arguments(parser, model=DEFAULT_MODEL, batch=DEFAULT_BATCH, seq=DEFAULT_SEQ, html=REPORT)
    parser.set_defaults(run=fuse_and_profile, parser=parser)

