"""The README, CONTRIBUTING.md and docs/ (docs/design.md among them) name only what
exists: every ``te_lab.*`` name resolves, every ``te-lab`` command, ``make`` target and
magic is real, the notebook table lists exactly the notebooks, and every relative link
points at a tracked file or one a make target writes."""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from te_lab.cli import build_parser
from te_lab.extensions import MAGIC_NAMES
from te_lab.options import BACKEND_CHOICES

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


def value_of(name: str):
    """The object ``te_lab.a.B`` names (see ``resolves``)."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for part in parts[split:]:
            value = getattr(value, part)
        return value
    raise LookupError(name)


def documented_parameters(text: str) -> list[str]:
    """``a, *, b="x", c=None`` as ["a", "*", 'b="x"', "c=None"] (commas inside brackets kept)."""
    parts, depth, current = [], 0, ""
    for char in " ".join(text.split()):
        depth += char in "([{" and 1 or (-1 if char in ")]}" else 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [part for part in parts + [current.strip()] if part]


def code_parameters(function) -> list[tuple]:
    """The parameters as (written name, default): names with ``*``/``**`` for varargs,
    ``"*"`` before keyword-only ones, defaults as values (``inspect.Parameter.empty``: none)."""
    written, star = [], False
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            written.append(("*", inspect.Parameter.empty))
            star = True
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        star = star or parameter.kind is inspect.Parameter.VAR_POSITIONAL
        written.append((prefix + parameter.name, parameter.default))
    return written


def parsed(part: str) -> tuple:
    """``b="x"`` as ("b", "x"); a default that is no literal stays its text."""
    name, equals, default = (piece.strip() for piece in part.partition("="))
    if not equals:
        return name, inspect.Parameter.empty
    try:
        return name, ast.literal_eval(default)
    except (ValueError, SyntaxError):
        return name, default


# Signatures at the start of a line in api.md, `te_lab.name(parameters) -> result`, not
# calls written as examples (whose arguments are not parameters with defaults).
API_SIGNATURES = [
    (name, parameters) for name, parameters in
    re.findall(r"(?m)^`(te_lab(?:\.\w+)+)\(([^`]*?)\)(?: -> [^`]*)?`", text_of(REPO / "docs" / "api.md"))
    if all(re.fullmatch(r"\*|\*{0,2}\w+(\s*=.*)?", part) for part in documented_parameters(parameters))
]


def test_api_md_documents_signatures():
    assert {"te_lab.fuse", "te_lab.profile", "te_lab.open_trace"} <= {name for name, _ in API_SIGNATURES}


@pytest.mark.parametrize("name, parameters", API_SIGNATURES, ids=[name for name, _ in API_SIGNATURES])
def test_api_md_signatures_match_the_code(name, parameters):
    """Names, order, keyword-only markers and defaults as inspect.signature gives them
    (a class's are its constructor's)."""
    assert [parsed(part) for part in documented_parameters(parameters)] == code_parameters(value_of(name))


def test_documented_backend_choices_are_the_options_modules():
    """Every ``--backend a|b|...`` in the docs lists te_lab.options.BACKEND_CHOICES, in order."""
    lists = [found for document in DOCUMENTS for found in re.findall(r"--backend ([\w|]+)", text_of(document))
             if "|" in found]
    assert lists and all(found.split("|") == list(BACKEND_CHOICES) for found in lists)
