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
import re
from dataclasses import dataclass, field
from typing import Optional

from te_lab.surgery.report import ROOT_LABEL

FUSED_BYTES_FORMULA = (
    "bytes one fused kernel per instance would move: the chain's first op's inputs, the inputs of its later ops "
    "that no earlier op of the chain produced (weights, masks, other operands: a same-shaped tensor is taken for "
    "the running value), and its last op's output; the intermediates stay in registers; never more than the ops "
    "move unfused")
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
        """``module (phase): op -> op -> ...`` with at most ``ops`` names, each shortened
        (:func:`short_name`)."""
        names = [short_name(name) for name in self.pattern]
        shown = " -> ".join(names[:ops]) + (f" -> ... ({len(names)} ops)" if len(names) > ops else "")
        phase = f" ({self.phase})" if self.phase else ""
        return f"{self.module}{phase}: {shown}"

    @classmethod
    def from_dict(cls, data: dict) -> "Opportunity":
        return cls(**data)


@dataclass
class Accounting:
    """Where the finder's step spent its time outside compute ops (ms)."""

    step_ms: float = 0.0  # the profiled step's wall time, the profiler's cost per op taken off
    compute_ms: float = 0.0  # GEMMs and attention kernels' ops
    chain_ops_ms: float = 0.0  # the chains' ops' own time (the rows' spans hold the Python between them too)
    single_ops_ms: float = 0.0  # memory-bound ops with no memory-bound neighbour in their module
    te_lab_ops_ms: float = 0.0
    outside_modules_ms: float = 0.0  # memory-bound ops no module ran (the caller's loss, gradient accumulation)
    views_ms: float = 0.0

    @property
    def non_compute_ms(self) -> float:
        return max(self.step_ms - self.compute_ms, 0.0)

    @property
    def between_ops_ms(self) -> float:
        """What the step spent outside every op counted above (Python, the autograd engine)."""
        return max(self.non_compute_ms - self.chain_ops_ms - self.single_ops_ms - self.te_lab_ops_ms
                   - self.outside_modules_ms - self.views_ms, 0.0)


@dataclass
class Opportunities:
    """The finder's result for one mode of one model (see the module doc)."""

    mode: str
    rows: list = field(default_factory=list)  # Opportunity, ranked
    accounting: Accounting = field(default_factory=Accounting)
    bandwidth_gbs: float = 0.0
    bandwidth_source: str = ""
    launch_us: float = 0.0
    formulas: dict = field(default_factory=dict)
    # Module path -> [forward, backward] ms of the rows' modules (and those an earlier result
    # asked for), whole, clocked without the profiler: what realized gains are measured from.
    module_ms: dict = field(default_factory=dict)

    def top(self, count: int = 10) -> list[Opportunity]:
        return self.rows[:count]

    @property
    def estimated_gain_ms(self) -> float:
        return sum(row.estimated_gain_ms or 0.0 for row in self.rows)

    @property
    def chains_ms(self) -> float:
        return sum(row.time_ms for row in self.rows)

    def summary(self, top: int = 10) -> str:
        a = self.accounting
        lines = [f"fusion opportunities ({self.mode} step {a.step_ms:.2f} ms, {a.compute_ms:.2f} ms of it GEMMs and "
                 f"attention): {len(self.rows)} unfused chain pattern(s), {self.chains_ms:.2f} ms, estimated gain "
                 f"{self.estimated_gain_ms:.2f} ms at {self.bandwidth_gbs:.0f} GB/s ({self.bandwidth_source}) and "
                 f"{self.launch_us:.1f} us per launch",
                 f"  outside compute: chains' ops {a.chain_ops_ms:.2f} ms, single ops {a.single_ops_ms:.2f}, "
                 f"te_lab ops {a.te_lab_ops_ms:.2f}, outside modules {a.outside_modules_ms:.2f}, "
                 f"views {a.views_ms:.2f}, between ops {a.between_ops_ms:.2f} (of {a.non_compute_ms:.2f} ms)"]
        return "\n".join(lines + table_lines(self.rows, top))

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython's display
        printer.text(self.summary())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def module_time_ms(self, path: str, phase: str, among: frozenset = frozenset()) -> Optional[float]:
        """The ``phase`` time of the module at ``path``, whole, less that of the outermost
        modules at the paths ``among`` nested in it (each row's modules count once); None
        where one of them was not clocked."""
        index = 1 if phase == "backward" else 0
        nested = [key for key in among if key != path and _inside(key, path)]
        outermost = [key for key in nested if not any(other != key and _inside(key, other) for other in nested)]
        if any(key not in self.module_ms for key in (path, *outermost)):
            return None
        return self.module_ms[path][index] - sum(self.module_ms[key][index] for key in outermost)

    def realized(self, after: "Opportunities") -> "Opportunities":
        """A copy of these rows with ``realized_gain_ms``: what each row's modules saved in
        ``after`` (a later step of the same model, with regions or twins in place), the
        modules' times with everything nested in them, before less after. A module's saving
        in a phase is shared among its rows of that phase by their estimated gains; a row
        whose realized gain is outside +-30% of its estimate says why in its note."""
        copy = Opportunities.from_dict(self.to_dict())
        among = frozenset(path for row in self.rows for path in row.paths)
        by_modules: dict = {}
        for row in copy.rows:
            by_modules.setdefault((tuple(sorted(row.paths)), row.phase), []).append(row)
        for (paths, phase), rows in by_modules.items():
            times = [(self.module_time_ms(path, phase, among), after.module_time_ms(path, phase, among))
                     for path in paths]
            if any(None in pair for pair in times):
                for row in rows:
                    row.note = ("realized: not measured (the later result did not clock these modules: pass "
                                "against= this result to te_lab.opportunities)")
                continue
            before, now = sum(b for b, _ in times), sum(a for _, a in times)
            estimated = sum(row.estimated_gain_ms or 0.0 for row in rows)
            for row in rows:
                share = (row.estimated_gain_ms or 0.0) / estimated if estimated > 0 else 1 / len(rows)
                row.realized_gain_ms = (before - now) * share
                row.note = _realized_note(row, before, now)
        return copy

    @classmethod
    def from_dict(cls, data: dict) -> "Opportunities":
        data = dict(data)
        data["rows"] = [Opportunity.from_dict(row) for row in data["rows"]]
        data["accounting"] = Accounting(**data["accounting"])
        return cls(**data)


