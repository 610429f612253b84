"""A te_lab-fused model through accelerate's ``Accelerator.prepare``: the same losses and
weights as unfused, in float32 and under bf16 mixed precision, whose forward wrapper
keeps calling the fused forward (te_lab still sees it, and unfuse still works under it);
a model wrapped first has its LM head reported as skipped, with the reason."""

import copy

import pytest
import torch

import te_lab
from integration_models import examples, llama, sample
from te_lab.modules import FusedAttention

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; each test builds its own Accelerator."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def train(model, mixed_precision, steps=3):
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    batch = examples()
    losses = []
    for step in range(steps):
        loss = prepared(**{name: value[2 * step: 2 * step + 2] for name, value in batch.items()}).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return prepared, losses


@pytest.mark.parametrize("mixed_precision, rtol", [("no", 1e-5), ("bf16", 1.6e-2)])
def test_accelerator_prepare_trains_fused_as_unfused(mixed_precision, rtol):
    unfused = llama()
    fused = copy.deepcopy(unfused)
    te_lab.fuse(fused, sample=sample())
    prepared, fused_losses = train(fused, mixed_precision)
    _, unfused_losses = train(unfused, mixed_precision)
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(unfused_losses), rtol=rtol, atol=rtol)
    # AdamW moves each weight by about lr = 1e-3 per step whatever its gradient's size, so under bf16 an
    # element whose gradient is rounding noise may go the other way at each of the 3 steps
    atol = 1e-5 if mixed_precision == "no" else 6e-3
    for (name, actual), expected in zip(fused.state_dict().items(), unfused.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    assert prepared is fused and isinstance(fused.model.layers[0].self_attn, FusedAttention)
    assert te_lab.fusions(fused)[0].replaces_forward  # seen through the wrapper, when there is one
    if mixed_precision == "bf16":
        assert "forward" in fused.__dict__ and fused.__dict__["forward"] is not fused.__dict__["_original_forward"]


def test_unfuse_under_accelerates_wrapper_passes_every_call_to_the_original():
    model = llama()
    te_lab.fuse(model, sample=sample())
    prepared, _ = train(model, "bf16", steps=1)
    wrapper = model.__dict__["forward"]
    result = te_lab.unfuse(model)
    assert len(result.restored) == 10 and not te_lab.is_fused(model)
    assert model.__dict__["forward"] is wrapper  # accelerate's autocast stays
    output = model(**sample())
    assert output.logits is not None  # the original forward ran, under the wrapper
    assert output.logits.dtype == torch.float32  # converted back by accelerate's wrapper
    with te_lab.unfused(model):
        pass
    assert model(**sample()).logits is not None


def test_fusing_after_accelerate_wrapped_the_forward_reports_the_lm_head_skipped():
    model = llama()
    train(model, "bf16", steps=1)
    report = te_lab.fuse(model, sample=sample())
    (row,) = [row for row in report.rows if row.rule == "lm_head_loss"]
    assert row.status == "skipped" and "forward is wrapped" in row.reason and "fuse before wrapping" in row.reason
    assert sum(row.status == "fused" for row in report.rows) == 9, report
