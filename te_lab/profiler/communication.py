"""Communication in a profiled step: how long torch.distributed's collectives ran.

- CPU (gloo): ProcessGroupGloo runs each collective on a worker thread of its own,
  inside a profiler event named ``gloo:<collective>`` (``gloo:all_reduce``,
  ``gloo:broadcast``, ``gloo:all_gather``; FSDP2's reduce-scatter runs as
  ``gloo:all_reduce``); the rank's thread only queues it (``c10d::allreduce_``).
- GPUs: NCCL (CUDA) and MCCL (MUSA) run collectives as device kernels whose names
  start with ``nccl`` / ``mccl`` (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``). Checked
  on gloo only; the GPU names follow the libraries' kernel naming.

The time is the union of the collectives' intervals (collectives overlapping each
other count once), waiting for the other ranks included. None of it is op time:
``c10d::`` ops and these events are not framework compute ops, so the step's regions
and ``(other)`` leave it out.
"""

from __future__ import annotations

from .device_kernels import union_ns

GLOO_EVENT_PREFIX = "gloo:"


def communication_ns(events, kernels) -> tuple[int, int]:
    """(ns during which collectives ran, how many ran) in a step: ``events`` are the
    profiler's CPU events, ``kernels`` the step's device kernels (on GPUs)."""
    intervals = [(kernel.start_ns, kernel.end_ns) for kernel in kernels if kernel.is_collective]
    intervals += [(round(event.time_range.start * 1e3), round(event.time_range.end * 1e3)) for event in events
                  if event.name.startswith(GLOO_EVENT_PREFIX)]
    return union_ns(sorted(intervals)), len(intervals)
