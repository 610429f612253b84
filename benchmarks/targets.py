"""Issue 9's targets, and issue 26's for MoE, read off a results object. Nothing here is
asserted anywhere: the results say for each target whether this run met it, plainly, with
the figures.

"te_lab" is the backend automatic selection picks (what a user gets); a target is met
when the ratio of medians reaches it (the bootstrap interval is given beside it). A
target the run did not measure (another device, dtype or model) is ``met: null``.
"""

from __future__ import annotations

from typing import Callable, Optional

MEMORY_BOUND_OPS = ("rms_norm", "layer_norm", "glu", "rope", "cross_entropy", "adamw")
# Issue 26's MoE targets: the block (benchmarks/cases.py's moe case: 32 experts of width 128,
# top-4) at 1024 tokens x hidden 256, and the 2-layer Qwen3-MoE's training step at 4 x 256.
MOE_BLOCK_SIZE = {"tokens": 1024, "hidden": 256}
MOE_MODEL, MOE_MODEL_SHAPE = "hf:qwen3_moe-mini", (4, 256)


def _auto(record: dict) -> Optional[dict]:
    return next((c for c in record["contenders"] if c["kind"] == "te_lab" and c["auto"] and c["error"] is None), None)


def _speedup(record: dict, contender: str, over: str) -> Optional[dict]:
    return next((s for s in record["speedups"] if s["contender"] == contender and s["over"] == over), None)


def _where(record: dict) -> str:
    if "op" in record:
        size = record["size"]
        return f"{record['case']} T={size['tokens']} H={size['hidden']} {record['dtype']} {record['mode']}"
    return f"{record['model']} {record['mode']}"


def _ratio_text(s: dict) -> str:
    return f"{s['value']:.2f}x [{s['interval_low']:.2f}-{s['interval_high']:.2f}]"


def _target(device: str, text: str, checks: list[tuple[str, bool, str]], unmeasured: str) -> dict:
    """``checks``: (where, met, figure) per measured record."""
    if not checks:
        return {"device": device, "target": text, "met": None, "measured": unmeasured, "detail": []}
    misses = [f"MISSED {where}: {figure}" for where, met, figure in checks if not met]
    measured = f"met in {len(checks) - len(misses)} of {len(checks)} measurements"
    return {"device": device, "target": text, "met": not misses, "measured": measured,
            "detail": misses or [f"{where}: {figure}" for where, _, figure in checks]}


def _op_ratio_checks(records: list[dict], over: str, threshold: float,
                     include: Callable[[dict], bool] = lambda r: True) -> list[tuple[str, bool, str]]:
    checks = []
    for record in records:
        auto = _auto(record)
        ratio = _speedup(record, auto["name"], over) if auto else None
        if ratio is not None and include(record):
            checks.append((_where(record), ratio["value"] >= threshold, f"{auto['name']} {_ratio_text(ratio)}"))
    return checks


def _compile_loses(record: dict) -> bool:
    compiled = _speedup(record, "torch.compile", "eager")
    return compiled is not None and compiled["value"] < 1


def _memory_checks(records: list[dict], fraction: float) -> list[tuple[str, bool, str]]:
    """The LM head's peak memory against eager's where the logits dominate eager's peak
    (the issue's condition): where the [tokens, vocab] logits are at least the size of
    the [vocab, hidden] weight, i.e. tokens >= hidden. Elsewhere the weight's gradient,
    which both must hold, is most of the peak."""
    checks = []
    for record in records:
        auto = _auto(record)
        eager = next((c for c in record["contenders"] if c["name"] == "eager"), None)
        size = record["size"]
        if record["case"] == "fused_linear_cross_entropy" and record["mode"] == "forward+backward" and auto \
                and eager and eager["peak_memory_bytes"] and size["tokens"] >= size["hidden"]:
            share = auto["peak_memory_bytes"] / eager["peak_memory_bytes"]
            checks.append((_where(record), share <= fraction,
                           f"{auto['peak_memory_bytes'] / 2**20:.1f} MiB = {100 * share:.0f}% of eager's "
                           f"{eager['peak_memory_bytes'] / 2**20:.1f} MiB"))
    return checks


def _dispatch_checks(records: list[dict], limit_us: float):
    return [(f"{r['case']} at {r['tokens']} x {r['hidden']}", r["overhead_per_call_us"] <= limit_us,
             f"{r['overhead_per_call_us']:.1f} us per call above its kernels")
            for r in records if r["overhead_per_call_us"] is not None]


def _is_moe_block(record: dict) -> bool:
    return record["case"] == "moe" and record["mode"] == "forward+backward" and record["size"] == MOE_BLOCK_SIZE


