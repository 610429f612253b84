"""te_lab.widgets.figures: the dashboard's plotly figures, from hand-made reports with
known numbers (exact assertions) and from one real tiny-Llama profile (everything builds)."""

import pytest
import torch

pytest.importorskip("ipywidgets")  # the Triton 3.2 test environment has no notebook stack
pytest.importorskip("plotly")

import te_lab
from te_lab import models
from te_lab.profiler.report import (
    Ceilings,
    Comparison,
    Environment,
    ModeSummary,
    ProfileReport,
    Region,
    RooflinePoint,
    TimelineEvent,
    Totals,
)
from te_lab.widgets import figures


def _comparison(key, kind, module_type, eager, fused):
    """``eager`` / ``fused``: (forward_ms, backward_ms)."""
    return Comparison(key, kind, module_type, Region(*eager), Region(*fused))


def _report(fp32_tflops=None, series=True) -> ProfileReport:
    modules = [
        _comparison("layers.0.norm", "norm", "RMSNorm", (1.0, 2.0), (0.5, 0.5)),  # saves 2.0
        _comparison("layers.0.mlp", "mlp", "MLP", (4.0, 6.0), (2.0, 3.0)),  # saves 5.0
        _comparison("layers.1.norm", "norm", "RMSNorm", (1.0, 1.0), (0.5, 0.5)),  # saves 1.0
        _comparison("(other)", "other", "", (9.0, 0.0), (1.0, 0.0)),  # saves 8.0, but goes last
    ]
    kinds = [
        _comparison("norm", "norm", "", (2.0, 3.0), (1.0, 1.0)),
        _comparison("mlp", "mlp", "", (4.0, 6.0), (2.0, 3.0)),
        _comparison("other", "other", "", (9.0, 0.0), (1.0, 0.0)),
    ]
    return ProfileReport(
        Environment("cpu", "test cpu", "2.13", None, 2, "float32"),
        modes={"eager": ModeSummary("eager", step_median_ms=20.0, peak_memory_bytes=3 * 2**20),
               "fused": ModeSummary("fused", step_median_ms=10.0, peak_memory_bytes=None)},
        modules=modules, kinds=kinds,
        totals=Totals(speedup=2.0, time_saved_ms=10.0, launches_saved=42, bytes_saved_estimate=5 * 2**20,
                      fused_share=0.5, step_time_change=-0.5, traffic_change=-0.25),
        roofline=[RooflinePoint("eager", "norm", 0.25, 2.0, 8.0, 5.0),
                  RooflinePoint("eager", "mlp", None, None, None, 10.0),
                  RooflinePoint("fused", "norm", 0.25, 5.0, 20.0, 2.0),
                  RooflinePoint("fused", "mlp", 4.0, 100.0, 25.0, 5.0)],
        ceilings=Ceilings(memory_bandwidth_gbs=50.0, fp32_tflops=fp32_tflops, bf16_tflops=None, source="test"),
        timeline=[TimelineEvent("eager", "aten::mm", 0.0, 10.0, "thread 1", "layers.0.mlp", "forward"),
                  TimelineEvent("eager", "aten::mm", 12.0, 20.0, "thread 1", "layers.0.mlp", "backward"),
                  TimelineEvent("fused", "te_lab::glu", 0.0, 5.0, "thread 1", "layers.0.mlp", "forward"),
                  TimelineEvent("fused", "aten::add", 6.0, 1.0, "thread 2", "", "forward"),
                  TimelineEvent("fused", "te_lab::glu_backward", 8.0, 9.0, "thread 1", "layers.0.mlp",
                                "backward")],
        utilization_series=[{"source": "psutil", "unit": "percent", "labels": ["cpu0", "cpu1"],
                             "times_s": [0.0, 0.1, 0.2], "values": [[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]],
                             "formula": "test"}] if series else [],
        utilization_marks=[("eager step 1 start", 0.01), ("eager step 1 end", 0.05),
                           ("fused step 1 start", 0.06), ("fused step 1 end", 0.08),
                           ("fused step 2 start", 0.09)],  # never ended: no band
        notes=[] if series else ["unavailable: nvml: not installed"],
    )


# ---- gains -------------------------------------------------------------------------------------


