"""Every te_lab Triton kernel compiled for real GPUs without one, and docs/gpu-kernels.md.

    python -m te_lab.gpu_checks.gpu_kernels record --out records.json
    python -m te_lab.gpu_checks.gpu_kernels compile --records records.json --out results.json [--targets 90,80]
    python -m te_lab.gpu_checks.gpu_kernels doc results-a.json [results-b.json ...] --out docs/gpu-kernels.md

``record`` runs the ops of :mod:`.kernel_scenarios` on CPU tensors with backend="triton"
under Triton's interpreter and keeps each distinct launch (:mod:`.kernel_launches`);
``compile`` compiles each for the targets (:mod:`.kernel_compile`; by default sm_90 and
sm_80, or sm_80 alone under Triton 3.2, the release Moore Threads ships for MUSA) and exits
1 on a compile error, shared memory over a target's limit or a register spill at realistic
sizes; ``doc`` writes the table per kernel and target. Whether te_lab's kernels are
interpreted is fixed when they are defined (importing te_lab), so ``record`` and ``compile``
rerun themselves in a fresh process with ``TRITON_INTERPRET`` set or unset as they need.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _rerun_unless_interpreting(interpret: bool, argv: list[str]):
    """None when this process's kernels are interpreted as ``interpret`` asks, else the exit
    status of this command run again in a process whose TRITON_INTERPRET says so."""
    if (os.environ.get("TRITON_INTERPRET") == "1") == interpret:
        return None
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "te_lab.gpu_checks.gpu_kernels", *argv], env=env).returncode


def newest_triton_targets(triton_version: str) -> list[int]:
    """The targets compiled under a Triton version: sm_80 (A100) under 3.2, the MUSA
    release (MUSA's own targets are not in upstream Triton), sm_90 and sm_80 otherwise."""
    return [80] if triton_version.startswith("3.2.") else [90, 80]


def record(out: Path, multiprocessors: int, only: str | None = None, ci: bool = False) -> int:
    import re

    import torch
    import triton

    from .kernel_launches import recording_launches
    from .kernel_scenarios import scenarios

    failures, started = [], time.perf_counter()
    every_scenario = [s for s in scenarios() if (only is None or re.search(only, s.label)) and (s.in_ci or not ci)]
    with recording_launches(multiprocessors) as log:
        for scenario in every_scenario:
            before = log.launch_count
            with log.scenario(scenario.label):
                try:
                    scenario.run()
                except Exception as error:  # an op refusing its own realistic call is a finding
                    failures.append(f"{scenario.label}: {type(error).__name__}: {error}")
            if log.launch_count == before and not any(f.startswith(scenario.label + ":") for f in failures):
                failures.append(f"{scenario.label}: no Triton launch")
    realistic = {scenario.label for scenario in every_scenario if scenario.realistic}
    records = list(log.records.values())
    for entry in records:
        entry["realistic"] = any(label in realistic for label in entry["scenarios"])
    out.write_text(json.dumps({"triton": triton.__version__, "torch": torch.__version__,
                               "scenario_set": "ci" if ci else "all", "multiprocessors": multiprocessors,
                               "launches": log.launch_count,
                               "seconds": round(time.perf_counter() - started, 1),
                               "scenario_failures": failures, "records": records}, indent=1))
    print(f"record: {len(records)} distinct launches from {log.launch_count} launches, "
          f"{len(failures)} scenario failures -> {out}")
    for failure in failures:
        print(f"  {failure}", file=sys.stderr)
    return 1 if failures else 0


def _compile_in_workers(records: list[dict], targets: list[int], jobs: int) -> list[dict]:
    """compile_records over ``jobs`` worker processes, each a share of the records; the
    results in the order one process would give them."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="te-lab-gpu-kernels-") as folder:
        shares, workers = [records[job::jobs] for job in range(jobs)], []
        for job, share in enumerate(shares):
            (Path(folder) / f"records-{job}.json").write_text(json.dumps({"records": share}))
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "te_lab.gpu_checks.gpu_kernels", "compile", "--records",
                 f"{folder}/records-{job}.json", "--out", f"{folder}/results-{job}.json",
                 "--targets", ",".join(str(t) for t in targets)], stdout=subprocess.DEVNULL))
        for worker in workers:
            worker.wait()  # a worker's problems are judged below, from its results
        per_job = [json.loads((Path(folder) / f"results-{job}.json").read_text())["results"] for job in range(jobs)]
    per_record = len(targets)
    ordered = []
    for index in range(len(records)):
        job, position = index % jobs, index // jobs
        ordered += per_job[job][position * per_record:(position + 1) * per_record]
    return ordered


def compile_(records_path: Path, out: Path, targets: list[int] | None, jobs: int = 1) -> int:
    import triton

    from .kernel_compile import compile_records, problems

    recorded = json.loads(records_path.read_text())
    targets = targets or newest_triton_targets(triton.__version__)
    started = time.perf_counter()
    if jobs > 1:
        results = _compile_in_workers(recorded["records"], targets, jobs)
    else:
        results = compile_records(recorded["records"], targets)
    out.write_text(json.dumps({"triton": triton.__version__, "targets": [f"sm_{t}" for t in targets],
                               "scenario_set": recorded.get("scenario_set", "all"),
                               "seconds": round(time.perf_counter() - started, 1), "results": results}, indent=1))
    failing = [(result, problem) for result in results for problem in problems(result)]
    print(f"compile: Triton {triton.__version__}, {len(results)} compiles for {targets}, "
          f"{len(failing)} problems, {time.perf_counter() - started:.0f} s -> {out}")
    for result, problem in failing:
        print(f"  {result['kernel']} {result['target']} ({result['scenarios'][0]}): {problem}", file=sys.stderr)
    return 1 if failing else 0


def _summary_rows(results: list[dict]) -> list[str]:
    from .kernel_compile import spills

    rows = []
    for kernel in sorted({r["kernel"] for r in results}):
        for target in sorted({r["target"] for r in results}, reverse=True):
            mine = [r for r in results if r["kernel"] == kernel and r["target"] == target]
            ok = [r for r in mine if r["status"] == "ok"]
            if not mine:
                continue
            if not ok:
                rows.append(f"| `{kernel}` | {target} | 0/{len(mine)} | | | | | | |")
                continue
            registers = sorted({r["registers"] for r in ok})
            spilled = [r for r in ok if spills(r)]
            spill_text = (f"{len(spilled)} ({', '.join(sorted({s['scenarios'][0] for s in spilled}))[:120]}; "
                          f"up to {max(s['stack_bytes'] for s in spilled)} B)" if spilled else "0")
            tensor_cores = (("wgmma" if any(r["wgmma"] for r in ok) else "")
                            + (" mma" if any(r["mma"] for r in ok) else "")).strip() or "none"
            rows.append(
                f"| `{kernel}` | {target} | {len(ok)}/{len(mine)} | {registers[0]}-{registers[-1]} | {spill_text} | "
                f"{max(r['shared'] + r['static_shared'] for r in ok)} | {tensor_cores} | "
                f"{','.join(str(w) for w in sorted({r['num_warps'] for r in ok}))} | "
                f"{min(r['occupancy'] for r in ok):.2f}-{max(r['occupancy'] for r in ok):.2f} |")
    return rows


# What each scenario set of ``record`` covers, as the doc's header states it.
_SCENARIO_SETS = {
    "all": "every scenario of `te_lab.gpu_checks.kernel_scenarios` (`record` without `--ci`), "
           "realistic sizes and the larger ones reported only",
    "ci": "only the subset CI compiles (`te_lab.gpu_checks.kernel_scenarios.CI_SCENARIOS`, `record --ci`)",
}


def write_doc(result_paths: list[Path], out: Path) -> None:
    from .kernel_compile import TARGETS

    runs = [json.loads(path.read_text()) for path in result_paths]
    covered = {run.get("scenario_set", "all") for run in runs}
    lines = [
        "# te_lab's Triton kernels on GPUs",
        "",
        "Generated by `python -m te_lab.gpu_checks.gpu_kernels doc` from the compile check in",
        "`tests/test_gpu_kernels.py` (see `te_lab.gpu_checks.gpu_kernels`): every launch te_lab's ops make",
        "at real model sizes, recorded on the CPU and compiled for each target without a GPU.",
        "Per kernel and target: the launch variants that compiled, registers per thread, how many",
        "variants spill registers to local memory (with the scenario and the largest stack frame),",
        "the most shared memory a variant requests (dynamic plus static, bytes), the tensor-core",
        "instructions in its PTX (`wgmma` on sm_90, `mma` on sm_80 and up), num_warps, and the",
        "theoretical occupancy (resident warps over the multiprocessor's maximum, from registers,",
        "warps and shared memory).",
        "",
        "Scenarios: " + "; ".join(_SCENARIO_SETS[name] for name in sorted(covered)) + ".",
        "",
        "Targets: " + "; ".join(f"{t.name} ({t.gpus}, {t.shared_per_block_optin} B shared memory per block)"
                                for t in TARGETS.values()) + ".",
    ]
    for run in runs:
        results = run["results"]
        failed = sum(r["status"] != "ok" for r in results)
        lines += ["", f"## Triton {run['triton']}: {', '.join(run['targets'])}", "",
                  f"{len(results)} compiles of {'CI' if run.get('scenario_set') == 'ci' else 'all'} scenarios "
                  f"(te_lab.gpu_checks.kernel_scenarios), {failed} failed, {run['seconds']:.0f} s on this project's "
                  "shared 2-core machine.", "",
                  "| kernel | target | compiled | registers | variants spilling | shared memory (B) "
                  "| tensor cores | num_warps | occupancy |",
                  "|---|---|---|---|---|---|---|---|---|", *_summary_rows(results)]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_lab.gpu_checks.gpu_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="record the launches te_lab's ops make")
    recording.add_argument("--out", type=Path, required=True)
    recording.add_argument("--multiprocessors", type=int, default=132,
                           help="the GPU's multiprocessor count the reductions are sized for (132: H100/H200)")
    recording.add_argument("--only", help="a regular expression: only the scenarios whose label it finds")
    recording.add_argument("--ci", action="store_true", help="only the scenarios CI compiles (Scenario.in_ci)")
    compiling = commands.add_parser("compile", help="compile recorded launches for GPU targets")
    compiling.add_argument("--records", type=Path, required=True)
    compiling.add_argument("--out", type=Path, required=True)
    compiling.add_argument("--targets", type=lambda text: [int(part) for part in text.split(",")],
                           help="compute capabilities, e.g. 90,80 (default: by Triton version)")
    compiling.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    documenting = commands.add_parser("doc", help="write the Markdown table of compile results")
    documenting.add_argument("results", type=Path, nargs="+")
    documenting.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "record":
        rerun = _rerun_unless_interpreting(True, argv)
        return record(args.out, args.multiprocessors, args.only, args.ci) if rerun is None else rerun
    if args.command == "compile":
        rerun = _rerun_unless_interpreting(False, argv)
        return compile_(args.records, args.out, args.targets, args.jobs) if rerun is None else rerun
    write_doc(args.results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
