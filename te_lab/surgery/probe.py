"""Probing: run an original module and its fused twin on the same inputs, forward and
backward, and judge outputs, input gradients and parameter gradients by their errors
against the original run in float64 (:mod:`.truth`): the twin passes where its error is
within :func:`te_lab.kernels.precision.error_budget` of the original's own, row by row.
Where the float64 run cannot be made, twin and original are compared with each other
at the dtype's tolerance instead, and the result says why.

A probe leaves no trace: gradients come from ``torch.autograd.grad`` (``.grad`` is
never written), buffers are restored, every module runs in eval mode (dropout off, so
the comparison is deterministic; train/eval flags are put back exactly), and the RNG
state of the CPU and the device is forked.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from te_lab.inputs import ProbeInputs, call_with, output_tensors
from te_lab.kernels.precision import ERROR_FACTOR, TOLERANCES, error_budget

from .truth import float64_run, to_float64

UPSTREAM_SEED = 0


@contextlib.contextmanager
def quiet_state(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Eval mode, forked RNG and restored buffers for the duration of the block."""
    modes = [(m, m.training) for root in modules for m in root.modules()]
    buffers = [(b, b.detach().clone()) for root in modules for b in root.buffers()]
    gpu_devices = [device] if device.type != "cpu" else []
    fork_options = {"device_type": device.type} if device.type != "cpu" else {}
    try:
        with torch.random.fork_rng(devices=gpu_devices, **fork_options):
            for module, _ in modes:
                module.training = False
            yield
    finally:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for buffer, saved in buffers:
                if buffer.shape == saved.shape:
                    buffer.copy_(saved)


def _detached(value: Any) -> Any:
    """A copy of captured arguments that later calls cannot alter: tensors cloned,
    containers rebuilt; stateful objects (KV caches, hook handles) become ``None``, so
    a probe computes the module's plain, cache-free forward."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return None


def capture_inputs(model: nn.Module, sample: ProbeInputs, modules: dict[str, nn.Module],
                   device: torch.device) -> tuple[dict[str, ProbeInputs], Any]:
    """Run ``model`` on ``sample`` once and record the first call of each module in
    ``modules`` (path -> module). Returns the captured inputs and the model's output."""
    captured: dict[str, ProbeInputs] = {}
    handles = []

    def recorder(path: str):
        def hook(_module, args, kwargs):
            if path not in captured:
                captured[path] = ProbeInputs(_detached(tuple(args)), _detached(dict(kwargs)))
        return hook

    for path, module in modules.items():
        handles.append(module.register_forward_pre_hook(recorder(path), with_kwargs=True))
    try:
        with quiet_state([model], device), torch.no_grad():
            output = call_with(model, sample)
    finally:
        for handle in handles:
            handle.remove()
    return captured, output


# A whole-model probe (the LM head + loss replaces the model's forward) runs on at most this
# many tokens of the sample's first sequence: the loss over them checks the head's math over
# the whole vocabulary, and the body's work stays a fraction of one training step.
WHOLE_MODEL_PROBE_TOKENS = 128


def sample_shape(sample: Optional[ProbeInputs]) -> Optional[tuple[int, int]]:
    """(batch, sequence) of a sample whose first tensor is [batch, sequence, ...]
    (token ids, or embeddings), or ``None``."""
    first = next((v for v in [*(sample.args if sample else ()), *(sample.kwargs.values() if sample else ())]
                  if isinstance(v, torch.Tensor)), None)
    return (first.shape[0], first.shape[1]) if first is not None and first.dim() >= 2 else None


