"""The dashboard as a user sees it: a real JupyterLab on 127.0.0.1, driven by Chromium
through Playwright. A notebook fuses and profiles the demo's Llama at the demo's batch
and shows the dashboard; the test runs all cells and reads the DOM: the widget rendered, the plotly
charts (plotly's MIME output, drawn by the jupyterlab-plotly extension) have their SVG and
the expected bars, the group-by control redraws the bars, choosing a row under "details
of" fills the details panel, the Opportunities tab ranks the finder's rows (what fusion left,
then the eager step's with their realized gains), no cell shows an error. The static HTML export
then opens in the same browser with the network blocked and must draw its charts. A
second notebook profiles a tiny fused Qwen3-MoE (``hf:qwen3_moe``) and its dashboard's
Expert load tab draws the heatmap, a row per MoE layer labelled with its imbalance.

Screenshots go to test-artifacts/ (git-ignored). CI installs Debian's chromium
(.ci/run); elsewhere the test is skipped when chromium is missing.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from servers import free_port, serving
from te_lab.cache import cache_directory
from te_lab.cli.demo import DEFAULT_BATCH, DEFAULT_MODEL, DEFAULT_SEQ

playwright_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("jupyterlab")

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
TIMEOUT_MS = 180_000

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"the browser test needs {CHROMIUM}; .ci/run installs Debian's chromium")
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.browser

# The demo's model and batch (``te-lab demo``, ``make demo``): README's screenshot is this
# test's, and its caption quotes the cards of a run at this size.
NOTEBOOK_CELLS = [
    "import te_lab\nfrom te_lab import models",
    f"model = models.build_model({DEFAULT_MODEL!r}, seed=0)\n"
    f"batch = model.example_batch({DEFAULT_BATCH}, {DEFAULT_SEQ})\n"
    "fusion = te_lab.fuse(model, sample=batch, progress=False)\nlen(fusion.fused)",
    "report = te_lab.profile(model, batch, steps=2, warmup=1)\nprint('kinds', len(report.kinds), "
    "'modules', len(report.modules), 'left', len(report.opportunities['fused'].rows), 'before', "
    "len(report.opportunities['eager'].rows))",
    "te_lab.show(report)",
    "te_lab.to_html(report, 'report.html')",
]
# A tiny Qwen3-MoE built from its config (2 layers, 32 experts, top-4), only its MoE blocks
# fused (the other rules' probes would add a minute on a loaded 2-core machine).
MOE_CELLS = [
    "import te_lab\nfrom te_lab import models",
    "model = models.build_model('hf:qwen3_moe', seed=0)\nbatch = models.example_batch(model, 2, 16)\n"
    "fusion = te_lab.fuse(model, sample=batch, only=['moe'], progress=False)\nlen(fusion.fused)",
    "report = te_lab.profile(model, batch, steps=2, warmup=1)\nload = report.expert_load\n"
    "print('layers', len(load.layers), 'experts', len(load.layers[0].tokens_per_expert), 'overall', "
    "f'{load.imbalance:.2f}x')",
    "te_lab.show(report)",
]


def write_notebook(path: Path, sources: list) -> None:
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": source}
             for source in sources]
    notebook = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                                            "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(notebook), encoding="utf-8")


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """A JupyterLab server of its own: free port, no token, its own HOME and root dir."""
    home = tmp_path_factory.mktemp("home")
    root = tmp_path_factory.mktemp("root")
    config = home / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    # The "Jupyter news" notice would cover the screenshots.
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    write_notebook(root / "dashboard.ipynb", NOTEBOOK_CELLS)
    write_notebook(root / "moe.ipynb", MOE_CELLS)
    port = free_port()
    # The kernel keeps this process's te_lab cache (C++ kernels built, choices measured), as
    # a user's notebook has its own, so no cell shows a build's messages.
    environment = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(cache_directory().parent),
                   "JUPYTER_CONFIG_DIR": str(config),
                   "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "IPYTHONDIR": str(home / "ipython")}
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--IdentityProvider.token=",
               "--ServerApp.password=", f"--ServerApp.root_dir={root}"]
    url = f"http://127.0.0.1:{port}"
    with serving(command, ready_url=f"{url}/api/status", log=home / "jupyterlab.log", env=environment):
        yield url, root, home


@pytest.fixture(scope="module")
def browser(jupyterlab):
    _, _, home = jupyterlab
    with playwright_api.sync_playwright() as playwright:
        instance = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-background-networking", "--disable-gpu", "--no-first-run",
                  "--disable-component-update", "--disable-sync"],
            env={**os.environ, "HOME": str(home)})
        try:
            yield instance
        finally:
            instance.close()


def run_all_cells(page, cells: list) -> None:
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=TIMEOUT_MS)
    page.wait_for_function(f"document.querySelectorAll('.jp-Notebook .jp-Cell').length === {len(cells)}",
                           timeout=TIMEOUT_MS)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_text("Run All Cells", exact=True).click()
    # every cell has run when the last one shows its execution count
    page.wait_for_function(
        "[...document.querySelectorAll('.jp-InputArea-prompt')].every(p => /\\[\\d+\\]/.test(p.textContent))",
        timeout=TIMEOUT_MS)


def bars(dashboard) -> int:
    return dashboard.locator(".js-plotly-plot").first.locator("g.trace.bars g.point").count()


def wait_for_ticks(page, count: int) -> None:
    """Until the gains chart (the first plot) has ``count`` x-axis labels."""
    page.wait_for_function(
        "n => { const plot = document.querySelector('.te-lab-dashboard .js-plotly-plot');"
        " return plot !== null && plot.querySelectorAll('g.xtick').length === n; }", arg=count, timeout=TIMEOUT_MS)


def test_the_dashboard_renders_and_responds_in_jupyterlab(jupyterlab, browser):
    url, root, _ = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/lab/tree/dashboard.ipynb", timeout=TIMEOUT_MS)
    run_all_cells(page, NOTEBOOK_CELLS)
    dashboard = page.locator(".te-lab-dashboard")
    dashboard.wait_for(timeout=TIMEOUT_MS)
    counts = page.locator(".jp-OutputArea-output pre", has_text="modules").first.text_content().split()
    kinds, modules, left, before = int(counts[1]), int(counts[3]), int(counts[5]), int(counts[7])

    # the gains chart: a pair of bars (eager, fused) per op kind, one axis label each
    gains = dashboard.locator(".js-plotly-plot").first
    gains.locator("svg.main-svg").first.wait_for(timeout=TIMEOUT_MS)
    wait_for_ticks(page, kinds)
    assert bars(dashboard) == 2 * kinds
    cards = dashboard.locator(".te-lab-cards").text_content()
    assert cards.index("step time") < cards.index("memory traffic") < cards.index("launches saved")
    assert "fusion ceiling" in cards and "available" in cards
    # the fusion ceiling below the gains: eager, fused and the ceiling, each compute + the rest
    ceiling = dashboard.locator(".js-plotly-plot", has_text="GEMMs and attention")
    ceiling.locator("g.trace.bars g.point").first.wait_for(timeout=TIMEOUT_MS)
    assert ceiling.locator("g.trace.bars g.point").count() == 6
    assert sorted(ceiling.locator("g.ytick text").all_text_contents()) == ["ceiling", "eager", "fused"]
    page.screenshot(path=str(ARTIFACTS / "dashboard-gains.png"), full_page=True)

    # group by module instance: a pair of bars per module
    dashboard.locator("select").first.select_option(label="module instance")
    wait_for_ticks(page, modules)
    assert bars(dashboard) == 2 * modules
    labels = gains.locator("g.xtick text").all_text_contents()
    assert "model.layers.0.mlp" in labels and len(labels) == modules

    # choosing a row under "details of" fills the details panel
    dashboard.locator(".widget-dropdown", has_text="details of").locator("select").select_option(
        label="model.layers.0.mlp")
    details = dashboard.locator(".te-lab-details")
    try:
        details.wait_for(timeout=60_000)
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard-details.png"), full_page=True)
    assert "speedup" in details.text_content() and "launches" in details.text_content()
    assert "95% interval" in details.text_content()

    # the other tabs draw their charts
    for tab in ("Timeline", "Utilization", "Roofline"):
        dashboard.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(500)
    assert dashboard.locator(".js-plotly-plot svg.main-svg").count() >= 4
    page.screenshot(path=str(ARTIFACTS / "dashboard-roofline.png"), full_page=True)

    # the Opportunities tab: what fusion left, ranked, then the eager step's rows with their realized gains
    dashboard.get_by_role("tab", name="Opportunities").click()
    chart = dashboard.locator(".js-plotly-plot", has_text="what fusion left")
    try:
        chart.locator("svg.main-svg").first.wait_for(timeout=60_000)
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard-opportunities-left.png"), full_page=True)
    assert chart.locator("g.trace.bars g.point").count() == min(left, 15)
    dashboard.get_by_role("button", name="before fusing").click()
    chart = dashboard.locator(".js-plotly-plot", has_text="before fusing")
    chart.locator("g.trace.bars g.point").first.wait_for(timeout=TIMEOUT_MS)
    assert before > 0 and chart.locator("g.trace.bars g.point").count() == 2 * min(before, 15)  # estimated, realized
    assert sorted(chart.locator("g.legend text.legendtext").all_text_contents()) == ["estimated gain",
                                                                                     "realized gain"]
    labels = chart.locator("g.ytick text").all_text_contents()
    assert sorted(int(t.split(".")[0]) for t in labels) == list(range(1, min(before, 15) + 1))  # ranked
    assert all("(forward)" in t or "(backward)" in t for t in labels)
    page.screenshot(path=str(ARTIFACTS / "dashboard-opportunities.png"), full_page=True)

    assert dashboard.get_by_role("tab", name="Expert load").count() == 0  # a dense model has no expert load
    assert page.locator('[data-mime-type="application/vnd.jupyter.error"]').count() == 0
    page.close()


def test_the_expert_load_heatmap_of_a_fused_moe_model(jupyterlab, browser):
    url, _, _ = jupyterlab
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # ?reset: JupyterLab would otherwise restore its workspace, the first test's notebook open beside this one
    page.goto(f"{url}/lab/tree/moe.ipynb?reset", timeout=TIMEOUT_MS)
    run_all_cells(page, MOE_CELLS)
    dashboard = page.locator(".te-lab-dashboard")
    dashboard.wait_for(timeout=TIMEOUT_MS)
    printed = page.locator(".jp-OutputArea-output pre", has_text="overall").first.text_content().split()
    layers, experts, overall = int(printed[1]), int(printed[3]), printed[5]
    assert (layers, experts) == (2, 32)

    dashboard.get_by_role("tab", name="Expert load").click()
    heatmap = dashboard.locator(".js-plotly-plot", has=page.locator("g.hm"))
    try:
        heatmap.locator("g.hm image").wait_for(timeout=60_000)  # the heatmap's cells, drawn as one image
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard-expert-load.png"), full_page=True)
    rows = heatmap.locator("g.ytick text").all_text_contents()
    assert sorted(row.split(" (")[0] for row in rows) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(row.endswith("x)") for row in rows)  # each layer's imbalance
    assert f"imbalance {overall} overall" in heatmap.locator("g.infolayer .gtitle").text_content()
    assert page.locator('[data-mime-type="application/vnd.jupyter.error"]').count() == 0
    page.close()


def test_the_static_export_renders_offline(jupyterlab, browser):
    _, root, _ = jupyterlab
    export = root / "report.html"
    assert export.exists(), "the notebook's last cell writes report.html (run the dashboard test first)"
    context = browser.new_context()
    requests = []

    def block_network(route):
        requests.append(route.request.url)
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            route.abort()

    context.route("**/*", block_network)
    page = context.new_page()
    page.goto(export.as_uri(), timeout=TIMEOUT_MS)
    page.wait_for_function("document.querySelectorAll('.plotly-graph-div svg.main-svg').length >= 5",
                           timeout=TIMEOUT_MS)
    assert page.locator(".plotly-graph-div").count() == 7  # and the Opportunities chart of each mode
    assert [url for url in requests if not url.startswith("file:")] == []
    page.screenshot(path=str(ARTIFACTS / "static-export.png"), full_page=True)
    shutil.copy(export, ARTIFACTS / "static-export.html")
    context.close()
