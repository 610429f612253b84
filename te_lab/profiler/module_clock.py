"""Modules' wall times inside a plain step, by hooks, without the profiler: where
:func:`te_lab.profile` takes its CPU module times from (:mod:`.assembly`).

- Forward: a forward pre-hook and a forward hook on the module, from one to the other.
  A forward that runs inside a backward pass (recomputed under activation checkpointing)
  is not counted as forward: it runs inside the backward's span.
- Backward: the autograd nodes the module's forward made (found from its outputs' nodes
  back to its inputs' nodes and the parameters' gradient accumulators), from the first
  of them starting to the last of them ending, the engine's gaps between them included.
  The CPU's autograd engine runs ready nodes highest sequence number first, so the
  module's nodes, numbered in a row by its forward, run one after another from the
  highest-numbered (a pre-hook on it) to the lowest-numbered (a post-hook on it).

A module pays four hook calls a step (a few us; a hook on every node of an attention
block, called from the engine, added 10-15% to it). The profiler instead pays for every
op, autograd node and region it records, and by no single cost per event: 0.26 us for an
ATen op called in a loop, 1.5-2 us for those of te_lab's fused RMSNorm (measured on the
2-core CPU, the norm alone with and without the profiler), so a profiled module's time,
less any one per-event cost, stays off by up to 10% for the modules densest in events.
What the hooks spend (finding the module's autograd nodes after its forward is most of
it) lies outside the modules' times but inside the step: :attr:`ModuleClock.hooks_ms`
says how much, so a module's share of the step is taken of the step without it.
"""

from __future__ import annotations

import time

from torch import nn

from te_lab.inputs import output_tensors
from te_lab.kernels.torch_internals import in_backward_pass


def _nodes_made(outputs: list, inputs: list) -> list:
    """The autograd nodes between ``outputs`` and ``inputs`` (the module's own)."""
    boundary = {t.grad_fn for t in inputs if t.grad_fn is not None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None and t.grad_fn not in boundary]
    seen = set(stack)
    while stack:
        node = stack.pop()
        for parent, _ in node.next_functions:
            if parent is None or parent in seen or parent in boundary or type(parent).__name__ == "AccumulateGrad":
                continue
            seen.add(parent)
            stack.append(parent)
    return list(seen)


class ModuleClock:
    """While active, times each module of ``modules`` (key -> module) in the steps that
    run: :meth:`take` returns key -> (forward ms, backward ms) of the last step, sets
    :attr:`hooks_ms` to what the hooks themselves spent in it, and starts over. A module
    called more than once in a step has its calls' times summed."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self._handles = []
        self._forward_start: dict[str, list] = {}  # a stack per key: a module may run inside itself
        self._forward_ms: dict[str, float] = {}
        self._backward: dict[str, list] = {}  # key -> [first node's start, last node's end] per call
        self._inputs: dict[str, list] = {}
        self._hooks_s = 0.0  # time inside the hooks since the last take
        self.hooks_ms = 0.0

    def __enter__(self) -> "ModuleClock":
        for key, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._entered(key), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._left(key), with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _entered(self, key: str):
        def hook(_module, args, kwargs):
            entered = time.perf_counter()
            if in_backward_pass():
                return
            self._inputs[key] = [t for t in output_tensors((args, kwargs)) if t.requires_grad]
            start = time.perf_counter()
            self._forward_start.setdefault(key, []).append(start)
            self._hooks_s += start - entered
        return hook

    def _left(self, key: str):
        def hook(_module, _args, _kwargs, output):
            now = time.perf_counter()
            if in_backward_pass() or not self._forward_start.get(key):
                return
            self._forward_ms[key] = self._forward_ms.get(key, 0.0) + (now - self._forward_start[key].pop()) * 1e3
            outputs = [t for t in output_tensors(output) if t.requires_grad]
            nodes = _nodes_made(outputs, self._inputs.pop(key, []))
            if nodes:
                span = [float("inf"), float("-inf")]
                self._backward.setdefault(key, []).append(span)

                def started(_grad_outputs):
                    span[0] = min(span[0], time.perf_counter())

                def ended(_grad_inputs, _grad_outputs):
                    span[1] = max(span[1], time.perf_counter())

                ordered = sorted(nodes, key=lambda node: node._sequence_nr())
                ordered[-1].register_prehook(started)
                ordered[0].register_hook(ended)
            self._hooks_s += time.perf_counter() - now
        return hook

    def take(self) -> dict[str, tuple[float, float]]:
        times = {}
        for key in self.modules:
            spans = [s for s in self._backward.get(key, []) if s[1] >= s[0]]
            times[key] = (self._forward_ms.get(key, 0.0), sum(end - start for start, end in spans) * 1e3)
        self._forward_ms.clear()
        self._backward.clear()
        self._forward_start.clear()
        self.hooks_ms, self._hooks_s = self._hooks_s * 1e3, 0.0
        return times


def own_times(times: dict[str, tuple[float, float]], modules: dict[str, nn.Module]) -> dict:
    """``times`` (key -> (forward, backward) ms, each module's whole) less what the keyed
    modules nested in each spent, as the profile charges a region (nested regions left
    out): key -> (forward, backward) ms of its own."""
    inside = {key: {id(m) for m in module.modules() if m is not module} for key, module in modules.items()}
    own = dict(times)
    for key in modules:
        nested = [other for other in modules if other != key and id(modules[other]) in inside[key]]
        # only the outermost of the nested ones: theirs already hold what nests deeper
        outermost = [n for n in nested if not any(id(modules[n]) in inside[o] for o in nested if o != n)]
        forward, backward = times[key]
        own[key] = (forward - sum(times[n][0] for n in outermost), backward - sum(times[n][1] for n in outermost))
    return own
