"""fuse: swap a model's layers for fused twins in place, each one verified first.

``fuse`` runs the model once on the user's sample to capture every candidate module's
real inputs, then takes the candidates top-down (:mod:`.selection`). For each it asks the
selected rules in order; a :class:`~te_lab.surgery.rules.Match` offers fused twins, each
probed against the module (forward and backward, docs/design.md's tolerances) on the
module's captured inputs (the sample's first sequence, see :func:`.probe.probe_part`) or on
synthesized ones, and judged by its error against the original run in float64. The first
twin within that bar replaces
the module in its parent (or, for the LM head + loss, is installed as the model's
``forward``); a module whose twins all miss stays as it is, and the report says by how
much they missed. Modules inside a replaced one are covered by its twin.

The swaps are recorded on the model (:mod:`.swaps`), so ``unfuse`` puts the very
original module objects back and a second ``fuse`` leaves fused modules alone.
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any, Optional

import torch
from torch import nn

from te_lab import distributed
from te_lab.inputs import as_call_inputs, output_tensors
from te_lab.kernels.linear import LINEAR
from te_lab.kernels.registry import forced_backend, recording_choices
from te_lab.modules import stepping_aside
from te_lab.options import check_backend, check_keep

from . import hooks, report as reports
from .inspection import tensor_like
from .model_check import check_model
from .probe import (
    WHOLE_MODEL_PROBE_TOKENS,
    ProbeResult,
    capture_inputs,
    probe,
    probe_part,
    quiet_state,
    sample_shape,
    trainable_parameters,
)
from .region_rule import region_rule, resolve_regions
from .rules import BuildOptions, FusionRule, Match, ProbeInputs, Skip, rules
from .selection import Candidate, Selection, already_fused, find_candidates
from .swaps import Swap, record_swaps, sites_of
from .timing import median_times_ms


class _Progress:
    """One bar over the phases of a fuse: capturing the sample's inputs, building and
    probing each candidate, checking the whole model; the bar's text names the phase, and
    the seconds each phase took add up in ``seconds`` (the report's ``phase_seconds``)."""

    def __init__(self, total: int, enabled: Optional[bool]):
        self.seconds: dict[str, float] = {}
        self.current, self.started = "", time.perf_counter()
        self.bar = None
        if enabled is False or total == 0:
            return
        # tqdm.auto would import IPython outside a notebook; use it only where IPython runs.
        if "IPython" in sys.modules:
            from tqdm.auto import tqdm
        else:
            from tqdm import tqdm
        self.bar = tqdm(total=total, desc="te_lab.fuse", disable=None if enabled is None else False, leave=False)

    def phase(self, description: str, key: str = "") -> None:
        """Enter the phase ``description``; its time counts under ``key`` (default: itself)."""
        self._account()
        self.current = key or description
        if self.bar is not None:
            self.bar.set_description_str(f"te_lab.fuse: {description}")

    def _account(self) -> None:
        now = time.perf_counter()
        if self.current:
            self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self.started
        self.started = now

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        self._account()
        self.current = ""
        if self.bar is not None:
            self.bar.close()


class _Fuser:
    def __init__(self, model: nn.Module, options: BuildOptions, verify: bool, keep: str, auto: bool, dry_run: bool,
                 captured: dict[str, ProbeInputs], sample_shape: Optional[tuple[int, int]], device: torch.device):
        self.model, self.options, self.verify, self.auto, self.dry_run = model, options, verify, auto, dry_run
        self.keep = keep
        self.captured, self.sample_shape, self.device = captured, sample_shape, device
        self.swaps: list[Swap] = []
        self.replaced: list[str] = []  # paths whose module a twin replaced (or would replace, in a dry run)
        self.current = ""  # the path being processed, for the message of an error or an interrupt
        self.ran: dict[str, set] = {}  # op name -> backends chosen in the last probe

    def process(self, candidate: Candidate) -> reports.FusionRow:
        self.current = candidate.path or reports.ROOT_LABEL
        reasons = []
        first_rule = candidate.results[0][0]
        row = None
        for rule, result in candidate.results:
            if isinstance(result, Skip):
                reasons.append(result.reason)
                continue
            row = self._try_match(candidate, rule, result, reasons)
            if row is not None:
                return row
        return reports.FusionRow(candidate.path, type(candidate.module).__name__, first_rule.name, first_rule.kind,
                                 reports.SKIPPED, reason=_first_miss(reasons))

    def _inputs(self, candidate: Candidate, match: Match) -> tuple[Optional[ProbeInputs], str]:
        """The probe's inputs and where they come from; ``None`` for a module that did not
        run on the sample and whose rule synthesizes none (a compiled region)."""
        captured = self.captured.get(candidate.path)
        if captured is not None:
            return (match.complete_inputs(captured) if match.complete_inputs else captured), "sample"
        if match.example_inputs is None:
            return None, "none"
        return self._synthesized(match), "synthesized"

    def _probed_part(self, inputs: ProbeInputs, match: Match) -> ProbeInputs:
        """The part of the sample's inputs a probe runs on (:func:`.probe.probe_part`):
        the first sequence, and for a whole-model probe at most ``WHOLE_MODEL_PROBE_TOKENS``."""
        if self.sample_shape is None:
            return inputs
        return probe_part(inputs, *self.sample_shape,
                          max_tokens=WHOLE_MODEL_PROBE_TOKENS if match.replaces_forward else None)

    def _synthesized(self, match: Match) -> ProbeInputs:
        with quiet_state([], self.device):  # a rule's random inputs leave the caller's RNG streams alone
            return match.example_inputs()

    def _try_match(self, candidate: Candidate, rule: FusionRule, match: Match, reasons: list):
        module = candidate.module
        if candidate.path == "" and not match.replaces_forward:
            reasons.append(f"is the model itself (rule {rule.name}); fuse swaps modules inside the model it is "
                           f"given, so pass its parent")
            return None
        inputs, source = (None, "none (verify=False)") if not self.verify else self._inputs(candidate, match)
        if self.verify and inputs is None:
            reasons.append(f"did not run on the sample, and {rule.name} is probed on the sample's inputs only "
                           f"(pass a sample that calls it)")
            return None
        projections_note = ""
        for variant in match.variants:
            try:
                twin = variant.build(self.options)
            except Exception as error:  # noqa: BLE001 - reported as the reason to skip
                reasons.append(f"could not build the fused twin: {type(error).__name__}: {error}")
                continue
            if not twin.kernel_names():
                reasons.append("nothing of it is fused under the selected rules")
                continue
            untaken = [] if match.replaces_forward else _arguments_the_twin_cannot_take(
                module, twin, self.captured.get(candidate.path))
            if untaken:
                reasons.append(f"its forward takes {', '.join(untaken)} beyond the input, which the fused "
                               f"{type(twin).__name__} does not take")
                continue
            unreachable = _hooks_the_twin_would_skip(candidate, twin, match)
            if unreachable:
                reasons.append(f"has hooks inside that its fused twin would never fire: {', '.join(unreachable)} "
                               f"(the twin computes that module's math itself); remove them to fuse it")
                return None
            original = twin.original_forward if match.replaces_forward else module
            result, probed, fallback = None, inputs, ""
            if self.verify:
                result = self._probe(module, original, twin, inputs, match)
                if result.inconclusive and source == "sample" and match.example_inputs is not None:
                    fallback, probed = result.inconclusive, self._synthesized(match)
                    result = self._probe(module, original, twin, probed, match)
                result, projections_note = self._with_accurate_projections(module, original, twin, probed, match,
                                                                           result)
            if result is not None and not result.passed:
                reasons.append(result.reason + (" (on synthesized inputs, after the sample's probe was "
                                                f"inconclusive: {fallback})" if fallback else ""))
                continue
            row = reports.FusionRow(
                candidate.path, type(module).__name__, rule.name, rule.kind, reports.FUSED,
                fused_type=type(twin).__name__, variant=variant.note,
                backends=self._backends_that_ran(twin), kernels=twin.kernel_names(),
                probe="synthesized" if fallback else source)
            if projections_note:
                row.variant = "; ".join(filter(None, (row.variant, projections_note)))
            if fallback:
                row.reason = f"verified on synthesized inputs: the sample's probe was inconclusive ({fallback})"
            if result is not None:
                row.output_max_abs, row.output_max_rel = result.output_max_abs, result.output_max_rel
                row.grad_max_abs, row.grad_max_rel = result.grad_max_abs, result.grad_max_rel
                row.original_output_max_abs = result.original_output_max_abs
                row.original_grad_max_abs = result.original_grad_max_abs
                row.truth = result.truth
            if self.auto or (match.timed and self.verify):
                with quiet_state(_modules_of(module, twin), self.device), hooks.silenced(module), \
                        stepping_aside.running_fused():
                    row.time_original_ms, row.time_fused_ms = median_times_ms(
                        original, twin, probed, trainable_parameters(module), match.constant_inputs,
                        match.probe_outputs or output_tensors, self.device)
                row.speedup = row.time_original_ms / row.time_fused_ms if row.time_fused_ms > 0 else None
                # A compiled region must beat its original by the margin stepping aside uses: a
                # tie within the noise is no reason to run compiled code.
                margin = stepping_aside.MARGIN if match.timed else 0.0
                if row.time_fused_ms >= (1 - margin) * row.time_original_ms:
                    row.status = reports.KEPT_SLOWER
                    row.reason = (f"fused {row.time_fused_ms:.3g} ms vs original {row.time_original_ms:.3g} ms "
                                  f"(forward + backward, median)" + (
                                      f"; a compiled region is kept where faster by more than {margin:.0%}"
                                      if margin else ""))
                    return row
            if result is not None:
                # Kept with the twin, so tools that meet it later (the profiler) can show it.
                against = "float64 truth" if result.truth == "float64" else "original"
                twin.verification = (f"probe ({row.probe}) against the {against}: output max abs err "
                                     f"{result.output_max_abs:.2g}, gradient max abs err "
                                     f"{_or_dash(result.grad_max_abs)}")
            if not match.replaces_forward:
                self.replaced.append(candidate.path)
            if self.dry_run:
                row.status = reports.WOULD_FUSE
                return row
            swap = Swap(candidate.path, rule.name, module, twin,
                        [] if match.replaces_forward else sites_of(self.model, module))
            swap.install()
            self.swaps.append(swap)
            self._decide_stepping_aside(twin, row, inputs if source == "sample" else None)
            return row
        return None

    def _decide_stepping_aside(self, twin, row: reports.FusionRow, sample: Optional[ProbeInputs]) -> None:
        """``keep="all"``: the twin runs fused at every size. ``keep="faster"``: for a twin
        that may step aside, the training calls of the sample's sizes are decided now (once
        per layer structure), and the row says what was measured."""
        if not getattr(twin, "measured_against_original", False):
            return
        if self.keep == "all":
            stepping_aside.keep_fused(twin)
            return
        if sample is None or self.auto:
            return
        decision = stepping_aside.decide(twin, sample.args, sample.kwargs, training=True)
        if decision is None or decision.speedup is None:
            return
        row.time_original_ms, row.time_fused_ms = decision.original_us / 1e3, decision.fused_us / 1e3
        row.speedup, row.steps_aside = decision.speedup, decision.aside
        if decision.aside:
            row.reason = "; ".join(filter(None, (row.reason, (
                f"steps aside at the sample's sizes: the original ran forward + backward in "
                f"{row.time_original_ms:.3g} ms against the twin's {row.time_fused_ms:.3g} ms (medians; other sizes "
                f"are measured when they first run; keep='all' runs it fused)"))))

    def _backends_that_ran(self, twin) -> dict[str, str]:
        """Op name -> the backend(s) the twin's ops ran on in its last probe (``cpp``,
        ``cpp+reference`` where calls of different sizes chose differently), or how the
        registry chooses it where no probe ran it (``verify=False``)."""
        ran = {name: "+".join(sorted(backends)) for name, backends in self.ran.items()}
        return {name: ran.get(name, how) for name, how in twin.resolved_backends(self.device).items()}

    def _with_accurate_projections(self, module: nn.Module, original, twin, inputs: ProbeInputs, match: Match,
                                   result: ProbeResult) -> tuple[ProbeResult, str]:
        """A twin that missed the bar while its projections ran as te_lab's ``linear`` op
        chosen automatically (oneDNN's GEMM, whose float32 rounding error is up to about
        twice MKL's on these machines) is probed once more with them on torch's own GEMM:
        the fusion around them is kept and the projections stay as accurate as the
        original's. Returns the verdict and, where the retry passed, the row's note."""
        if result.passed or result.inconclusive or LINEAR not in getattr(twin, "ops", ()) \
                or twin.backend_for(LINEAR) not in (None, "auto") or forced_backend(LINEAR)[0] not in (None, "auto"):
            return result, ""
        twin.pin_backend(LINEAR, "reference")
        retried = self._probe(module, original, twin, inputs, match)
        if not retried.passed:
            return result, ""
        return retried, ("projections on torch's GEMM: with te_lab's linear op the probe missed the bar ("
                         + result.reason + ")")

    def _probe(self, module: nn.Module, original, twin, inputs: ProbeInputs, match: Match) -> ProbeResult:
        part = self._probed_part(inputs, match)
        result = self._probe_on(module, original, twin, part, match)
        if part is not inputs and result.reason.startswith("probe raised"):
            # the first sequence alone is not a call this module takes: probe the whole sample
            result = self._probe_on(module, original, twin, inputs, match)
        return result

    def _probe_on(self, module: nn.Module, original, twin, inputs: ProbeInputs, match: Match) -> ProbeResult:
        try:
            with quiet_state(_modules_of(module, twin), self.device), hooks.silenced(module), \
                    stepping_aside.running_fused(), recording_choices() as self.ran:
                return probe(original, twin, inputs, trainable_parameters(module), match.constant_inputs,
                             match.probe_outputs, truth_roots=[module],
                             whole_model_head=module.get_submodule(twin.head_name) if match.replaces_forward else None)
        except torch.OutOfMemoryError:
            raise  # the device's state, not the twin's verdict: fuse stops and undoes its swaps
        except Exception as error:  # noqa: BLE001 - a failing probe means "do not swap"
            return ProbeResult(False, float("inf"), float("inf"), None, None,
                               f"probe raised {type(error).__name__}: {error}")


def _arguments_the_twin_cannot_take(module: nn.Module, twin: Any, call: Optional[ProbeInputs]) -> list[str]:
    """The arguments of the module's forward, after its first, that the twin's
    ``fused_forward`` has no place for: those of the model's own ``call`` where the sample
    captured one, else those the forward requires (e.g. Bloom's MLP, ``forward(hidden_states,
    residual)``, which adds the residual itself); empty where either signature is unknown."""
    try:
        original = inspect.signature(module.forward)
        fused = inspect.signature(twin.fused_forward)
    except (TypeError, ValueError):
        return []
    if call is None:
        required = [p for p in original.parameters.values() if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        args = tuple(None for p in required if p.kind is not p.KEYWORD_ONLY)
        call = ProbeInputs(args, {p.name: None for p in required if p.kind is p.KEYWORD_ONLY})
    try:
        fused.bind(*call.args, **call.kwargs)
        return []
    except TypeError:
        pass
    try:
        given = list(original.bind(*call.args, **call.kwargs).arguments.items())[1:]
    except TypeError:
        return []  # not a call the original takes either: the probe says what happens
    names = []
    for name, value in given:
        kind = original.parameters[name].kind
        names += list(value) if kind is inspect.Parameter.VAR_KEYWORD else \
            [f"{len(value)} more positional"] if kind is inspect.Parameter.VAR_POSITIONAL else [name]
    return [f"`{name}`" for name in names if name not in fused.parameters or name.endswith("positional")]


def _hooks_the_twin_would_skip(candidate: Candidate, twin: Any, match: Match) -> list[str]:
    """Modules whose hooks the twin would not fire: those inside the replaced module
    (the twin's hooks are the module's own, see :mod:`.hooks`), or for the LM head +
    loss, which replaces the model's forward, the head it no longer calls."""
    if match.replaces_forward:
        head = candidate.module.get_submodule(twin.head_name)
        return hooks.hooked_modules(head, ".".join(p for p in (candidate.path, twin.head_name) if p),
                                    include_root=True)
    return hooks.hooked_modules(candidate.module, candidate.path, include_root=False,
                                called=getattr(twin, "called_children", ()))


def _or_dash(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2g}"


def _first_miss(reasons: list[str]) -> str:
    """Why the most plausible fused form did not fit (rules and their variants are tried
    most plausible first: RMSNorm before Gemma's RMSNorm before LayerNorm); the others
    are counted, since their misses say little about the module."""
    if not reasons:
        return "no rule applied"
    others = len(reasons) - 1
    return reasons[0] + (f" (and {others} other fused form(s) did not fit)" if others else "")


def _modules_of(module: nn.Module, twin: Any) -> list[nn.Module]:
    """What a probe must hold in eval mode: the module and, when it is one, its twin
    (which is not in the model yet, so the model's mode does not reach it)."""
    return [module, twin] if isinstance(twin, nn.Module) else [module]


def fuse(model: nn.Module, *, sample: Any = None, only=None, exclude=None, backend: str = "auto",
         verify: bool = True, keep: str = "faster", auto: bool = False, dry_run: bool = False,
         progress: Optional[bool] = None, regions=None, region_options: Optional[dict] = None) -> reports.FusionReport:
    """Swap ``model``'s layers for fused twins, in place, and report what was done.

    - ``sample``: inputs for ``model`` (a tensor, a tuple of positional arguments or a
      dict of keyword arguments). The model runs on it once so every candidate is
      probed on its real inputs, and the whole model's output is compared before and
      after. Without it, probes are synthesized from the modules' shapes.
    - ``only`` / ``exclude``: rule names (see :func:`te_lab.rules`) or module-path
      globs (``"model.layers.0.*"``), one or a list.
    - ``backend``: ``"auto"``, or a backend forced on every fused op that has it.
    - ``verify=False`` swaps without probing (not recommended).
    - ``keep="faster"`` (the default): a verified twin of a module without side effects
      (norms, MLPs) steps aside, handing the call to the original, at the sizes where the
      original measures faster on this machine (:mod:`te_lab.modules.stepping_aside`);
      with a sample, the training calls of its sizes are decided now, once per layer
      structure, and the report's rows say which step aside and why. ``keep="all"``:
      every verified twin runs fused at every size (to study the kernels).
    - ``auto=True`` times each verified twin against its original (forward + backward
      on the probe, interleaved medians) and keeps only the faster ones.
    - ``dry_run=True`` finds, builds and probes (and with ``auto``, times) every candidate
      but swaps nothing: rows that would be fused say ``would-fuse``.
    - ``progress``: show a progress bar (default: where a terminal or notebook shows one).
    - ``regions``: modules no rule knows, to fuse by compiling each alone with
      ``torch.compile`` (:mod:`.region_rule`): module paths or globs, module classes or
      class names, or rows of :func:`te_lab.opportunities` (or its whole result), one or a
      list. Each is probed on the sample's inputs (so ``sample`` is required) like every
      twin and kept only where it measures faster; ``region_options``: keyword arguments
      for ``torch.compile`` (``mode``, ``options``, ``backend``, ``dynamic``).

    A ``DistributedDataParallel`` wrapper has its wrapped module fused; a model already
    sharded by FSDP2's ``fully_shard`` (DTensor parameters) is refused: fuse, then shard.

    A probe on the sample that compares nothing (no elements; NaN or infinity from the
    original) is inconclusive and is repeated on synthesized inputs, and the row says so.
    A swapped module's hooks move to its twin (:mod:`.hooks`). Any exception or interrupt
    that escapes undoes every swap this call made, and names the module being processed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"te_lab.fuse: model must be a torch.nn.Module, got {type(model).__name__}")
    model = distributed.unwrap(model)  # DDP's hooks sit on the Parameters, which the twins keep
    distributed.refuse_sharded(model, "te_lab.fuse", "probes would run its modules outside the hooks that gather "
                               "their shards; fuse the model before sharding it")
    requested = check_backend(backend, "te_lab.fuse")
    check_keep(keep, "te_lab.fuse")
    if auto and not verify:
        raise ValueError("te_lab.fuse: auto=True times verified swaps; it cannot be combined with verify=False")
    if verify and torch.is_inference_mode_enabled():
        raise RuntimeError("te_lab.fuse: probes need autograd, which torch.inference_mode() disables; "
                           "call fuse outside it (or pass verify=False)")
    all_modules = dict(model.named_modules())
    selection = Selection(only, exclude, list(all_modules), [r.name for r in rules()])
    first_rules = _region_rules(model, regions, region_options, sample, verify)
    _, device = tensor_like(model)
    already = already_fused(model)
    candidates = find_candidates(model, selection, first_rules)
    captured, before = {}, None
    sample_inputs = None if sample is None else as_call_inputs(sample, "te_lab.fuse", "sample")
    show_progress = progress if progress is not None else (None if auto or len(candidates) > 8 else False)
    bar = _Progress(len(candidates) + (2 if sample_inputs is not None else 0), show_progress)
    if sample_inputs is not None:
        bar.phase("capturing the sample's inputs")
        try:
            captured, before = capture_inputs(model, sample_inputs, {c.path: c.module for c in candidates}, device)
        except Exception as error:
            bar.close()
            raise ValueError(f"te_lab.fuse: running the model on sample failed: {type(error).__name__}: {error}") \
                from error
        bar.step()
    fuser = _Fuser(model, BuildOptions(requested, selection.enabled_rules), verify, keep, auto, dry_run, captured,
                   sample_shape(sample_inputs), device)
    rows = []
    report = reports.FusionReport(type(model).__name__, str(device), backend or "auto", rows, already)
    try:
        for candidate in candidates:
            bar.phase(f"building and probing {candidate.path or reports.ROOT_LABEL}",
                      f"building and probing: {candidate.results[0][0].name}")
            if not any(candidate.path.startswith(p + ".") for p in fuser.replaced):
                # (a module inside one already replaced is covered by that twin)
                rows.append(fuser.process(candidate))
            bar.step()
        if sample_inputs is not None and fuser.swaps:
            fuser.current = "the whole model's check"
            bar.phase("checking the whole model")
            with stepping_aside.running_fused():
                report.model_check = check_model(model, sample_inputs, before, device, fuser.swaps,
                                                 fuser.sample_shape)
        if sample_inputs is not None:
            bar.step()
    except BaseException as error:
        # An interrupt (the notebook's stop button), out of memory, a bug: never half fused.
        for swap in reversed(fuser.swaps):
            swap.remove()
        _annotate(error, f"te_lab.fuse: stopped by {type(error).__name__} while processing {fuser.current}; "
                         f"every swap it had made is undone, the model is as before")
        raise
    finally:
        bar.close()
    report.phase_seconds = {phase: round(seconds, 4) for phase, seconds in bar.seconds.items()}
    record_swaps(model, fuser.swaps)
    if dry_run:
        report.notes.append("dry run: nothing was swapped")
    aside = [row for row in rows if row.steps_aside]
    if aside:
        report.notes.append(f"{len(aside)} fused twin(s) step aside at the sample's sizes, where the original "
                            f"measured faster on this machine (training calls, forward + backward): "
                            f"{', '.join(sorted({row.rule for row in aside}))}; keep='all' runs them fused")
    if any(row.rule == "lm_head_loss" and row.status == reports.FUSED for row in rows):
        report.notes.append("lm_head_loss: called with labels, the model returns the loss and logits=None "
                            "(the full logits are never materialized); without labels it returns logits as before")
    return report


COMPILE_OPTIONS = ("mode", "options", "backend", "dynamic")


def _region_rules(model: nn.Module, regions, region_options: Optional[dict], sample, verify: bool) -> tuple:
    """The call's compiled-region rule, checked (none without ``regions``)."""
    if region_options is not None and regions is None:
        raise ValueError("te_lab.fuse: region_options is given without regions")
    if regions is None:
        return ()
    if region_options is not None:
        if not isinstance(region_options, dict):
            raise TypeError(f"te_lab.fuse: region_options must be a dict of torch.compile keyword arguments, got "
                            f"{type(region_options).__name__}")
        unknown = sorted(set(region_options) - set(COMPILE_OPTIONS))
        if unknown:
            raise ValueError(f"te_lab.fuse: region_options: unknown key(s) {', '.join(map(repr, unknown))}; expected "
                             f"some of {', '.join(COMPILE_OPTIONS)} (fullgraph is always True)")
    if verify and sample is None:
        raise ValueError("te_lab.fuse: regions are probed on the sample's inputs and timed on them; pass sample=")
    return (region_rule(model, resolve_regions(model, regions), region_options),)


def _annotate(error: BaseException, message: str) -> None:
    """Add ``message`` to ``error``'s traceback (a note), and for an interrupt, which
    prints only its arguments, to its text."""
    if isinstance(error, KeyboardInterrupt) and not error.args:
        error.args = (message,)
    elif hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(message)
    else:
        error.args = (f"{message}: {error.args[0]}" if error.args else message, *error.args[1:])
