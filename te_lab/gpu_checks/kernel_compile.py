"""Recorded Triton launches (:mod:`.kernel_launches`) compiled for real GPUs, on a machine
without one, and what each compile costs the GPU.

Triton compiles to PTX and a cubin for any target given explicitly, and its wheel ships
ptxas and cuobjdump. :func:`compile_records` puts a compile-only driver in place of the
GPU's (current device, stream and target: all ``JITFunction.warmup`` asks for), rebuilds each
launch from small stand-in tensors of the recorded dtype and alignment, and compiles it
through Triton's own launch path minus the launch. The cubin's resource usage
(``cuobjdump --dump-resource-usage``: registers, stack frame, local memory, static shared
memory), the dynamic shared memory Triton requests at launch and the tensor-core
instructions in the PTX give each result; the theoretical occupancy follows from them.

The process must not have ``TRITON_INTERPRET=1`` set when te_lab's kernels are defined
(kernels are then interpreted functions, which compile nothing): run it through
``python -m te_lab.gpu_checks.gpu_kernels compile``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class GpuTarget:
    """What one compute capability's multiprocessor offers a kernel (CUDA C Programming
    Guide, compute capabilities table)."""

    capability: int
    gpus: str
    shared_per_block_optin: int  # bytes; the most a launch may request
    shared_per_multiprocessor: int
    registers_per_multiprocessor: int = 65536
    max_warps_per_multiprocessor: int = 64
    max_blocks_per_multiprocessor: int = 32

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"


TARGETS = {
    90: GpuTarget(90, "H100, H200", shared_per_block_optin=232448, shared_per_multiprocessor=233472),
    80: GpuTarget(80, "A100", shared_per_block_optin=166912, shared_per_multiprocessor=167936),
}
# Registers are allocated per warp in units of 256; the runtime reserves 1 KB of shared
# memory per block.
_REGISTER_UNIT = 256
_RESERVED_SHARED_PER_BLOCK = 1024


def theoretical_occupancy(target: GpuTarget, registers: int, num_warps: int, shared: int) -> tuple[int, float]:
    """(blocks per multiprocessor, resident warps / the multiprocessor's maximum) for a
    kernel using ``registers`` per thread and ``shared`` bytes per block."""
    registers_per_warp = math.ceil(max(registers, 1) * 32 / _REGISTER_UNIT) * _REGISTER_UNIT
    blocks = min(target.registers_per_multiprocessor // (registers_per_warp * num_warps),
                 target.max_warps_per_multiprocessor // num_warps,
                 target.shared_per_multiprocessor // (shared + _RESERVED_SHARED_PER_BLOCK),
                 target.max_blocks_per_multiprocessor)
    return blocks, blocks * num_warps / target.max_warps_per_multiprocessor


class _CompileOnlyDriver:
    """What ``JITFunction.run(..., warmup=True)`` asks of Triton's driver, without a GPU:
    each device index stands for one target, so each target keeps its own kernel cache."""

    def __init__(self, targets: list) -> None:
        self.targets = targets
        self.device = 0

    def get_current_device(self) -> int:
        return self.device

    def set_current_device(self, device: int) -> None:
        self.device = device

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.targets[self.device]

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def _compile_only(capabilities: list[int]) -> _CompileOnlyDriver:
    """Makes the compile-only driver Triton's active one for the rest of the process: Triton's
    own default cannot be put back on a machine without a GPU (creating it fails there)."""
    from triton.backends.compiler import GPUTarget as TritonTarget
    from triton.runtime import driver

    compile_only = _CompileOnlyDriver([TritonTarget("cuda", capability, 32) for capability in capabilities])
    driver.set_active(compile_only)
    return compile_only


def _stand_in(encoded: dict):
    """A small value Triton specializes exactly as it did the recorded argument."""
    import triton.language as tl

    kind = encoded["kind"]
    if kind == "tensor":
        base = torch.empty(64, dtype=getattr(torch, encoded["dtype"]))
        return base if encoded["aligned16"] else base[1:]  # one element in: off 16-byte alignment
    if kind == "none":
        return None
    if kind == "tl_dtype":
        return tl.dtype(encoded["name"])
    return encoded["value"]


def _cubin_usage(cuobjdump: str, cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", file.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"_cubin_usage: cuobjdump printed no resource usage: {text[-300:]!r}")
    registers, stack, static_shared, local = (int(group) for group in found.groups())
    return {"registers": registers, "stack_bytes": stack, "static_shared": static_shared, "local_bytes": local}


def _tensor_core_instructions(ptx: str) -> dict:
    return {"mma": len(re.findall(r"\bmma\.sync\.", ptx)), "wgmma": len(re.findall(r"\bwgmma\.mma_async\.", ptx))}


def _kernel(qualified: str):
    module, name = qualified.split(":")
    return getattr(importlib.import_module(module), name)


def compile_records(records: list[dict], capabilities: list[int]) -> list[dict]:
    """One result per record and target: ``status`` "ok" with the resource figures, or
    "error" with Triton's message. Sequential, in a fresh kernel cache (a kernel found
    in the cache would be reported from an older compile). For processes that launch no
    kernels: Triton's driver stays the compile-only one afterwards."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_records: TRITON_INTERPRET=1 is set, so te_lab's kernels are interpreted "
                           "functions and compile nothing; run it in a process without it")
    import triton

    unknown = [capability for capability in capabilities if capability not in TARGETS]
    if unknown:
        raise ValueError(f"compile_records: capabilities {unknown} are not known; expected some of {sorted(TARGETS)}")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    results, compile_only = [], _compile_only(capabilities)
    with tempfile.TemporaryDirectory(prefix="te-lab-triton-cache-") as cache, _patched_environ(TRITON_CACHE_DIR=cache):
        for record in records:
            kernel = _kernel(record["kernel"])
            arguments = {name: _stand_in(encoded) for name, encoded in record["arguments"].items()}
            for device, capability in enumerate(capabilities):
                compile_only.set_current_device(device)
                results.append(_compile_one(kernel, arguments, record, TARGETS[capability], cuobjdump))
    return results


