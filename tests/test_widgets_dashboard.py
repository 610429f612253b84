"""The dashboard widget and the static export, driven from Python (the widget model, not
a browser): what each tab holds, that the controls redraw the gains in place, that a
click fills the details panel, Re-run through a ProfileRun, the text fallback and the HTML file."""

import pytest

pytest.importorskip("ipywidgets")  # the Triton 3.2 test environment has no notebook stack
Points = pytest.importorskip("plotly.callbacks").Points

import te_lab  # noqa: E402
from te_lab import models  # noqa: E402
from te_lab.widgets import Dashboard  # noqa: E402


@pytest.fixture(scope="module")
def profile_run():
    model = models.llama("tiny", seed=0)
    batch = model.example_batch(2, 16)
    te_lab.fuse(model, sample=batch, progress=False)
    return te_lab.ProfileRun(model, batch, steps=2, warmup=1)


@pytest.fixture(scope="module")
def report(profile_run):
    return profile_run.run()


def bar_labels(figure_widget):
    return [list(trace.x) for trace in figure_widget.data]


def test_the_dashboard_draws_every_tab(report):
    dashboard = Dashboard(report)
    assert [trace.name for trace in dashboard.gains.data] == ["eager", "fused"]
    assert len(dashboard.gains.data[0].x) == len(report.kinds)
    assert len(dashboard.timeline.data) > 0 and len(dashboard.roofline.data) > 0
    assert "effective parallelism" in dashboard.utilization_table.value
    assert "process CPU time / wall time" in dashboard.utilization_table.value
    assert dashboard.cards.value.index("step time") < dashboard.cards.value.index("memory traffic") \
        < dashboard.cards.value.index("launches saved")  # the headline comes first, in this order


def test_group_by_and_phase_redraw_the_gains_in_place(report):
    dashboard = Dashboard(report)
    widget = dashboard.gains
    by_kind = bar_labels(widget)
    dashboard.group_by.value = "module"
    assert dashboard.gains is widget
    by_module = bar_labels(widget)
    assert len(by_module[0]) == len(report.modules) and by_module != by_kind
    both = list(widget.data[0].y)
    dashboard.phase.value = "forward"
    forward = list(widget.data[0].y)
    assert all(f <= b + 1e-9 for f, b in zip(sorted(forward), sorted(both))) and forward != both


def test_clicking_a_bar_fills_the_details_panel(report):
    dashboard = Dashboard(report)
    dashboard.group_by.value = "module"
    trace = dashboard.gains.data[1]
    index = list(trace.customdata).index("model.layers.0.mlp")
    dashboard._show_details(trace, Points(point_inds=[index], xs=[trace.x[index]], ys=[trace.y[index]],
                                          trace_name="fused", trace_index=1), None)
    assert "model.layers.0.mlp" in dashboard.details.value
    assert "te_lab::glu [[2, 16, 176], [2, 16, 176]]" in dashboard.details.value  # the op and its input shapes
    assert "GB/s" in dashboard.details.value and "probe (sample): output max abs err" in dashboard.details.value


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
    assert text.count('class="plotly-graph-div"') == 4
    assert "speedup" in text and "process CPU time / wall time" in text
    with pytest.raises(ValueError, match="must end in .html"):
        te_lab.to_html(report, tmp_path / "report.txt")

