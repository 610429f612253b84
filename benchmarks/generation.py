"""The generation benchmark: prefill and decode tokens/s, eager against te_lab-fused,
``torch.compile`` and te_lab-fused under ``torch.compile``.

    python -m te_lab.benchmarks.generation [--quick | --key] [--models hf:llama-24,llama-mini]
        [--batches 1,4,16] [--prompts 128,1024] [--new-tokens 32] [--rounds 5]

``--key`` is issue 28's figure alone, within a few minutes on the 2-core CPU: ``hf:llama-24``
at batch 1, a 64-token prompt and 32 new tokens, eager against fused, 21 interleaved rounds
(the decode ratio's interval narrows with rounds; a decode step of this model takes tens of
milliseconds). Without options, the full grid (every model, batch 1, 4 and 16, prompts 128
and 1024, every mode) takes hours there.

Each configuration (model, batch, prompt length) runs greedy decoding of ``new_tokens``
tokens after a random prompt, once per mode per round, the modes interleaved (the order
rotates every round) after two warm-up generations each; the first one's time is
reported as the first call (it includes fusing's measured choices and compiling). Prefill is the forward
over the prompt; decode is every step after it, reported per generated token. A Hugging
Face model decodes through its KV cache (``DynamicCache``; ``StaticCache`` under
``torch.compile``, whose shapes must not change); a demo model has no cache and runs
every step over the whole sequence so far. Tokens/s count every row of the batch.
Ratios are medians over paired rounds with a 95% bootstrap interval (``stats.py``), and
every mode's tokens are checked against eager's.

Models: the demo Llamas by name (``llama-tiny``, ``llama-mini``, ...) and ``hf:llama-24``,
a randomly initialised Hugging Face ``LlamaForCausalLM`` of 24 layers, hidden 256, 4 query
and 2 key-value heads (the issue's decode case).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

import te_lab
from te_lab.models import build_model, huggingface

from .harness import Timing
from .stats import speedup

MODES = ("eager", "fused", "compile", "fused+compile")
HF_LLAMA_24 = "hf:llama-24"


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...] = ("llama-tiny", "llama-mini", HF_LLAMA_24)
    batches: tuple[int, ...] = (1, 4, 16)
    prompts: tuple[int, ...] = (128, 1024)
    new_tokens: int = 32
    rounds: int = 5
    warmup: int = 1  # generations per mode after the first call, untimed
    modes: tuple[str, ...] = MODES


FULL = Config()
QUICK = Config(models=("llama-tiny", HF_LLAMA_24), batches=(1, 4), prompts=(128,), new_tokens=16, rounds=3)
# `te-lab gpu-check`'s generation stage: minutes on one GPU, the 24-layer model at decode
# (batch 1) and a batch of 16, every mode.
GPU_CHECK = Config(models=(HF_LLAMA_24,), batches=(1, 16), prompts=(128,), new_tokens=32, rounds=5)
# Issue 28's key figure: greedy decoding at batch 1 on the 24-layer Hugging Face Llama, fused
# against eager, with enough interleaved rounds for the median ratio's interval.
KEY = Config(models=(HF_LLAMA_24,), batches=(1,), prompts=(64,), new_tokens=32, rounds=21, modes=("eager", "fused"))


def build(name: str, max_len: int) -> nn.Module:
    """The model ``name`` in eval mode, positions up to ``max_len``."""
    if name == HF_LLAMA_24:
        model = huggingface("llama", "mini", num_layers=24, num_heads=4, num_kv_heads=2, max_seq_len=max_len)
    else:
        model = build_model(name, max_seq_len=max_len)
    return model.eval()


def has_kv_cache(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM (which decodes through a KV cache)."""
    return hasattr(model, "generation_config") and hasattr(model, "config")


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model``'s forward takes its KV cache."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@dataclass
class Generation:
    tokens: torch.Tensor
    prefill_s: float
    decode_s: float


