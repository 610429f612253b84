"""Activation checkpointing (torch.utils.checkpoint, non-reentrant) around fused decoder
layers: the same loss and gradients as without it, with dropout drawing the same masks
on recomputation, under autocast, through Hugging Face's gradient checkpointing, and with
a selective policy that saves the fused attention's output instead of recomputing it."""

import copy
import importlib

import pytest
import torch
from torch import nn
from torch.utils import checkpoint

import te_lab
from conftest import DEVICE, assert_close
from te_lab import models
from te_lab.kernels.attention import ATTENTION
from te_lab.kernels.registry import select_backend
from te_lab.modules import FusedAttention, FusedQKVAttention, FusedRMSNorm


class Checkpointed(nn.Module):
    """A decoder layer whose activations are recomputed in the backward pass."""

    def __init__(self, layer: nn.Module, **options):
        super().__init__()
        self.layer = layer
        self.options = options

    def forward(self, *args, **kwargs):
        return checkpoint.checkpoint(self.layer, *args, use_reentrant=False, **self.options, **kwargs)


def _decoder_layers(model):
    body = getattr(model, model.base_model_prefix)
    return body.layers if hasattr(body, "layers") else body.h


def _fused_with_checkpointed_copy(name, **overrides):
    model = models.build_model(name, seed=0, **overrides).to(DEVICE)
    batch = model.example_batch(2, 16)
    report = te_lab.fuse(model, sample=batch, progress=False)
    assert all(row.status == "fused" for row in report.rows), str(report)
    checkpointed = copy.deepcopy(model)
    layers = _decoder_layers(checkpointed)
    for index, layer in enumerate(layers):
        layers[index] = Checkpointed(layer)
    return model, checkpointed, batch


def _loss_and_grads(model, batch, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks for every run
    with torch.autocast(DEVICE.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [param.grad.clone() for param in model.parameters()]


def _assert_same(actual, expected, dtype=torch.float32):
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    assert_close(loss, expected_loss, dtype=dtype)
    assert len(grads) == len(expected_grads)
    for grad, expected in zip(grads, expected_grads):
        assert_close(grad, expected, dtype=dtype)


def _count_forwards(model, module_type):
    calls = []
    for module in model.modules():
        if isinstance(module, module_type):
            module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name, overrides", [
    ("llama-tiny", {}),
    # Dropout in attention and MLP: recomputation must draw the masks the forward drew.
    ("gpt2-tiny", {"dropout": 0.1}),
])
def test_checkpointed_fused_layers_give_the_same_loss_and_gradients(name, overrides):
    model, checkpointed, batch = _fused_with_checkpointed_copy(name, **overrides)
    attention_type = FusedAttention if name.startswith("llama") else FusedQKVAttention
    calls = _count_forwards(checkpointed, attention_type)
    expected = _loss_and_grads(model, batch)
    _assert_same(_loss_and_grads(checkpointed, batch), expected)
    # Every fused attention ran twice: in the forward and again in the backward.
    assert len(calls) == 2 * len(_decoder_layers(model))
    if overrides:  # dropout really was on, or the masks would not matter
        model.eval()
        assert not torch.equal(_loss_and_grads(model, batch)[0], expected[0])


def test_checkpointed_fused_layers_under_bf16_autocast():
    model, checkpointed, batch = _fused_with_checkpointed_copy("llama-tiny")
    _assert_same(_loss_and_grads(checkpointed, batch, torch.bfloat16),
                 _loss_and_grads(model, batch, torch.bfloat16), torch.bfloat16)


def test_hugging_face_gradient_checkpointing_of_a_fused_model():
    pytest.importorskip("transformers")
    model = models.build_model("hf:llama-tiny", seed=0).to(DEVICE)
    batch = models.example_batch(model, 2, 16)
    te_lab.fuse(model, sample=batch, progress=False)
    expected = _loss_and_grads(model, batch)
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    calls = _count_forwards(model, FusedRMSNorm)
    _assert_same(_loss_and_grads(model, batch), expected)
    layers = len(_decoder_layers(model))
    # Two norms per layer recomputed, the final norm outside the layers run once.
    assert len(calls) == 2 * 2 * layers + 1


needs_selective_checkpointing = pytest.mark.skipif(
    not hasattr(checkpoint, "create_selective_checkpoint_contexts"),
    reason="this torch has no selective activation checkpointing")


@needs_selective_checkpointing
def test_selective_checkpointing_can_save_the_fused_attention_instead_of_recomputing_it(monkeypatch):
    def save_attention(ctx, op, *args, **kwargs):
        if op == torch.ops.te_lab.attention.default:
            return checkpoint.CheckpointPolicy.MUST_SAVE
        return checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    model = models.build_model("llama-tiny", seed=0).to(DEVICE)
    batch = model.example_batch(2, 16)
    te_lab.fuse(model, sample=batch, progress=False)
    selective = copy.deepcopy(model)
    layers = _decoder_layers(selective)
    contexts = lambda: checkpoint.create_selective_checkpoint_contexts(save_attention)  # noqa: E731
    for index, layer in enumerate(layers):
        layers[index] = Checkpointed(layer, context_fn=contexts)
    expected = _loss_and_grads(model, batch)
    # The attention kernel of the backend the fused layers run, counted.
    implementation = importlib.import_module("te_lab.kernels.attention")._IMPLEMENTATIONS[
        select_backend(ATTENTION, DEVICE)]
    kernel_calls = []
    original_forward = implementation.forward

    def counted_forward(*args):
        kernel_calls.append(1)
        return original_forward(*args)

    monkeypatch.setattr(implementation, "forward", counted_forward)
    _assert_same(_loss_and_grads(selective, batch), expected)
    # The attention kernel ran in the forward only; its output was kept for the backward.
    assert len(kernel_calls) == len(layers)
