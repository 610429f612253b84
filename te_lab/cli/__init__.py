"""The ``te-lab`` command: ``demo``, ``profile``, ``generate``, ``bench``, ``gpu-check``, ``info`` and ``lab``, one
file per command. Each module has ``add_parser(subcommands)``, which declares its
options and sets ``run(args) -> exit status`` as the parser's default."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from te_lab.models import CheckpointError

from . import bench, demo, generate, gpu_check, info, lab, profile

COMMANDS = (demo, profile, generate, bench, gpu_check, info, lab)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="te-lab", description="te_lab: fuse a Transformer's layers into fused kernels, verify and profile them.")
    subcommands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(subcommands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CheckpointError as error:  # a checkpoint that exists but cannot be loaded: what to do, no traceback
        args.parser.error(f"--model: {error}")
