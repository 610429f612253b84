"""Packaging: environment.yml mirrors pyproject.toml, kernels/ and extensions/ ship
only as te_lab.kernels and te_lab.extensions, and importing te_lab stays light.

Imports that only these tests need (yaml) happen inside them: the Triton 3.2 test
environment collects this file without installing them.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent

# conda-forge names that differ from the PyPI names pyproject.toml uses
CONDA_TO_PYPI = {"pytorch": "torch"}
# what a conda environment needs to exist at all, not te_lab's dependencies
CONDA_ONLY = {"python", "pip"}

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*([^;]*?)\s*(?:;\s*(.+?))?\s*$")


def normalized(requirement: str) -> tuple[str, str, str]:
    """(name, version specifier, environment marker), spelled one way: PEP 503 names,
    no spaces, specifier clauses sorted, double quotes in markers."""
    match = REQUIREMENT.match(requirement)
    assert match, f"cannot parse requirement {requirement!r}"
    name, specifier, marker = match.groups()
    name = re.sub(r"[-_.]+", "-", name).lower()
    specifier = ",".join(sorted(clause for clause in re.sub(r"\s+", "", specifier).split(",") if clause))
    marker = re.sub(r"\s+", "", marker or "").replace("'", '"')
    return name, specifier, marker


PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
DIST_INFO = f"{PROJECT['name']}-{PROJECT['version']}.dist-info"


def pyproject_requirements() -> set[tuple[str, str, str]]:
    return {normalized(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]}


def environment_requirements() -> set[tuple[str, str, str]]:
    import yaml

    environment = yaml.safe_load((REPO / "environment.yml").read_text(encoding="utf-8"))
    found = set()
    for entry in environment["dependencies"]:
        if isinstance(entry, dict):
            found |= {normalized(r) for r in entry["pip"]}
            continue
        name, specifier, marker = normalized(entry)
        if name not in CONDA_ONLY:
            found.add((CONDA_TO_PYPI.get(name, name), specifier, marker))
    return found


def run_python(code: str, cwd: Path, pythonpath: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter outside the repository (so the working
    directory cannot stand in for site-packages) and return what it printed."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_environment_yml_mirrors_pyproject():
    in_pyproject = pyproject_requirements()
    in_environment = environment_requirements()
    assert in_environment == in_pyproject, (
        f"only in pyproject.toml: {sorted(in_pyproject - in_environment)}; "
        f"only in environment.yml: {sorted(in_environment - in_pyproject)}"
    )


def test_normalized_spells_requirements_one_way():
    assert normalized("PyYAML") == normalized("pyyaml")
    assert normalized("ipywidgets >= 8") == ("ipywidgets", ">=8", "")
    assert normalized("tomli; python_version < '3.11'") == ("tomli", "", 'python_version<"3.11"')
    assert normalized("torch>=2.5,<3") == normalized("torch <3, >=2.5")


NOTEBOOK_MODULES = ("IPython", "ipywidgets", "plotly", "anywidget")

# What an interpreter that imports te_lab sees; one run serves several tests, since
# importing torch takes seconds.
IMPORT_CHECK = f"""
import importlib.util, json, sys
import te_lab.kernels, te_lab.extensions
print(json.dumps({{
    "kernels": te_lab.kernels.__file__,
    "extensions": te_lab.extensions.__file__,
    "top_level": {{name: getattr(importlib.util.find_spec(name), "origin", None)
                  for name in ("kernels", "extensions")}},
    "notebook_modules": [name for name in {NOTEBOOK_MODULES!r} if name in sys.modules],
}}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The import check run against the installed (editable) te_lab."""
    return json.loads(run_python(IMPORT_CHECK, cwd=tmp_path_factory.mktemp("elsewhere")))


def none_of_te_labs(top_level: dict, *roots: Path) -> bool:
    """Whether no top-level module of these names comes from te_lab's files: none is found, or
    another distribution's is (transformers >= 5.25 installs the Hugging Face Hub's `kernels`)."""
    return all(origin is None or not any(Path(origin).resolve().is_relative_to(root) for root in roots)
               for origin in top_level.values())


def test_kernels_and_extensions_import_only_inside_te_lab(installed):
    assert Path(installed["kernels"]).resolve() == REPO / "kernels" / "__init__.py"
    assert Path(installed["extensions"]).resolve() == REPO / "extensions" / "__init__.py"
    assert set(installed["top_level"]) == {"kernels", "extensions"}
    assert none_of_te_labs(installed["top_level"], REPO / "kernels", REPO / "extensions")


def test_importing_te_lab_leaves_the_notebook_stack_unloaded(installed):
    assert installed["notebook_modules"] == []


def build_wheel(tmp_path: Path) -> Path:
    """The wheel ``pip install .`` would install, built from a copy of the sources so
    the repository gets no build/ folder."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("te_lab", "kernels", "extensions", "benchmarks"):
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    out = tmp_path / "dist"
    built = run_python(
        f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))", cwd=source)
    return out / built.strip().splitlines()[-1]


@pytest.mark.slow  # a setuptools build and a fresh interpreter importing torch
def test_wheel_installs_kernels_and_extensions_inside_te_lab_only(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(f"{DIST_INFO}/top_level.txt").decode().split()
        archive.extractall(tmp_path / "installed")
    outside = [name for name in names if not name.startswith(("te_lab/", f"{DIST_INFO}/"))]
    assert not outside
    assert top_level == ["te_lab"]
    for expected in ("te_lab/__init__.py", "te_lab/device/__init__.py", "te_lab/kernels/__init__.py",
                     "te_lab/kernels/registry.py", "te_lab/extensions/__init__.py", "te_lab/benchmarks/suite.py",
                     "te_lab/kernels/cpp/rms_norm.cpp"):
        assert expected in names
    # the C++ CPU kernels' sources and headers, compiled where the wheel is installed
    cpp_sources = sorted(f"te_lab/kernels/cpp/{path.name}" for path in (REPO / "kernels" / "cpp").iterdir())
    assert "te_lab/kernels/cpp/rows.h" in cpp_sources
    assert [source for source in cpp_sources if source not in names] == []
    # every module of the te_lab/ source tree ships (a subpackage missing from
    # pyproject's package list would silently drop out of the wheel)
    sources = sorted(str(path.relative_to(REPO)) for path in (REPO / "te_lab").rglob("*.py"))
    assert [source for source in sources if source not in names] == []

    # the unpacked wheel, ahead of the editable install on sys.path, imports on its own
    found = json.loads(run_python(IMPORT_CHECK, cwd=tmp_path, pythonpath=tmp_path / "installed"))
    assert Path(found["kernels"]).is_relative_to(tmp_path / "installed")
    assert set(found["top_level"]) == {"kernels", "extensions"}
    assert none_of_te_labs(found["top_level"], REPO / "kernels", REPO / "extensions", tmp_path / "installed")
    assert found["notebook_modules"] == []

