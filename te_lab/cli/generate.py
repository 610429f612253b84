"""``te-lab generate --model ... --prompt ... --max-new-tokens N``: greedy decoding with the
model fused and unfused, the text (or token ids), tokens/s of each and whether their
tokens agree."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import te_lab
from te_lab import device as devices
from te_lab.benchmarks.generation import Generation, generate
from te_lab.models import MODEL_NAMES, build_model

from .options import DTYPES, device_name, model_name, positive_int


def add_parser(subcommands) -> None:
    parser = subcommands.add_parser(
        "generate", help="greedy text generation, fused against unfused: the text and tokens/s",
        description="Load MODEL (a Hugging Face checkpoint folder with its tokenizer, or a model te_lab builds "
                    "with random weights), fuse it, decode greedily from PROMPT unfused and fused in turn, and "
                    "print the text (token ids for a model without a tokenizer), prefill and decode tokens/s of "
                    "each, and whether both produced the same tokens.")
    parser.add_argument("--model", type=model_name, required=True,
                        help="a folder with a Hugging Face checkpoint (config, weights, tokenizer), a demo model "
                             f"({', '.join(MODEL_NAMES)}) or hf:<architecture>[-<preset>]")
    parser.add_argument("--prompt", required=True,
                        help="the text to continue; for a model without a tokenizer, token ids separated by "
                             "spaces or commas")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed generations per mode, interleaved, after one untimed each (default 3)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="parameter dtype (default float32)")
    parser.add_argument("--device", type=device_name, default=None,
                        help=f"cpu, cuda[:N] or musa[:N] (default: here {devices.default_device()})")
    parser.set_defaults(run=run, parser=parser)


def _load(source: str, dtype: torch.dtype, device: torch.device):
    """(model in eval mode, tokenizer or None)."""
    model = build_model(source, dtype=dtype, device=device).eval()
    tokenizer = None
    if Path(source).is_dir():
        import transformers  # build_model loaded the checkpoint with it

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError):
            pass
    return model, tokenizer


def _prompt_ids(prompt: str, tokenizer, vocab: int) -> torch.Tensor:
    if tokenizer is not None:
        return tokenizer(prompt, return_tensors="pt").input_ids
    try:
        ids = [int(part) for part in prompt.replace(",", " ").split()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        raise SystemExit(f"te-lab generate: --prompt: this model has no tokenizer, so the prompt is token ids in "
                         f"[0, {vocab}) separated by spaces or commas; got {prompt!r}")
    return torch.tensor([ids])


def _tokens_per_s(tokens: int, seconds: list[float]) -> float:
    return tokens / statistics.median(seconds)


def run(args: argparse.Namespace) -> int:
    device = devices.resolve(args.device)
    model, tokenizer = _load(args.model, DTYPES[args.dtype], device)
    vocab = model.lm_head.out_features  # demo and Hugging Face causal LMs alike
    prompt = _prompt_ids(args.prompt, tokenizer, vocab).to(device)
    new_tokens = args.max_new_tokens
    report = te_lab.fuse(model, sample={"input_ids": prompt}, progress=False)
    print(f"fused {len(report.fused)} modules of {type(model).__name__}", file=sys.stderr)

    def once(fused: bool) -> Generation:
        if fused:
            return generate(model, model, prompt, new_tokens)
        with te_lab.unfused(model):
            return generate(model, model, prompt, new_tokens)

    runs: dict[bool, list[Generation]] = {False: [], True: []}
    first = {fused: once(fused) for fused in (False, True)}
    for round_index in range(args.rounds):
        for fused in ((False, True) if round_index % 2 == 0 else (True, False)):
            runs[fused].append(once(fused))
    tokens = first[True].tokens[0, prompt.shape[1]:]
    if tokenizer is not None:
        print(tokenizer.decode(first[True].tokens[0], skip_special_tokens=True))
    else:
        print(" ".join(str(int(token)) for token in first[True].tokens[0]))
    prompt_tokens, decode_steps = prompt.shape[1], max(new_tokens - 1, 1)
    rows = []
    for fused in (False, True):
        generations = runs[fused]
        prefill = _tokens_per_s(prompt_tokens, [g.prefill_s for g in generations])
        decode = _tokens_per_s(decode_steps, [g.decode_s for g in generations])
        rows.append((prefill, decode))
        print(f"{'fused' if fused else 'unfused':>8}: prefill {prefill:,.0f} tokens/s, decode {decode:,.1f} tokens/s "
              f"(medians of {args.rounds})")
    print(f"fused / unfused: prefill {rows[1][0] / rows[0][0]:.2f}x, decode {rows[1][1] / rows[0][1]:.2f}x")
    identical = all(torch.equal(a.tokens, first[False].tokens) for a in [first[True], *runs[True], *runs[False]])
    print(f"tokens identical fused and unfused: {'yes' if identical else 'NO'} ({len(tokens)} new tokens)")
    return 0 if identical else 1
