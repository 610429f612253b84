"""Raw profiler traces written while :func:`te_lab.profile` runs (``trace_dir=``,
``te-lab profile --trace-dir DIR``), so a GPU run's traces can be opened elsewhere with
:func:`te_lab.open_trace`, TensorBoard, Perfetto or Holistic Trace Analysis.

Every profiled step of each mode is written as ``<mode>.step<N>.pt.trace.json.gz``
(Kineto's Chrome-trace format, gzipped): ``step0`` is the first profiled step, whose
figures the report discards (the profiler's first session and first compiled calls cost
extra), ``step1`` onward are the steps the report's figures come from.
"""

from __future__ import annotations

import contextlib
import contextvars
import pathlib
from typing import Optional

_target: contextvars.ContextVar[Optional["_Directory"]] = contextvars.ContextVar("te_lab_trace_dir", default=None)


class _Directory:
    def __init__(self, path: pathlib.Path):
        self.path = path
        self.steps: dict[str, int] = {}
        self.written: list[pathlib.Path] = []


@contextlib.contextmanager
def writing_to(directory):
    """Within the block, :func:`export` writes traces into ``directory`` (created if
    missing); with ``None`` it writes nothing."""
    if directory is None:
        yield None
        return
    path = pathlib.Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"te_lab.profile: trace_dir {str(directory)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    token = _target.set(_Directory(path))
    try:
        yield _target.get()
    finally:
        _target.reset(token)


def export(profiler, mode: str) -> Optional[pathlib.Path]:
    """Write ``profiler``'s trace (a finished ``torch.profiler.profile``) as the next step of
    ``mode``, when inside :func:`writing_to`; returns the file written, or None."""
    target = _target.get()
    if target is None:
        return None
    step = target.steps.get(mode, 0)
    target.steps[mode] = step + 1
    path = target.path / f"{mode}.step{step}.pt.trace.json.gz"
    profiler.export_chrome_trace(str(path))
    target.written.append(path)
    return path