def test_gain_rows_by_module_sorted_by_time_saved_with_other_last():
    rows = figures.gain_rows(_report(), group_by="module")
    assert [row.label for row in rows] == ["layers.0.mlp", "layers.0.norm", "layers.1.norm", "(other)"]
    assert [row.time_saved_ms for row in rows] == [5.0, 2.0, 1.0, 8.0]
    assert rows[0].keys == ["layers.0.mlp"]
    assert (rows[0].eager_ms, rows[0].fused_ms, rows[0].speedup) == (10.0, 5.0, 2.0)


def test_gain_rows_by_module_type_merges_modules_of_one_type():
    rows = figures.gain_rows(_report(), group_by="module_type")
    assert [row.label for row in rows] == ["MLP", "RMSNorm", "(other)"]
    norm = rows[1]
    assert norm.keys == ["layers.0.norm", "layers.1.norm"]
    assert (norm.eager_ms, norm.fused_ms, norm.time_saved_ms, norm.speedup) == (5.0, 2.0, 3.0, 2.5)


def test_gain_rows_by_kind_lists_the_modules_of_each_kind():
    rows = figures.gain_rows(_report(), group_by="kind")
    assert [(row.label, row.keys) for row in rows] == [
        ("mlp", ["layers.0.mlp"]), ("norm", ["layers.0.norm", "layers.1.norm"]), ("other", ["(other)"])]


@pytest.mark.parametrize("phase, expected", [
    ("forward", {"layers.0.mlp": (4.0, 2.0), "layers.0.norm": (1.0, 0.5), "(other)": (9.0, 1.0)}),
    ("backward", {"layers.0.mlp": (6.0, 3.0), "layers.0.norm": (2.0, 0.5), "(other)": (0.0, 0.0)}),
])
def test_gain_rows_use_only_the_chosen_phase(phase, expected):
    rows = {row.label: row for row in figures.gain_rows(_report(), group_by="module", phase=phase)}
    assert {label: (rows[label].eager_ms, rows[label].fused_ms) for label in expected} == expected
    assert rows["(other)"].speedup == (9.0 if phase == "forward" else None)


@pytest.mark.parametrize("argument, value", [("group_by", "layer"), ("phase", "sideways")])
def test_gain_rows_reject_unknown_choices_naming_the_argument(argument, value):
    with pytest.raises(ValueError, match=f"{argument} must be one of .*'{value}'"):
        figures.gain_rows(_report(), **{argument: value})


def test_gains_figure_draws_eager_and_fused_bars_with_speedup_text():
    figure = figures.gains_figure(_report(), group_by="module_type", phase="both")
    eager, fused = figure.data
    assert (eager.name, fused.name) == ("eager", "fused")
    assert list(eager.x) == list(fused.x) == ["MLP", "RMSNorm", "(other)"]
    assert list(eager.y) == [10.0, 5.0, 9.0]
    assert list(fused.y) == [5.0, 2.0, 1.0]
    assert list(fused.text) == ["2.00x", "2.50x", "9.00x"]
    assert fused.customdata is None and "%{x}" in fused.hovertemplate  # the labels once, as x
    assert figure.layout.barmode == "group"
    assert "module type" in figure.layout.title.text and "both" in figure.layout.title.text


# ---- timeline ----------------------------------------------------------------------------------


def test_timeline_has_a_subplot_per_mode_and_one_bar_per_event():
    figure = figures.timeline_figure(_report())
    assert [a.text for a in figure.layout.annotations] == ["eager", "fused"]
    assert figure.layout.xaxis.matches == "x2"  # shared time axis
    bars = {(trace.xaxis, trace.name): trace for trace in figure.data}
    assert all(trace.type == "bar" and trace.orientation == "h" for trace in figure.data)
    assert sum(len(trace.x) for trace in figure.data) == len(_report().timeline)
    fused_forward = bars[("x2", "forward")]
    assert list(fused_forward.base) == [0.0, 6.0]
    assert list(fused_forward.x) == [5.0, 1.0]
    assert list(fused_forward.y) == ["thread 1", "thread 2"]
    assert list(bars[("x", "backward")].base) == [12.0] and list(bars[("x", "backward")].x) == [20.0]
    assert bars[("x", "forward")].marker.color != bars[("x", "backward")].marker.color
    assert tuple(fused_forward.customdata[1]) == ("aten::add", "(outside any module)")  # the duration is x


# ---- roofline ----------------------------------------------------------------------------------


def _traces(figure):
    return {trace.name: trace for trace in figure.data}