def _model_checks(records: list[dict], model: Optional[str], over: str, threshold: float,
                  contender: str = "te_lab", shape: Optional[tuple[int, int]] = None):
    """Training steps of ``model`` (every model for None), at ``shape`` (batch, seq) if given."""
    checks = []
    for record in records:
        ratio = _speedup(record, contender, over)
        if record["mode"] == "train" and (model is None or record["model"] == model) and ratio is not None \
                and (shape is None or (record["batch"], record["seq"]) == shape):
            checks.append((_where(record), ratio["value"] >= threshold,
                           f"{contender} {_ratio_text(ratio)} over {over}"))
    return checks


def _bandwidth_checks(records: list[dict], fraction: float):
    checks = []
    for record in records:
        auto = _auto(record)
        if record["op"] in MEMORY_BOUND_OPS and auto and auto["fraction_of_copy_bandwidth"] is not None:
            share = auto["fraction_of_copy_bandwidth"]
            checks.append((_where(record), share >= fraction, f"{auto['gbs']:.0f} GB/s = {100 * share:.0f}% of copy"))
    return checks


def evaluate(results: dict) -> list[dict]:
    """The schema's ``targets`` list for ``results`` (its ``ops`` and ``models``)."""
    on_gpu = not results["environment"]["device"].startswith("cpu")
    device = "gpu" if on_gpu else "cpu"
    ops = [r for r in results["ops"] if r["dtype"] == ("bfloat16" if on_gpu else "float32")]
    large = [r for r in ops if r["size"]["tokens"] >= 1024]
    models = results["models"]
    # Each target's checks, built only for the device this run measured.
    cpu = [
        ("every op (CPU, float32): per call and direction at most 15 us above its own kernels (64 x 64)",
         lambda: _dispatch_checks(results.get("dispatch", []), 15.0)),
        ("every op (CPU, float32): never slower than the eager baseline, at every size",
         lambda: _op_ratio_checks(ops, "eager", 1.0)),
        ("every op (CPU, float32): at least 0.95x torch.compile's steady state from 1024 rows up",
         lambda: _op_ratio_checks(large, "torch.compile", 0.95)),
        ("every op (CPU, float32): ahead of torch.compile where torch.compile loses to eager (as on add + LayerNorm)",
         lambda: _op_ratio_checks(ops, "torch.compile", 1.0, include=_compile_loses)),
        ("fused linear cross-entropy (CPU, float32): peak memory <= 35% of eager where the logits dominate "
         "(tokens >= hidden)", lambda: _memory_checks(ops, 0.35)),
        ("training step with fusion alone (te_lab::linear's routing off, CPU): at least 1.1x eager",
         lambda: _model_checks(models, None, "eager", 1.1, contender="te_lab (fusion only)")),
        ("training step with routing on (CPU, reported beside it): at least 1.1x eager",
         lambda: _model_checks(models, None, "eager", 1.1)),
        ("MoE block, 32 experts of width 128, top-4, 1024 x 256 (CPU, float32, forward+backward): at least 3x "
         "Hugging Face's eager experts", lambda: _op_ratio_checks(ops, "eager", 3.0, include=_is_moe_block)),
        ("MoE block, 32 experts of width 128, top-4, 1024 x 256 (CPU, float32, forward+backward): ahead of "
         "torch.compile of the same block", lambda: _op_ratio_checks(ops, "torch.compile", 1.0, include=_is_moe_block)),
        (f"training step of the 2-layer Qwen3-MoE ({MOE_MODEL}) at {MOE_MODEL_SHAPE[0]} x {MOE_MODEL_SHAPE[1]} "
         f"(CPU): at least 2x eager", lambda: _model_checks(models, MOE_MODEL, "eager", 2.0, shape=MOE_MODEL_SHAPE)),
    ]
    gpu = [
        ("memory-bound kernels (GPU, bf16): >= 80% of the measured copy bandwidth",
         lambda: _bandwidth_checks(ops, 0.8)),
        ("every op (GPU, bf16): at least as fast as Liger-Kernel's", lambda: _op_ratio_checks(ops, "liger", 1.0)),
        ("training step (GPU): at least 1.4x eager", lambda: _model_checks(models, None, "eager", 1.4)),
        ("training step (GPU): at least torch.compile's throughput",
         lambda: _model_checks(models, None, "torch.compile", 1.0)),
    ]
    targets = []
    for target_device, entries in (("cpu", cpu), ("gpu", gpu)):
        for text, checks in entries:
            if target_device == device:
                targets.append(_target(device, text, checks(),
                                       "not measured in this run (other ops, models or dtypes)"))
            else:
                targets.append(_target(target_device, text, [], "not measured on this device"))
    return targets
