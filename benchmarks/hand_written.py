"""The hand-written part of a markdown results file: everything from :data:`MARKER` on.

``--markdown`` rewrites the generated report and keeps that part as it was, so the
explanations written by hand next to a run's tables (why a target was missed, figures
measured by hand) survive the next ``make bench``.
"""

from __future__ import annotations

import pathlib

MARKER = "<!-- Written by hand from here on: `--markdown` rewrites what is above and keeps this part. -->"


def write_keeping_hand_written(path, generated: str) -> None:
    """Write ``generated`` to ``path``, followed by the hand-written part of the file
    already there, if it has one."""
    target = pathlib.Path(path)
    existing = target.read_text(encoding="utf-8") if target.exists() else ""
    at = existing.find(MARKER)
    kept = "\n" + existing[at:] if at >= 0 else ""
    target.write_text(generated.rstrip("\n") + "\n" + kept, encoding="utf-8")
