"""The package's layers import only downward: every ``import`` of every te_lab module (the
ones inside functions too), read from the source with ``ast``, goes to its own layer or a
lower one. The order, lowest first: device -> kernels -> modules -> surgery -> profiler
-> widgets -> the API, magics and CLI. A module the table does not place fails the test,
so a new module has to be given a layer. Within a layer, no module imports itself back
through others: the modules' imports form no cycle."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Package name -> its directory (pyproject.toml's package-dir).
PACKAGES = {"te_lab": ROOT / "te_lab", "te_lab.kernels": ROOT / "kernels", "te_lab.extensions": ROOT / "extensions",
            "te_lab.benchmarks": ROOT / "benchmarks"}
# Lowest first; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    # version: te_lab.__version__, importing nothing
    ("device", ("te_lab.device", "te_lab.inputs", "te_lab.distributed", "te_lab.cache", "te_lab.version")),
    ("kernels", ("te_lab.kernels", "te_lab.options")),
    ("modules", ("te_lab.modules", "te_lab.models")),
    ("surgery", ("te_lab.surgery",)),
    # optim labels its work with the profiler's region names (te_lab.profiler.regions)
    ("profiler", ("te_lab.profiler", "te_lab.optim")),
    # views: te_lab.show / te_lab.to_html, handing reports to the widgets
    ("widgets", ("te_lab.widgets", "te_lab.views")),
    # status describes the whole installation (te_lab.__version__, every op's backend)
    # integrations: te_lab inside other libraries' training loops (Hugging Face's Trainer)
    # gpu_checks times through the benchmark suite's harness (te_lab.benchmarks)
    ("api", ("te_lab", "te_lab.status", "te_lab.extensions", "te_lab.cli", "te_lab.benchmarks",
             "te_lab.gpu_checks", "te_lab.integrations")),
)


def _layer_of(module: str) -> int:
    matches = [(len(prefix), rank) for rank, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise AssertionError(f"tests/test_layers.py: module {module} is in no layer of LAYERS; give it one")
    return max(matches)[1]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = [part for part in path.relative_to(directory).with_suffix("").parts if part != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imported(module: str, path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, te_lab module) for every import in the file, relative ones resolved, and
    ``from package import name`` read as the submodule where ``name`` is one."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    imports = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imports += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[:len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imports.append((node.lineno, submodule if submodule in MODULES else base))
    return [(line, name) for line, name in imports if name == "te_lab" or name.startswith("te_lab.")]


def test_every_module_is_placed_in_a_layer():
    assert "te_lab.profiler.report" in MODULES and "te_lab.kernels.registry" in MODULES
    for module in MODULES:
        _layer_of(module)


def test_the_layer_table_reads_imports_as_python_does():
    # the resolver itself, on imports whose targets are known
    report = _imported("te_lab.widgets.figures", MODULES["te_lab.widgets.figures"])
    assert any(name == "te_lab.profiler.report" for _, name in report)
    registry = _imported("te_lab.kernels.registry", MODULES["te_lab.kernels.registry"])
    assert any(name == "te_lab.device" for _, name in registry)  # from te_lab import device as devices
    assert _layer_of("te_lab.profiler.engine") < _layer_of("te_lab.widgets.dashboard") < _layer_of("te_lab.cli.demo")


def test_torch_internals_and_the_op_declaration_sit_in_the_kernels_layer():
    # Every private torch API goes through torch_internals, which leans on no te_lab module;
    # the op declaration (define_op) is what each op's file imports.
    internals = "te_lab.kernels.torch_internals"
    assert _layer_of(internals) == _layer_of("te_lab.kernels.op_declaration") == _layer_of("te_lab.kernels")
    assert _imported(internals, MODULES[internals]) == []
    assert any(name == "te_lab.kernels.op_declaration"
               for _, name in _imported("te_lab.kernels.rms_norm", MODULES["te_lab.kernels.rms_norm"]))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_higher_layer(module):
    rank = _layer_of(module)
    upward = [f"{MODULES[module].relative_to(ROOT)}:{line} imports {name} ({LAYERS[_layer_of(name)][0]} layer)"
              for line, name in _imported(module, MODULES[module]) if _layer_of(name) > rank]
    assert not upward, f"{module} is in the {LAYERS[rank][0]} layer, but " + "; ".join(upward)


def _import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of the import graph ``imports`` (module -> modules it imports), each as the
    modules along it, the first repeated last: a depth-first walk's, at least one through
    every group of modules that import each other; none when the graph has no cycle."""
    cycles, finished = [], set()

    def walk(module, path, on_path):
        for target in sorted(imports.get(module, ())):
            if target in on_path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in finished:
                walk(target, path + [target], on_path | {target})
        finished.add(module)

    for module in sorted(imports):
        if module not in finished:
            walk(module, [module], {module})
    return cycles


def test_the_cycle_finder_finds_cycles_and_only_them():
    assert _import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert _import_cycles({"a": {"a"}}) == [["a", "a"]]


def test_no_import_cycle_among_te_labs_modules():
    imports = {module: {name for _, name in _imported(module, path) if name in MODULES and name != module}
               for module, path in MODULES.items()}
    cycles = _import_cycles(imports)
    assert not cycles, "import cycles (each import, those inside functions too, counts): " + "; ".join(
        " -> ".join(cycle) for cycle in cycles)
