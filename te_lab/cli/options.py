"""Options shared by the commands that build, fuse and profile a model (``demo``,
``profile``), checked while parsing so a mistake fails at once, naming the option and
what it accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from te_lab import device as devices
from te_lab.models import HUGGINGFACE_MODEL_NAMES, MODEL_NAMES, canonical_model_name, is_checkpoint_path
from te_lab.options import argument_type, check_budget, check_steps, check_warmup

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def model_name(value: str) -> str:
    """A demo or ``hf:`` model name, or a checkpoint on disk (a folder that
    ``save_pretrained`` wrote, a ``.gguf`` file), which must exist."""
    if is_checkpoint_path(value):
        if not Path(value).exists():
            raise argparse.ArgumentTypeError(f"checkpoint {value!r} does not exist: pass a folder that "
                                             f"save_pretrained wrote (config.json and *.safetensors) or a .gguf file")
        return value
    try:
        return canonical_model_name(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown model {value!r}; choose from {', '.join(MODEL_NAMES + HUGGINGFACE_MODEL_NAMES)} "
            f"('hf:<architecture>' alone is its tiny preset), or pass a checkpoint folder or .gguf file") from None


def device_name(value: str) -> str:
    try:
        return str(devices.resolve(value))
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("device: ")) from None


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def file_with_suffix(*suffixes: str):
    """An argparse type: a path whose name ends in one of ``suffixes``, in a folder that exists."""
    def check(value: str) -> Path:
        if not value.lower().endswith(suffixes):
            raise argparse.ArgumentTypeError(f"expected a path ending in {' or '.join(suffixes)}, got {value!r}")
        path = Path(value)
        if not path.parent.is_dir():  # found now, not after the run it would be written at the end of
            raise argparse.ArgumentTypeError(f"the folder of {value!r} does not exist")
        return path
    return check


def add_run_arguments(parser: argparse.ArgumentParser, *, model: str | None, batch: int, seq: int,
                      html: Path | None) -> None:
    """The model, its batch, the device, the dtype, the profile's length and the report
    files; ``model=None`` makes ``--model`` required."""
    parser.add_argument("--model", type=model_name, default=model, required=model is None,
                        help="a checkpoint folder (config.json and safetensors) or .gguf file, "
                             f"a demo model ({', '.join(MODEL_NAMES)}) or a Hugging Face one built from a config, "
                             f"no download (hf:<architecture>[-<preset>], e.g. hf:llama, hf:qwen2-mini)"
                             + (f"; default {model}" if model else ""))
    parser.add_argument("--batch", type=positive_int, default=batch, help=f"sequences per batch (default {batch})")
    parser.add_argument("--seq", type=positive_int, default=seq, help=f"tokens per sequence (default {seq})")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="parameter dtype (default float32)")
    parser.add_argument("--device", type=device_name, default=None,
                        help=f"cpu, cuda[:N] or musa[:N] (default: the first GPU, else the CPU; here "
                             f"{devices.default_device()})")
    parser.add_argument("--steps", type=argument_type(check_steps), default="auto",
                        help="timed steps per mode, or auto: interleaved pairs until the speedup's 95%% interval is "
                             "within ±3%% or --budget runs out (default auto)")
    parser.add_argument("--budget", type=argument_type(check_budget), default=60.0, metavar="SECONDS",
                        help="with --steps auto, the most seconds spent on timed steps (default 60)")
    parser.add_argument("--warmup", type=argument_type(check_warmup), default=2,
                        help="untimed steps per mode first (default 2)")
    parser.add_argument("--html", type=file_with_suffix(".html", ".htm"), default=html,
                        help="write the static dashboard here" + (f" (default {html})" if html else ""))
    parser.add_argument("--json", type=file_with_suffix(".json"), default=None,
                        help="write the ProfileReport here as JSON (te_lab.ProfileReport.from_json reads it)")
    parser.add_argument("--opportunities", type=positive_int, nargs="?", const=10, default=None, metavar="N",
                        help="print the fusion-opportunity finder's top N rows per mode (default 10): what fusion "
                             "left, and the eager step's chains with the gains fusing realized")
    parser.add_argument("--trace-dir", type=Path, default=None, metavar="DIR",
                        help="write each mode's raw profiler traces here (<mode>.step<N>.pt.trace.json.gz; "
                             "te_lab.open_trace, TensorBoard or Perfetto read them)")


def check_dtype_on_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    device = devices.resolve(args.device)
    if not devices.supports_dtype(DTYPES[args.dtype], device):
        parser.error(f"argument --dtype: {args.dtype} is not supported on {device} "
                     f"({devices.device_name(device)}); choose from "
                     f"{', '.join(name for name, dtype in DTYPES.items() if devices.supports_dtype(dtype, device))}")
