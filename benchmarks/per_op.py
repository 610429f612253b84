"""Per-op measurements: each fused op's cases in each mode, every contender interleaved.

Contenders: ``eager`` (the baseline model code), ``torch.compile`` of that baseline,
``te_lab[<backend>]`` for every backend that runs the op on the device (the one that
automatic selection picks is marked ``auto``; the CPU's Triton interpreter is for tests
and never timed), and ``liger`` where ``liger_kernel`` is importable on a GPU and has an
equivalent. The optimizer step has its own contenders (see :func:`adamw_contenders`).
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from te_lab import device as devices
from te_lab.kernels import FusedAdamW, available_backends, registered_ops, select_backend
from te_lab.kernels.registry import aten_kernel_exists

from .cases import OpCase, Size, adamw_bytes, adamw_parameters, op_cases
from .harness import Contender, Timing, interleaved, op_contender, op_sampling, peak_memory_bytes, upstream_gradients
from .op_calls import automatic_backend
from .stats import speedup

OP_MODES = ("forward", "backward", "forward+backward")
OPTIMIZER_MODE = "step"


@dataclass(frozen=True)
class ContenderInfo:
    kind: str  # "eager", "torch.compile", "te_lab", "liger", "torch"
    backend: Optional[str] = None
    auto: bool = False


def liger_functional(device: torch.device):
    """``liger_kernel.transformers.functional`` where Liger can run (a GPU with it
    installed), else None: Liger's kernels are Triton kernels for GPUs only."""
    if not devices.is_gpu(device):
        return None
    try:
        return importlib.import_module("liger_kernel.transformers.functional")
    except ImportError:
        return None


