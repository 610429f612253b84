"""te_lab.kernels.torch_internals: every private torch API te_lab uses, each entry exercised
on the installed torch (CI runs this file on every torch of its matrix), and no other te_lab
module reaching into torch's private names."""

import ast
import pathlib
import re

import torch
from torch import Tensor

from te_lab.kernels import torch_internals as internals

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [path for folder in ("te_lab", "kernels", "extensions", "benchmarks")
           for path in sorted((ROOT / folder).rglob("*.py"))]


def test_below_autograd_and_the_keys_after_autograd_skip_autograd():
    x = torch.ones(3, requires_grad=True)
    with internals.below_autograd():
        assert not (x * 2).requires_grad
    assert (x * 2).requires_grad  # outside, autograd records again
    keys = torch._C._dispatch_keys(x)  # what an autograd kernel is called with
    after = keys & internals.AFTER_AUTOGRAD_KEYS
    assert keys.has(torch._C.DispatchKey.AutogradCPU) and not after.has(torch._C.DispatchKey.AutogradCPU)
    assert after.has(torch._C.DispatchKey.CPU)


def test_has_kernel_and_argument_names_read_the_dispatcher():
    assert internals.has_kernel("aten::add.Tensor", "CPU")
    assert not internals.has_kernel("aten::add.Tensor", "AutocastCPU")
    assert internals.has_kernel("aten::linear", "AutocastCPU")
    assert internals.argument_names("aten::add.Tensor") == ("self", "other", "alpha")
    assert internals.argument_names("te_lab::rms_norm") == ("x", "residual", "weight", "eps", "weight_offset",
                                                            "backend")
    assert isinstance(torch.ops.te_lab.rms_norm.default, internals.OpOverload)


def test_mode_autocast_and_profiler_probes_see_what_is_active():
    assert not internals.dispatch_modes_active() and not internals.function_modes_active()
    with internals.TorchDispatchMode():
        assert internals.dispatch_modes_active()
    with torch.overrides.TorchFunctionMode():
        assert internals.function_modes_active()
    assert not internals.any_autocast_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert internals.any_autocast_enabled()
    assert not internals.profiler_enabled()
    with torch.profiler.profile():
        assert internals.profiler_enabled()


class _Probe(torch.autograd.Function):
    """Records, inside its backward, what the engine says about keeping the graph."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append((internals.backward_keeps_graph(), internals.saved_tensors_hooks_enabled()))
        return grad


def test_the_autograd_engine_probes_answer_inside_a_backward():
    x = torch.ones(2, requires_grad=True)
    _Probe.seen.clear()
    _Probe.apply(x).sum().backward(retain_graph=True)
    _Probe.apply(x).sum().backward()
    assert [keeps for keeps, _ in _Probe.seen] == [True, False]
    assert all(isinstance(enabled, bool) for _, enabled in _Probe.seen)


def test_the_lowering_api_traces_and_compiles_a_graph():
    from torch.fx.experimental.proxy_tensor import make_fx

    compile_fx_inner, select_decomp_table = internals.lowering_api()
    lookups = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
    compiles_before = sum(internals.compile_counters()["inductor"][name] for name in lookups)
    x = torch.randn(4, 8)
    with internals.no_duck_shapes(), torch.no_grad():
        gm = make_fx(lambda t: (t * 2 + 1,), decomposition_table=select_decomp_table(), tracing_mode="symbolic")(x)
    placeholders = [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]
    fake_mode = internals.fake_mode_of(placeholders)
    assert fake_mode is not None
    with internals.tracing(fake_mode), torch.no_grad():
        compiled = compile_fx_inner(gm, placeholders)
    (out,) = compiled([x])
    torch.testing.assert_close(out, x * 2 + 1)
    assert sum(internals.compile_counters()["inductor"][name] for name in lookups) == compiles_before + 1


def test_fake_tensor_mode_gives_shapes_without_data():
    with internals.FakeTensorMode() as mode:
        fake = torch.empty(3, 5) @ torch.empty(5, 2)
    assert isinstance(fake, Tensor) and fake.shape == (3, 2) and mode is not None


def _private_uses(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``torch._x`` attribute reads and ``torch._x`` / ``torch.*._x`` imports in a source
    file; ATen's private operators (``torch.ops.aten._op``, ``torch._fused_adamw_``)
    excepted."""
    found, inside = [], set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and id(node) not in inside:
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                inside.add(id(inner))
                chain.append(inner.attr)
                inner = inner.value
            chain.reverse()
            private = any(part.startswith("_") and not part.startswith("__") for part in chain)
            operator = chain[0] == "ops" or (len(chain) == 1 and hasattr(torch._C._VariableFunctions, chain[0]))
            if isinstance(inner, ast.Name) and inner.id == "torch" and private and not operator:
                found.append(f"{where}: torch.{'.'.join(chain)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"{where}: import {name}" for name in names
                      if name.startswith("torch.") and any(part.startswith("_") for part in name.split("."))]
    return found


def test_no_module_but_torch_internals_uses_a_private_torch_api():
    uses = [use for path in SOURCES if path.name != "torch_internals.py" for use in _private_uses(path)]
    assert uses == []


def test_the_private_api_scan_finds_attribute_reads_and_imports(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("import torch\nimport torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
                      "x = torch._C._len_torch_dispatch_stack()\ny = torch.ops.aten._fused_rms_norm\n"
                      "z = torch.nn.functional.__name__\ntorch._foreach_add_([x], 1.0)\ntorch._check(True)\n")
    assert _private_uses(source, tmp_path) == [
        "example.py:2: import torch._dynamo", "example.py:3: import torch.utils._pytree",
        "example.py:4: torch._C._len_torch_dispatch_stack", "example.py:8: torch._check"]


def _internal_includes(path: pathlib.Path) -> list[str]:
    """The torch-internal headers (``torch/csrc/...``) a C++ source includes directly."""
    return [f"{path.name}: {header}"
            for header in re.findall(r'^\s*#\s*include\s*[<"](torch/csrc/[^>"]+)[>"]',
                                     path.read_text(encoding="utf-8"), re.MULTILINE)]


def test_no_cpp_source_but_torch_internals_h_includes_torch_internals():
    sources = sorted((ROOT / "kernels" / "cpp").glob("*.[ch]*"))
    assert [use for path in sources if path.name != "torch_internals.h" for use in _internal_includes(path)] == []
    # the scan sees an include: the one internal header, in the one place for it
    assert _internal_includes(ROOT / "kernels" / "cpp" / "torch_internals.h") == [
        "torch_internals.h: torch/csrc/autograd/graph_task.h"]

