"""Which devices this machine has, which one a ``device`` argument means, and the torch
module that drives it (``torch.musa``, ``torch.cuda``, ``torch.cpu``).

MUSA (Moore Threads, via torch_musa) is registered by torch as the PrivateUse1 backend
with the device string ``"musa"``; it is looked for first, then CUDA, then the CPU. Work
is synchronised through the device's own module, never torch.accelerator's generic
synchronize (broken on MUSA with torch 2.7).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Union

import torch

DeviceLike = Union[str, torch.device, None]

GPU_TYPES = ("musa", "cuda")  # in order of preference for the default device


def _musa_is_available() -> bool:
    # torch_musa registers torch.musa when imported; it is optional.
    if importlib.util.find_spec("torch_musa") is None:
        return False
    try:
        importlib.import_module("torch_musa")
    except Exception:  # a broken install must not break te_lab on other devices
        return False
    module = getattr(torch, "musa", None)
    return bool(module is not None and module.is_available())


def is_available(device_type: str) -> bool:
    """Whether devices of ``device_type`` ("musa", "cuda", "cpu") can be used here."""
    if device_type == "cpu":
        return True
    if device_type == "cuda":
        return torch.cuda.is_available()
    if device_type == "musa":
        return _musa_is_available()
    return False


def device_module(device: torch.device):
    """The torch module for a device type: ``torch.cuda``, ``torch.musa``, ``torch.cpu``."""
    return getattr(torch, device.type)


def device_count(device_type: str) -> int:
    if device_type == "cpu":
        return 1
    if not is_available(device_type):
        return 0
    return device_module(torch.device(device_type)).device_count()


def available_devices() -> list[torch.device]:
    """Every usable device, GPUs first (MUSA, then CUDA), the CPU last."""
    found = [
        torch.device(kind, index)
        for kind in GPU_TYPES
        for index in range(device_count(kind))
    ]
    return found + [torch.device("cpu")]


def default_device() -> torch.device:
    """The first GPU (MUSA before CUDA) if there is one, else the CPU."""
    for kind in GPU_TYPES:
        if device_count(kind) > 0:
            return torch.device(kind, 0)
    return torch.device("cpu")


def resolve(device: DeviceLike = None) -> torch.device:
    """Turn ``None``, ``"musa"``, ``"cuda:1"``, ``"cpu"`` or a ``torch.device`` into a
    usable ``torch.device`` with an explicit index on GPUs; raise if it is not usable."""
    if device is None:
        return default_device()
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device: expected a str such as 'cpu', 'cuda:0', 'musa' or a torch.device, "
            f"got {type(device).__name__}"
        )
    # torch cannot parse "musa" until torch_musa has registered it, so an absent GPU
    # type is reported as unavailable before torch is asked to parse the string.
    if isinstance(device, str):
        kind = device.split(":", 1)[0]
        if kind in GPU_TYPES and device_count(kind) == 0:
            raise _unavailable_error(device)
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"device: {device!r} is not a device string "
            f"(expected 'cpu', 'cuda', 'cuda:N', 'musa' or 'musa:N')"
        ) from error
    if parsed.type == "privateuseone" or parsed.type not in ("cpu",) + GPU_TYPES:
        raise ValueError(
            f"device: {device!r} has type {parsed.type!r}; te_lab supports 'cpu', 'cuda' and 'musa'"
        )
    if parsed.type == "cpu":
        return torch.device("cpu")
    count = device_count(parsed.type)
    if count == 0:
        raise _unavailable_error(device)
    index = 0 if parsed.index is None else parsed.index
    if index >= count:
        raise ValueError(
            f"device: {device!r} does not exist; this machine has {count} {parsed.type} device(s)"
        )
    return torch.device(parsed.type, index)


def _unavailable_error(device: DeviceLike) -> ValueError:
    return ValueError(
        f"device: {device!r} is not available on this machine "
        f"(available: {', '.join(str(d) for d in available_devices())})"
    )


def is_gpu(device: torch.device) -> bool:
    return device.type in GPU_TYPES


def synchronize(device: DeviceLike = None) -> None:
    """Wait for all queued work on ``device``; a no-op on the CPU."""
    dev = resolve(device)
    if is_gpu(dev):
        device_module(dev).synchronize(dev)


def device_guard(device: torch.device):
    """A context that makes ``device`` current, so kernels launch on the right GPU."""
    return device_module(device).device(device) if is_gpu(device) else contextlib.nullcontext()
