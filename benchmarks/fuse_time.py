"""What ``te_lab.fuse`` costs, in unfused training steps of its own sample, phase by phase.

The model is shaped like a 135M-parameter pretrained Llama (30 layers, hidden 576,
intermediate 1536, 9 query / 3 key-value heads, vocabulary 49152, tied embeddings) and
made real-like (:mod:`te_lab.models.real_like`: outlier channels, activations about 2e4),
since the verdict's work depends on what the probes find. The sample is 4 x 256 tokens
with labels. First the unfused training step (forward and backward) is timed, median of
``steps`` after one warm-up; then one ``fuse`` and ``unfuse`` warm the measured choices and
compiled kernels (the state any later fuse on the same machine finds, since both are
cached on disk; reported apart), and then ``fuse`` is timed with its phases (:attr:`te_lab.FusionReport.phase_seconds`).

    python -m te_lab.benchmarks.fuse_time [--layers 30] [--batch 4] [--seq 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import te_lab
from te_lab.models.real_like import make_real_like

from . import environment


def smollm_like(layers: int, seed: int = 0):
    import transformers

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                                      max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                      attention_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make_real_like(transformers.LlamaForCausalLM(config))


def _training_step_s(model, batch: dict) -> float:
    start = time.perf_counter()
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run(layers: int = 30, batch: int = 4, seq: int = 256, steps: int = 3) -> dict:
    model = smollm_like(layers)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    _training_step_s(model, sample)
    step_s = statistics.median(_training_step_s(model, sample) for _ in range(steps))
    start = time.perf_counter()
    te_lab.fuse(model, sample=sample, progress=False)
    first_s = time.perf_counter() - start
    te_lab.unfuse(model)
    start = time.perf_counter()
    report = te_lab.fuse(model, sample=sample, progress=False)
    fuse_s = time.perf_counter() - start
    return dict(layers=layers, batch=batch, seq=seq, step_s=step_s, first_fuse_s=first_s, fuse_s=fuse_s,
                fuse_steps=fuse_s / step_s, phases=report.phase_seconds, summary=report.summary().splitlines()[0])


def markdown(result: dict) -> list[str]:
    lines = [f"Llama-shaped, {result['layers']} layers (hidden 576, vocabulary 49152), real-like, sample "
             f"{result['batch']} x {result['seq']}; unfused training step {result['step_s']:.2f} s (median); "
             f"`fuse` {result['fuse_s']:.2f} s = **{result['fuse_steps']:.2f} steps** (a first fuse on this "
             f"machine, measuring its choices: {result['first_fuse_s']:.2f} s). {result['summary']}.", "",
             "| phase | s | steps |", "|---|---:|---:|"]
    lines += [f"| {phase} | {seconds:.2f} | {seconds / result['step_s']:.2f} |"
              for phase, seconds in sorted(result["phases"].items(), key=lambda item: -item[1])]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.benchmarks.fuse_time", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(environment.cpu_headline())
    print("\n".join(markdown(run(args.layers, args.batch, args.seq, args.steps))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
