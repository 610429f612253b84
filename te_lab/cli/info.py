"""``te-lab info``: what te_lab finds here — devices, the backend each fused op runs,
whether Triton kernels can run on each kind of GPU (and why not), versions."""

from __future__ import annotations

import importlib.util

import torch

from te_lab import device as devices
from te_lab.status import status_lines, triton_line


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "info", help="devices, backends per op, Triton, versions",
        description="Print the devices te_lab detects (MUSA, CUDA, CPU), the backend each fused op runs on the "
                    "default device (and the others available there), whether te_lab's Triton kernels can run "
                    "on each GPU type, and the versions of torch, triton, torch_musa and transformers.")
    parser.set_defaults(run=run)


def _gpu_line(device_type: str) -> str:
    count = devices.device_count(device_type)
    if device_type == "musa":
        found = "torch_musa installed" if importlib.util.find_spec("torch_musa") else "torch_musa not installed"
    else:
        found = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "torch built without CUDA"
    # With no device the Triton line still says whether the software stack would run kernels.
    return f"{device_type}: {count} device(s) ({found}); {'' if count else 'with a device, '}{triton_line(device_type)}"


def run(args) -> int:
    lines = status_lines()
    default = devices.default_device()
    lines.append("GPU types:")
    lines += [f"  {_gpu_line(kind)}" for kind in devices.GPU_TYPES]
    lines.append(f"torch.distributed backend on {default}: {devices.distributed_backend(default)}")
    print("\n".join(lines))
    return 0
