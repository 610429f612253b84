"""FusionReport: what :func:`te_lab.fuse` did, one row per candidate module.

Pure data (dataclasses) with three views: a text table for terminals (``str``), an
HTML table for notebooks (``_repr_html_``) and plain dicts / JSON for tools
(``to_dict`` / ``to_json``; ``from_dict`` reads them back).
"""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Optional

FUSED, SKIPPED, KEPT_SLOWER, WOULD_FUSE = "fused", "skipped", "kept-original-slower", "would-fuse"
ROOT_LABEL = "(model)"


@dataclass
class FusionRow:
    """One candidate. Errors are the fused twin's worst max-abs / max-relative errors on the
    probe (outputs; input and parameter gradients) against the original run in float64
    (``truth == "float64"``; the ``original_*`` fields hold the original's own errors in
    its dtype), or against the original where ``truth`` says why there was no float64 run;
    ``probe`` says where its inputs came from (``sample``, ``synthesized``;
    a fused row verified on synthesized inputs because the sample's probe compared
    nothing says why in ``reason``). ``speedup`` (original time
    / fused time, forward + backward, medians) is measured with ``fuse(auto=True)``, and
    with the default ``keep="faster"`` for the twins that may step aside (``steps_aside``)."""

    path: str
    original_type: str
    rule: str
    kind: str
    status: str
    reason: str = ""
    fused_type: str = ""
    variant: str = ""
    backends: dict = field(default_factory=dict)
    kernels: list = field(default_factory=list)
    probe: str = ""
    output_max_abs: Optional[float] = None
    output_max_rel: Optional[float] = None
    grad_max_abs: Optional[float] = None
    grad_max_rel: Optional[float] = None
    # The original's own errors against the float64 truth (the bar the twin's are judged by),
    # and "float64" or why the probe compared the twin with the original instead.
    original_output_max_abs: Optional[float] = None
    original_grad_max_abs: Optional[float] = None
    truth: str = ""
    time_original_ms: Optional[float] = None
    time_fused_ms: Optional[float] = None
    speedup: Optional[float] = None
    # keep="faster": whether the twin hands the training calls of the sample's sizes to the
    # original (measured slower there); None where that was not decided
    steps_aside: Optional[bool] = None

    @property
    def label(self) -> str:
        return self.path or ROOT_LABEL


@dataclass
class ModelCheck:
    """The whole model on the user's sample, fused against unfused (forward, eval mode; see
    :mod:`te_lab.surgery.model_check`). Each output is judged by its error against the
    unfused model run in float64 (``truth == "float64"``) on ``truth_on`` (a part of the
    sample): each entry of ``compared`` gives the fused model's largest error there
    (``fused_error``) beside the unfused model's (``unfused_error``), and ``max_abs`` /
    ``max_rel`` the largest difference before vs after on the whole sample. Where the model
    does not run in float64, ``truth`` says why and the outputs are compared before vs
    after against their scale (:func:`te_lab.surgery.probe.compare`). An entry that misses
    says by how much in ``failure``."""

    # dicts: name, max_abs, max_rel, within_tolerance, failure, and with a truth fused_error, unfused_error
    compared: list = field(default_factory=list)
    loss_before: Optional[float] = None
    loss_after: Optional[float] = None
    note: str = ""
    # Why the comparison proves nothing (no elements; NaN or infinity before fusing), if it does not.
    inconclusive: str = ""
    # "float64", or why the model could not run in float64; and the part of the sample it ran on.
    truth: str = ""
    truth_on: str = ""

    @property
    def within_tolerance(self) -> bool:
        """Every output within tolerance, on a comparison that proves something."""
        return not self.inconclusive and all(entry["within_tolerance"] for entry in self.compared)


