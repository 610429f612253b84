"""The whole model's check after :func:`te_lab.fuse`'s swaps (the report's ``model_check``).

The fused model runs on the user's sample and each output (logits and loss of a causal LM,
else every output tensor) is judged by its error against the model run in float64 without
the swaps, as a probe judges a module (:func:`.probe.judge`: row by row, the fused error may
be twice the unfused model's own error plus the dtype's tolerance of the true values), so a
fused model that is closer to the truth than the unfused one is never refused for
differing from it (a real-like Gemma 4's fused logits were 5.7e-4 from the unfused ones,
outside float32's fixed tolerance, while 7.9e-5 from the truth against the unfused 4.9e-4).

The float64 run costs a forward of the whole model in float64, so it runs on part of the
sample: the first sequence, at most ``WHOLE_MODEL_PROBE_TOKENS`` of it where the sample is
token ids ([batch, sequence]; see :func:`.probe.probe_part`), with the fused and unfused
models run in float32 on that same part. The rest of the sample, which has no float64 run,
is compared before vs after with the bar the truth implies (:func:`.probe.judge_beside_original`):
a fused output within its budget of the truth differs from the unfused one by at most three
times the unfused model's error measured on the part, plus the tolerance. Where the model
cannot run in float64, every output is compared with the one before fusing at the dtype's
fixed tolerance against its scale, and the check says why.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from te_lab.inputs import ProbeInputs, call_with, output_tensors

from . import report as reports
from .probe import (
    WHOLE_MODEL_PROBE_TOKENS,
    Difference,
    compare,
    inconclusive_reason,
    judge,
    judge_beside_original,
    probe_part,
    quiet_state,
)
from .swaps import Swap
from .truth import float64_run, to_float64


def check_model(model: nn.Module, sample: ProbeInputs, before: Any, device: torch.device, swaps: list[Swap],
                shape: Optional[tuple[int, int]]) -> reports.ModelCheck:
    """Judge ``model`` (fused by ``swaps``) on ``sample`` against the float64 truth of the
    model without them; ``before`` is the unfused model's output on ``sample``, ``shape``
    the sample's (batch, sequence)."""
    with quiet_state([model], device), torch.no_grad():
        after = call_with(model, sample)
    check = reports.ModelCheck()
    pairs = _pairs(check, after, before)
    truth = _truth_on_part(model, sample, before, after, device, swaps, shape)
    if isinstance(truth, str):
        check.truth = truth
        differences = [compare(name, actual, expected, normwise=True) for name, actual, expected in pairs]
        for difference in differences:
            check.compared.append(dict(name=difference.name, max_abs=difference.max_abs, max_rel=difference.max_rel,
                                       within_tolerance=difference.within_tolerance, failure=difference.failure))
        check.inconclusive = inconclusive_reason(differences)
        return check
    fused_part, unfused_part, true_part, check.truth_on = truth
    check.truth = "float64"
    on_part = {name: (actual, expected, true) for name, actual, expected, true in
               _triples(fused_part, unfused_part, true_part)}
    on_sample: list[Difference] = []  # after vs before, on the whole sample
    on_truth: list[Difference] = []  # after against the float64 truth, on the part
    for name, actual, expected in pairs:
        against_truth = judge(name, *on_part[name]) if name in on_part else None
        unfused_error = None if against_truth is None else against_truth.original_max_abs
        if against_truth is None or against_truth.inconclusive or unfused_error is None:
            beside = compare(name, actual, expected, normwise=True)  # nothing measured to judge it by
        else:
            beside = judge_beside_original(name, actual, expected, unfused_error)
        on_sample.append(beside)
        entry = dict(name=name, max_abs=beside.max_abs, max_rel=beside.max_rel,
                     within_tolerance=beside.within_tolerance, failure=beside.failure)
        if against_truth is not None:
            on_truth.append(against_truth)
            entry.update(within_tolerance=against_truth.within_tolerance and beside.within_tolerance,
                         fused_error=against_truth.max_abs, unfused_error=unfused_error,
                         failure=against_truth.failure or beside.failure)
        check.compared.append(entry)
    check.inconclusive = inconclusive_reason(on_sample, on_truth)
    return check


def _pairs(check: reports.ModelCheck, after: Any, before: Any) -> list[tuple[str, Any, Any]]:
    """(name, after, before) for each output compared; a causal LM's loss values and a note
    go on ``check``."""
    if hasattr(before, "logits") or hasattr(before, "loss"):
        loss_before, loss_after = getattr(before, "loss", None), getattr(after, "loss", None)
        check.loss_before = None if loss_before is None else float(loss_before)
        check.loss_after = None if loss_after is None else float(loss_after)
        if getattr(before, "logits", None) is not None and getattr(after, "logits", None) is None:
            check.note = "logits not compared: the fused LM head does not return them when labels are given"
    return [(name, actual, expected) for name, actual, expected in _named_outputs(after, before)
            if actual is not None and expected is not None]


