"""The dashboard widget and the static export, driven from Python (the widget model, not
a browser): what each tab holds, that the controls redraw the gains in place, that the
details list fills the details panel, that each chart's data is in the widget state once
(no plotly.js), the timeline drawn a window at a time, Re-run through a ProfileRun, the
text fallback and the HTML file."""

import copy
import dataclasses
import html
import json

import pytest

pytest.importorskip("ipywidgets")  # the Triton 3.2 test environment has no notebook stack
pytest.importorskip("plotly")

import ipywidgets  # noqa: E402

import te_lab  # noqa: E402
from te_lab import models  # noqa: E402
from te_lab.widgets import Dashboard  # noqa: E402
from te_lab.widgets.figures import TIMELINE_PAGE_EVENTS  # noqa: E402
from te_lab.widgets.plots import PLOTLY_MIME  # noqa: E402


@pytest.fixture(scope="module")
def profile_run():
    model = models.llama("tiny", seed=0)
    batch = model.example_batch(2, 16)
    te_lab.fuse(model, sample=batch, progress=False)
    return te_lab.ProfileRun(model, batch, steps=2, warmup=1)


@pytest.fixture(scope="module")
def report(profile_run):
    # glu forced onto its C++ kernel: the measured choice may pick the unfused math
    # (reference) on this machine, and then the profile holds no te_lab::glu op to show.
    with te_lab.use_backend(glu="cpp"):
        return profile_run.run()


def bar_labels(plot):
    return [list(trace["x"]) for trace in shown(plot)["data"]]


def shown(plot):
    """The figure the Output widget holds, as the frontend receives it."""
    (output,) = plot.outputs
    return output["data"][PLOTLY_MIME]


def test_the_dashboard_draws_every_tab(report):
    dashboard = Dashboard(report)
    assert [trace["name"] for trace in shown(dashboard.gains)["data"]] == ["eager", "fused"]
    assert len(shown(dashboard.gains)["data"][0]["x"]) == len(report.kinds)
    assert shown(dashboard.timeline)["data"] and shown(dashboard.roofline)["data"]
    assert "(other)" in dashboard.other.value and "Fusion does not change it" in dashboard.other.value
    assert "effective parallelism" in dashboard.utilization_table.value
    assert "process CPU time / wall time" in dashboard.utilization_table.value
    assert dashboard.cards.value.index("step time") < dashboard.cards.value.index("memory traffic") \
        < dashboard.cards.value.index("launches saved")  # the headline comes first, in this order
    ceiling = shown(dashboard.ceiling)["data"]
    assert [trace["name"] for trace in ceiling] == ["GEMMs and attention", "the rest"]
    assert list(ceiling[0]["y"]) == ["eager", "fused", "ceiling"]
    assert html.escape(report.ceiling.verdict()) in dashboard.cards.value


def test_group_by_and_phase_redraw_the_gains_in_place(report):
    dashboard = Dashboard(report)
    widget = dashboard.gains
    by_kind = bar_labels(widget)
    dashboard.group_by.value = "module"
    assert dashboard.gains is widget
    by_module = bar_labels(widget)
    assert len(by_module[0]) == len(report.modules) and by_module != by_kind
    both = list(shown(widget)["data"][0]["y"])
    dashboard.phase.value = "forward"
    forward = list(shown(widget)["data"][0]["y"])
    assert all(f <= b + 1e-9 for f, b in zip(sorted(forward), sorted(both))) and forward != both


def test_other_is_explained_per_mode_and_a_change_fusion_cannot_cause_is_flagged(report):
    from te_lab.profiler.report import OTHER_KEY

    other = next(c for c in report.modules if c.key == OTHER_KEY)
    text = Dashboard(report).other.value
    assert f"Eager: {other.eager.total_ms:.3f} ms" in text and f"fused: {other.fused.total_ms:.3f} ms" in text
    assert ("a difference fusion cannot cause" in text) == bool(other.distinguishable)
    changed = copy.deepcopy(report)
    moved = next(c for c in changed.modules if c.key == OTHER_KEY)
    moved.fused.forward_ms, moved.fused.backward_ms = moved.eager.total_ms / 1.6, 0.0
    moved.speedup_low, moved.speedup_high = 1.4, 1.8
    assert "Here it changed 1.60x [1.40, 1.80]: a difference fusion cannot cause" in Dashboard(changed).other.value


