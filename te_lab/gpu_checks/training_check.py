"""A short mixed-precision training check: a demo Llama trained fused and unfused under
``torch.autocast(device_type, torch.bfloat16)``, step by step side by side, the two loss
curves compared within bfloat16's tolerance and the step times as interleaved medians.

Both copies start from the same seed and see the same batch every step; the unfused one
steps ``torch.optim.AdamW``, the fused one te_lab's ``FusedAdamW`` (the same algorithm),
as a user of each would. The two steps alternate which runs first.
"""

from __future__ import annotations

import contextlib

import torch

import te_lab
from te_lab.benchmarks.end_to_end import torch_adamw
from te_lab.benchmarks.harness import Contender, interleaved
from te_lab.benchmarks.stats import speedup
from te_lab.kernels import FusedAdamW
from te_lab.kernels.precision import TOLERANCES
from te_lab.models import build_model, example_batch


def _training_contender(name: str, model: torch.nn.Module, optimizer, batch: dict, dtype: torch.dtype,
                        device: torch.device, losses: list) -> Contender:
    def step():
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    @contextlib.contextmanager
    def autocast():
        with torch.autocast(device.type, dtype=dtype):
            yield

    return Contender(name, step, after=lambda: optimizer.zero_grad(set_to_none=True), context=autocast)


def autocast_training_check(device: torch.device, *, model: str = "llama-mini", steps: int = 20, batch: int = 4,
                            seq: int = 128, dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
                            progress=lambda _: None) -> dict:
    """Train ``model`` unfused and fused (``te_lab.fuse(..., backend=backend)``) for
    ``steps`` steps each under autocast to ``dtype``. Returns both loss curves, whether they
    agree within ``dtype``'s tolerance (``|fused - unfused| <= atol + rtol * |unfused|`` at
    every step), the largest
    difference, each contender's median step time and the fused model's speedup."""
    if steps < 2:
        raise ValueError(f"autocast_training_check(steps={steps}): expected at least 2 (a first step and a timed one)")
    unfused, fused = build_model(model, device=device), build_model(model, device=device)
    sample = example_batch(unfused, batch, seq)
    progress(f"{model}: fusing")
    te_lab.fuse(fused, sample=sample, backend=backend, progress=False)
    losses = {"unfused": [], "fused": []}
    contenders = [
        _training_contender("unfused", unfused, torch_adamw(unfused, device), sample, dtype, device, losses["unfused"]),
        _training_contender("fused", fused, FusedAdamW(fused.parameters(), lr=1e-4), sample, dtype, device,
                            losses["fused"]),
    ]
    timings, _ = interleaved(contenders, device, rounds=steps - 1, warmup=0, progress=progress)
    errors = {name: timing.error for name, timing in timings.items() if timing.error is not None}
    if errors:
        raise RuntimeError(f"autocast_training_check({model!r}, {dtype}): a training step failed: {errors}")
    curves = {name: [float(loss) for loss in values] for name, values in losses.items()}
    tolerance = TOLERANCES[dtype]
    differences = [abs(f - u) for f, u in zip(curves["fused"], curves["unfused"])]
    agree = all(d <= tolerance["atol"] + tolerance["rtol"] * abs(u) for d, u in zip(differences, curves["unfused"]))
    ratio = speedup(timings["fused"], over=timings["unfused"])
    return {"model": model, "dtype": str(dtype).removeprefix("torch."), "backend": backend, "steps": steps,
            "batch": batch, "seq": seq,
            "losses": curves, "within_tolerance": agree, "max_loss_difference": max(differences),
            "median_step_ms": {name: timing.median_ms for name, timing in timings.items()},
            "fused_speedup": ratio.as_dict()}
