"""A saved notebook with the dashboard stays light: one profile of a 30-layer model (tiny
width, so it runs in about a minute), shown with te_lab.show, executed by nbconvert's
executor and saved with its widget state, as `jupyter nbconvert --execute` saves it.
plotly's FigureWidget put its 5 MB plotly.js into each of the dashboard's four charts;
the dashboard's charts now carry their data once."""

import json

import pytest

nbformat = pytest.importorskip("nbformat")
ExecutePreprocessor = pytest.importorskip("nbconvert.preprocessors").ExecutePreprocessor
pytest.importorskip("ipywidgets")

from te_lab.widgets.plots import PLOTLY_MIME  # noqa: E402

LAYERS = 30
SAVED_LIMIT_BYTES = 2 * 2**20
CELLS = [
    "import te_lab\nfrom te_lab import models",
    f"model = models.llama('tiny', seed=0, num_layers={LAYERS})\nbatch = model.example_batch(1, 8)\n"
    "fusion = te_lab.fuse(model, sample=batch, progress=False)",
    "report = te_lab.profile(model, batch, steps=2, warmup=1)\nlen(report.timeline)",
    "te_lab.show(report)",
]


@pytest.mark.slow  # profiles a 30-layer model in a kernel of its own
def test_a_saved_notebook_with_a_30_layer_dashboard_stays_under_2_mb(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    ExecutePreprocessor(timeout=600, kernel_name="python3", store_widget_state=True).preprocess(
        notebook, {"metadata": {"path": str(tmp_path)}})
    path = tmp_path / "dashboard.ipynb"
    nbformat.write(notebook, path)
    outputs = [output for cell in notebook.cells for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not any("USDT:" in o.get("text", "") for o in outputs)  # no profiler chatter in the cells
    events = int(notebook.cells[2].outputs[0]["data"]["text/plain"])
    assert events > 5000  # a long step: the timeline is drawn a window at a time
    state = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    assert any(model["model_name"] == "VBox" or model["model_name"] == "VBoxModel" for model in state.values())
    charts = [model["state"]["outputs"] for model in state.values()
              if model["model_name"] == "OutputModel" and model["state"].get("outputs")]
    assert len(charts) == 6 and all(PLOTLY_MIME in chart[0]["data"] for chart in charts)
    assert not any("_esm" in model["state"] for model in state.values())  # no plotly.js in the state
    size = path.stat().st_size
    assert size < SAVED_LIMIT_BYTES, f"{size / 2**20:.2f} MB saved, largest models: " + str(sorted(
        (len(json.dumps(model)), model["model_name"]) for model in state.values())[-4:])