def _named_outputs(actual: Any, expected: Any) -> list[tuple[str, Any, Any]]:
    if hasattr(expected, "logits") or hasattr(expected, "loss"):
        return [(name, getattr(actual, name, None), getattr(expected, name, None)) for name in ("logits", "loss")]
    return [(f"output {i}", a, e) for i, (a, e) in enumerate(zip(output_tensors(actual), output_tensors(expected)))]


def _triples(fused: Any, unfused: Any, true: Any) -> list[tuple[str, Any, Any, Any]]:
    """(name, fused, unfused, float64) for each output all three have."""
    truths = {name: t for name, _, t in _named_outputs(true, true)}
    return [(name, a, e, truths.get(name)) for name, a, e in _named_outputs(fused, unfused)
            if a is not None and e is not None and isinstance(truths.get(name), torch.Tensor)]


def _detached(output: Any) -> Any:
    """``output`` (a model output object, a tuple or a tensor) with its tensors detached."""
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, (tuple, list)) and not hasattr(output, "keys"):
        return type(output)(_detached(v) for v in output)
    if hasattr(output, "keys") and hasattr(output, "__setitem__"):
        for key in list(output.keys()):
            output[key] = _detached(output[key])
    return output


@contextlib.contextmanager
def _without(swaps: list[Swap]) -> Iterator[None]:
    """The model as it was before this fuse for the block: its swaps out, last first, then
    back in."""
    for swap in reversed(swaps):
        swap.remove()
    try:
        yield
    finally:
        for swap in swaps:
            swap.install()


def _parts(sample: ProbeInputs, shape: Optional[tuple[int, int]]) -> list[ProbeInputs]:
    """The parts of the sample to try the float64 run on, smallest first: the first sequence's
    first ``WHOLE_MODEL_PROBE_TOKENS`` tokens, the first sequence, the sample."""
    if shape is None:
        return [sample]
    parts = [probe_part(sample, *shape, max_tokens=WHOLE_MODEL_PROBE_TOKENS), probe_part(sample, *shape), sample]
    return [part for i, part in enumerate(parts) if all(part is not other for other in parts[:i])]


def _describe(part: ProbeInputs, sample: ProbeInputs, shape: Optional[tuple[int, int]]) -> str:
    """The part of the sample, in words: token ids ([batch, sequence]) by sequence and tokens."""
    if part is sample or shape is None:
        return "the sample"
    first = next(v for v in [*part.args, *part.kwargs.values()] if isinstance(v, torch.Tensor))
    if first.dim() != 2:
        return "the first item of the batch"
    return f"the first sequence ({first.shape[1]} tokens)" if shape[0] > 1 else f"the first {first.shape[1]} tokens"


def _truth_on_part(model: nn.Module, sample: ProbeInputs, before: Any, after: Any, device: torch.device,
                   swaps: list[Swap], shape: Optional[tuple[int, int]]):
    """(fused, unfused, float64 outputs, what part of the sample they ran on) on the smallest
    part of the sample the model takes, or why there is no float64 run."""
    for part in _parts(sample, shape):
        whole = part is sample
        try:
            # With autograd on, as the probes ran at these sizes: a twin's call without gradients
            # may first time itself against its original for a new size class (and compile a kernel
            # for it), which this check must not set off.
            with quiet_state([model], device), torch.enable_grad():
                fused = after if whole else _detached(call_with(model, part))
                with _without(swaps):
                    unfused = before if whole else _detached(call_with(model, part))
        except Exception:  # noqa: BLE001 - not a call the model takes: try a larger part
            if whole:
                raise
            continue
        try:
            with quiet_state([model], device), torch.no_grad(), _without(swaps), \
                    float64_run([model], grouped_mm=True):
                true = call_with(model, ProbeInputs(to_float64(part.args), to_float64(part.kwargs)))
        except torch.OutOfMemoryError as error:
            return f"the model does not fit the device in float64 ({type(error).__name__})"
        except Exception as error:  # noqa: BLE001 - the check falls back to comparing with the unfused model
            return f"the model does not run in float64 ({type(error).__name__}: {error})"
        return fused, unfused, true, _describe(part, sample, shape)
    return "no part of the sample runs"  # not reached: the whole sample ran before fusing
