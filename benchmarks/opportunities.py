"""What the fusion-opportunity finder says of a model before and after ``te_lab.fuse``,
with the gains fusing realized against each row's estimate.

The finder (:func:`te_lab.opportunities`) looks at the unfused model's training step; then
``fuse`` swaps its layers (every rule, verified); then the finder looks at the fused step
with ``against=`` the first result, which clocks the first result's modules again, so each
of its rows gets the gain fusing realized. Both tables are printed: the eager rows with
estimated and realized gains, and what fusion left.

    python -m te_lab.benchmarks.opportunities [--model llama-mini | smollm-like] [--layers 30]
        [--batch 4] [--seq 256] [--top 8] [--steps 3]

``smollm-like`` is :mod:`.fuse_time`'s 135M-shaped real-like Llama (``--layers`` of it);
any other name is a demo or ``hf:`` model of :func:`te_lab.models.build_model`.
"""

from __future__ import annotations

import argparse

import torch

import te_lab
from te_lab.models import build_model, example_batch

from . import environment
from .fuse_time import smollm_like

SMOLLM_LIKE = "smollm-like"


def model_and_sample(name: str, layers: int, batch: int, seq: int) -> tuple:
    if name == SMOLLM_LIKE:
        model = smollm_like(layers)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        return model, {"input_ids": ids, "labels": ids}
    model = build_model(name, seed=0)
    return model, example_batch(model, batch, seq)


def run(name: str, layers: int, batch: int, seq: int, steps: int) -> dict:
    model, sample = model_and_sample(name, layers, batch, seq)
    before = te_lab.opportunities(model, sample, steps=steps)
    fusion = te_lab.fuse(model, sample=sample, progress=False)
    after = te_lab.opportunities(model, sample, steps=steps, against=before)
    return {"model": name, "fusion": fusion.summary().splitlines()[0], "before": before.realized(after),
            "after": after}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.benchmarks.opportunities",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-mini")
    parser.add_argument("--layers", type=int, default=30, help=f"layers of {SMOLLM_LIKE} (default 30)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="profiled and clocked steps per finder (default 3)")
    args = parser.parse_args(argv)
    print(environment.cpu_headline())
    result = run(args.model, args.layers, args.batch, args.seq, args.steps)
    print(f"{result['model']}, batch {args.batch} x {args.seq}: {result['fusion']}")
    print("before fusing, with the gains fusing realized:")
    print(result["before"].summary(args.top))
    print("what fusion left:")
    print(result["after"].summary(args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
