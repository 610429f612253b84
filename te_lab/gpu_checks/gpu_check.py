"""GPU check: the one script for the first GPU te_lab runs on (``make gpu-check``, ``te-lab
gpu-check``), a few minutes on one H100/H200 or MUSA GPU. Everything lands in one folder
(``--out``, default ``gpu-check``):

1. correctness: every op with a ``triton`` backend, each case in float32 and bfloat16,
   forward output and every gradient against the reference run in float64 on the same
   inputs (the truth); the Triton result passes when its largest error is at most twice
   the reference's run in the benchmark dtype, plus that dtype's tolerance (atol + rtol x
   the largest true value: one rounding more than eager's is no failure). FusedAdamW's
   Triton kernel the same way against ``torch.optim.AdamW``'s steps.
2. timing: the same ops' cases (forward+backward) and the AdamW step in bfloat16, te_lab's
   Triton kernels against eager, torch.compile and Liger-Kernel where installed, through the suite's
   per-op harness (interleaved rounds, L2 flushed, several calls per sample), achieved
   GB/s beside the device's peak.
3. training: a Hugging Face Llama trained fused and unfused under bf16 autocast, loss
   curves side by side and step times (``training_check``).
4. a te_lab profile of the fused demo Llama: ``profile.html``, ``profile.json`` and the
   raw traces (``traces/``, for ``te_lab.open_trace`` anywhere).
5. generation: the generation benchmark's prefill and decode tokens/s on the GPU
   (:data:`te_lab.benchmarks.generation.GPU_CHECK`: eager, fused, torch.compile and fused
   under it), with whether each mode's greedy tokens are eager's (reported, not failed:
   another GEMM's rounding may flip a near tie on a random-weight model).

``gpu-check.md`` collects every table (written after each stage, so an interrupted run
keeps what it finished), ``results.json`` the data. A stage that raises is recorded as a
failure and the next stage runs. Exit status 1 when a check fails or a stage raised; on a
machine without a GPU that Triton drives it says so, writes nothing and exits 1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Callable

import torch

import te_lab
from te_lab import device as devices
from te_lab.benchmarks import environment, generation, per_op
from te_lab.benchmarks.cases import OP_CASES, OpCase, Size, op_cases, transformer_parameter_shapes
from te_lab.benchmarks.harness import describe_error
from te_lab.kernels import FusedAdamW
from te_lab.kernels.precision import TOLERANCES, error_budget
from te_lab.kernels.registry import registered_ops
from te_lab.models import build_model, example_batch

from .training_check import autocast_training_check

CHECK_DTYPES = ("float32", "bfloat16")
DTYPES_BY_NAME = {str(dtype).removeprefix("torch."): dtype for dtype in TOLERANCES}
ADAMW_STEPS = 3


def triton_ops() -> list[str]:
    """The benchmarked ops that have a ``triton`` backend (``linear`` has none: it is a
    oneDNN projection on the CPU)."""
    return [op for op in OP_CASES if "triton" in registered_ops()[op].backends()]


def _outputs_and_grads(fn, inputs, dtype=None):
    """Outputs and input gradients of ``fn`` on copies of ``inputs`` (cast to ``dtype``),
    under the same seeded upstream gradients every time."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    generator = torch.Generator(device="cpu").manual_seed(0)
    upstream = [torch.randn(o.shape, generator=generator).to(o.device, o.dtype) for o in out]
    return [t.detach() for t in out] + list(torch.autograd.grad(out, leaves, upstream))


