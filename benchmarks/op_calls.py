"""The te_lab op calls a piece of code makes, and the backend its automatic choice runs."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from te_lab import device as devices
from te_lab.kernels import custom_ops, registered_ops

from .cases import OpCase


@contextlib.contextmanager
def recording_op_calls(calls: list):
    """Record every te_lab op call (the op and its arguments) made inside the block. The
    calls go through the dispatcher, so that an op on the ``cpp`` backend, whose eager
    backward otherwise runs inside autograd's engine, calls (and records) its backward
    op from Python too."""
    def record(op, *args):
        calls.append((op, args))
        return op.op(*args)

    original = custom_ops.CustomOp.__call__
    custom_ops.CustomOp.__call__ = record
    try:
        yield
    finally:
        custom_ops.CustomOp.__call__ = original


def automatic_backend(case: OpCase, device: torch.device, *, training: bool = True) -> Optional[str]:
    """For an op whose automatic CPU choice is measured per size class (every op that
    names ``cpu_measured`` backends), the backend that choice runs for the case's inputs
    in a training call (with ``training``) or a call without gradients: the backend
    argument of the te_lab op its forward calls (reference when it calls none). None
    elsewhere: the registry's choice does not depend on the inputs."""
    if devices.is_gpu(device) or not registered_ops()[case.op].cpu_measured:
        return None
    calls: list = []
    with torch.enable_grad() if training else torch.no_grad():
        case.fused(*case.inputs, backend=None)  # a first call may measure, running every candidate
        with recording_op_calls(calls):
            case.fused(*case.inputs, backend=None)
    return calls[0][1][-1] if calls else "reference"