@dataclass
class FusionReport:
    model_type: str
    device: str
    backend: str
    rows: list = field(default_factory=list)
    already_fused: list = field(default_factory=list)
    model_check: Optional[ModelCheck] = None
    notes: list = field(default_factory=list)
    # Seconds per phase of the fuse: "capturing the sample's inputs", "building and probing:
    # <rule>" (every candidate of that rule), "checking the whole model".
    phase_seconds: dict = field(default_factory=dict)

    @property
    def fused(self) -> list:
        return [row for row in self.rows if row.status == FUSED]

    def counts(self) -> dict:
        """rule -> {status: number of modules}, for every rule with a candidate."""
        counts: dict = {}
        for row in self.rows:
            counts.setdefault(row.rule, Counter())[row.status] += 1
            if row.status == FUSED and "te_lab::rope" in row.kernels:
                counts.setdefault("rope", Counter())[FUSED] += 1
        return {rule: dict(counter) for rule, counter in counts.items()}

    def summary(self) -> str:
        per_rule = ", ".join(f"{rule} {c.get(FUSED, 0)}/{sum(c.values())}" for rule, c in self.counts().items())
        lines = [f"te_lab.fuse: {len(self.fused)} of {len(self.rows)} candidate modules fused in {self.model_type} "
                 f"on {self.device} (backend {self.backend})"
                 + (f"; fused/candidates by rule: {per_rule}" if per_rule else "")]
        if self.already_fused:
            lines.append(f"{len(self.already_fused)} module(s) were already fused and were left alone")
        if any(row.truth == "float64" for row in self.rows):
            whole_model = any(row.truth == "float64" and row.kind == "loss" for row in self.rows)
            lines.append("errors are each side's largest against the original run in float64 (the original's in "
                         "parentheses); a twin passes where, row by row, its error is within twice the original's "
                         "plus the dtype's tolerance" + (
                             " (the LM head + loss's gradients, which come back through the whole model: over "
                             "each whole tensor, the original's error measured twice)" if whole_model else ""))
        if any(row.backends for row in self.rows) and self.device.startswith("cpu"):
            lines.append("backends: what each twin's probe ran; on the CPU several ops choose theirs by measuring "
                         "on this machine per class of sizes, so other sizes may run another (te-lab info lists "
                         "the decisions)")
        if self.model_check is not None:
            lines.append(_model_check_line(self.model_check))
        lines.extend(self.notes)
        return "\n".join(lines)

    def grouped_rows(self) -> list[tuple[str, list]]:
        """The rows by rule, rules in the order their first candidate came."""
        groups: dict[str, list] = {}
        for row in self.rows:
            groups.setdefault(row.rule, []).append(row)
        return list(groups.items())

    def __str__(self) -> str:
        header = ("module", "original -> fused", "backend", "out err (orig)", "grad err (orig)", "speedup", "status")
        table: list = [header]
        for rule, rows in self.grouped_rows():
            table.append(f"{rule}: {sum(row.status == FUSED for row in rows)} of {len(rows)} fused")
            table.extend((
                "  " + row.label, f"{row.original_type} -> {row.fused_type or '-'}", _backends(row),
                _errors(row.output_max_abs, row.original_output_max_abs),
                _errors(row.grad_max_abs, row.original_grad_max_abs), _speedup(row.speedup),
                row.status + (f": {row.reason}" if row.reason else ""),
            ) for row in rows)
        cells = [line for line in table if isinstance(line, tuple)]
        widths = [max(len(str(line[i])) for line in cells) for i in range(len(header) - 1)]
        lines = [line if isinstance(line, str) else
                 "  ".join(str(cell).ljust(width) for cell, width in zip(line[:-1], widths)) + "  " + line[-1]
                 for line in table]
        return self.summary() + "\n\n" + "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        names = ("module", "original", "fused", "backend / kernels", "max err out (orig)", "max err grad (orig)",
                 "speedup", "status")
        cells = "".join(f"<th>{name}</th>" for name in names)
        body = ""
        for rule, rows in self.grouped_rows():
            fused = sum(row.status == FUSED for row in rows)
            body += (f'<tr class="te-lab-rule"><th colspan="{len(names)}" style="text-align:left">'
                     f"{html.escape(rule)}: {fused} of {len(rows)} fused</th></tr>")
            body += "".join(
                "<tr>" + "".join(f"<td>{html.escape(str(value))}</td>" for value in (
                    row.label, row.original_type, row.fused_type or "-",
                    f"{_backends(row)} {' '.join(row.kernels)}".strip(),
                    _errors(row.output_max_abs, row.original_output_max_abs),
                    _errors(row.grad_max_abs, row.original_grad_max_abs), _speedup(row.speedup),
                )) + f'<td style="color:{_STATUS_COLOURS[row.status]}">{html.escape(row.status)}'
                + (f": {html.escape(row.reason)}" if row.reason else "") + "</td></tr>"
                for row in rows)
        summary = "<br>".join(html.escape(line) for line in self.summary().splitlines())
        return (f'<div class="te-lab-fusion-report"><p>{summary}</p>'
                f'<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table></div>')

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **dumps_options) -> str:
        return json.dumps(self.to_dict(), **dumps_options)

    @classmethod
    def from_dict(cls, data: dict) -> "FusionReport":
        data = dict(data)
        data["rows"] = [FusionRow(**row) for row in data.get("rows", [])]
        if data.get("model_check") is not None:
            data["model_check"] = ModelCheck(**data["model_check"])
        return cls(**data)


_STATUS_COLOURS = {FUSED: "green", SKIPPED: "#a05a00", KEPT_SLOWER: "#555", WOULD_FUSE: "#2a6fb0"}


def _error(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2g}"


def _speedup(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _backends(row: FusionRow) -> str:
    """What the row's ops ran on, e.g. ``cpp+native``."""
    return "+".join(sorted({b for value in row.backends.values() for b in value.split("+")})) or "-"


def _errors(twin: Optional[float], original: Optional[float]) -> str:
    """The twin's error, and in parentheses the original's, both against the float64 truth."""
    return _error(twin) + ("" if original is None else f" ({original:.2g})")


def _model_check_line(check: ModelCheck) -> str:
    parts = [f"{entry['name']} max abs diff {entry['max_abs']:.2g}" for entry in check.compared]
    if check.loss_before is not None and check.loss_after is not None:
        parts.append(f"loss {check.loss_before:.6g} -> {check.loss_after:.6g}")
    verdict = (f"INCONCLUSIVE: {check.inconclusive}" if check.inconclusive
               else "within tolerance" if check.within_tolerance else "OUTSIDE tolerance")
    text = "; ".join(parts) if parts else "nothing comparable"
    errors = [f"{entry['name']} fused {entry['fused_error']:.2g}, unfused {entry['unfused_error']:.2g}"
              for entry in check.compared if entry.get("fused_error") is not None
              and entry.get("unfused_error") is not None]
    if check.truth == "float64" and errors:
        against = (f"; largest errors against the unfused model run in float64 on {check.truth_on}: "
                   + "; ".join(errors) + " (the fused may be twice the unfused's, plus the dtype's tolerance)")
    elif check.truth and check.truth != "float64":
        against = f"; compared before vs after at the dtype's fixed tolerance: {check.truth}"
    else:
        against = ""
    failures = [entry["failure"] for entry in check.compared if not entry["within_tolerance"] and entry.get("failure")]
    return (f"whole model on the sample, before vs after: {text}{against} ({verdict})"
            + (f": {failures[0]}" if failures and not check.inconclusive else "")
            + (f"; {check.note}" if check.note else ""))
