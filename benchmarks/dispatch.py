"""The dispatch benchmark: what a te_lab op costs per call above its own kernels.

    python -m te_lab.benchmarks.dispatch [--sizes 64x64] [--rounds 15] [--calls 20]

At small sizes (64 tokens x 64 hidden by default, where a notebook's tiny model lives)
a fused op's time is mostly what it costs to get to its kernels: argument checks,
backend selection, the autograd Function, the op's registration. For each op case,
forward and backward together, four contenders are timed interleaved (each sample the
mean of ``calls`` calls):

- ``te_lab``: the public op, automatic backend, forward and the gradients of every input;
- ``kernels``: the same work with nothing around it: each te_lab op's implementation
  called directly with the arguments the op gave it in one recorded real call (forward
  and backward ops alike);
- ``autograd``: autograd's round trip for the same inputs with no math (the gradient of
  a view of each), which eager code pays too, once per backward pass, whatever its ops;
- ``eager``: the model code the op replaces.

``overhead per call`` = (te_lab - kernels - autograd) / the number of te_lab op calls one
step makes: the per-call, per-direction cost above the op's own kernel time.

Generation calls the ops without gradients, and a decode step on one row per sequence,
where what a call costs around its kernels is all there is: each op also has a
``prefill`` row (the forward alone, no gradients, at ``PREFILL_TOKENS`` rows) and a
``decode`` row (the same at one row), timed the same way without the autograd contender
(overhead per call = (te_lab - kernels) / calls). Their automatic choice is the one for
calls without gradients (``te_lab.kernels.registry.training_call``). Where the
suite's case wraps the op in work that is no te_lab op (``linear_act``'s GEMM around
``bias_act``), the case here is the op alone (``cases.DISPATCH_CASES``): the replay
would leave that work out and count it as overhead.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from te_lab.kernels import custom_ops, registered_ops, select_backend

from .cases import OP_CASES, OPTIMIZER_OPS, OpCase, Size, op_cases
from .harness import Contender, Sampling, interleaved, op_contender, upstream_gradients
from .op_calls import automatic_backend, recording_op_calls
from .stats import speedup

DEFAULT_SIZE = Size(64, 64)
# The smallest whole heads of 128: attention's q/k/v, RoPE's GQA 4:1 k.
SMALLEST = {"attention": Size(64, 128), "rope": Size(64, 512)}
CONTENDERS = ("te_lab", "kernels", "autograd", "eager")
PHASES = ("training", "prefill", "decode")
PREFILL_TOKENS = 128


def recorded_kernels(fused: Callable, inputs: tuple,
                     upstream: Optional[list]) -> list[tuple[custom_ops.CustomOp, tuple]]:
    """The te_lab op calls one forward+backward step of ``fused`` makes (a forward without
    gradients where ``upstream`` is None), with their arguments; after a first step
    unrecorded, which may measure an automatic choice, running every candidate."""
    step = (_without_gradients(fused, inputs) if upstream is None
            else op_contender("te_lab", fused, inputs, "forward+backward", upstream).step)
    step()
    calls: list = []
    with recording_op_calls(calls):
        step()
    return calls


def _without_gradients(fn: Callable, inputs: tuple) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return fn(*inputs)
    return run


def _engine_step(inputs: tuple) -> Callable[[], object]:
    """Autograd's round trip for ``inputs`` with no math: the gradient of a view of each.
    Eager code and te_lab pay it once per backward pass, whatever its ops."""
    views = lambda: tuple(x.view_as(x) for x in inputs)  # noqa: E731
    ones = [torch.ones_like(x) for x in inputs]
    return lambda: torch.autograd.grad(views(), inputs, ones)


def _kernels_step(calls: list) -> Callable[[], None]:
    def run():
        with torch.no_grad():
            for op, args in calls:
                op.__wrapped__(*args)
    return run


@dataclass
class DispatchResult:
    case: str
    size: Size
    backend: str
    calls: int
    median_us: dict
    te_lab_vs_eager: Optional[dict]
    phase: str = "training"

    @property
    def overhead_per_call_us(self) -> Optional[float]:
        """(te_lab - kernels - autograd's round trip, where timed) / te_lab op calls."""
        if not self.calls:
            return None
        us = self.median_us
        return (us["te_lab"] - us["kernels"] - us.get("autograd", 0.0)) / self.calls


def run_case(case: OpCase, size: Size, device: torch.device, *, rounds: int, calls: int,
             phase: str = "training") -> DispatchResult:
    """``case`` timed as a training call (forward and backward) or, for ``prefill`` and
    ``decode``, as a forward without gradients."""
    fused = lambda *inputs: case.fused(*inputs, backend=None)  # noqa: E731 - the automatic choice
    training = phase == "training"
    if training:
        upstream = upstream_gradients(fused, case.inputs)
        contenders = [op_contender("te_lab", fused, case.inputs, "forward+backward", upstream),
                      Contender("autograd", _engine_step(case.inputs)),
                      op_contender("eager", case.baseline, case.inputs, "forward+backward", upstream)]
    else:
        upstream = None
        contenders = [Contender("te_lab", _without_gradients(fused, case.inputs)),
                      Contender("eager", _without_gradients(case.baseline, case.inputs))]
    recorded = recorded_kernels(fused, case.inputs, upstream)
    contenders.insert(1, Contender("kernels", _kernels_step(recorded)))
    timings, _ = interleaved(contenders, device, rounds=rounds, warmup=3, sampling=Sampling(calls=calls))
    ratio = speedup(timings["te_lab"], timings["eager"])
    backend = (automatic_backend(case, device, training=training)
               or select_backend(registered_ops()[case.op], device))
    return DispatchResult(case.name, size, backend, len(recorded),
                          {name: timing.median_ms * 1000 for name, timing in timings.items()},
                          {"value": ratio.value, "interval_low": ratio.interval_low,
                           "interval_high": ratio.interval_high}, phase)


def run(device: torch.device, sizes: Optional[tuple[Size, ...]] = None, *, rounds: int = 15, calls: int = 20,
        dtype: torch.dtype = torch.float32, phases: tuple[str, ...] = PHASES,
        progress=lambda _: None) -> list[DispatchResult]:
    """Every op case at ``sizes`` (default: 64 x 64, or the op's smallest legal size) in
    each of ``phases``: training at those sizes; prefill at ``PREFILL_TOKENS`` rows and
    decode at one, of the same width."""
    results = []
    for op in OP_CASES:
        if op in OPTIMIZER_OPS:
            continue
        for size in sizes or (SMALLEST.get(op, DEFAULT_SIZE),):
            for phase in phases:
                shape = {"training": size, "prefill": Size(PREFILL_TOKENS, size.hidden),
                         "decode": Size(1, size.hidden)}[phase]
                for case in op_cases(op, device, dtype, shape, dispatch=True):
                    progress(f"dispatch: {case.name} {shape} {phase}")
                    results.append(run_case(case, shape, device, rounds=rounds, calls=calls, phase=phase))
    return results


def as_record(result: DispatchResult) -> dict:
    return {"case": result.case, "phase": result.phase, "tokens": result.size.tokens, "hidden": result.size.hidden,
            "backend": result.backend, "te_lab_op_calls": result.calls, "median_us": result.median_us,
            "overhead_per_call_us": result.overhead_per_call_us, "te_lab_vs_eager": result.te_lab_vs_eager}


def markdown(records: list[dict]) -> list[str]:
    """The dispatch table (records as :func:`as_record` writes them)."""
    lines = ["| case | phase | size | backend | te_lab us | kernels alone us | autograd round trip us | eager us | "
             "te_lab op calls | overhead per call us | te_lab vs eager |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        us = r["median_us"]
        overhead = "-" if r["overhead_per_call_us"] is None else f"{r['overhead_per_call_us']:.1f}"
        autograd = "-" if "autograd" not in us else f"{us['autograd']:.1f}"
        ratio = r["te_lab_vs_eager"]
        lines.append(f"| {r['case']} | {r.get('phase', 'training')} | {r['tokens']}x{r['hidden']} | {r['backend']} | "
                     f"{us['te_lab']:.1f} | "
                     f"{us['kernels']:.1f} | {autograd} | {us['eager']:.1f} | {r['te_lab_op_calls']} | "
                     f"{overhead} | "
                     f"{ratio['value']:.2f}x [{ratio['interval_low']:.2f}-{ratio['interval_high']:.2f}] |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.benchmarks.dispatch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help="comma-separated TOKENSxHIDDEN sizes (default: 64x64, "
                        "or the smallest each op takes: whole heads of 128)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed sample")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    args = parser.parse_args(argv)
    phases = tuple(name.strip() for name in args.phases.split(",") if name.strip())
    if not phases or set(phases) - set(PHASES):
        print(f"te_lab.benchmarks.dispatch: --phases: got {args.phases!r}; expected a comma-separated subset of "
              f"{','.join(PHASES)}", file=sys.stderr)
        return 2
    try:
        sizes = None if args.sizes is None else tuple(Size.parse(t) for t in args.sizes.split(",") if t.strip())
    except ValueError as error:
        print(f"te_lab.benchmarks.dispatch: --sizes: {error}", file=sys.stderr)
        return 2
    for option in ("rounds", "calls"):
        if getattr(args, option) < 1:
            print(f"te_lab.benchmarks.dispatch: --{option}: got {getattr(args, option)}; expected a positive int",
                  file=sys.stderr)
            return 2
    results = run(torch.device("cpu"), sizes, rounds=args.rounds, calls=args.calls, phases=phases,
                  progress=lambda message: print(message, file=sys.stderr, flush=True))
    print("\n".join(markdown([as_record(result) for result in results])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
