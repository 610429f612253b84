"""Whether te_lab's Triton kernels can run on a device type, and why not: Triton
installed, with a backend for the vendor (Moore Threads' build on MUSA), or its
interpreter on the CPU (``TRITON_INTERPRET=1``, for tests)."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from . import selection
from .selection import DeviceLike


def _triton_backend_for(device_type: str) -> Optional[str]:
    """Why the triton backend cannot run on ``device_type``, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'te_lab[triton]', or Moore Threads' triton on MUSA)"
    if device_type == "cuda":
        return None
    if device_type == "musa":
        for backend in ("triton.backends.mthreads", "triton.backends.mtgpu"):
            try:
                if importlib.util.find_spec(backend) is not None:
                    return None
            except ModuleNotFoundError:
                continue
        return "the installed triton has no Moore Threads backend (install Moore Threads' triton build)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        "Triton kernels do not run on the CPU "
        "(TRITON_INTERPRET=1 runs them through Triton's interpreter, for tests only)"
    )


_triton_reasons: dict[str, Optional[str]] = {}


@torch.compiler.assume_constant_result
def triton_unavailable_reason(device_type: str) -> Optional[str]:
    """``None`` when the triton backend can run on devices of this type, else why not.

    Checked once per process and device type. Under torch.compile the answer is a
    trace-time constant, so selecting a backend never breaks the graph.
    """
    if device_type not in _triton_reasons:
        _triton_reasons[device_type] = _triton_backend_for(device_type)
    return _triton_reasons[device_type]


def triton_available(device: DeviceLike = None) -> bool:
    return triton_unavailable_reason(selection.resolve(device).type) is None
