"""What fusion could still buy, chain by chain: the rows the fusion-opportunity finder
(:mod:`te_lab.profiler.opportunities` for a live step, :mod:`te_lab.profiler.kernel_sequences`
for a GPU trace) returns, as plain data with a lossless dict round trip.

A row is one *pattern*: a chain of consecutive memory-bound ops (element-wise ops,
reductions, softmax, norms, casts, copies) that no te_lab op covers, run by one module
(layer indices written ``*``, so the same chain in 30 layers is one row of 30 instances)
in one phase. Its figures add up over the instances:

- ``time_ms``: measured (the ops' own time in the profiled step: host time on the CPU,
  kernel time on a GPU);
- ``bytes_unfused``: every op's inputs read and output written, by the cost model;
- ``bytes_fused``: what one kernel per instance would move, the chain's external inputs
  and its last output (:data:`FUSED_BYTES_FORMULA`);
- ``fused_ms``: that kernel's time if it ran at the bandwidth, ``bytes_fused`` at the
  bandwidth plus one launch per instance (:data:`GAIN_FORMULA`), so
  ``estimated_gain_ms`` = ``time_ms - fused_ms`` (never below 0) is an upper bound: a
  fused kernel still does the chain's math (``tanh``, ``exp``, division), which on a CPU
  can cost more than its bytes;
- ``fused_by``: the te_lab rule that would fuse it and why it did not apply, or "";
- ``realized_gain_ms``: after :func:`te_lab.fuse` ``(regions=...)`` compiled the module,
  what the region saved in a re-measurement (None until then).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

FUSED_BYTES_FORMULA = (
    "bytes one fused kernel per instance would move: the chain's first op's inputs, the inputs of its later ops "
    "that no earlier op of the chain produced (weights, masks, other operands: a same-shaped tensor is taken for "
    "the running value), and its last op's output; the intermediates stay in registers")
GAIN_FORMULA = ("estimated gain = measured time - (fused bytes / bandwidth + one launch per instance), at least 0 "
                "(an upper bound: the fused kernel's math is not costed); the launch cost is the median time of the "
                "step's ops that move at most 4 KiB")


@dataclass
class Opportunity:
    """One unfused chain pattern (see the module doc)."""

    mode: str  # "eager" or "fused" (a live profile), "trace" (a trace file)
    module: str  # path pattern ("model.layers.*.mlp.act"); on a GPU trace, the operator that launched the kernels
    module_type: str  # the module's class ("" on a trace)
    phase: str  # "forward" | "backward" ("" where a trace does not say)
    pattern: list = field(default_factory=list)  # op (or kernel) names, in order
    instances: int = 0
    time_ms: float = 0.0
    launches: int = 0
    bytes_unfused: Optional[int] = None  # None where the source records no shapes
    bytes_fused: Optional[int] = None
    fused_ms: Optional[float] = None
    bandwidth_gbs: Optional[float] = None
    fused_by: str = ""  # "rule <name> did not apply: <why>", or "" (no te_lab rule)
    paths: list = field(default_factory=list)  # the module paths that ran it (for fuse(regions=...))
    realized_gain_ms: Optional[float] = None
    note: str = ""

    @property
    def estimated_gain_ms(self) -> Optional[float]:
        return None if self.fused_ms is None else max(self.time_ms - self.fused_ms, 0.0)

    @property
    def bytes_saved(self) -> Optional[int]:
        if self.bytes_unfused is None or self.bytes_fused is None:
            return None
        return max(self.bytes_unfused - self.bytes_fused, 0)

    @property
    def launches_saved(self) -> int:
        return self.launches - self.instances

    def label(self, ops: int = 4) -> str:
        """``module (phase): op -> op -> ...`` with at most ``ops`` names."""
        names = [name.split("::")[-1] for name in self.pattern]
        shown = " -> ".join(names[:ops]) + (f" -> ... ({len(names)} ops)" if len(names) > ops else "")
        phase = f" ({self.phase})" if self.phase else ""
        return f"{self.module}{phase}: {shown}"

    @classmethod
    def from_dict(cls, data: dict) -> "Opportunity":
        return cls(**data)


def ranked(rows: list[Opportunity]) -> list[Opportunity]:
    """Largest estimated gain first (rows without an estimate last, by measured time)."""
    return sorted(rows, key=lambda row: (row.estimated_gain_ms is None, -(row.estimated_gain_ms or 0.0),
                                         -row.time_ms))


def table_lines(rows: list[Opportunity], top: int = 10) -> list[str]:
    """A plain-text table of the ``top`` rows, ranked."""
    if not rows:
        return ["  no unfused chain of memory-bound ops was found"]
    lines = [f"  {'gain ms':>8} {'time ms':>8} {'x':>4} {'launches':>8} {'MiB unfused':>11} {'MiB fused':>9}  "
             f"chain (what would fuse it)"]
    for row in ranked(rows)[:top]:
        gain = "-" if row.estimated_gain_ms is None else f"{row.estimated_gain_ms:.3f}"
        unfused = "-" if row.bytes_unfused is None else f"{row.bytes_unfused / 2**20:.2f}"
        fused = "-" if row.bytes_fused is None else f"{row.bytes_fused / 2**20:.2f}"
        realized = "" if row.realized_gain_ms is None else f"; realized {row.realized_gain_ms:.3f} ms"
        by = f" [{row.fused_by}]" if row.fused_by else " [no te_lab rule]"
        lines.append(f"  {gain:>8} {row.time_ms:8.3f} {row.instances:4d} {row.launches:8d} {unfused:>11} {fused:>9}  "
                     f"{row.label()}{by}{realized}")
    if len(rows) > top:
        lines.append(f"  ... and {len(rows) - top} more row(s)")
    return lines


def as_dicts(rows: list[Opportunity]) -> list[dict]:
    return [dataclasses.asdict(row) for row in rows]
