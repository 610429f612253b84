"""torch.compile of fused models: Dynamo traces a fused demo model (with and without
labels, under autocast too) as one graph, te_lab causes no graph break in fused Hugging
Face models either, and the Inductor-compiled fused Llama computes what eager fused
does, loss and every gradient."""

from pathlib import Path

import pytest
import torch

import te_lab
from conftest import DEVICE, assert_close
from te_lab import kernels, models

TE_LAB_SOURCES = (str(Path(te_lab.__file__).parent), str(Path(kernels.__file__).parent))


def _fused(name):
    model = models.build_model(name, seed=0).to(DEVICE)
    batch = models.example_batch(model, 2, 16)
    report = te_lab.fuse(model, sample=batch, progress=False)
    assert all(row.status == "fused" for row in report.rows), str(report)
    return model, batch


def _explain(model, inputs, autocast_dtype=None):
    torch._dynamo.reset()
    with torch.autocast(DEVICE.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        return torch._dynamo.explain(model)(**inputs)


def _te_lab_breaks(explanation):
    """The graph breaks whose stack passes through te_lab's code."""
    return [reason for reason in explanation.break_reasons
            if any(frame.filename.startswith(TE_LAB_SOURCES) for frame in reason.user_stack)]


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("labels", [True, False], ids=["loss", "logits"])
def test_fused_demo_model_traces_as_one_graph(name, labels):
    # The demo models are plain PyTorch, so any break would be te_lab's.
    model, batch = _fused(name)
    inputs = batch if labels else {"input_ids": batch["input_ids"]}
    explanation = _explain(model, inputs)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    assert not explanation.break_reasons
    # With labels the traced forward is the fused LM head's (it returns no logits).
    assert (model(**inputs).logits is None) == labels


@pytest.mark.parametrize("routing", ["native", "auto"])
def test_a_fused_llama_with_routed_projections_traces_as_one_graph(routing):
    """Projections of 256 x 256 and up go through te_lab::linear; its routing (oneDNN or the
    BLAS, forced or measured) is decided outside the graph."""
    model = models.llama("tiny", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2).to(DEVICE)
    batch = models.example_batch(model, 2, 16)
    with kernels.use_backend(linear=routing):
        te_lab.fuse(model, sample=batch, progress=False)
        explanation = _explain(model, batch)
    assert explanation.graph_count == 1 and not explanation.break_reasons, explanation.break_reasons


def test_fused_llama_traces_as_one_graph_under_autocast():
    model, batch = _fused("llama-tiny")
    explanation = _explain(model, batch, torch.bfloat16)
    assert explanation.graph_count == 1 and not explanation.break_reasons


@pytest.mark.parametrize("name", ["hf:llama-tiny", "hf:gpt2-tiny"])
def test_fused_hugging_face_models_have_no_graph_break_from_te_lab(name):
    pytest.importorskip("transformers")
    model, batch = _fused(name)
    for inputs in (batch, {"input_ids": batch["input_ids"]}):
        explanation = _explain(model, inputs)
        assert not _te_lab_breaks(explanation), [reason.reason for reason in _te_lab_breaks(explanation)]


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in model.parameters()]


@pytest.mark.slow
def test_compiled_fused_llama_matches_eager_fused():
    model, batch = _fused("llama-tiny")
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for seed in (0, 1):
        batch = models.example_batch(model, 2, 16, seed=seed)
        # The second batch must reuse the graphs compiled for the first.
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            loss, grads = _loss_and_grads(compiled, batch)
        expected_loss, expected_grads = _loss_and_grads(model, batch)
        assert_close(loss, expected_loss)
        for grad, expected in zip(grads, expected_grads):
            # Weight gradients are sums over every token; fp32 needs 1e-4 there (docs/design.md).
            assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def _te_lab_ops_traced(model, inputs) -> list[str]:
    """The te_lab ops in the graphs torch.compile traces of ``model(**inputs)`` without gradients."""
    traced = []

    def backend(graph_module, example_inputs):
        traced.extend(str(node.target) for node in graph_module.graph.nodes
                      if node.op == "call_function" and str(node.target).startswith("te_lab."))
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(**inputs)
    return traced


def test_a_compiled_decode_step_without_gradients_runs_the_original_math():
    """Under torch.compile without gradients, a call of at most COMPILED_DECODE_ROWS rows (a
    decode step) is the original's, which Inductor fuses itself; a prefill's keeps te_lab's ops."""
    model, batch = _fused("llama-tiny")
    model.eval()
    prefill = {"input_ids": batch["input_ids"]}  # 2 x 16 = 32 rows
    decode = {"input_ids": batch["input_ids"][:1, :1]}
    assert _te_lab_ops_traced(model, prefill)
    assert _te_lab_ops_traced(model, decode) == []
    with torch.no_grad():
        logits = torch.compile(model)(**decode).logits
        with te_lab.unfused(model):
            expected = model(**decode).logits
    assert_close(logits, expected)