def compiled(fn: Callable) -> Callable:
    """torch.compile of ``fn`` as a user would write it, on a copy of its code object:
    every case gets a compile cache of its own, so a sweep over shapes and dtypes never
    runs into torch.compile's recompile limit (or its switch to dynamic shapes)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(copy)


def te_lab_backends(op_name: str, device: torch.device, only: Optional[tuple[str, ...]] = None,
                    automatic: Optional[str] = None) -> list[tuple[str, bool]]:
    """(backend, picked automatically) for every backend that can be timed here (those in
    ``only``, where given): the reference only where automatic selection picks it (it is
    what a user gets then), and Triton only on GPUs (the CPU's interpreter is for tests).
    ``automatic``: the backend the automatic choice runs for the case's inputs, where it
    depends on them (see :func:`automatic_backend`)."""
    op = registered_ops()[op_name]
    auto = automatic or select_backend(op, device)
    timed = [b for b in available_backends(op, device)
             if (b != "reference" or b == auto) and (b != "triton" or devices.is_gpu(device))
             and (only is None or b in only)]
    return [(backend, backend == auto) for backend in timed]


def case_functions(case: OpCase, device: torch.device,
                   backends: Optional[tuple[str, ...]] = None) -> dict[str, tuple[Callable, ContenderInfo]]:
    """Contender name -> (the function of the inputs it runs, what it is); te_lab's
    contenders limited to ``backends`` where given."""
    functions = {"eager": (case.baseline, ContenderInfo("eager")),
                 "torch.compile": (compiled(case.baseline), ContenderInfo("torch.compile"))}
    for backend, auto in te_lab_backends(case.op, device, backends, automatic_backend(case, device)):
        run = (lambda backend: lambda *inputs: case.fused(*inputs, backend=backend))(backend)
        functions[f"te_lab[{backend}]"] = (run, ContenderInfo("te_lab", backend, auto))
    functional = liger_functional(device)
    if functional is not None and case.liger is not None:
        functions["liger"] = (case.liger(functional), ContenderInfo("liger"))
    return functions


def adamw_contenders(device: torch.device, dtype: torch.dtype, hidden: int,
                     backends: Optional[tuple[str, ...]] = None
                     ) -> tuple[list[Contender], dict[str, ContenderInfo], int, int]:
    """Each optimizer contender on a parameter set of its own, its state allocated by one
    untimed step: torch.optim.AdamW's default (foreach) step, torch.compile of it,
    AdamW(fused=True) where the device has ATen's fused kernel, and te_lab's FusedAdamW
    on each backend. Returns the contenders, what they are, the bytes a step moves and
    the parameter count."""
    def prepared(make_optimizer) -> Callable:
        optimizer = make_optimizer(adamw_parameters(device, dtype, hidden))
        optimizer.step()
        return optimizer.step

    contenders = [Contender("eager", prepared(torch.optim.AdamW)),
                  Contender("torch.compile", torch.compile(prepared(torch.optim.AdamW)))]
    infos = {"eager": ContenderInfo("eager"), "torch.compile": ContenderInfo("torch.compile")}
    if aten_kernel_exists("aten::_fused_adamw_", device.type):
        contenders.append(Contender("torch AdamW(fused=True)", prepared(lambda p: torch.optim.AdamW(p, fused=True))))
        infos["torch AdamW(fused=True)"] = ContenderInfo("torch")
    for backend, auto in te_lab_backends("adamw", device, backends):
        name = f"te_lab[{backend}]"
        contenders.append(Contender(name, prepared(lambda p, backend=backend: FusedAdamW(p, backend=backend))))
        infos[name] = ContenderInfo("te_lab", backend, auto)
    params = adamw_parameters(device, dtype, hidden)
    return contenders, infos, adamw_bytes(params), sum(p.numel() for p in params)


def contender_record(timing: Timing, info: ContenderInfo, bytes_moved: int, flops: Optional[int],
                     peak_memory: Optional[int], ceilings: dict) -> dict:
    record = {"name": timing.name, "kind": info.kind, "backend": info.backend, "auto": info.auto,
              "error": timing.error, "first_call_ms": timing.first_call_ms, "samples_ms": timing.samples_ms,
              "median_ms": None, "spread_ms": None, "gbs": None, "fraction_of_copy_bandwidth": None,
              "fraction_of_peak_bandwidth": None, "tflops": None, "fraction_of_peak_flops": None,
              "peak_memory_bytes": peak_memory}
    if timing.error is None:
        seconds = timing.median_ms * 1e-3
        gbs = bytes_moved / seconds / 1e9
        record.update(median_ms=timing.median_ms, spread_ms=timing.spread_ms, gbs=gbs,
                      fraction_of_copy_bandwidth=gbs / ceilings["copy_gbs"],
                      fraction_of_peak_bandwidth=gbs / ceilings["peak_gbs"])
        if flops:
            record["tflops"] = flops / seconds / 1e12
            if ceilings["peak_tflops"]:
                record["fraction_of_peak_flops"] = record["tflops"] / ceilings["peak_tflops"]
    return record


def speedup_records(timings: dict[str, Timing], infos: dict[str, ContenderInfo]) -> list[dict]:
    """Every contender over eager; te_lab's contenders also over torch.compile and Liger."""
    ran = {name: timing for name, timing in timings.items() if timing.error is None}
    pairs = [(name, "eager") for name in ran if name != "eager"]
    pairs += [(name, over) for name in ran if infos[name].kind == "te_lab" for over in ("torch.compile", "liger")]
    return [speedup(ran[name], ran[over]).as_dict() for name, over in pairs if name in ran and over in ran]


def measure(contenders: list[Contender], infos: dict[str, ContenderInfo], device: torch.device, *,
            bytes_moved: int, flops: Optional[int], ceilings: dict, rounds: int, warmup: int, progress) -> dict:
    timings, _ = interleaved(contenders, device, rounds=rounds, warmup=warmup, progress=progress,
                             sampling=op_sampling(device))
    records = []
    for contender in contenders:
        timing = timings[contender.name]
        memory = peak_memory_bytes(contender, device) if timing.error is None else None
        records.append(contender_record(timing, infos[contender.name], bytes_moved, flops, memory, ceilings))
    return {"bytes_moved": bytes_moved, "flops": flops, "contenders": records,
            "speedups": speedup_records(timings, infos)}


def run_op(op: str, size: Size, dtype: torch.dtype, modes: tuple[str, ...], device: torch.device, *,
           ceilings: dict, rounds: int, warmup: int, progress,
           backends: Optional[tuple[str, ...]] = None) -> list[dict]:
    """One result record per case of ``op`` and mode (the JSON schema's ``ops`` items);
    te_lab's contenders limited to ``backends`` where given."""
    dtype_name = str(dtype).removeprefix("torch.")
    base = {"op": op, "dtype": dtype_name, "size": {"tokens": size.tokens, "hidden": size.hidden}}
    if op == "adamw":
        contenders, infos, bytes_moved, count = adamw_contenders(device, dtype, size.hidden, backends)
        title = f"AdamW step, {count / 1e6:.1f}M {dtype_name} parameters (one Llama layer of width {size.hidden})"
        progress(f"{title}")
        result = measure(contenders, infos, device, bytes_moved=bytes_moved, flops=None, ceilings=ceilings,
                         rounds=rounds, warmup=warmup, progress=progress)
        return [{**base, "case": "adamw", "title": title, "mode": OPTIMIZER_MODE, **result}]
    records = []
    for case in op_cases(op, device, dtype, size):
        functions = case_functions(case, device, backends)
        upstream = upstream_gradients(case.baseline, case.inputs)
        for mode in modes:
            progress(f"{case.title} {dtype_name} {mode}")
            contenders = [op_contender(name, fn, case.inputs, mode, upstream) for name, (fn, _) in functions.items()]
            infos = {name: info for name, (_, info) in functions.items()}
            result = measure(contenders, infos, device, bytes_moved=case.bytes_for(mode), flops=case.flops_for(mode),
                             ceilings=ceilings, rounds=rounds, warmup=warmup, progress=progress)
            records.append({**base, "case": case.name, "title": case.title, "mode": mode, **result})
    return records
