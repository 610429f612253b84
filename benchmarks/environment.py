"""What every result is recorded with: the machine, its threads and load, the versions
of what ran, and the bandwidth and compute ceilings the figures are read against."""

from __future__ import annotations

import datetime
import os
import platform
import sys

import torch

from te_lab import device as devices
from te_lab.status import package_versions

PACKAGES = ("te_lab", "torch", "triton", "transformers", "liger_kernel", "numpy")


def describe(device: torch.device) -> dict:
    """The schema's ``environment`` object. Measures the copy bandwidth (once per process)."""
    peak = devices.peak(device)
    return {
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": devices.device_name(device),
        "parallel_units": devices.multiprocessor_count(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": package_versions(PACKAGES),
        "copy_bandwidth_gbs": devices.measure_copy_bandwidth(device),
        "peak": {"name": peak.name, "memory_bandwidth_gbs": peak.memory_bandwidth_gbs,
                 "fp32_tflops": peak.fp32_tflops, "bf16_tflops": peak.bf16_tflops, "source": peak.source},
    }


def cpu_headline() -> str:
    """One line for a hand-run benchmark's output: the CPU, its threads, torch, the load."""
    machine = describe(torch.device("cpu"))
    return (f"{machine['device_name']}, {machine['torch_threads']} threads, torch {torch.__version__}, "
            f"load average {machine['load_average_1min']}")


def ceilings(environment: dict, dtype: torch.dtype) -> dict:
    """The figures an op's achieved rates are divided by, for ``dtype``."""
    peak = environment["peak"]
    return {"copy_gbs": environment["copy_bandwidth_gbs"], "peak_gbs": peak["memory_bandwidth_gbs"],
            "peak_tflops": peak["fp32_tflops"] if dtype == torch.float32 else peak["bf16_tflops"]}
