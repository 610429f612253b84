"""The markdown report of a results object: the machine, the targets (met or not,
plainly), the end-to-end table, a per-op summary (one row per case, size, dtype and
mode) and every contender's figures."""

from __future__ import annotations

from typing import Optional

from .dispatch import markdown as dispatch_table
from .generation import markdown as generation_table


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _speedup_cell(record: dict, contender: str, over: str) -> str:
    found = next((s for s in record["speedups"] if s["contender"] == contender and s["over"] == over), None)
    if found is None:
        return "-"
    return f"{found['value']:.2f}x [{found['interval_low']:.2f}-{found['interval_high']:.2f}]"


def machine_lines(results: dict) -> list[str]:
    env = results["environment"]
    versions = ", ".join(f"{name} {version}" for name, version in env["versions"].items() if version)
    peak = env["peak"]
    flops = "" if peak["fp32_tflops"] is None else (f", {peak['fp32_tflops']} TFLOP/s fp32, "
                                                    f"{peak['bf16_tflops']} TFLOP/s bf16")
    return [
        f"- command: `{results['command']}`",
        f"- run: {env['created_utc']}",
        f"- device: {env['device_name']} (`{env['device']}`), {env['parallel_units']} parallel units, "
        f"{env['cpu_count']} CPUs, torch threads {env['torch_threads']}, 1-min load average at start "
        f"{env['load_average_1min']}",
        f"- measured copy bandwidth: {env['copy_bandwidth_gbs']:.1f} GB/s; peak: {peak['memory_bandwidth_gbs']:.1f} "
        f"GB/s{flops} ({peak['source']})",
        f"- Python {env['python']} on {env['platform']}; {versions}",
    ]


def targets_table(results: dict) -> list[str]:
    lines = ["| target | met | measured |", "|---|---|---|"]
    for target in results["targets"]:
        met = {True: "**yes**", False: "**NO**", None: "not measured"}[target["met"]]
        lines.append(f"| {target['target']} | {met} | {target['measured']} |")
    misses = [(t["target"], line) for t in results["targets"] if t["met"] is False for line in t["detail"]]
    if misses:
        lines += ["", "Missed:", ""] + [f"- {target}: {line}" for target, line in misses]
    return lines