def _synchronized_clock(device: torch.device) -> float:
    te_lab.device.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate(forward: Callable, model: nn.Module, prompt: torch.Tensor, new_tokens: int, *,
             static_cache: bool = False) -> Generation:
    """Greedy decoding of ``new_tokens`` after ``prompt`` with ``forward`` (the model, or a
    compiled one), timing prefill and decode apart."""
    batch, length = prompt.shape
    device = prompt.device
    start = _synchronized_clock(device)
    if has_kv_cache(model):
        from transformers import DynamicCache, StaticCache

        cache = (StaticCache(config=model.config, max_cache_len=length + new_tokens) if static_cache
                 else DynamicCache(config=model.config))
        # Hugging Face renamed the argument (past_key_values -> cache) over releases.
        with_cache = {cache_argument(model): cache, "use_cache": True}
        logits = forward(input_ids=prompt, cache_position=torch.arange(length, device=device), **with_cache).logits
        step = lambda token, position: forward(input_ids=token, cache_position=position, **with_cache).logits  # noqa: E731
    else:
        logits = forward(prompt).logits
        step = None
    token = logits[:, -1].argmax(-1, keepdim=True)
    prefilled = _synchronized_clock(device)
    generated = [token]
    sequence = prompt
    for index in range(1, new_tokens):
        if step is not None:
            logits = step(token, torch.tensor([length + index - 1], device=device))
        else:
            sequence = torch.cat([sequence, token], dim=1)
            logits = forward(sequence).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(token)
    end = _synchronized_clock(device)
    return Generation(torch.cat([prompt, *generated], dim=1), prefilled - start, end - prefilled)


@dataclass
class _Mode:
    name: str
    model: nn.Module
    forward: Callable
    static_cache: bool
    first_call_ms: Optional[float] = None
    prefill_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)  # per generated token after the first
    tokens: Optional[torch.Tensor] = None
    error: Optional[str] = None


def _modes(model: nn.Module, fused: nn.Module, names: tuple[str, ...]) -> list[_Mode]:
    kv = has_kv_cache(model)

    def compiled(target: nn.Module) -> Callable:
        # A demo model's sequence grows every step: dynamic shapes instead of one graph per length.
        return torch.compile(target, dynamic=None if kv else True)

    make = {"eager": lambda: _Mode("eager", model, model, False),
            "fused": lambda: _Mode("fused", fused, fused, False),
            "compile": lambda: _Mode("compile", model, compiled(model), kv),
            "fused+compile": lambda: _Mode("fused+compile", fused, compiled(fused), kv)}
    return [make[name]() for name in names]


def _tokens_per_s(tokens: int, ms: list[float]) -> Optional[float]:
    return tokens / (Timing("", None, ms).median_ms / 1000) if ms else None


def run_config(model_name: str, batch: int, prompt_length: int, config: Config, *,
               device: Optional[torch.device] = None, progress=lambda _: None) -> dict:
    """One model at one batch and prompt length, every mode: the record ``markdown`` reads."""
    device = device or torch.device("cpu")
    model = build(model_name, prompt_length + config.new_tokens).to(device)
    vocab = model.lm_head.out_features
    prompt = torch.randint(1, vocab - 1, (batch, prompt_length), generator=torch.Generator().manual_seed(0)).to(device)
    fused = copy.deepcopy(model)
    progress(f"generation: {model_name} batch {batch} prompt {prompt_length}: fusing")
    report = te_lab.fuse(fused, sample={"input_ids": prompt[:1, : min(prompt_length, 64)]}, progress=False)
    modes = _modes(model, fused, config.modes)
    for mode in modes:
        progress(f"generation: {model_name} batch {batch} prompt {prompt_length}: {mode.name}, first call")
        try:
            first = generate(mode.forward, mode.model, prompt, config.new_tokens, static_cache=mode.static_cache)
        except Exception as error:  # one mode that breaks (a compile failure) is a result of its own
            mode.error = f"{type(error).__name__}: {error}"
            continue
        mode.first_call_ms = (first.prefill_s + first.decode_s) * 1000
        mode.tokens = first.tokens
        for _ in range(config.warmup):  # a compiled mode may compile again once it has seen two shapes
            generate(mode.forward, mode.model, prompt, config.new_tokens, static_cache=mode.static_cache)
    running = [mode for mode in modes if mode.error is None]
    decode_steps = max(config.new_tokens - 1, 1)
    for round_index in range(config.rounds):
        progress(f"generation: {model_name} batch {batch} prompt {prompt_length}: round {round_index + 1}")
        shift = round_index % max(len(running), 1)
        for mode in running[shift:] + running[:shift]:
            result = generate(mode.forward, mode.model, prompt, config.new_tokens, static_cache=mode.static_cache)
            mode.prefill_ms.append(result.prefill_s * 1000)
            mode.decode_ms.append(result.decode_s * 1000 / decode_steps)
    eager = next((mode for mode in modes if mode.name == "eager" and mode.error is None), None)
    record = {"model": model_name, "batch": batch, "prompt": prompt_length, "new_tokens": config.new_tokens,
              "fused_modules": len(report.fused), "kv_cache": has_kv_cache(model), "modes": {}, "speedups": []}
    for mode in modes:
        record["modes"][mode.name] = {
            "error": mode.error, "first_call_ms": mode.first_call_ms,
            "prefill_ms": mode.prefill_ms, "decode_ms_per_token": mode.decode_ms,
            "prefill_tokens_per_s": _tokens_per_s(batch * prompt_length, mode.prefill_ms),
            "decode_tokens_per_s": _tokens_per_s(batch, mode.decode_ms),
            "tokens_identical_to_eager": (None if eager is None or mode.tokens is None
                                          else bool(torch.equal(mode.tokens, eager.tokens)))}
    by_name = {mode.name: mode for mode in running}
    for contender, over in (("fused", "eager"), ("compile", "eager"), ("fused+compile", "eager"),
                            ("fused+compile", "compile")):
        if contender in by_name and over in by_name:
            for phase, attribute in (("prefill", "prefill_ms"), ("decode", "decode_ms")):
                ratio = speedup(Timing(contender, None, getattr(by_name[contender], attribute)),
                                Timing(over, None, getattr(by_name[over], attribute)))
                record["speedups"].append({"phase": phase, **ratio.as_dict()})
    return record


