"""Modules' wall times inside a plain training step, by hooks, without the profiler: the
ground truth the profile's module figures claim to be (:mod:`.module_alone` compares them).

- Forward: a forward pre-hook and a forward hook on the module, from one to the other.
- Backward: the autograd nodes the module's forward made (found from its outputs' nodes
  back to its inputs' nodes and the parameters' gradient accumulators), from the first
  of them starting to the last of them ending, the engine's gaps between them included
  (the profile counts a module's backward alike). The CPU's autograd engine runs ready
  nodes highest sequence number first, so the module's nodes, numbered in a row by its
  forward, run one after another from the highest-numbered (a pre-hook on it) to the
  lowest-numbered (a post-hook on it).

A module pays four hook calls a step (a few us; a hook on every node of an attention
block, called from the engine, added 10-15% to it), where the profiler pays 0.3-0.5 us
for every op, autograd node and region it records. What the hooks spend (finding the
module's autograd nodes after its forward is most of it) lies outside the modules' times
but inside the step: :attr:`InStepTimes.hooks_ms` says how much, so a module's share of
the step can be taken of the step without it.
"""

from __future__ import annotations

import time

from torch import nn

from te_lab.inputs import output_tensors


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


class InStepTimes:
    """While active, times each module of ``modules`` (path -> module) in the steps that
    run: :meth:`take` returns path -> (forward ms, backward ms) of the last step, sets
    :attr:`hooks_ms` to what the hooks themselves spent in it, and starts over. A module
    called more than once in a step has its calls' times summed."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self._handles = []
        self._forward_start: dict[str, float] = {}
        self._forward_ms: dict[str, float] = {}
        self._backward: dict[str, list] = {}  # path -> [first node's start, last node's end] per call
        self._inputs: dict[str, list] = {}
        self._hooks_s = 0.0  # time inside the hooks since the last take
        self.hooks_ms = 0.0

    def __enter__(self) -> "InStepTimes":
        for path, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._entered(path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._left(path), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _entered(self, path: str):
        def hook(_module, args, kwargs):
            entered = time.perf_counter()
            self._inputs[path] = [t for t in output_tensors((args, kwargs)) if t.requires_grad]
            self._forward_start[path] = time.perf_counter()
            self._hooks_s += self._forward_start[path] - entered
        return hook

    def _left(self, path: str):
        def hook(_module, _args, _kwargs, output):
            now = time.perf_counter()
            self._forward_ms[path] = self._forward_ms.get(path, 0.0) + (now - self._forward_start[path]) * 1e3
            outputs = [t for t in output_tensors(output) if t.requires_grad]
            nodes = _nodes_made(outputs, self._inputs.pop(path, []))
            if not nodes:
                self._hooks_s += time.perf_counter() - now
                return
            span = [float("inf"), float("-inf")]
            self._backward.setdefault(path, []).append(span)

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
        for path in self.modules:
            spans = [s for s in self._backward.get(path, []) if s[1] >= s[0]]
            times[path] = (self._forward_ms.get(path, 0.0), sum(end - start for start, end in spans) * 1e3)
        self._forward_ms.clear()
        self._backward.clear()
        self.hooks_ms, self._hooks_s = self._hooks_s * 1e3, 0.0
        return times
