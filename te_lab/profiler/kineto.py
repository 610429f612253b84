"""Kineto's activities in one form, whether they come from a live ``torch.profiler`` session
or from a trace file it wrote: everything downstream (device kernels, their figures, the
timeline) reads :class:`Activity` and never knows which.

Two ids link the activities, as torch's own parser and its Chrome-trace export use them:

- ``correlation``: a runtime or driver call (``cudaLaunchKernel``, ``cuLaunchKernel``,
  ``musaLaunchKernel``, ``hipLaunchKernel``) and the device activity it queued share it
  (CUPTI's, MUPTI's or roctracer's correlation id; ``args.correlation`` in a file);
- ``external_id``: device activity and runtime calls carry the id of the CPU op they ran
  under (``linked_correlation_id()`` live, ``args["External id"]`` in a file); a CPU op
  carries its own id there, so the two meet.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Activities that put no time on a device stream of their own even when a trace places
# them on one (host waits, flow markers); everything else under these kinds runs on the
# device.
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
# Host activities that carry their own id as their external id (torch's Chrome export
# writes "External id" for them from ``correlation_id()``).
HOST_OP_KINDS = ("cpu_op", "user_annotation", "python_function", "cpu_instant_event")


@dataclass(frozen=True)
class Activity:
    """One Kineto activity: times in ns on Kineto's clock (a file's µs, scaled)."""

    kind: str  # Kineto's activity type: "kernel", "gpu_memcpy", "cuda_runtime", "cpu_op", ...
    name: str
    start_ns: int
    duration_ns: int
    correlation: int = 0  # runtime call <-> device activity
    external_id: int = 0  # device activity / runtime call -> CPU op; a CPU op's own id
    device: int = 0  # the device (GPU activity) or the process (host activity)
    resource: int = 0  # the stream (GPU activity) or the thread (host activity)
    metadata: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns

    @property
    def on_device(self) -> bool:
        return self.kind in DEVICE_KINDS


def _metadata(text: str) -> dict:
    try:
        return json.loads("{" + text + "}") if text else {}
    except ValueError:
        return {}


def live_activities(activities) -> list[Activity]:
    """The activities of a live session (``profiler.profiler.kineto_results.trace_activities()``)."""
    converted = []
    for activity in activities:
        kind = activity.type()
        linked = activity.linked_correlation_id()
        correlation = activity.correlation_id()
        own_id = correlation if kind in HOST_OP_KINDS else 0
        converted.append(Activity(kind, activity.name(), activity.timestamp(), max(activity.duration(), 0),
                                  0 if kind in HOST_OP_KINDS else correlation, linked or own_id,
                                  _int(activity.device_id()), _int(activity.resource_id()),
                                  _metadata(activity.metadata_json() or "")))
    return converted


def file_activities(trace: dict) -> list[Activity]:
    """The complete ("X") events of a Chrome-trace JSON document as torch.profiler /
    Kineto write it (``export_chrome_trace``, ``tensorboard_trace_handler``): timestamps
    in µs, ids and kernel fields under ``args``."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("te_lab.open_trace: the file has no 'traceEvents' list; expected a torch.profiler "
                         "(Kineto) Chrome trace")
    converted = []
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X" or "ts" not in event:
            continue
        args = event.get("args") or {}
        kind = str(event.get("cat", ""))
        device_side = kind in DEVICE_KINDS
        converted.append(Activity(
            kind, str(event.get("name", "")), _ns(event["ts"]), max(_ns(event.get("dur", 0)), 0),
            _int(args.get("correlation", 0)),
            _int(args.get("External id", 0)),
            _int(args.get("device", event.get("pid", 0))) if device_side else _int(event.get("pid", 0)),
            _int(args.get("stream", event.get("tid", 0))) if device_side else _int(event.get("tid", 0)),
            args))
    return converted


def _ns(microseconds) -> int:
    """A file's µs as whole ns, exact for the float it holds: the product ``µs * 1e3`` in
    float64 is off by up to 128 ns at today's epoch timestamps (about 1.7e18 ns)."""
    value = float(microseconds)
    whole = math.floor(value)
    return whole * 1000 + round((value - whole) * 1000)


def has_fractional_timestamps(trace: dict) -> bool:
    """Whether a trace file's timestamps, read as one column, are not all whole µs: an event
    with a fractional ``ts`` (nanosecond resolution) or without one (Holistic Trace Analysis
    rounds such a trace's times to whole µs: :mod:`.temporal_breakdown`)."""
    return any(not isinstance(event, dict) or not isinstance(event.get("ts"), int)
               for event in trace.get("traceEvents") or ())


def _int(value) -> int:
    """Ids as files spell them: ints, numeric strings, hex strings ("0x0")."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return int(value)
    try:
        return int(str(value), 0)
    except ValueError:
        return 0