def models_table(results: dict) -> list[str]:
    lines = ["| model | mode | contender | first call ms | time to first step s | median ms (±) | tokens/s "
             "| peak MiB | vs eager [95% CI] | vs torch.compile [95% CI] |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for record in results["models"]:
        for c in record["contenders"]:
            if c["error"] is not None:
                lines.append(f"| {record['model']} | {record['mode']} | {c['name']} | failed: {c['error']} "
                             "| | | | | | |")
                continue
            lines.append(
                f"| {record['model']} | {record['mode']} | {c['name']} | {c['first_call_ms']:.0f} "
                f"| {c['time_to_first_step_s']:.1f} | {c['median_ms']:.1f} (±{c['spread_ms']:.1f}) "
                f"| {c['tokens_per_s']:,.0f} | {_mib(c['peak_memory_bytes'])} "
                f"| {_speedup_cell(record, c['name'], 'eager')} "
                f"| {_speedup_cell(record, c['name'], 'torch.compile')} |")
    notes = []
    for record in results["models"]:
        check = record["check"]
        if check is not None:
            notes.append(f"- {record['model']} {record['mode']}: {record['parameters']:,} parameters, batch "
                         f"{record['batch']} x seq {record['seq']}; "
                         f"fuse {record['fuse_s']:.1f} s ({record['fusion']}); "
                         f"eager vs te_lab {check['compared']} max |diff| {check['max_abs_difference']:.2g}")
    return lines + ([""] + notes if notes else [])


def _auto_name(record: dict) -> Optional[str]:
    return next((c["name"] for c in record["contenders"] if c["kind"] == "te_lab" and c["auto"]), None)


def ops_summary_table(results: dict) -> list[str]:
    lines = ["| case | T x H | dtype | mode | te_lab (auto) | median ms | eager ms | torch.compile ms "
             "| te_lab vs eager | te_lab vs torch.compile | te_lab vs liger |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for record in results["ops"]:
        by_name = {c["name"]: c for c in record["contenders"]}
        auto = _auto_name(record)
        size = record["size"]
        median = lambda name: _ms(by_name[name]["median_ms"]) if name in by_name else "-"  # noqa: E731
        lines.append(f"| {record['case']} | {size['tokens']} x {size['hidden']} | {record['dtype']} "
                     f"| {record['mode']} | {auto or '-'} | {median(auto)} | {median('eager')} "
                     f"| {median('torch.compile')} | {_speedup_cell(record, auto, 'eager')} "
                     f"| {_speedup_cell(record, auto, 'torch.compile')} | {_speedup_cell(record, auto, 'liger')} |")
    return lines


def ops_detail_table(results: dict) -> list[str]:
    lines = ["| case | T x H | dtype | mode | contender | first call ms | median ms (±) | GB/s | % copy "
             "| TFLOP/s | peak MiB | vs eager |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for record in results["ops"]:
        size = record["size"]
        where = f"| {record['case']} | {size['tokens']} x {size['hidden']} | {record['dtype']} | {record['mode']} "
        for c in record["contenders"]:
            label = c["name"] + (" (auto)" if c["auto"] else "")
            if c["error"] is not None:
                lines.append(where + f"| {label} | failed: {c['error']} | | | | | | |")
                continue
            tflops = "-" if c["tflops"] is None else f"{c['tflops']:.3f}"
            lines.append(where + f"| {label} | {c['first_call_ms']:.0f} | {c['median_ms']:.3f} (±{c['spread_ms']:.3f}) "
                         f"| {c['gbs']:.1f} | {100 * c['fraction_of_copy_bandwidth']:.0f}% | {tflops} "
                         f"| {_mib(c['peak_memory_bytes'])} | {_speedup_cell(record, c['name'], 'eager')} |")
    return lines


def markdown(results: dict, *, title: str = "te_lab benchmark results") -> str:
    sections = [f"# {title}", "", *machine_lines(results), "",
                "Contenders run interleaved (the order rotates every round) after warm-up calls; times are "
                "medians, (±) half the interquartile range; `vs X` is X's median over the contender's (above 1: "
                "faster) with a 95% bootstrap interval over paired rounds. GB/s is the bytes the op must move "
                "(benchmarks/cases.py) over the median time.", "",
                "## Targets", "", *targets_table(results), ""]
    if results["failures"]:
        sections += ["## Failures", "", *(f"- {f['where']}: {f['error']}" for f in results["failures"]), ""]
    if results["models"]:
        sections += ["## End to end", "", *models_table(results), ""]
    if results.get("dispatch"):
        sections += ["## Per call: te_lab's ops against their own kernels (benchmarks/dispatch.py)", "",
                     "Forward and backward together; `kernels alone` calls each te_lab op's implementation "
                     "directly with the arguments the op passed it; `autograd round trip` is the gradient of a "
                     "view of each input, the engine's fixed cost that eager code pays as well; overhead per "
                     "call = (te_lab - kernels - autograd round trip) / te_lab op calls.", "",
                     *dispatch_table(results["dispatch"]), ""]
    if results.get("generation"):
        sections += ["## Generation (benchmarks/generation.py)", "",
                     "Greedy decoding after a random prompt; prefill is the forward over the prompt, decode every "
                     "step after it, tokens/s over every row of the batch. Hugging Face models decode through their "
                     "KV cache (a static one under torch.compile); demo models have none and rerun the sequence. "
                     "`tokens = eager`: the mode generated eager's tokens.", "",
                     *generation_table(results["generation"]), ""]
    if results["ops"]:
        sections += ["## Per op: te_lab against the baselines", "", *ops_summary_table(results), "",
                     "## Per op: every contender", "", *ops_detail_table(results), ""]
    return "\n".join(sections)