def test_roofline_points_and_memory_ceiling_slope():
    figure = figures.roofline_figure(_report())
    traces = _traces(figure)
    assert set(traces) == {"eager", "fused", "memory ceiling"}  # no compute ceiling without fp32_tflops
    assert list(traces["eager"].x) == [0.25] and list(traces["eager"].text) == ["norm"]  # None point left out
    assert list(traces["fused"].y) == [5.0, 100.0]
    ceiling = traces["memory ceiling"]
    assert len(ceiling.x) == 2
    assert all(y == pytest.approx(50.0 * x) for x, y in zip(ceiling.x, ceiling.y))
    assert ceiling.x[0] <= 0.25 and ceiling.x[1] >= 4.0
    assert (figure.layout.xaxis.type, figure.layout.yaxis.type) == ("log", "log")


def test_roofline_compute_ceiling_when_fp32_peak_is_known():
    traces = _traces(figures.roofline_figure(_report(fp32_tflops=1.0)))
    compute, memory = traces["fp32 compute ceiling"], traces["memory ceiling"]
    assert list(compute.y) == [1000.0, 1000.0]
    ridge = 1000.0 / 50.0
    assert compute.x[0] == memory.x[1] == pytest.approx(ridge)
    assert memory.y[1] == pytest.approx(1000.0)


# ---- utilization -------------------------------------------------------------------------------


def test_utilization_lines_per_channel_and_a_band_per_step():
    figure = figures.utilization_figure(_report())
    assert [(trace.name, list(trace.y)) for trace in figure.data] == [
        ("cpu0", [10.0, 30.0, 50.0]), ("cpu1", [20.0, 40.0, 60.0])]
    assert list(figure.data[0].x) == [0.0, 0.1, 0.2]
    bands = [(shape.x0, shape.x1, shape.legendgroup, shape.showlegend) for shape in figure.layout.shapes]
    assert bands == [(0.01, 0.05, "eager", True), (0.06, 0.08, "fused", True)]


def test_utilization_without_series_says_why():
    figure = figures.utilization_figure(_report(series=False))
    assert not figure.data
    assert "nvml: not installed" in figure.layout.title.text


# ---- cards -------------------------------------------------------------------------------------


def test_summary_cards():
    report = _report()
    report.modes["eager"].profiled_step_ms, report.modes["fused"].compiles = 30.0, 2
    report.modes["eager"].launches, report.modes["fused"].launches = 50, 8
    assert figures.summary_cards(report) == [
        ("step time", "-50.0% (20.000 -> 10.000 ms, 2.00x)"),
        ("memory traffic (estimate)", "-25.0% (5.0 MiB saved)"),
        ("launches saved", "42 (50 -> 8)"),
        ("fusion ceiling", "-"),
        ("peak memory", "eager 3.0 MiB / fused -"),
        ("modules fused", "3"),
        ("profiled / unprofiled step", "eager 1.50x / fused -"),
        ("compiles in measured steps", "eager 0 / fused 2"),
    ]


# ---- a real report -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_report():
    torch.manual_seed(0)
    model = models.llama("tiny")
    batch = model.example_batch(2, 32)
    te_lab.fuse(model, sample=batch, progress=False)
    return te_lab.profile(model, batch, steps=3, warmup=1)


def test_every_figure_builds_from_a_real_report(tiny_llama_report):
    report = tiny_llama_report
    for group_by in figures.GROUP_BY:
        for phase in figures.PHASES:
            figures.gains_figure(report, group_by, phase)
    gains = figures.gains_figure(report)
    assert len(gains.data[0].x) == len(gains.data[1].x) == len(report.kinds)
    # the bars are what the axis says: each mode's kinds add up to its unprofiled step
    assert gains.layout.yaxis.title.text == figures.GAINS_AXIS
    for bars, mode in zip(gains.data, ("eager", "fused")):
        assert sum(bars.y) == pytest.approx(report.modes[mode].step_median_ms, rel=0.01)
    timeline = figures.timeline_figure(report)
    assert sum(len(trace.x) for trace in timeline.data) == len(report.timeline)
    figures.roofline_figure(report)
    figures.utilization_figure(report)
    assert [title for title, _ in figures.summary_cards(report)] == [
        "step time", "memory traffic (estimate)", "launches saved", "fusion ceiling", "peak memory", "modules fused",
        "profiled / unprofiled step", "compiles in measured steps"]
