"""CONTRIBUTING.md's checklist for a fused op, for the steps that nothing else would catch
when forgotten: every registered op has its kernel file, its costs file, its export, its
test file, its benchmark case (and GPU compile scenarios where it has Triton kernels), a
row in README's op table and an entry in docs/api.md; every built-in rule is documented
in the order it is tried and exercised by the fuse tests; every op is one ``define_op``
declaration, whose C++ overloads the C++ kernels only register against. (Two more steps are checked
where their subject is: every custom op's autocast kernel in test_autocast.py, every
custom op's cost and hand count in test_costs.py.)"""

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

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


# Ops registered by hand, each with why; every other op is one define_op declaration.
NOT_DECLARED = {
    "adamw": "an optimizer step over parameter lists that it updates in place, returning nothing: no outputs, "
             "autograd or autocast for a declaration to define (kernels/adamw.py)",
}
# What only define_op does for a declared op.
WIRING_CALLS = {"register_op", "custom_op", "CustomOp", "register_fake", "register_autograd",
                "register_autocast_rule"}
# Wiring calls a declared op's file may still make, with why.
ALLOWED_WIRING = {
    ("fused_linear_cross_entropy", "register_autocast_rule"): "te_lab::fused_linear_cross_entropy_scale_ mutates "
                                                              "its arguments: a torch.library.custom_op of its own",
    ("fused_linear_cross_entropy", "custom_op"): "the same op's definition",
    ("fused_linear_cross_entropy", "register_fake"): "the same op's fake",
}


def calls_in(path: Path) -> list[str]:
    """The names of the functions and methods a source file calls, decorators included."""
    return [node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))]


@pytest.mark.parametrize("name", sorted(set(OPS) - set(NOT_DECLARED)))
def test_each_op_is_one_define_op_declaration(name):
    calls = calls_in(REPO / "kernels" / f"{name}.py")
    assert calls.count("define_op") == 1
    assert sorted({call for call in calls if call in WIRING_CALLS} - {wiring for op, wiring in ALLOWED_WIRING
                                                                      if op == name}) == []


@pytest.mark.parametrize("name", sorted(set(OPS) - set(NOT_DECLARED)))
def test_each_op_runs_its_reference_path_through_run_reference(name):
    # which, under autocast, casts and runs as the op's custom op does (kernels/op_declaration.py)
    assert "run_reference" in calls_in(REPO / "kernels" / f"{name}.py")


def test_the_declaration_check_sees_hand_wiring(tmp_path):
    source = tmp_path / "my_op.py"
    source.write_text("@custom_op('te_lab::my_op')\ndef f(x): ...\n@f.register_fake\ndef g(x): ...\n"
                      "MY_OP = register_op(FusedOp(name='my_op'))\n")
    assert sorted(set(calls_in(source)) & WIRING_CALLS) == ["custom_op", "register_op"]


def cpp_sources_defining_schemas() -> list[str]:
    """The C++ sources that define an operator schema (``m.def``) themselves."""
    return sorted(path.stem for path in (REPO / "kernels" / "cpp").glob("*.cpp")
                  if re.search(r"\bm\.def\(", path.read_text(encoding="utf-8")))


def test_the_cpp_kernels_only_register_against_the_schemas_python_declares():
    assert cpp_sources_defining_schemas() == sorted(set(NOT_DECLARED) & {
        path.stem for path in (REPO / "kernels" / "cpp").glob("*.cpp")})


def declared_cpp_overloads() -> list[str]:
    """``te_lab::<op>.<overload>`` for every C++ overload the declared ops define."""
    packets = {name: getattr(torch.ops.te_lab, name) for name in dir(torch.ops.te_lab)}
    return [f"te_lab::{name}.{overload}" for name, packet in packets.items() if hasattr(packet, "overloads")
            for overload in packet.overloads() if overload != "default"
            and name.removesuffix("_backward").removesuffix("_over_logits") not in NOT_DECLARED]


def test_the_cpp_library_registers_a_kernel_for_every_declared_cpp_overload():
    from te_lab.kernels import cpu_kernels
    from te_lab.kernels.torch_internals import argument_names, has_kernel

    if cpu_kernels.unavailable_reason() is not None:
        pytest.skip(cpu_kernels.unavailable_reason())
    overloads = declared_cpp_overloads()
    assert {"te_lab::rms_norm.cpp", "te_lab::rms_norm_backward.cpp",
            "te_lab::cross_entropy_backward.cpp_in_place"} <= set(overloads)
    assert [overload for overload in overloads if not has_kernel(overload, "CPU")] == []
    for overload in overloads:
        op = overload.rsplit(".", 1)[0]
        packet = getattr(torch.ops.te_lab, op.removeprefix("te_lab::"))
        if overload.endswith(".cpp") and "default" in packet.overloads():
            assert argument_names(overload) == argument_names(op)[:len(argument_names(overload))], overload


def test_a_cpp_schema_is_the_op_schema_less_backend():
    from te_lab.kernels.custom_ops import cpp_schema

    assert cpp_schema("(Tensor x, float eps, str backend) -> Tensor") == "(Tensor x, float eps) -> Tensor"
    with pytest.raises(ValueError, match="backend"):
        cpp_schema("(Tensor x, float eps) -> Tensor")


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
