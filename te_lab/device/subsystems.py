"""What torch's subsystems call a device: the profiler activity that records its work and
the torch.distributed process-group backend that connects it."""

from __future__ import annotations

import torch

from . import selection
from .selection import DeviceLike


def profiler_activities(device: DeviceLike = None) -> list:
    """torch.profiler activities that record work on ``device``."""
    from torch.profiler import ProfilerActivity

    # MUSA's kernels are recorded under PrivateUse1, where the torch build has it.
    device_activity = getattr(ProfilerActivity, _PROFILER_ACTIVITY.get(selection.resolve(device).type, ""), None)
    activities = [ProfilerActivity.CPU]
    if device_activity is not None and device_activity in torch.profiler.supported_activities():
        activities.append(device_activity)
    return activities


_PROFILER_ACTIVITY = {"cuda": "CUDA", "musa": "PrivateUse1"}


def distributed_backend(device: DeviceLike = None) -> str:
    """The torch.distributed process-group backend for a device."""
    return {"cuda": "nccl", "musa": "mccl", "cpu": "gloo"}[selection.resolve(device).type]