REALIZED_SLACK = 0.3
ROOT_KEY = ROOT_LABEL  # the model itself, in the finder's keys (as in the FusionReport's rows)


def _inside(key: str, around: str) -> bool:
    return around == ROOT_KEY or key.startswith(around + ".")


def _realized_note(row: Opportunity, before_ms: float, after_ms: float) -> str:
    estimated = row.estimated_gain_ms or 0.0
    realized = row.realized_gain_ms or 0.0
    text = f"realized {realized:.3g} ms of the estimated {estimated:.3g} ms"
    if estimated > 0 and abs(realized - estimated) <= REALIZED_SLACK * estimated:
        return text + " (within 30%)"
    if after_ms >= before_ms:
        return text + (f": the module ran {after_ms:.3g} ms after against {before_ms:.3g} ms before, no faster "
                       f"(not fused, or its fused code is no quicker here)")
    bound = row.fused_ms or 0.0
    if realized > estimated:
        return text + (f": the modules saved more than the chain's time, {after_ms:.3g} ms after against "
                       f"{before_ms:.3g} ms before: the region also removed other work of theirs (single ops, the "
                       f"Python and autograd engine between ops, a slower eager kernel of the same math)")
    return text + (f": the modules now take {after_ms:.3g} ms where the estimate's bound is {bound:.3g} ms for the "
                   f"chain alone; the bound costs only the bytes at the copy bandwidth and one launch, while compiled "
                   f"code also pays its math (exp, tanh, division), its own launches and the other ops the modules "
                   f"hold")


def short_name(name: str) -> str:
    """An op's or a kernel's name without its namespace, template arguments and parameters:
    ``aten::mul`` -> ``mul``; ``void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)``
    -> ``vectorized_elementwise_kernel``."""
    bare = re.sub(r"<.*>", "", name.split("(")[0]).removeprefix("void ").strip()
    return bare.split("::")[-1] or name


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
        by = f" [{row.fused_by}]" if row.fused_by else "" if row.mode == "trace" else " [no te_lab rule]"
        lines.append(f"  {gain:>8} {row.time_ms:8.3f} {row.instances:4d} {row.launches:8d} {unfused:>11} {fused:>9}  "
                     f"{row.label()}{by}{realized}")
    if len(rows) > top:
        lines.append(f"  ... and {len(rows) - top} more row(s)")
    return lines