def probe_part(inputs: ProbeInputs, batch: int, seq: int, max_tokens: Optional[int] = None) -> ProbeInputs:
    """The first sequence of a module's captured inputs: every tensor of two or more
    dimensions whose first is the sample's ``batch`` keeps its first row. A probe then costs
    a fraction of the step it verifies, and the whole model's check after the swaps covers
    the full sample. With ``max_tokens`` (a whole-model call), [batch, seq] tensors also
    keep only their first ``max_tokens`` positions, a prefix a causal model computes the
    same way. ``inputs`` itself where nothing would change."""
    tokens = seq if max_tokens is None else min(seq, max_tokens)
    if tokens != seq and any(isinstance(v, torch.Tensor) and v.dim() > 2 and seq in v.shape[1:]
                             for v in [*inputs.args, *inputs.kwargs.values()]):
        tokens = seq  # a [batch, ..., seq, ...] tensor (a 4-D mask, embeddings) would need cutting too
    if batch == 1 and tokens == seq:
        return inputs

    def part(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == batch:
            value = value[:1]
            return value[:, :tokens] if value.dim() == 2 and value.shape[1] == seq else value
        if isinstance(value, (tuple, list)):
            return type(value)(part(v) for v in value)
        return value

    return ProbeInputs(tuple(part(v) for v in inputs.args), {k: part(v) for k, v in inputs.kwargs.items()})


@dataclass(frozen=True)
class Difference:
    """How far one tensor is from its reference: max |a - b|, that over max |b|, and
    whether it is within the dtype's tolerance; ``failure`` says why not, and
    ``inconclusive`` why the comparison proves nothing, where it does not. Judged against
    the float64 truth (:func:`judge`), the reference is the truth and
    ``original_max_abs`` the unfused computation's own error."""

    name: str
    max_abs: float
    max_rel: float
    within_tolerance: bool
    failure: str = ""
    # Why the values compared prove nothing: the original's hold NaN or infinity.
    inconclusive: str = ""
    elements: int = 0
    original_max_abs: Optional[float] = None


def _tolerance_dtype(expected: Tensor) -> torch.dtype:
    """``expected``'s dtype, or inside an autocast region on its device the region's
    low-precision dtype where that is coarser: autocast may have run any of the math
    behind ``expected`` in it (fusing inside a bf16 region probes bf16 computations)."""
    device_type = expected.device.type
    if expected.is_floating_point() and torch.is_autocast_enabled(device_type):
        region_dtype = torch.get_autocast_dtype(device_type)
        if torch.finfo(region_dtype).eps > torch.finfo(expected.dtype).eps:
            return region_dtype
    return expected.dtype


def _comparable(name: str, actual: Optional[Tensor], expected: Optional[Tensor]):
    """``(actual, expected, None)`` ready to compare (a missing gradient is zeros), or a
    settled :class:`Difference` where there is nothing to compare or they cannot match."""
    if actual is None and expected is None:
        return None, None, Difference(name, 0.0, 0.0, True)
    if actual is None or expected is None:
        present = expected if actual is None else actual
        actual = torch.zeros_like(present) if actual is None else actual
        expected = torch.zeros_like(present) if expected is None else expected
    if actual.shape != expected.shape:
        return None, None, Difference(name, float("inf"), float("inf"), False,
                                      f"{name} has shape {tuple(actual.shape)}, the original's {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        return None, None, Difference(name, float("inf"), float("inf"), False,
                                      f"{name} has dtype {actual.dtype}, the original's {expected.dtype}")
    if actual.numel() == 0:
        return None, None, Difference(name, 0.0, 0.0, True)
    return actual, expected, None


def _dtype_label(tolerance_dtype: torch.dtype, expected: Tensor) -> str:
    return str(tolerance_dtype).replace("torch.", "") + ("" if tolerance_dtype == expected.dtype else " (autocast)")


def _rows(tensor: Tensor) -> Tensor:
    """``tensor`` as rows over its last dimension (a token's features, a weight's inputs)."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() >= 2 else tensor.reshape(1, -1)


# Errors are taken about this many elements at a time: a whole-model probe's gradients reach
# hundreds of millions of elements (Gemma 4's per-layer embedding: 134 million), whose whole
# float64 copies cost seconds in page faults alone.
ERROR_BLOCK_ELEMENTS = 1 << 20


def _largest_errors(values: Tensor, t: Tensor, whole_tensor: bool, nan: float) -> Tensor:
    """Per row of ``t`` (over its last dimension; with ``whole_tensor`` one row of every
    element), the largest ``|values - t|``, in float64 and a block of rows at a time; a NaN
    error counts as ``nan``."""
    v = values.detach()
    if whole_tensor:
        flat_v, flat_t = v.reshape(-1), t.reshape(-1)
        largest = torch.zeros(1, dtype=torch.float64, device=t.device)
        for start in range(0, flat_t.numel(), ERROR_BLOCK_ELEMENTS):
            stop = start + ERROR_BLOCK_ELEMENTS
            error = flat_v[start:stop].to(torch.float64, copy=True).sub_(flat_t[start:stop]).abs_()
            largest = torch.maximum(largest, torch.nan_to_num_(error, nan=nan).amax().reshape(1))
        return largest
    rows_v, rows_t = _rows(v), _rows(t)
    out = torch.empty(rows_t.shape[0], dtype=torch.float64, device=t.device)
    step = max(1, ERROR_BLOCK_ELEMENTS // max(rows_t.shape[1], 1))
    for start in range(0, rows_t.shape[0], step):
        error = rows_v[start:start + step].to(torch.float64, copy=True).sub_(rows_t[start:start + step]).abs_()
        out[start:start + step] = torch.nan_to_num_(error, nan=nan).amax(1)
    return out


def judge(name: str, actual: Optional[Tensor], expected: Optional[Tensor], true: Tensor, *,
          expected_again: Optional[Tensor] = None, whole_tensor: bool = False) -> Difference:
    """The twin's ``actual`` against the float64 ``true`` values, given the original's
    ``expected`` in the working dtype: row by row (over the last dimension), the twin's
    largest error may be :func:`~te_lab.kernels.precision.error_budget` of the
    original's largest error in that row and the row's largest true value. Rows keep one
    outlier channel from setting the bar for every token, and a row's maximum is a
    stable measure of a dtype's rounding where one element's error is chance.

    ``expected_again``: the original's values from a second float32 computation of the same
    math (:func:`rerounded_gradient`); the original's error is then, per row, the larger of
    the two. ``whole_tensor``: the tensor is one row (a whole-model probe's gradients, see
    :func:`probe`)."""
    actual, expected, settled = _comparable(name, actual, expected)
    if settled is not None:
        return settled
    t = true.detach().to(torch.float64)
    if t.shape != expected.shape:
        return compare(name, actual, expected)
    # A sum in float64 of float32-range values is finite exactly when every value is; the
    # original's values are finite where its errors are.
    original_rows = _largest_errors(expected, t, whole_tensor, nan=float("nan"))
    if not (math.isfinite(float(t.sum())) and math.isfinite(float(original_rows.max()))):
        # errors against non-finite values prove nothing either way
        return Difference(name, float("nan"), float("nan"), True, "", f"the original's {name} holds NaN or infinity",
                          actual.numel())
    twin_rows = _largest_errors(actual, t, whole_tensor, nan=float("inf"))
    if expected_again is not None and expected_again.shape == expected.shape:
        original_rows = torch.maximum(original_rows, _largest_errors(expected_again, t, whole_tensor, nan=0.0))
    rows = (lambda tensor: tensor.reshape(1, -1)) if whole_tensor else _rows
    true_rows = torch.maximum(rows(t).amax(1), rows(t).amin(1).neg())
    tolerance_dtype = _tolerance_dtype(expected)
    allowed = error_budget(original_rows, true_rows, tolerance_dtype)
    max_abs = float(twin_rows.max())
    row, max_rel, tolerance = _verdict(twin_rows, allowed, max_abs, float(true_rows.max()), tolerance_dtype)
    within, failure = row is None, ""
    if not within:
        where, largest = ("", "the largest value") if whole_tensor else \
            (f" (row {row} of {len(twin_rows)})", "the row's largest value")
        failure = (f"{name} is {float(twin_rows[row]):.3g} from the float64 truth where the original's own error is "
                   f"{float(original_rows[row]):.3g}{where}; the "
                   f"{_dtype_label(tolerance_dtype, expected)} bar is {ERROR_FACTOR:g} x the original's error + "
                   f"{tolerance['atol']:g} + {tolerance['rtol']:g} x {largest} = {float(allowed[row]):.3g}")
    return Difference(name, max_abs, max_rel, within, failure, "", actual.numel(), float(original_rows.max()))


def _verdict(error_rows: Tensor, allowed: Tensor, max_abs: float, scale: float,
             tolerance_dtype: torch.dtype) -> tuple[Optional[int], float, dict]:
    """(the row furthest over its budget, or None where every row is within; the largest
    error relative to the largest value; the dtype's tolerances, for the failure's words)."""
    excess = error_rows - allowed
    row = None if bool((excess <= 0).all()) else int(excess.argmax())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return row, max_rel, TOLERANCES.get(tolerance_dtype, TOLERANCES[torch.float32])


def judge_beside_original(name: str, actual: Optional[Tensor], expected: Optional[Tensor],
                          original_error: float) -> Difference:
    """``actual`` against the original's ``expected`` where no float64 run was made, given the
    original's largest error against the float64 truth measured on part of the same call
    (``original_error``). A result within :func:`judge`'s budget of the truth is at most
    ``ERROR_FACTOR x original_error + atol + rtol x`` the row's largest value from the truth,
    and the original at most ``original_error`` from it, so row by row the two may differ by
    :func:`~te_lab.kernels.precision.error_budget` of ``original_error`` and the row's largest
    value of ``expected``, plus ``original_error`` once more. ``original_max_abs`` is
    ``original_error``."""
    actual, expected, settled = _comparable(name, actual, expected)
    if settled is not None:
        return settled
    a, b = actual.detach().double(), expected.detach().double()
    if not math.isfinite(float(b.sum())):
        return Difference(name, float("nan"), float("nan"), True, "", f"the original's {name} holds NaN or infinity",
                          actual.numel(), original_error)
    difference = torch.nan_to_num_((a - b).abs_(), nan=float("inf"))
    difference_rows = _rows(difference).amax(1)
    scale_rows = _rows(b.abs()).amax(1)
    tolerance_dtype = _tolerance_dtype(expected)
    allowed = error_budget(original_error, scale_rows, tolerance_dtype) + original_error
    max_abs = float(difference.max())
    row, max_rel, tolerance = _verdict(difference_rows, allowed, max_abs, float(scale_rows.max()), tolerance_dtype)
    within, failure = row is None, ""
    if not within:
        failure = (f"{name} differs from the original's by {float(difference_rows[row]):.3g} (row {row} of "
                   f"{len(difference_rows)}), where the original's own error against the float64 truth is "
                   f"{original_error:.3g}; the {_dtype_label(tolerance_dtype, expected)} bar is "
                   f"{ERROR_FACTOR + 1:g} x the original's error + {tolerance['atol']:g} + {tolerance['rtol']:g} x "
                   f"the row's largest value = {float(allowed[row]):.3g}")
    return Difference(name, max_abs, max_rel, within, failure, "", actual.numel(), original_error)


def compare(name: str, actual: Optional[Tensor], expected: Optional[Tensor], *, normwise: bool = False) -> Difference:
    """Compare with docs/design.md's tolerance for ``expected``'s dtype (under autocast: the
    region's, see :func:`_tolerance_dtype`): element by element
    (``|a - b| <= atol + rtol * |b|``), or with ``normwise`` against the tensor's scale
    (``max |a - b| <= atol + rtol * max |b|``). Gradients are sums over every token; an
    element whose terms nearly cancel carries the summation-order noise of the whole
    sum, which grows with the number of tokens, so gradients are compared normwise."""
    actual, expected, settled = _comparable(name, actual, expected)
    if settled is not None:
        return settled
    a, b = actual.detach().double(), expected.detach().double()
    # NaN == NaN would make a broken twin agree with a broken original.
    inconclusive = "" if bool(torch.isfinite(b).all()) else f"the original's {name} holds NaN or infinity"
    tolerance_dtype = _tolerance_dtype(expected)
    tolerance = TOLERANCES.get(tolerance_dtype, TOLERANCES[torch.float32])
    both_nan = torch.isnan(a) & torch.isnan(b)
    error = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    max_abs = float(error.max())
    scale = float(b.abs().nan_to_num(0.0).max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    dtype = _dtype_label(tolerance_dtype, expected)
    if normwise:
        allowed = tolerance["atol"] + tolerance["rtol"] * scale
        within = max_abs <= allowed and not bool(torch.isnan(a).ne(torch.isnan(b)).any())
        rule = (f"the {dtype} tolerance allows {allowed:.3g} ({tolerance['atol']:g} + {tolerance['rtol']:g} "
                f"x max |value|)")
    else:
        within = bool(torch.allclose(a, b, equal_nan=True, **tolerance))
        rule = f"the {dtype} tolerance allows {tolerance['atol']:g} + {tolerance['rtol']:g} x |value| per element"
    failure = "" if within else (
        f"{name} differs from the original's by up to {max_abs:.3g} ({max_rel:.3g} of its largest value); {rule}")
    return Difference(name, max_abs, max_rel, within, failure, inconclusive, actual.numel())


@dataclass(frozen=True)
class ProbeResult:
    """The verdict of one probe: the twin's worst output and gradient errors (against the
    float64 truth, or against the original where ``truth`` says why there is none), the
    original's own where there is a truth, and why it failed or proved nothing when it did."""

    passed: bool
    output_max_abs: float
    output_max_rel: float
    grad_max_abs: Optional[float]
    grad_max_rel: Optional[float]
    reason: str = ""
    # Set when the probe compared nothing (see :func:`inconclusive_reason`); ``passed`` is then False.
    inconclusive: str = ""
    original_output_max_abs: Optional[float] = None
    original_grad_max_abs: Optional[float] = None
    # "float64", or why the original could not run in float64 (the twin was then compared with it).
    truth: str = "float64"


def _argument_names(fn: Callable, inputs: ProbeInputs) -> list[str]:
    try:
        parameters = list(inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = []
    for index in range(len(inputs.args)):
        if index < len(parameters) and parameters[index].kind in (
                inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameters[index].name)
        else:
            names.append(f"arg{index}")
    return names


def _prepared(inputs: ProbeInputs, names: list[str],
              constant: frozenset) -> tuple[ProbeInputs, list[tuple[str, Tensor]]]:
    """Fresh copies of the inputs; floating tensors not named constant require grad."""
    differentiable: list[tuple[str, Tensor]] = []

    def prepare(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            copy = value.detach().clone()
            top_level = name.split("[")[0]
            if top_level not in constant and "mask" not in top_level and copy.is_floating_point():
                copy.requires_grad_(True)
                differentiable.append((name, copy))
            return copy
        if isinstance(value, (tuple, list)):
            return type(value)(prepare(f"{name}[{i}]", v) for i, v in enumerate(value))
        return value

    args = tuple(prepare(name, value) for name, value in zip(names, inputs.args))
    kwargs = {name: prepare(name, value) for name, value in inputs.kwargs.items()}
    return ProbeInputs(args, kwargs), differentiable


def prepare(original: Callable, inputs: ProbeInputs,
            constant: frozenset) -> tuple[ProbeInputs, list[tuple[str, Tensor]]]:
    """Fresh copies of ``inputs`` for one call, and the differentiable ones among them:
    floating tensors not named constant, named as ``original``'s signature names them
    (the same names serve its fused twin, which may take ``*args, **kwargs``)."""
    return _prepared(inputs, _argument_names(original, inputs), constant)


def forward_backward(fn: Callable, prepared: ProbeInputs, differentiable: list[tuple[str, Tensor]],
                     parameters: list[tuple[str, nn.Parameter]], select: Callable[[Any], list[Tensor]]):
    """Outputs of ``fn``, and gradients of a fixed random linear function of them w.r.t.
    the differentiable inputs and ``parameters`` (``None`` where unused)."""
    with torch.enable_grad():
        outputs = select(call_with(fn, prepared))
        targets = [t for t in outputs if t.requires_grad]
        if not targets:
            return outputs, []
        generator = torch.Generator(device="cpu").manual_seed(UPSTREAM_SEED)
        total = sum((t.float() * torch.randn(t.shape, generator=generator).to(t.device)).sum() for t in targets)
        leaves = [tensor for _, tensor in differentiable + parameters]
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return outputs, list(grads)


def _float64_truth(original: Callable, inputs: ProbeInputs, constant: frozenset,
                   parameters: list[tuple[str, nn.Parameter]], select: Callable[[Any], list[Tensor]],
                   roots: Sequence[nn.Module], grouped_mm: bool = False):
    """Outputs and gradients of ``original`` run in float64 (see :mod:`.truth`), or
    ``(None, None, why not)``."""
    try:
        with float64_run(roots, grouped_mm=grouped_mm) as stand_in:
            wide = ProbeInputs(to_float64(inputs.args), to_float64(inputs.kwargs))
            prepared, names = prepare(original, wide, constant)
            wide_parameters = [(name, stand_in(parameter)) for name, parameter in parameters]
            outputs, grads = forward_backward(original, prepared, names, wide_parameters, select)
    except Exception as error:  # noqa: BLE001 - the verdict falls back to comparing with the original
        return None, None, f"the original does not run in float64 ({type(error).__name__}: {error})"
    return [t.detach() for t in outputs], [None if g is None else g.detach() for g in grads], ""


# The second float32 computation of a whole-model probe's original (:func:`rerounded_gradient`)
# draws its changes to the head's gradient from this seed.
REROUNDING_SEED = 1


def rerounded_gradient(fn: Callable, module: nn.Module) -> Callable:
    """``fn`` with the gradient that flows back into ``module``'s output rounded differently:
    each element multiplied by ``1 + u x eps`` (``u`` uniform in [-1, 1], seeded; ``eps`` the
    gradient dtype's machine epsilon), a rounding or two away from the gradient ``fn``
    computes itself, as any other correct computation of that output's gradient (a
    different summation order, a chunked or fused loss) would be. Everything upstream of
    ``module`` then runs its backward on a gradient as valid as the first: a second float32
    computation of the same math, whose error against the truth is the original's own error
    measured twice."""
    def rerounded(grad: Tensor) -> Tensor:
        generator = torch.Generator(device=grad.device).manual_seed(REROUNDING_SEED)
        u = torch.rand(grad.shape, generator=generator, device=grad.device, dtype=torch.float32)
        return (grad.float() * u.mul_(2 * torch.finfo(grad.dtype).eps).add_(1 - torch.finfo(grad.dtype).eps)).to(
            grad.dtype)

    def hook(_module, _args, output):
        if isinstance(output, Tensor) and output.requires_grad and output.is_floating_point():
            output.register_hook(rerounded)

    def run(*args, **kwargs):
        handle = module.register_forward_hook(hook)
        try:
            return fn(*args, **kwargs)
        finally:
            handle.remove()

    return run


def probe(original: Callable, fused: Callable, inputs: ProbeInputs, parameters: list[tuple[str, nn.Parameter]],
          constant: frozenset, select: Optional[Callable[[Any], list[Tensor]]] = None,
          truth_roots: Sequence[nn.Module] = (), whole_model_head: Optional[nn.Module] = None) -> ProbeResult:
    """Judge ``fused`` against ``original`` on ``inputs`` (see the module doc; the caller
    holds :func:`quiet_state`). ``truth_roots``: the modules whose parameters and buffers
    the float64 run of ``original`` holds in float64 (none: compare with the original).

    ``whole_model_head``: the head of a whole-model probe (the LM head + loss, whose twin
    replaces the model's forward and shares its whole body with the original). Each
    parameter's gradient then comes back through every layer of the body, whose float32
    backward (a saturated softmax's cancellation, most of all) turns any rounding-sized
    change of the head's gradient into an error of the size of the original's own: a row
    of a weight gradient, a sum over a few tokens of one output feature's errors, holds one
    random draw of it (measured on real-like Gemma 4, OLMo 3 and LFM2: the original with
    its head's gradient rounded differently missed its own row bar by up to 8x). So
    gradients are judged over the whole tensor, whose largest error is a maximum over every
    row, and the original's error is measured twice, the second time with its head's
    gradient rounded differently (:func:`rerounded_gradient`), the bar taking the larger."""
    select = select or output_tensors
    prepared, names = prepare(original, inputs, constant)
    expected, expected_grads = forward_backward(original, prepared, names, parameters, select)
    prepared, fused_names = prepare(original, inputs, constant)
    actual, actual_grads = forward_backward(fused, prepared, fused_names, parameters, select)
    if len(actual) != len(expected):
        return ProbeResult(False, float("inf"), float("inf"), None, None,
                           f"returns {len(actual)} tensor(s) where the original returns {len(expected)}")
    truth, truth_grads, no_truth = (None, None, "no float64 run was asked for") if not truth_roots else \
        _float64_truth(original, inputs, constant, parameters, select, truth_roots, whole_model_head is not None)
    if truth is not None and len(truth) != len(expected):
        truth, truth_grads, no_truth = None, None, "the original's float64 run returns other outputs"
    again, again_grads = [None] * len(expected), [None] * len(expected_grads)
    if truth is not None and whole_model_head is not None:
        prepared, again_names = prepare(original, inputs, constant)
        again, again_grads = forward_backward(rerounded_gradient(original, whole_model_head), prepared, again_names,
                                              parameters, select)
        again, again_grads = _padded(again, len(expected)), _padded(again_grads, len(expected_grads))

    def verdict(name: str, a: Optional[Tensor], e: Optional[Tensor], true: Optional[Tensor], e_again: Optional[Tensor],
                gradient: bool):
        if truth is None or true is None:
            return compare(name, a, e, normwise=gradient)
        return judge(name, a, e, true, expected_again=e_again, whole_tensor=gradient and whole_model_head is not None)

    output_names = [f"output {i}" if len(expected) > 1 else "output" for i in range(len(expected))]
    outputs = [verdict(name, a, e, None if truth is None else truth[i], again[i], False)
               for i, (name, a, e) in enumerate(zip(output_names, actual, expected))]
    grad_names = [f"grad of input {name}" for name, _ in names] + [f"grad of {name}" for name, _ in parameters]
    grads = [verdict(name, a, e, None if truth_grads is None else truth_grads[i], again_grads[i], True)
             for i, (name, a, e) in enumerate(zip(grad_names, actual_grads, expected_grads))]
    failures = [d for d in outputs + grads if not d.within_tolerance]
    worst_out = max(outputs, key=lambda d: d.max_abs, default=Difference("output", 0.0, 0.0, True))
    worst_grad = max(grads, key=lambda d: d.max_abs, default=None)
    vacuous = inconclusive_reason(outputs, grads)
    reason = failures[0].failure if failures else (f"probe inconclusive: {vacuous}" if vacuous else "")
    return ProbeResult(not failures and not vacuous, worst_out.max_abs, worst_out.max_rel,
                       None if worst_grad is None else worst_grad.max_abs,
                       None if worst_grad is None else worst_grad.max_rel, reason, vacuous,
                       _largest(d.original_max_abs for d in outputs), _largest(d.original_max_abs for d in grads),
                       "float64" if truth is not None else no_truth)


def _padded(values: list, length: int) -> list:
    return (list(values) + [None] * length)[:length]


def _largest(values) -> Optional[float]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def inconclusive_reason(outputs: list[Difference], others: Sequence[Difference] = ()) -> str:
    """Why comparisons of these outputs (and gradients) prove nothing, or ``""``: no
    output element was compared, or a value of the original is NaN or infinite (where a
    broken twin could agree with a broken original)."""
    if sum(d.elements for d in outputs) == 0:
        return "the original's output has no elements" if outputs else "the original returned no tensor"
    return next((d.inconclusive for d in [*outputs, *others] if d.inconclusive), "")


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters that take gradients, by name (for the probe's messages)."""
    return [(name, parameter) for name, parameter in module.named_parameters() if parameter.requires_grad]
