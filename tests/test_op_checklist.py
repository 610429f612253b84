"""CONTRIBUTING.md's checklist for a fused op, for the steps that nothing else would catch
when forgotten: every registered op has its kernel file, its costs file, its export, its
test file, its benchmark case (and GPU compile scenarios where it has Triton kernels), a
row in README's op table and an entry in docs/api.md; every built-in rule is documented
in the order it is tried and exercised by the fuse tests. (Two more steps are checked
where their subject is: every custom op's autocast kernel in test_autocast.py, every
custom op's cost and hand count in test_costs.py.)"""

import ast
import importlib
import re
from pathlib import Path

import pytest

import te_lab
from te_lab import kernels
from te_lab.benchmarks.cases import OP_CASES, OPTIMIZER_OPS
from te_lab.gpu_checks.kernel_scenarios import scenarios
from te_lab.kernels import registered_ops

REPO = Path(__file__).resolve().parent.parent
OPS = registered_ops()
# The built-in rules, in the order fuse tries them (rules a test registers are left out).
BUILT_IN_RULES = [rule.name for rule in te_lab.rules() if rule.match.__module__.startswith("te_lab.surgery.")]


def section(document: str, heading: str) -> str:
    """The text under ``heading`` (a markdown heading line) up to the next heading of its level."""
    text = (REPO / document).read_text(encoding="utf-8")
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    following = re.search(rf"\n{level} ", text[start + 1:])
    return text[start:start + 1 + following.start()] if following else text[start:]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the markdown tables in ``text``."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows if not set(row[0].strip()) <= set("-:")][1:]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_lives_in_its_own_kernel_file(name):
    assert OPS[name].reference.__module__ == f"te_lab.kernels.{name}"
    assert (REPO / "kernels" / f"{name}.py").is_file()


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_reference_is_exported_from_te_lab_kernels(name):
    reference = OPS[name].reference.__name__
    assert reference in kernels.__all__ and getattr(kernels, reference) is OPS[name].reference


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_costs_are_its_costs_file(name):
    assert importlib.import_module(f"te_lab.kernels.costs.{name}").COSTS == dict(OPS[name].costs)


@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_has_its_test_file(name):
    assert (REPO / "tests" / f"test_{name}.py").is_file()


def test_every_op_and_only_registered_ops_have_a_benchmark_case():
    assert not set(OP_CASES) & set(OPTIMIZER_OPS)
    assert set(OP_CASES) | set(OPTIMIZER_OPS) == set(OPS)


def test_every_op_with_triton_kernels_has_gpu_compile_scenarios_some_in_ci():
    found = scenarios()
    for name, op in OPS.items():
        if "triton" not in op.backends():
            continue
        own = [scenario for scenario in found if scenario.label.split(" ")[0] == name]
        assert own, f"te_lab/gpu_checks/kernel_scenarios.py has no scenario for {name}"
        assert any(scenario.in_ci for scenario in own), f"no scenario of {name} in CI_SCENARIOS"


def readme_op_rows() -> dict[str, list[str]]:
    """README's "What is fused" rows by the op their functions belong to."""
    rows = {}
    for row in table_rows(section("README.md", "## What is fused")):
        owners = {getattr(kernels, name).__module__.rsplit(".", 1)[-1] for name in backticked(row[0])}
        assert len(owners) == 1, f"README's op table row {row[0]} names functions of several ops: {owners}"
        rows[owners.pop()] = row
    return rows


def test_readme_op_table_has_a_row_per_op_with_its_backends_and_cpu_default():
    rows = readme_op_rows()
    assert set(rows) == set(OPS)
    for name, (_, _, backends, cpu_default, _) in rows.items():
        listed = {word.strip() for word in re.sub(r"\([^)]*\)", "", backends).split(",")}
        assert listed == set(OPS[name].backends()) - {"reference"}, name
        assert OPS[name].cpu_preference in re.findall(r"\w+", cpu_default), name


def test_readme_op_table_names_every_built_in_rule_and_only_rules():
    named = {word for row in readme_op_rows().values() for word in backticked(row[-1])}
    assert named == set(BUILT_IN_RULES)


def test_api_reference_documents_every_op():
    ops = section("docs/api.md", "## Ops")
    assert [name for name in sorted(OPS) if f"(`te_lab.kernels.{name}`)" not in ops] == []


def test_api_reference_lists_the_built_in_rules_in_the_order_they_are_tried():
    rows = table_rows(section("docs/api.md", "### Rules"))
    assert [backticked(row[0])[0] for row in rows] == BUILT_IN_RULES


def asserted_strings(path: Path) -> set[str]:
    """The string constants a test file asserts on: inside ``assert`` statements, and in
    the ``parametrize`` values of a test that asserts (expected rows per rule, say); not
    those that only select or exclude rules, or sit in comments."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assert):
            found |= strings_in(node)
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and any(
                isinstance(inner, ast.Assert) for inner in ast.walk(node)):
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize":
                    found |= strings_in(decorator)
    return found


def strings_in(node: ast.AST) -> set[str]:
    return {leaf.value for leaf in ast.walk(node) if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str)}


def test_every_built_in_rule_is_asserted_on_by_the_fuse_tests():
    asserted = set().union(*(asserted_strings(path) for path in sorted((REPO / "tests").glob("test_fuse*.py"))))
    assert [name for name in BUILT_IN_RULES if name not in asserted] == []


def test_asserted_strings_ignores_names_that_only_select_rules(tmp_path):
    source = tmp_path / "test_fuse_example.py"
    source.write_text(
        "import pytest\n"
        "# the rope rule\n"
        "@pytest.mark.parametrize('expected', [{'rmsnorm': 3}])\n"
        "def test_counts(expected):\n"
        "    report = fuse(model, exclude=['attention'])\n"
        "    assert report.rows[0].rule == 'mlp'\n")
    assert asserted_strings(source) & {"rope", "rmsnorm", "attention", "mlp"} == {"rmsnorm", "mlp"}