def compare_to_truth(got: list, in_dtype: list, truth: list, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(passed, worst error of ``got``, worst error of ``in_dtype``), both vs ``truth``,
    tensor by tensor: ``got`` passes where its largest error is at most twice
    ``in_dtype``'s plus ``dtype``'s atol + rtol x the tensor's largest true value."""
    passed, worst, worst_reference = True, 0.0, 0.0
    for value, reference, true in zip(got, in_dtype, truth):
        error = (value.double() - true).abs().max().item()
        reference_error = (reference.double() - true).abs().max().item()
        budget = error_budget(reference_error, true.abs().max().item(), dtype)
        passed &= error <= budget
        worst, worst_reference = max(worst, error), max(worst_reference, reference_error)
    return passed, worst, worst_reference


def check_case(case: OpCase) -> tuple[bool, float, float]:
    """(passed, worst Triton error, worst reference-in-dtype error), both vs float64."""
    dtype = case.inputs[0].dtype
    triton = _outputs_and_grads(lambda *a: case.fused(*a, backend="triton"), case.inputs)
    in_dtype = _outputs_and_grads(lambda *a: case.fused(*a, backend="reference"), case.inputs)
    truth = _outputs_and_grads(lambda *a: case.fused(*a, backend="reference"), case.inputs, torch.float64)
    return compare_to_truth(triton, in_dtype, truth, dtype)


def check_adamw(device: torch.device, dtype: torch.dtype, shapes: list[tuple],
                steps: int = ADAMW_STEPS) -> tuple[bool, float, float]:
    """FusedAdamW(backend="triton") against torch.optim.AdamW, both in ``dtype``, after
    ``steps`` steps on the same parameters and gradients; the truth is torch's AdamW in
    float64. Returns (passed, worst Triton error, worst torch-in-dtype error) over the
    parameters."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    start = [0.02 * torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[1e-3 * torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]

    def trained(make_optimizer, as_dtype):
        # copies: a step updates in place, and .to() returns the tensor itself when nothing changes
        params = [torch.nn.Parameter(p.to(device, as_dtype, copy=True)) for p in start]
        optimizer = make_optimizer(params)
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.to(device, as_dtype)
            optimizer.step()
        return [p.detach() for p in params]

    torch_adamw = lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False)  # noqa: E731
    return compare_to_truth(trained(lambda params: FusedAdamW(params, lr=1e-3, backend="triton"), dtype),
                    trained(torch_adamw, dtype), trained(torch_adamw, torch.float64), dtype)


def correctness(device: torch.device, dtypes: list[str], size: Size, progress: Callable[[str], None]) -> list[dict]:
    """One row per case and dtype (and one for FusedAdamW per dtype); a case that raises
    is a row with its error, and the next case runs."""
    rows = []

    def attempt(title: str, dtype_name: str, check) -> None:
        progress(f"correctness: {title}, {dtype_name}")
        try:
            passed, error, reference_error = check()
            rows.append({"case": title, "dtype": dtype_name, "passed": passed, "triton_error": error,
                         "reference_error": reference_error, "error": None})
        except Exception as failure:  # one broken kernel must not hide the others' results
            rows.append({"case": title, "dtype": dtype_name, "passed": False, "triton_error": None,
                         "reference_error": None, "error": describe_error(failure)})

    for dtype_name in dtypes:
        dtype = DTYPES_BY_NAME[dtype_name]
        for op in triton_ops():
            try:
                built = op_cases(op, device, dtype, size)
            except Exception as failure:
                rows.append({"case": op, "dtype": dtype_name, "passed": False, "triton_error": None,
                             "reference_error": None, "error": describe_error(failure)})
                continue
            for case in built:
                attempt(case.title, dtype_name, lambda case=case: check_case(case))
        shapes = transformer_parameter_shapes(size.hidden, 1, 8192, 4 * size.hidden)
        attempt(f"FusedAdamW step x{ADAMW_STEPS} (one Llama layer of width {size.hidden})", dtype_name,
                lambda dtype=dtype: check_adamw(device, dtype, shapes))
    return rows


def timing(device: torch.device, size: Size, rounds: int, warmup: int, progress) -> list[dict]:
    """The suite's per-op records (forward+backward; the AdamW step) in bfloat16 for the
    ops with a triton backend; an op that raises is a record with its error."""
    env = environment.describe(device)
    dtype = torch.bfloat16
    records = []
    for op in triton_ops() + ["adamw"]:
        try:
            # te_lab's triton backend only: what automatic selection picks on GPUs (an inductor
            # contender would cost a torch.compile per case more, beyond the check's minutes)
            records += per_op.run_op(op, size, dtype, ("forward+backward",), device,
                                     ceilings=environment.ceilings(env, dtype), rounds=rounds, warmup=warmup,
                                     progress=progress, backends=("triton",))
        except Exception as failure:
            records.append({"op": op, "title": op, "error": describe_error(failure), "contenders": []})
    return records


def profile_run(device: torch.device, model_name: str, out: pathlib.Path, progress) -> dict:
    """Fuse and profile ``model_name`` in bfloat16; its HTML, JSON and raw traces into ``out``."""
    model = build_model(model_name, dtype=torch.bfloat16, device=device)
    batch = example_batch(model, 4, 256)
    progress(f"profile: fusing {model_name}")
    te_lab.fuse(model, sample=batch, progress=False)
    progress("profile: eager against fused")
    report = te_lab.profile(model, batch, steps=5, warmup=2, trace_dir=out / "traces")
    html = te_lab.to_html(report, out / "profile.html")
    (out / "profile.json").write_text(report.to_json(indent=1), encoding="utf-8")
    return {"model": model_name, "summary": report.summary(), "html": str(html),
            "traces": sorted(str(p.name) for p in (out / "traces").iterdir())}


def correctness_markdown(rows: list[dict]) -> str:
    lines = ["## Triton kernels against float64 truth", "", "| case | dtype | result | triton error | eager error |",
             "|---|---|---|---:|---:|"]
    for row in rows:
        if row["error"] is not None:
            lines.append(f"| {row['case']} | {row['dtype']} | ERROR: {row['error']} | - | - |")
        else:
            lines.append(f"| {row['case']} | {row['dtype']} | {'PASS' if row['passed'] else 'FAIL'} | "
                         f"{row['triton_error']:.3g} | {row['reference_error']:.3g} |")
    return "\n".join(lines) + "\n"


def timing_markdown(records: list[dict]) -> str:
    lines = ["## Times (bfloat16, forward+backward; the AdamW step)", "",
             "| case | contender | median ms | GB/s | of peak bandwidth | vs eager |", "|---|---|---:|---:|---:|---:|"]
    for record in records:
        if record.get("error"):
            lines.append(f"| {record['title']} | ERROR: {record['error']} | | | | |")
            continue
        over_eager = {s["contender"]: s["value"] for s in record.get("speedups", []) if s["over"] == "eager"}
        for contender in record["contenders"]:
            if contender["error"] is not None:
                lines.append(f"| {record['title']} | {contender['name']} | ERROR: {contender['error']} | | | |")
                continue
            ratio = over_eager.get(contender["name"])
            lines.append(f"| {record['title']} | {contender['name']} | {contender['median_ms']:.4f} | "
                         f"{contender['gbs']:.0f} | {100 * contender['fraction_of_peak_bandwidth']:.0f}% | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines) + "\n"


def training_markdown(result: dict) -> str:
    ratio = result["fused_speedup"]
    return (f"## {result['model']} training under autocast({result['dtype']}), {result['steps']} steps\n\n"
            f"loss curves {'agree' if result['within_tolerance'] else 'DIFFER'} (max |diff| "
            f"{result['max_loss_difference']:.3g}); median step: unfused {result['median_step_ms']['unfused']:.2f} ms, "
            f"fused {result['median_step_ms']['fused']:.2f} ms, fused speedup {ratio['value']:.2f}x "
            f"[{ratio['interval_low']:.2f}-{ratio['interval_high']:.2f}]\n")


def profile_markdown(result: dict) -> str:
    return (f"## te_lab profile of {result['model']} (bfloat16)\n\n```\n{result['summary']}\n```\n\n"
            f"{result['html']}; raw traces in traces/: {', '.join(result['traces'])}\n")


def generation_markdown(records: list[dict]) -> str:
    return "## Generation (float32; tokens/s count every row)\n\n" + "\n".join(generation.markdown(records)) + "\n"


def stage_passed(name: str, result) -> bool:
    """Whether a stage's result holds no failed check."""
    if name == "correctness":
        return all(row["passed"] for row in result)
    if name == "timing":
        return not any(record.get("error") for record in result)
    if name == "training":
        return bool(result["within_tolerance"])
    if name == "generation":
        return not any(mode["error"] for record in result for mode in record["modes"].values())
    return True


def run_stages(stages: list[tuple[str, Callable[[], object], Callable[[object], str]]], out: pathlib.Path,
               header: str, progress) -> bool:
    """Run each ``(name, measure, markdown)`` stage in turn, rewriting ``gpu-check.md`` and
    ``results.json`` in ``out`` after each; a stage that raises is recorded under
    ``failures``. Returns whether every stage ran and passed."""
    results: dict = {"failures": []}
    sections = [header]
    all_passed = True
    for name, measure, markdown in stages:
        started = time.perf_counter()
        try:
            result = measure()
        except Exception as failure:
            results["failures"].append({"stage": name, "error": describe_error(failure)})
            sections.append(f"## {name}: FAILED\n\n{describe_error(failure)}\n")
            all_passed = False
        else:
            results[name] = result
            sections.append(markdown(result))
            all_passed &= stage_passed(name, result)
        progress(f"{name}: {time.perf_counter() - started:.0f} s")
        (out / "gpu-check.md").write_text("\n".join(sections), encoding="utf-8")
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    return all_passed


def unavailable_reason(device: torch.device):
    """Why this check cannot run on ``device``, or None."""
    if not devices.is_gpu(device):
        return "no CUDA or MUSA GPU on this machine; nothing to check"
    if not devices.triton_available(device):
        return devices.triton_unavailable_reason(device.type)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu-check"),
                        help="folder for gpu-check.md, results.json, profile.html/json and traces/ (default gpu-check)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens (rows) of the activations (default 4096)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument("--dtypes", default=",".join(CHECK_DTYPES), help="dtypes of the correctness checks")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per op (default 10)")
    parser.add_argument("--training-model", default="hf:llama-mini",
                        help="model of the bf16 training check (default hf:llama-mini)")
    parser.add_argument("--training-steps", type=int, default=10, help="steps of the training check (default 10)")
    parser.add_argument("--profile-model", default="llama-small", help="model profiled (default llama-small)")