@contextlib.contextmanager
def _patched_environ(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _compile_one(kernel, arguments: dict, record: dict, target: GpuTarget, cuobjdump: str) -> dict:
    result = {"kernel": record["kernel"].split(":")[1], "module": record["kernel"].split(":")[0],
              "target": target.name, "options": record["options"], "scenarios": record["scenarios"],
              "realistic": record.get("realistic", True)}
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # Triton 3.2 prints its ptxas warnings
            compiled = kernel.warmup(grid=(1,), **arguments, **record["options"])
        usage = _cubin_usage(cuobjdump, compiled.asm["cubin"])
    except Exception as error:  # a failed compile is a result to report, not the end of the run
        result.update(status="error", error=f"{type(error).__name__}: {error}"[:4000],
                      seconds=round(time.perf_counter() - started, 3))
        return result
    metadata = compiled.metadata
    # metadata.shared: the dynamic shared memory the launch requests (checked at launch against
    # the opt-in limit); the cubin's static shared memory is reported apart.
    blocks, occupancy = theoretical_occupancy(target, usage["registers"], metadata.num_warps,
                                              metadata.shared + usage["static_shared"])
    result.update(status="ok", seconds=round(time.perf_counter() - started, 3), num_warps=metadata.num_warps,
                  num_stages=metadata.num_stages, shared=metadata.shared, **usage,
                  **_tensor_core_instructions(compiled.asm["ptx"]),
                  blocks_per_multiprocessor=blocks, occupancy=round(occupancy, 3),
                  shared_over_limit=metadata.shared + usage["static_shared"] > target.shared_per_block_optin)
    return result


def spills(result: dict) -> bool:
    """Whether the compile put values in local memory: Triton kernels have no local arrays
    or calls, so a stack frame or local memory means registers spilled."""
    return result["status"] == "ok" and (result["stack_bytes"] > 0 or result["local_bytes"] > 0)


def problems(result: dict) -> list[str]:
    """What makes ``result`` fail the check: a compile error, shared memory over the
    target's opt-in limit, or a spill in a realistic scenario."""
    if result["status"] != "ok":
        return [f"compile error: {result['error'][:300]}"]
    found = []
    if result["shared_over_limit"]:
        found.append(f"{result['shared'] + result['static_shared']} B of shared memory, over "
                     f"{result['target']}'s limit")
    if spills(result) and result["realistic"]:
        found.append(f"spills: {result['stack_bytes']} B stack frame, {result['local_bytes']} B local memory "
                     f"at {result['registers']} registers")
    return found
