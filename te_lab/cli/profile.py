"""``te-lab profile --model NAME``: fuse, verify and profile any demo or Hugging Face
model at the batch, dtype and device given."""

from __future__ import annotations

from .options import add_run_arguments
from .workflow import fuse_and_profile


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "profile", help="fuse, verify and profile a model eager against fused",
        description="Build MODEL (random weights, no download), fuse it with every swap probe-verified, profile "
                    "it eager against fused and print both reports; --html writes the static dashboard, --json "
                    "the ProfileReport.")
    add_run_arguments(parser, model=None, batch=2, seq=64, html=None)
    parser.set_defaults(run=fuse_and_profile, parser=parser)

