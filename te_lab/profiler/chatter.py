"""torch's C++ profiler announces every session on the process's stderr (file
descriptor 2, below Python's ``sys.stderr``)::

    USDT:2026-12-03 09:32:14 6843:6843 SyncActivityProfilerHandler.cpp:52] profiler_start

Two such lines per profiled step land in ``te-lab``'s progress bar and summary and in
notebook cells. :func:`without_profiler_chatter` points fd 2 at a temporary file while a
session starts or stops, then writes everything it caught back to the real fd 2 except
those lines: a warning or an error printed there still shows, a moment later.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator

CHATTER = re.compile(rb"^USDT:.*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)\s*$")


def without_chatter(captured: bytes) -> bytes:
    """``captured`` without the profiler's start / stop lines."""
    return b"".join(line for line in captured.splitlines(keepends=True) if not CHATTER.match(line))


@contextlib.contextmanager
def without_profiler_chatter() -> Iterator[None]:
    """Run the block with fd 2 caught; pass on what it printed there, less the chatter."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (a closed stderr): nothing to keep quiet
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = without_chatter(capture.read())
            if kept:
                os.write(2, kept)