def test_choosing_a_row_fills_the_details_panel(report):
    dashboard = Dashboard(report)
    dashboard.group_by.value = "module"
    assert "model.layers.0.mlp" in [value for _, value in dashboard.detail_row.options]
    dashboard.detail_row.value = "model.layers.0.mlp"
    assert "model.layers.0.mlp" in dashboard.details.value
    assert "te_lab::glu [[2, 16, 176], [2, 16, 176]]" in dashboard.details.value  # the op and its input shapes
    assert "GB/s" in dashboard.details.value and "probe (sample)" in dashboard.details.value
    mlp = next(c for c in report.modules if c.key == "model.layers.0.mlp")
    assert f"[{mlp.speedup_low:.2f}, {mlp.speedup_high:.2f}] (95% interval)" in dashboard.details.value
    dashboard.group_by.value = "kind"  # new rows: the panel empties
    assert dashboard.detail_row.value == "" and "Choose a row" in dashboard.details.value


def test_each_chart_is_in_the_widget_state_once_without_plotly_js(report):
    """plotly's FigureWidget put its 5 MB plotly.js bundle into every chart's widget state;
    the charts are now Output widgets holding the figure's JSON once."""
    before = set(ipywidgets.Widget.widgets)
    dashboard = Dashboard(report)
    dashboard.group_by.value = "module"  # a redraw replaces the chart's data, it does not add to it
    ours = {key: widget for key, widget in ipywidgets.Widget.widgets.items() if key not in before}
    states = {key: widget.get_state() for key, widget in ours.items()}
    assert not any("_esm" in state for state in states.values())
    plotted = [state for state in states.values() if state.get("_model_name") == "OutputModel" and state["outputs"]]
    assert len(plotted) == 6  # gains, fusion ceiling, timeline, utilization, roofline, opportunities
    assert all(len(state["outputs"]) == 1 and PLOTLY_MIME in state["outputs"][0]["data"] for state in plotted)
    size = len(json.dumps(list(states.values())))
    timeline = len(json.dumps(shown(dashboard.timeline)))
    assert size < 2 * timeline + 200_000, (size, timeline)  # the timeline once, and little beside it


def test_a_long_timeline_is_drawn_a_window_at_a_time(report):
    events = [event for event in report.timeline if event.mode == "eager"]
    end = max(e.start_us + e.duration_us for e in events)
    long_timeline = [dataclasses.replace(e, start_us=e.start_us + copy * end) for copy in range(
        TIMELINE_PAGE_EVENTS // len(events) * 3) for e in events]
    long_report = dataclasses.replace(report, timeline=long_timeline + [e for e in report.timeline
                                                                        if e.mode == "fused"])
    dashboard = Dashboard(long_report)
    windows = len(dashboard.timeline_page.options)
    assert windows >= 3 and dashboard.timeline_page.layout.display is None
    drawn = sum(len(trace["x"]) for trace in shown(dashboard.timeline)["data"])
    assert drawn <= 1.2 * TIMELINE_PAGE_EVENTS + len(report.timeline)
    first = shown(dashboard.timeline)["data"][0]["base"]
    dashboard.timeline_page.value = windows - 1
    last = shown(dashboard.timeline)["data"][0]["base"]
    assert min(last) > max(first)  # a later window of the step
    assert Dashboard(report).timeline_page.layout.display == "none"  # a short step is one window


def test_rerun_profiles_again_with_progress_and_redraws(report, profile_run):
    dashboard = Dashboard(report, rerun=profile_run)
    assert not dashboard.rerun_button.disabled
    new_report = dashboard.rerun()
    assert new_report is not report and dashboard.report is new_report
    assert dashboard.progress.value == dashboard.progress.max > 0
    assert not dashboard.rerun_button.disabled


def test_without_a_profile_run_there_is_nothing_to_rerun(report):
    loaded = te_lab.ProfileReport.from_json(report.to_json())
    assert not hasattr(loaded, "rerun") and not hasattr(report, "rerun")  # the report is data only
    dashboard = Dashboard(loaded)
    assert dashboard.rerun_button.disabled and "No ProfileRun was given" in dashboard.rerun_button.tooltip
    assert dashboard.rerun() is None


def test_show_without_a_widget_frontend_prints_the_summary(report, capsys):
    assert te_lab.show(report) is None
    assert capsys.readouterr().out.strip() == report.summary().strip()


def test_static_export_is_one_self_contained_file(report, tmp_path):
    path = te_lab.to_html(report, tmp_path / "report.html")
    text = path.read_text(encoding="utf-8")
    assert len(text) > 1_000_000  # plotly.js inlined
    assert "<script src=" not in text.replace('<script src="data:', "")  # nothing fetched from a network
    assert text.count('class="plotly-graph-div"') == 5 + 2  # and the Opportunities chart of each mode
    assert "speedup" in text and "process CPU time / wall time" in text
    with pytest.raises(ValueError, match="must end in .html"):
        te_lab.to_html(report, tmp_path / "report.txt")

