"""End-to-end measurements: a model's training step and its inference forward, four
contenders interleaved.

Two copies of the model are built from the same seed: one stays unfused, the other is
fused once (``te_lab.fuse(model, sample=batch)``, timed: that wait is part of te_lab's
time to first step). Contenders:

- ``eager``: the unfused model; the step's optimizer is ``torch.optim.AdamW`` with
  ``fused=True`` where the device has ATen's fused kernel (``foreach`` otherwise);
- ``torch.compile``: ``torch.compile`` of the unfused model, same optimizer;
- ``te_lab``: the fused model with te_lab's ``FusedAdamW``, its projections on whichever
  GEMM library measured faster here (``te_lab::linear``'s routing, kernels/linear.py);
- ``te_lab (fusion only)``: the same fused model with that routing off (every projection
  on ``F.linear``): what fusion alone gains;
- ``torch.compile(te_lab)``: ``torch.compile`` of the fused model, ``FusedAdamW``.

A contender and its compiled twin share one model and one optimizer (the weights keep
training as the rounds go, alike for all). The training step is ``loss =
model(**batch).loss; loss.backward(); optimizer.step()``, then, untimed,
``optimizer.zero_grad(set_to_none=True)``. Inference is ``model(input_ids=...).logits``
under ``torch.no_grad()`` in eval mode (``use_cache=False`` for Hugging Face models).
Inference runs first, on the freshly built weights, so the eager and fused logits can be
compared; the training step's first loss
is compared the same way (both models are at their first step then).

Time to first step: build-time waits (``fuse``) plus the first call, which for the
compiled contenders includes torch.compile's compile.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

import te_lab
from te_lab import device as devices
from te_lab.kernels import FusedAdamW, use_backend
from te_lab.kernels.registry import aten_kernel_exists
from te_lab.models import build_model, example_batch

from .harness import Contender, interleaved, peak_memory_bytes
from .stats import speedup

MODEL_MODES = ("inference", "train")
CONTENDERS = ("eager", "torch.compile", "te_lab", "te_lab (fusion only)", "torch.compile(te_lab)")
FUSION_ONLY = "te_lab (fusion only)"


def _without_routing(model: torch.nn.Module) -> Callable:
    """``model`` called with te_lab::linear's routing off (projections on F.linear)."""
    def run(**inputs):
        with use_backend(linear="reference"):
            return model(**inputs)
    return run


def torch_adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if aten_kernel_exists("aten::_fused_adamw_", device.type):
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _train_contender(name: str, model: Callable, module: torch.nn.Module, optimizer, batch: dict) -> Contender:
    def step():
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    @contextlib.contextmanager
    def training():
        module.train()
        yield

    return Contender(name, step, after=lambda: optimizer.zero_grad(set_to_none=True), context=training)


def _inference_contender(name: str, model: Callable, module: torch.nn.Module, batch: dict) -> Contender:
    # One forward over the whole sequence, as scoring runs it: a Hugging Face model would
    # otherwise fill a KV cache, whose per-layer state torch.compile guards on (a recompile
    # per layer, past its recompile limit).
    inputs = {"input_ids": batch["input_ids"]}
    if hasattr(module.config, "use_cache"):
        inputs["use_cache"] = False

    @contextlib.contextmanager
    def inference():
        module.eval()
        with torch.no_grad():
            yield

    return Contender(name, lambda: model(**inputs).logits, context=inference)


def _counts_line(report) -> str:
    return "; ".join(f"{rule}: " + ", ".join(f"{status} {n}" for status, n in by_status.items())
                     for rule, by_status in report.counts().items())


def run_model(name: str, device: torch.device, *, batch: int, seq: int, rounds: int, warmup: int,
              modes: tuple[str, ...], progress) -> list[dict]:
    """One record per mode (the JSON schema's ``models`` items)."""
    progress(f"{name}: building two copies")
    eager_model, fused_model = build_model(name, device=device), build_model(name, device=device)
    max_seq = getattr(eager_model.config, "max_seq_len", None) or eager_model.config.max_position_embeddings
    seq = min(seq, max_seq)
    sample = example_batch(eager_model, batch, seq)
    progress(f"{name}: fusing")
    devices.synchronize(device)
    start = time.perf_counter()
    report = te_lab.fuse(fused_model, sample=sample, progress=False)
    devices.synchronize(device)
    fuse_s = time.perf_counter() - start
    compiled_eager, compiled_fused = torch.compile(eager_model), torch.compile(fused_model)
    optimizers = {"eager": torch_adamw(eager_model, device), "te_lab": FusedAdamW(fused_model.parameters(), lr=1e-4)}
    models = {"eager": (eager_model, eager_model, "eager"), "torch.compile": (compiled_eager, eager_model, "eager"),
              "te_lab": (fused_model, fused_model, "te_lab"),
              FUSION_ONLY: (_without_routing(fused_model), fused_model, "te_lab"),
              "torch.compile(te_lab)": (compiled_fused, fused_model, "te_lab")}
    setup_s = {"eager": 0.0, "torch.compile": 0.0, "te_lab": fuse_s, FUSION_ONLY: fuse_s,
               "torch.compile(te_lab)": fuse_s}
    parameters = sum(p.numel() for p in eager_model.parameters())
    base = {"model": name, "parameters": parameters, "batch": batch, "seq": seq, "tokens": batch * seq,
            "fuse_s": fuse_s, "fusion": _counts_line(report),
            "not_fused": [f"{row.label} ({row.rule}): {row.status}: {row.reason}"
                          for row in report.rows if row.status != "fused"]}
    records = []
    for mode in modes:
        if mode == "train":
            contenders = [_train_contender(c, models[c][0], models[c][1], optimizers[models[c][2]], sample)
                          for c in CONTENDERS]
        else:
            contenders = [_inference_contender(c, models[c][0], models[c][1], sample) for c in CONTENDERS]
        progress(f"{name}: {mode}")
        timings, first = interleaved(contenders, device, rounds=rounds, warmup=warmup, progress=progress,
                                     keep_first_outputs=True)
        check = None
        if "eager" in first and "te_lab" in first:
            difference = (first["eager"].double() - first["te_lab"].double()).abs().max().item()
            check = {"compared": "first loss" if mode == "train" else "logits", "max_abs_difference": difference}
        del first
        contender_records = []
        for contender in contenders:
            timing = timings[contender.name]
            record = {"name": contender.name, "error": timing.error, "setup_s": setup_s[contender.name],
                      "first_call_ms": timing.first_call_ms, "samples_ms": timing.samples_ms,
                      "median_ms": None, "spread_ms": None, "tokens_per_s": None, "time_to_first_step_s": None,
                      "peak_memory_bytes": None}
            if timing.error is None:
                record.update(median_ms=timing.median_ms, spread_ms=timing.spread_ms,
                              tokens_per_s=batch * seq / (timing.median_ms * 1e-3),
                              time_to_first_step_s=setup_s[contender.name] + timing.first_call_ms * 1e-3,
                              peak_memory_bytes=peak_memory_bytes(contender, device))
            contender_records.append(record)
        ran = {n: t for n, t in timings.items() if t.error is None}
        pairs = [(n, "eager") for n in CONTENDERS[1:]] + [("te_lab", "torch.compile"), (FUSION_ONLY, "torch.compile"),
                                                         ("torch.compile(te_lab)", "torch.compile")]
        records.append({**base, "mode": mode, "check": check, "contenders": contender_records,
                        "speedups": [speedup(ran[a], ran[b]).as_dict() for a, b in pairs if a in ran and b in ran]})
    return records