def run(config: Config, *, device: Optional[torch.device] = None, progress=lambda _: None) -> list[dict]:
    return [run_config(model, batch, prompt, config, device=device, progress=progress)
            for model in config.models for batch in config.batches for prompt in config.prompts]


def _number(value: Optional[float], digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(record: dict, contender: str, over: str, phase: str) -> str:
    for ratio in record["speedups"]:
        if (ratio["contender"], ratio["over"], ratio["phase"]) == (contender, over, phase):
            return f"{ratio['value']:.2f}x [{ratio['interval_low']:.2f}-{ratio['interval_high']:.2f}]"
    return "-"


def markdown(records: list[dict]) -> list[str]:
    """The generation table (records as :func:`run_config` returns them)."""
    lines = ["| model | batch | prompt | mode | prefill tok/s | decode tok/s | prefill vs eager | decode vs eager | "
             "decode vs compile | first call s | tokens = eager |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for record in records:
        for name, mode in record["modes"].items():
            head = f"| {record['model']} | {record['batch']} | {record['prompt']} | {name} | "
            if mode["error"] is not None:
                lines.append(head + f"failed: {mode['error'][:80]} | | | | | | |")
                continue
            identical = {True: "yes", False: "**no**", None: "-"}[mode["tokens_identical_to_eager"]]
            first = None if mode["first_call_ms"] is None else mode["first_call_ms"] / 1000
            lines.append(head + f"{_number(mode['prefill_tokens_per_s'])} | "
                         f"{_number(mode['decode_tokens_per_s'], 1)} | "
                         f"{_ratio(record, name, 'eager', 'prefill')} | {_ratio(record, name, 'eager', 'decode')} | "
                         f"{_ratio(record, name, 'compile', 'decode')} | {_number(first, 1)} | {identical} |")
    return lines


def _integers(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise SystemExit(f"te_lab.benchmarks.generation: --{option}: got {text!r}; expected positive integers "
                         f"separated by commas")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.benchmarks.generation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--quick", action="store_true", help="llama-tiny and hf:llama-24, batch 1 and 4, prompt 128, "
                        "16 new tokens, 3 rounds")
    chosen.add_argument("--key", action="store_true", help="hf:llama-24, batch 1, prompt 64, 32 new tokens, eager and "
                        "fused, 21 rounds: the decode ratio of issue 28")
    parser.add_argument("--models", default=None, help=f"comma-separated (default: {','.join(FULL.models)})")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1,4,16)")
    parser.add_argument("--prompts", default=None, help="comma-separated prompt lengths (default: 128,1024)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per run (default: 32)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 5)")
    parser.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(MODES)}")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else KEY if args.key else FULL
    try:
        changes = {}
        if args.models:
            changes["models"] = tuple(name.strip() for name in args.models.split(",") if name.strip())
        if args.batches:
            changes["batches"] = _integers(args.batches, "batches")
        if args.prompts:
            changes["prompts"] = _integers(args.prompts, "prompts")
        for option in ("new_tokens", "rounds"):
            if getattr(args, option) is not None:
                changes[option] = _integers(str(getattr(args, option)), option.replace("_", "-"))[0]
        if args.modes:
            changes["modes"] = tuple(name.strip() for name in args.modes.split(",") if name.strip())
            unknown = [name for name in changes["modes"] if name not in MODES]
            if unknown or "eager" not in changes["modes"]:
                raise SystemExit(f"te_lab.benchmarks.generation: --modes: got {args.modes!r}; expected eager and "
                                 f"any of {', '.join(MODES[1:])}")
    except SystemExit as error:
        print(error, file=sys.stderr)
        return 2
    config = Config(**{**config.__dict__, **changes})
    records = run(config, progress=lambda message: print(message, file=sys.stderr, flush=True))
    print("\n".join(markdown(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
