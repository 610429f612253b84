"""``te-lab lab``: JupyterLab on the tutorial notebooks.

The notebooks live in the source repository (``notebooks/``), not in the installed
package: from a checkout (an editable install) ``te-lab lab`` opens them; an install
from a wheel has none and asks for ``--notebook-dir`` (a clone's ``notebooks/``, or any
folder of your own notebooks).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

import te_lab

FIRST_NOTEBOOK = "01_quickstart.ipynb"


def checkout_notebooks(package_dir: Path = Path(te_lab.__file__).resolve().parent) -> Optional[Path]:
    """The source checkout's ``notebooks/`` beside the ``te_lab`` package, if there is one."""
    candidate = package_dir.parent / "notebooks"
    return candidate if (candidate / FIRST_NOTEBOOK).is_file() else None


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "lab", help="start JupyterLab on the tutorial notebooks",
        description="Start JupyterLab (it must be installed: pip install jupyterlab) on te_lab's tutorial notebooks. "
                    "From a source checkout these are its notebooks/ folder; elsewhere pass --notebook-dir. "
                    "Arguments after -- go to JupyterLab unchanged (e.g. -- --ServerApp.token=secret).")
    parser.add_argument("--notebook-dir", type=Path, default=None,
                        help=f"the folder to open (default: the checkout's notebooks/, here "
                             f"{checkout_notebooks() or 'none: te_lab is not installed from a checkout'})")
    parser.add_argument("--port", type=int, default=8888, help="the port to serve on (default 8888)")
    parser.add_argument("--ip", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser")
    parser.add_argument("jupyter_arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(run=run, parser=parser)


def jupyter_command(args: argparse.Namespace, notebook_dir: Path) -> list[str]:
    extra = args.jupyter_arguments[1:] if args.jupyter_arguments[:1] == ["--"] else args.jupyter_arguments
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebook_dir}",
               f"--ServerApp.ip={args.ip}", f"--ServerApp.port={args.port}", "--ServerApp.port_retries=0"]
    if args.no_browser:
        command.append("--no-browser")
    # Jupyter refuses to run as root without this flag; containers and CI machines often are root.
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    return command + extra


def run(args: argparse.Namespace) -> int:
    notebook_dir = args.notebook_dir or checkout_notebooks()
    if notebook_dir is None:
        args.parser.error("--notebook-dir is required: te_lab is not installed from a source checkout, and the "
                          "tutorial notebooks ship only with the repository's notebooks/ folder")
    if not notebook_dir.is_dir():
        args.parser.error(f"argument --notebook-dir: {str(notebook_dir)!r} is not a directory")
    if importlib.util.find_spec("jupyterlab") is None:
        print("te-lab lab: JupyterLab is not installed (pip install jupyterlab)", file=sys.stderr)
        return 1
    command = jupyter_command(args, notebook_dir.resolve())
    print(f"te-lab lab: JupyterLab on {notebook_dir.resolve()} at http://{args.ip}:{args.port}/lab "
          f"(JupyterLab prints the address with its access token below; Ctrl-C stops it)", flush=True)
    # Replace this process, so signals (Ctrl-C, a terminate) reach JupyterLab itself.
    os.execv(command[0], command)
