"""The README, CONTRIBUTING.md and docs/ (docs/design.md among them) name only what
exists: every ``te_lab.*`` name resolves, every ``te-lab`` command, ``make`` target and
magic is real, the notebook table lists exactly the notebooks, and every relative link
points at a tracked file or one a make target writes."""

import importlib
import re
from pathlib import Path

import pytest

from te_lab.cli import build_parser
from te_lab.extensions import MAGIC_NAMES

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
MAKEFILE = (REPO / "Makefile").read_text(encoding="utf-8")


def text_of(document: Path) -> str:
    return document.read_text(encoding="utf-8")


def resolves(dotted: str) -> bool:
    """Whether ``te_lab.a.b`` is a module or an attribute reached from one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[split:]:
                value = getattr(value, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_every_te_lab_name_exists(document):
    # "te_lab.module:<path>" is a profiler region label, not a Python name; in
    # "torch.ops.te_lab.attention" te_lab is the op namespace
    names = set(re.findall(r"(?<![\w.])te_lab(?:\.[A-Za-z_]\w*)+(?![\w:])", text_of(document)))
    assert sorted(name for name in names if not resolves(name)) == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_every_command_target_and_magic_exists(document):
    text = text_of(document)
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(re.findall(r"\bte-lab ([\w-]+)", text)) <= set(commands)
    targets = set(re.findall(r"^([\w-]+):", MAKEFILE, flags=re.MULTILINE))
    assert set(re.findall(r"`make ([\w-]+)", text)) <= targets
    assert set(re.findall(r"%%?(te_\w+)", text)) <= set(MAGIC_NAMES["line"]) | set(MAGIC_NAMES["cell"])


def test_the_readme_lists_every_notebook():
    listed = re.findall(r"^\| `(\d\d_\w+)` \|", text_of(REPO / "README.md"), flags=re.MULTILINE)
    assert listed == sorted(path.stem for path in (REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_relative_links_point_at_files(document):
    links = [link for link in re.findall(r"\]\(([^)#]+)\)", text_of(document)) if "://" not in link]
    for link in links:
        target = (document.parent / link).resolve()
        # a file `make bench` writes (benchmarks/RESULTS.md) counts: the link names its output
        assert target.exists() or str(target.relative_to(REPO)) in MAKEFILE, link
