"""The benchmark table: one row per contender, medians, ratios to the eager baseline
and to torch.compile, achieved bandwidth and FLOP/s."""

from __future__ import annotations


def print_table(case, timings, *, peak_gbs: float, peak_label: str, peak_memory=None) -> None:
    """``peak_memory`` maps contender names to peak bytes, when the case measures it."""
    eager = timings["eager"].median_ms
    compiled = timings["torch.compile"].median_ms
    print(f"| contender | first call ms | median ms (±) | vs eager | vs torch.compile | GB/s | % {peak_label} |"
          + (" GFLOP/s |" if case.flops else "") + (" peak MiB |" if peak_memory else ""))
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if case.flops else "") + ("---:|" if peak_memory else ""))
    for name, timing in timings.items():
        median = timing.median_ms
        gbs = case.bytes_moved / (median * 1e-3) / 1e9
        row = (f"| {name} | {timing.first_call_ms:.0f} | {median:.2f} (±{timing.spread_ms:.2f}) | "
               f"{eager / median:.2f}x | {compiled / median:.2f}x | {gbs:.1f} | {100 * gbs / peak_gbs:.0f}% |")
        if case.flops:
            row += f" {case.flops / (median * 1e-3) / 1e9:.1f} |"
        if peak_memory:
            row += f" {peak_memory[name] / 2**20:.0f} |"
        print(row)
