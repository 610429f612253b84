"""What fusion buys on a 135M-shaped checkpoint: training steps, greedy decoding and the ceiling.

The model is the one :mod:`.fuse_time` fuses (a 30-layer Llama of the 135M shape, made
real-like: outlier channels, activations about 2e4). Two copies from one seed: one stays
unfused, the other is fused (``te_lab.fuse`` with its defaults, on the first training
batch). Interleaved rounds, the order alternating, each round timing:

- a training step (``model(**batch).loss.backward()``, gradients then dropped, untimed) at
  each ``--train`` size (batch x sequence);
- greedy decoding (``generate``, ``max_new_tokens`` new tokens, no sampling) of a prompt
  at each ``--decode`` batch, the whole call timed, with the two copies' tokens compared.

Each contender's figure is the median over rounds; the ratio eager / fused has its 95%
bootstrap interval over the paired rounds (:func:`te_lab.profiler.intervals.ratio_interval`).
Then ``te_lab.profile`` of the first training size gives the fusion ceiling and te_lab's
share of it (:mod:`te_lab.profiler.ceiling`).

    python -m te_lab.benchmarks.checkpoint_speed [--layers 30] [--train 4x256,2x128]
        [--decode 1] [--prompt 32] [--new-tokens 48] [--rounds 5] [--profile-steps 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import te_lab
from te_lab.profiler.intervals import ratio_interval

from . import environment
from .fuse_time import smollm_like


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(n) for n in size.split("x")) for size in text.split(",") if size]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 4x256,2x128, got {text!r}") from None


def _batch(vocab: int, batch: int, seq: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _train_ms(model, batch: dict) -> float:
    start = time.perf_counter()
    model(**batch).loss.backward()
    elapsed = (time.perf_counter() - start) * 1e3
    model.zero_grad(set_to_none=True)
    return elapsed


def _decode(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return (time.perf_counter() - start) * 1e3, tokens


def _row(name: str, eager: list[float], fused: list[float]) -> dict:
    low, high = ratio_interval(eager, fused)
    return dict(case=name, eager_ms=statistics.median(eager), fused_ms=statistics.median(fused),
                speedup=statistics.median(eager) / statistics.median(fused), low=low, high=high)


def run(layers: int, train: list, decode: list, prompt: int, new_tokens: int, rounds: int,
        profile_steps: int) -> dict:
    eager = smollm_like(layers)
    fused = copy.deepcopy(eager)
    vocab = eager.config.vocab_size
    batches = {size: _batch(vocab, *size, seed=index) for index, size in enumerate(train)}
    prompts = {rows: torch.randint(0, vocab, (rows, prompt), generator=torch.Generator().manual_seed(100 + rows))
               for rows in decode}
    start = time.perf_counter()
    report = te_lab.fuse(fused, sample=batches[train[0]], progress=False)
    fuse_s = time.perf_counter() - start
    times: dict = {}
    same_tokens = {}
    for model in (eager, fused):  # warm-up: first calls, measured choices of other sizes
        for batch in batches.values():
            _train_ms(model, batch)
        model.eval()
        for rows, ids in prompts.items():
            _decode(model, ids, new_tokens)
        model.train()
    for round_index in range(rounds):
        order = (("eager", eager), ("fused", fused))
        for name, model in (order if round_index % 2 == 0 else order[::-1]):
            for size, batch in batches.items():
                times.setdefault(f"training step {size[0]} x {size[1]}", {}).setdefault(name, []).append(
                    _train_ms(model, batch))
            model.eval()
            for rows, ids in prompts.items():
                elapsed, tokens = _decode(model, ids, new_tokens)
                times.setdefault(f"greedy decode batch {rows}, {new_tokens} tokens", {}).setdefault(
                    name, []).append(elapsed)
                same_tokens.setdefault(rows, {})[name] = tokens
            model.train()
    rows = [_row(case, modes["eager"], modes["fused"]) for case, modes in times.items()]
    profile = te_lab.profile(fused, batches[train[0]], steps=profile_steps, warmup=1)
    return dict(layers=layers, rounds=rounds, fuse_s=fuse_s, fusion=report.summary().splitlines()[0],
                aside=[row.path for row in report.rows if row.steps_aside], rows=rows,
                tokens_identical={rows: bool(torch.equal(t["eager"], t["fused"])) for rows, t in same_tokens.items()},
                ceiling=profile.ceiling, profile_speedup=profile.totals.speedup,
                profile_kinds=[(c.key, c.speedup, c.speedup_low, c.speedup_high) for c in profile.kinds])


def markdown(result: dict) -> list[str]:
    lines = [f"135M-shaped Llama, {result['layers']} layers, real-like; {result['fusion']} (in "
             f"{result['fuse_s']:.1f} s); twins stepping aside at the training sample's sizes: "
             f"{len(result['aside'])}; {result['rounds']} interleaved rounds, medians", "",
             "| case | eager ms | fused ms | speedup [95% interval] |", "|---|---:|---:|---|"]
    lines += [f"| {row['case']} | {row['eager_ms']:.1f} | {row['fused_ms']:.1f} | {row['speedup']:.2f}x "
              f"[{row['low']:.2f}, {row['high']:.2f}] |" for row in result["rows"]]
    lines += ["", f"greedy tokens identical, eager against fused: {result['tokens_identical']}"]
    ceiling = result["ceiling"]
    if ceiling is not None:
        lines += ["", f"profile of the first training size: {result['profile_speedup']:.2f}x; fusion ceiling "
                      f"{ceiling.ceiling_speedup:.2f}x: {ceiling.verdict()}",
                  "", "| op kind | speedup [95% interval] |", "|---|---|"]
        lines += [f"| {key} | {speedup:.2f}x [{low:.2f}, {high:.2f}] |" if low is not None else
                  f"| {key} | {speedup:.2f}x |" for key, speedup, low, high in result["profile_kinds"]
                  if speedup is not None]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.benchmarks.checkpoint_speed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--train", type=_sizes, default=[(4, 256), (2, 128)], help="batch x sequence sizes")
    parser.add_argument("--decode", type=lambda text: [int(n) for n in text.split(",")], default=[1],
                        help="decode batch sizes")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(environment.cpu_headline())
    result = run(args.layers, args.train, args.decode, args.prompt, args.new_tokens, args.rounds, args.profile_steps)
    print("\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
