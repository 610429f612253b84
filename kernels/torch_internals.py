"""Every private torch API te_lab uses, in one place: a torch upgrade that moves one breaks
here first, and ``tests/test_torch_internals.py`` exercises each entry on the installed
torch (CI runs it on every torch of its matrix).

Nothing else in te_lab imports from ``torch._*`` or reads a private attribute of torch;
``tests/test_torch_internals.py`` checks that too. (ATen's private operators, called as
``torch.ops.aten._name`` by the ``native`` backends, are operators with schemas, not Python
API, and stay where they are used: :func:`te_lab.kernels.registry.aten_kernel_exists` asks
whether this torch build has them; so are ``torch._foreach_*`` and ``torch._fused_adamw_``.)

Where an entry may be missing from an older torch, it has a fallback that keeps te_lab
correct (slower, or with a check skipped), and says so.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

# ---- the dispatcher ----

#: An operator overload (``torch.ops.te_lab.rms_norm.default``): type annotations only.
OpOverload = torch._ops.OpOverload


# The entries on te_lab's per-call path are torch's own callables, not wrappers: an eager
# call pays no extra Python frame for reaching them through this module.

#: ``with below_autograd():`` a block whose dispatches skip the autograd keys (as an
#: autograd kernel's own redispatch does).
below_autograd = torch._C._AutoDispatchBelowAutograd
#: The keys an autograd kernel redispatches its op with: ``keyset & AFTER_AUTOGRAD_KEYS``.
AFTER_AUTOGRAD_KEYS = torch._C._after_autograd_keyset


def has_kernel(qualified_name: str, dispatch_key: str) -> bool:
    """Whether op ``qualified_name`` (``"aten::_fused_rms_norm"``, ``"te_lab::rms_norm.cpp"``)
    has a kernel at ``dispatch_key`` (``"CPU"``, ``"AutocastCUDA"``); raises RuntimeError for
    an unknown op."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified_name, dispatch_key))


@functools.lru_cache(maxsize=None)
def argument_names(qualified_name: str) -> tuple[str, ...]:
    """The names of operator ``qualified_name``'s arguments (``"te_lab::rms_norm"``, the
    default overload; ``"te_lab::rms_norm.cpp"``), in schema order."""
    namespace, _, name = qualified_name.partition("::")
    packet, _, overload = name.partition(".")
    schema = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")._schema
    return tuple(argument.name for argument in schema.arguments)


# ---- modes, autocast and the profiler, as the per-call path asks about them ----

#: How many ``TorchDispatchMode``s (fake tensors, a FLOP counter, a checkpointing policy)
#: are on the stack: 0 for none.
dispatch_modes_active: Callable[[], int] = torch._C._len_torch_dispatch_stack
#: Whether a ``TorchFunctionMode`` is active.
function_modes_active: Callable[[], bool] = torch._C._is_torch_function_mode_enabled


#: Whether autocast is on for any device type (one C call where torch has it).
any_autocast_enabled: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(device_type) for device_type in ("cpu", "cuda")))


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording now."""
    return torch.autograd.profiler._is_profiler_enabled


_fast_region = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)


def profiler_region(name: str) -> contextlib.AbstractContextManager:
    """A labelled region in profiler traces, as ``torch.profiler.record_function(name)``
    records it, at about a sixth of its cost inside the region (measured on the 2-core CPU:
    1.4 us against 7.8-20 us around an empty module): the C++ context manager torch.compile
    uses, where torch has it; ``record_function`` otherwise."""
    return _fast_region(name) if _fast_region is not None else torch.profiler.record_function(name)


# ---- autograd's engine ----

_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward_pass() -> bool:
    """Whether a backward pass is running on this thread (a forward recomputed under
    activation checkpointing runs inside one); False where this torch cannot tell."""
    return _graph_task_id is not None and _graph_task_id() != -1


def backward_keeps_graph() -> Optional[bool]:
    """Inside a backward pass: whether it keeps the graph for another (``retain_graph`` or
    ``create_graph``); None where this torch cannot tell (callers then assume it may)."""
    return None if _keeps_graph is None else bool(_keeps_graph())


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished (called from inside it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensor hooks may be active (True where this torch cannot tell)."""
    return getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)()


# ---- torch.compile ----

#: Tells the compiler a fact about a (symbolic) size: ``check(count >= 0)``.
check = torch._check


def capturing_scalar_outputs() -> contextlib.AbstractContextManager:
    """torch.compile traces ``.tolist()`` and ``.item()`` into the graph (data-dependent
    sizes) instead of breaking it."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True)


# ---- Inductor, for the inductor backend's direct lowering (kernels/inductor_compiled.py) ----

def lowering_api():
    """(compile_fx_inner, select_decomp_table): Inductor's graph compiler and the
    decompositions torch.compile traces with."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    return compile_fx_inner, select_decomp_table


def no_duck_shapes() -> contextlib.AbstractContextManager:
    """Symbolic tracing in which two sizes equal on the first call stay two sizes."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False)


def fake_mode_of(fake_tensors: list):
    """The fake mode of ``fake_tensors`` (a traced graph's placeholder values)."""
    return torch._guards.detect_fake_mode(fake_tensors)


def tracing(fake_mode) -> contextlib.AbstractContextManager:
    """The tracing context Inductor expects around a compile, on ``fake_mode``."""
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))


def compile_counters() -> dict:
    """torch.compile's counters (``["frames"]["ok"]``, ``["inductor"][...]``)."""
    from torch._dynamo.utils import counters

    return counters


# ---- fake tensors and dispatch modes (the benchmarks' cost recorder) ----

#: Tensors with shapes, dtypes and devices but no data.
FakeTensorMode = torch._subclasses.fake_tensor.FakeTensorMode
#: The base class of a mode that sees every dispatched op.
TorchDispatchMode = torch.utils._python_dispatch.TorchDispatchMode
