"""The Triton launches te_lab's ops make, recorded on the CPU.

Under ``TRITON_INTERPRET=1`` every ``kernel[grid](...)`` goes through the interpreter's
``InterpretedFunction``; :func:`recording_launches` replaces its launcher for a while with one that
writes down what a GPU compile depends on (the kernel, each argument as Triton specializes
it: tensors by dtype and 16-byte alignment, integers by value, constexprs, the launch options)
and skips running the kernel, so ops run at real model sizes in seconds. The launch wrappers
are put in the state they are in on a GPU (:func:`te_lab.kernels.triton_support.standing_for_gpu`),
so what is recorded is what a GPU would compile. :mod:`.kernel_compile` compiles the records.

A record is plain JSON: ``{"kernel": "module:name", "arguments": {name: encoded}, "options":
{...}, "grid": [...], "scenarios": [labels]}``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Iterator, Optional

import torch

# Launch keywords that are options of the compile, not kernel arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
# H100/H200 SXM: the GPU whose multiprocessor count the recorded reductions are sized for.
DEFAULT_MULTIPROCESSORS = 132


def encode_argument(value) -> dict:
    """A launch argument as JSON: what Triton's specialization and a stand-in need."""
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "dtype": str(value.dtype).removeprefix("torch."),
                "aligned16": value.data_ptr() % 16 == 0}
    if value is None:
        return {"kind": "none"}
    if isinstance(value, tl.dtype):
        return {"kind": "tl_dtype", "name": value.name}
    for kind in (bool, int, float, str):  # bool before int: True is an int too
        if isinstance(value, kind):
            return {"kind": kind.__name__, "value": value}
    raise TypeError(f"encode_argument: cannot record a launch argument of type {type(value).__name__}; "
                    f"expected a tensor, None, a tl.dtype, bool, int, float or str")


def _specialization(encoded: dict, constexpr: bool) -> str:
    """How Triton tells launches apart for this argument (its part of the kernel cache key)."""
    kind = encoded["kind"]
    if kind == "tensor":
        return "*" + encoded["dtype"] + ("" if encoded["aligned16"] else " unaligned")
    if kind == "none":
        return "None"
    if kind == "tl_dtype":
        return encoded["name"]
    value = encoded["value"]
    if constexpr or kind in ("bool", "str"):
        return repr(value)
    if kind == "float":
        return "fp32"
    width = "i32" if -2**31 <= value < 2**31 else "i64"
    return width + ("=1" if value == 1 else " %16" if value % 16 == 0 else "")


def launch_key(record: dict) -> str:
    """One string per compile a GPU would make: the kernel, every argument's
    specialization and the options."""
    arguments = ",".join(f"{name}={_specialization(enc, name in record['constexprs'])}"
                         for name, enc in record["arguments"].items())
    options = ",".join(f"{name}={value}" for name, value in sorted(record["options"].items()))
    return f"{record['kernel']}({arguments})[{options}]"


class LaunchLog:
    """The distinct launches seen, in first-seen order, each with the scenarios that made it."""

    def __init__(self) -> None:
        self.records: dict[str, dict] = {}
        self.launch_count = 0
        self._scenario: Optional[str] = None

    @contextlib.contextmanager
    def scenario(self, label: str) -> Iterator[None]:
        """Launches made inside this block are credited to ``label``."""
        self._scenario = label
        try:
            yield
        finally:
            self._scenario = None

    def add(self, fn, args: tuple, kwargs: dict, grid) -> None:
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in LAUNCH_OPTIONS}
        signature = inspect.signature(fn)
        bound = signature.bind(*args, **kwargs)
        constexprs = sorted(name for name, parameter in signature.parameters.items()
                            if "constexpr" in str(parameter.annotation))
        record = {"kernel": f"{fn.__module__}:{fn.__qualname__}",
                  "arguments": {name: encode_argument(value) for name, value in bound.arguments.items()},
                  "constexprs": constexprs, "options": options,
                  "grid": list(grid) if isinstance(grid, (tuple, list)) else None, "scenarios": []}
        record = self.records.setdefault(launch_key(record), record)
        if self._scenario is not None and self._scenario not in record["scenarios"]:
            record["scenarios"].append(self._scenario)
        self.launch_count += 1


@contextlib.contextmanager
def recording_launches(multiprocessors: int = DEFAULT_MULTIPROCESSORS, execute: bool = False) -> Iterator[LaunchLog]:
    """Within this block every interpreted Triton launch is logged (and, unless ``execute``,
    not run), with the launch wrappers choosing as on a GPU with ``multiprocessors`` units."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("recording_launches: needs TRITON_INTERPRET=1 set before te_lab's kernels "
                           "are defined (the launches it records go through Triton's interpreter)")
    from triton.runtime import interpreter

    from te_lab.kernels.triton_support import standing_for_gpu

    log = LaunchLog()
    # kernel[grid] is InterpretedFunction.__getitem__ in Triton 3.2 and 3.9 alike (3.9 then
    # calls .run, which 3.2's instances do not have as a method)
    launcher_for = interpreter.InterpretedFunction.__getitem__

    def logging_launcher_for(self, grid):
        launch = launcher_for(self, grid)

        def logged_launch(*args, **kwargs):
            log.add(self.fn, args, dict(kwargs), grid)
            return launch(*args, **kwargs) if execute else None
        return logged_launch

    interpreter.InterpretedFunction.__getitem__ = logging_launcher_for
    try:
        with standing_for_gpu(multiprocessors):
            yield log
    finally:
        interpreter.InterpretedFunction.__getitem__ = launcher_for
