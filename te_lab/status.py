"""What te_lab finds on this machine: devices, the backend each fused op runs, whether
Triton kernels can run (and why not), and the versions that matter. ``%te_status`` and
``te-lab info`` print these lines."""

from __future__ import annotations

import importlib.metadata

import torch

from te_lab import device as devices
from te_lab.kernels import (
    available_backends,
    cpu_kernels,
    inductor_compiled,
    measured_choice,
    registered_ops,
    select_backend,
)
from te_lab.kernels.registry import describe_backend
from te_lab.version import __version__

VERSIONED = ("torch", "triton", "torch_musa", "transformers")


def package_versions(packages: tuple[str, ...] = VERSIONED) -> dict[str, str | None]:
    """Installed version of each of ``packages`` (``None``: not installed)."""
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def triton_line(device_type: str) -> str:
    reason = devices.triton_unavailable_reason(device_type)
    return f"triton backend on {device_type}: " + ("available" if reason is None else f"unavailable: {reason}")


def cpp_line() -> str:
    """Whether te_lab's C++ CPU kernels (the ``cpp`` backend) are built here, and where."""
    reason = cpu_kernels.unavailable_reason()
    return "cpp backend on cpu: " + (f"built in {cpu_kernels.build_directory()}" if reason is None
                                     else f"unavailable: {reason}")


def measured_choice_lines() -> list[str]:
    """The machine-dependent choices measured here so far (kernels.measured_choice)."""
    made = measured_choice.decisions()
    lines = [f"measured choices for {measured_choice.machine_fingerprint()}"
             + (":" if made else ": none yet (each is measured the first time it matters)")]
    for key, decision in sorted(made.items()):
        times = ", ".join(f"{name} {us:.0f} us" for name, us in decision["median_us"].items())
        lines.append(f"  {key}: {decision['choice']} ({times})")
    return lines


def status_lines() -> list[str]:
    """Devices (the default first), backends per op on the default device (the automatic
    choice, then the others available), Triton's and the C++ kernels' availability, the
    measured choices, versions and threads."""
    default = devices.default_device()
    lines = [f"devices: {', '.join(str(d) for d in devices.available_devices())} (default {default}: "
             f"{devices.device_name(default)})", f"backends on {default} (auto choice first):"]
    for name, op in registered_ops().items():
        chosen = select_backend(op, default)
        others = [b for b in available_backends(op, default) if b != chosen]
        lines.append(f"  {name}: {describe_backend(op, default)}" + (f" (also: {', '.join(others)})" if others else ""))
    lines.append(triton_line(default.type))
    lines.append(cpp_line())
    lines.extend(measured_choice_lines())
    slow = sorted(name for name, how in inductor_compiled.LOWERING.items() if how != "direct")
    if slow:
        lines.append(f"inductor graphs run through torch.compile (their direct lowering failed): {', '.join(slow)}")
    versions = ", ".join(f"{package} {version or 'not installed'}" for package, version in package_versions().items())
    lines.append(f"versions: {versions}; te_lab {__version__}; {torch.get_num_threads()} CPU threads")
    return lines
