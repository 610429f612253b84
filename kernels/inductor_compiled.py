"""The ``inductor`` backend's building block: a reference function compiled by Inductor
into a C++ (CPU) or Triton (GPU) kernel, called without torch.compile's per-call machinery.

A function compiled by ``torch.compile`` pays, on every call, for Dynamo's frame entry
and guards and for AOTAutograd's runtime wrappers: about 110 us per call on a 2-core CPU,
more than an RMSNorm over 256 x 256 costs in eager. The fused ops call their compiled
math below autograd, on detached tensors of a known layout, so none of that is needed:
the function is traced once per specialisation into an ATen graph with symbolic sizes
(``make_fx``), lowered by Inductor (``compile_fx_inner``, which uses Inductor's on-disk
cache, so a later process loads the kernel instead of compiling it) and then called
straight through the generated wrapper. The graph is guarded only on what changes the
generated code: the specialisation key (dtypes, device type, which sizes are 0 or 1,
the values of non-tensor arguments) and the size relations tracing recorded, if any.

Where that lowering is unavailable (Inductor's internals move between torch releases;
te_lab supports torch >= 2.5), or fails for a function, the function runs through
``torch.compile`` instead, once warned: slower per call, the same numbers.
"""

from __future__ import annotations

import functools
import re
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import torch_internals as internals

# How each compiled function runs, by name: "direct" (traced and lowered, called without
# torch.compile's runtime) or "torch.compile" (the fallback, after a lowering failed).
# te-lab info shows it.
LOWERING: dict[str, str] = {}


def _size_class(size: int) -> int:
    """0, 1 or 2 for "two or more": tracing specialises sizes 0 and 1 to constants."""
    return size if size < 2 else 2


def _specialization(value) -> Any:
    """What a compiled graph is specialised on: tensors by dtype, device type and the class
    of each size (the sizes themselves stay symbolic), anything else by value."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device.type, tuple(_size_class(size) for size in value.shape))
    return (type(value), value)


def _flatten(output) -> tuple[list, Optional[tuple]]:
    """A math function's result (a tensor, or a tuple of tensors and Nones) as its tensors
    and where the Nones go (None for a lone tensor)."""
    if isinstance(output, torch.Tensor):
        return [output], None
    if isinstance(output, tuple) and all(item is None or isinstance(item, torch.Tensor) for item in output):
        return [item for item in output if item is not None], tuple(item is None for item in output)
    raise TypeError(f"expected a tensor or a tuple of tensors and Nones, got {type(output).__name__}")


def _unflatten(tensors, nones: Optional[tuple]):
    if nones is None:
        return tensors[0]
    leaves = iter(tensors)
    return tuple(None if none else next(leaves) for none in nones)


def _guard_function(code: Optional[str], count: int) -> Optional[Callable]:
    """The guards' expression over ``L['t<i>']`` as a function of the tensors."""
    if code is None:
        return None
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    names = [f"t{i}" for i in range(count)]
    body = re.sub(r"L\['(t\d+)'\]", r"\1", code)
    return eval(f"lambda {', '.join(names)}: {body}", dict(SYMPY_INTERP))  # noqa: S307 - torch's own guard code


@dataclass
class _Lowered:
    """One traced, lowered graph of a function and how to call it."""

    run: Callable[[list], Any]
    guards: Optional[Callable]  # of the tensors, or None when unguarded
    nones: Optional[tuple]

    def call(self, _args, tensors: list):
        # The generated wrapper empties the list it is given: a fresh one per call.
        return _unflatten(self.run(tensors), self.nones)


