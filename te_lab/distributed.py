"""te_lab under torch.distributed: starting a process group the right way per device,
and what fusion and profiling must know about wrapped or sharded models.

- ``DistributedDataParallel`` keeps the module it wraps, and its gradient hooks sit on
  the Parameter objects, which every fused twin adopts: fusing before or after
  wrapping gives the same training. ``te_lab.fuse`` fuses the wrapped module.
- FSDP2's ``fully_shard`` (and tensor parallelism) replace a module's Parameters by
  DTensors, on the module that holds them when it runs, the twin. Fusing after that
  would probe modules outside the hooks that gather their shards, and unfusing would
  restore originals still holding the Parameters from before sharding: both refuse.
  Fuse first, then shard.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch
from torch import nn

from te_lab import device as devices

# What torchrun sets for every process it starts (LOCAL_RANK picks the GPU).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _dist():
    if not torch.distributed.is_available():
        raise RuntimeError("te_lab.distributed: this torch build has no torch.distributed")
    return torch.distributed


def init_process_group(device_type: Optional[str] = None, *,
                       timeout: Optional[datetime.timedelta] = None) -> torch.device:
    """Start the default process group of a process launched by ``torchrun`` and return
    this rank's device.

    ``device_type`` ("musa", "cuda", "cpu"; default: the type of te_lab's default
    device) gives the backend (``mccl``, ``nccl``, ``gloo``, from
    :func:`te_lab.device.distributed_backend`); on a GPU the device is the one at
    index ``LOCAL_RANK``, made current so kernels and collectives launch there.
    """
    dist = _dist()
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(f"te_lab.distributed.init_process_group: environment variables {', '.join(missing)} are "
                           f"not set; launch the script with torchrun (e.g. torchrun --nproc-per-node 2 train.py)")
    if dist.is_initialized():
        raise RuntimeError("te_lab.distributed.init_process_group: the default process group is already initialized")
    kind = device_type or devices.default_device().type
    if kind == "cpu":
        device = torch.device("cpu")
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        count = devices.device_count(kind)
        if local_rank >= count:
            raise ValueError(f"te_lab.distributed.init_process_group: LOCAL_RANK={local_rank} but this machine has "
                             f"{count} {kind} device(s); start at most {count} processes per node")
        device = devices.resolve(f"{kind}:{local_rank}")
        devices.device_module(device).set_device(device)
    options = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(devices.distributed_backend(device), **options)
    return device


def rank_and_world_size() -> tuple[Optional[int], int]:
    """(this process's rank, the number of ranks) in an initialized process group,
    else (None, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, 1


def is_data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` wrapper."""
    return torch.distributed.is_available() and isinstance(model, nn.parallel.DistributedDataParallel)


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wrapper holds; any other model itself."""
    return model.module if is_data_parallel(model) else model


def sharded_parameter(model: nn.Module) -> Optional[str]:
    """The name of the first of ``model``'s parameters that is a DTensor, else None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return next((name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor)), None)


def refuse_sharded(model: nn.Module, caller: str, why: str) -> None:
    """Raise where ``model``'s parameters were replaced by DTensors; ``why`` says what
    ``caller`` cannot do with them and what to do instead."""
    name = sharded_parameter(model)
    if name is not None:
        raise RuntimeError(f"{caller}: parameter {name!r} of this {type(model).__name__} is a DTensor (FSDP2's "
                           f"fully_shard or tensor parallelism replaced the Parameters); {why}")