def run(args: argparse.Namespace) -> int:
    device = devices.default_device()
    reason = unavailable_reason(device)
    if reason is not None:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return 1
    dtypes = args.dtypes.split(",")
    unknown = [name for name in dtypes if name not in DTYPES_BY_NAME]
    if unknown:
        print(f"gpu_check: --dtypes: {unknown[0]!r} is not one of {', '.join(DTYPES_BY_NAME)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    size = Size(args.tokens, args.hidden)

    def progress(message: str) -> None:
        print(f"  .. {message}", file=sys.stderr, flush=True)

    header = (f"# te_lab GPU check: {devices.device_name(device)} ({device}), torch {torch.__version__}, "
              f"{size}\n")
    print(header, flush=True)
    stages = [
        ("correctness", lambda: correctness(device, dtypes, size, progress), correctness_markdown),
        ("timing", lambda: timing(device, size, args.rounds, 3, progress), timing_markdown),
        ("training", lambda: autocast_training_check(device, model=args.training_model, steps=args.training_steps,
                                                     progress=progress), training_markdown),
        ("profile", lambda: profile_run(device, args.profile_model, args.out, progress), profile_markdown),
        ("generation", lambda: generation.run(generation.GPU_CHECK, device=device, progress=progress),
         generation_markdown),
    ]
    passed = run_stages(stages, args.out, header, progress)
    print((args.out / "gpu-check.md").read_text(encoding="utf-8"))
    print("all checks passed" if passed else "SOME CHECKS FAILED")
    return 0 if passed else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.gpu_checks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