def _lower(fn: Callable, args: tuple, tensor_positions: list[int]) -> _Lowered:
    """Trace ``fn`` on ``args`` with symbolic sizes (the non-tensor arguments baked in) and
    lower the graph with Inductor."""
    from torch.fx.experimental.proxy_tensor import make_fx

    compile_fx_inner, select_decomp_table = internals.lowering_api()

    structure: list[Optional[tuple]] = []

    def graph(*tensors):
        full = list(args)
        for position, tensor in zip(tensor_positions, tensors):
            full[position] = tensor
        leaves, nones = _flatten(fn(*full))
        structure.append(nones)
        return tuple(leaves)

    tensors = []
    for i in tensor_positions:
        # One tensor passed twice would trace as one input: the graph would assume every
        # later call passes one tensor twice too.
        tensors.append(args[i].clone() if any(args[i] is seen for seen in tensors) else args[i])
    # No duck sizing: two sizes equal in the first call (a 64 x 64 input) must stay two sizes.
    with internals.no_duck_shapes(), torch.no_grad():
        # Decomposed as torch.compile's own tracing does: Inductor lowers only the core ops.
        gm = make_fx(graph, decomposition_table=select_decomp_table(), tracing_mode="symbolic")(*tensors)
    placeholders = [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]
    fake_mode = internals.fake_mode_of(placeholders)
    with internals.tracing(fake_mode), torch.no_grad():
        compiled = compile_fx_inner(gm, placeholders)
    # After lowering: Inductor adds guards of its own (e.g. a row short enough for one pass).
    # Static sizes too (ignore_static=False): a size the graph took as a constant is a guard.
    guards = _guard_function(fake_mode.shape_env.produce_guards_expression(placeholders, ignore_static=False),
                             len(tensors))
    direct = getattr(compiled, "current_callable", None)
    # The generated CPU wrapper takes contiguous tensors as they are. On GPUs, Inductor's
    # own entry re-aligns inputs its Triton kernels assume aligned: keep it there.
    run = direct if direct is not None and all(t.device.type == "cpu" for t in tensors) else compiled
    return _Lowered(run=run, guards=guards, nones=structure[-1])


def _torch_compiled(fn: Callable) -> Callable:
    # A fresh code object gives this specialisation its own recompile budget.
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    compiled = torch.compile(copy, dynamic=True, fullgraph=True)
    return lambda args: compiled(*args)


# Argument signatures remembered per function (a training loop repeats a few); past this
# many, new signatures are still served, by the guard check alone.
MAX_REMEMBERED_SIGNATURES = 256


def inductor_compiled(fn: Callable) -> Callable:
    """``fn`` compiled with Inductor, one graph per specialisation of its arguments (see
    the module doc); every call runs under no_grad with contiguous tensors.

    A call whose argument signature (each tensor's dtype, device and shape, every other
    argument's value) was seen before goes straight to the graph that served it; only a
    new signature pays for the specialisation key and the guard check."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    lowered: dict[tuple, list[_Lowered]] = {}
    fallback: dict[tuple, Callable] = {}
    remembered: dict[tuple, Callable[[tuple, list], Any]] = {}

    def serving(args: tuple, tensors: list) -> Callable[[tuple, list], Any]:
        """The callable that serves ``args``: a lowered graph whose guards hold, a new one,
        or the torch.compile fallback."""
        key = tuple(_specialization(arg) for arg in args)
        if key in fallback:
            return fallback[key]
        for graph in lowered.get(key, ()):
            if graph.guards is None or graph.guards(*tensors):
                return graph.call
        try:
            graph = _lower(fn, args, [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)])
        except Exception as error:  # noqa: BLE001 - any lowering failure has the same remedy
            warnings.warn(f"te_lab: {name} runs through torch.compile (slower per call): "
                          f"its direct Inductor lowering failed ({type(error).__name__}: {error})", stacklevel=3)
            LOWERING[name] = "torch.compile"
            compiled = _torch_compiled(fn)

            def through_torch_compile(args, _tensors):
                with torch.no_grad():
                    return compiled(args)

            fallback[key] = through_torch_compile
            return through_torch_compile
        LOWERING.setdefault(name, "direct")
        lowered.setdefault(key, []).append(graph)
        return graph.call

    @functools.wraps(fn)
    def run(*args):
        signature, tensors, contiguous = [], [], []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if not arg.is_contiguous():
                    arg = arg.contiguous()
                tensors.append(arg)
                signature.append((arg.dtype, arg.device, arg.shape))
            else:
                signature.append(arg)
            contiguous.append(arg)
        signature = tuple(signature)
        call = remembered.get(signature)
        if call is None:
            call = serving(tuple(contiguous), tensors)
            if len(remembered) < MAX_REMEMBERED_SIGNATURES:
                remembered[signature] = call
        return call(contiguous, tensors)

    return run
