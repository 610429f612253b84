"""te_lab.optim.overlap_step: updates applied during backward equal optimizer.step() after
backward, bit for bit, on the tiny demo models (unfused, fused, a tied GPT-2, under
activation checkpointing), through parameters without gradients, frozen parameters,
gradient accumulation, LR schedules and state-dict round trips; the hooks come off; what
cannot be overlapped is refused; and the profiler's timeline shows the updates between
backward ops.

Why exact equality: backward reads every weight before its update (autograd runs a
parameter's AccumulateGrad node after all nodes that use it), so both paths compute the
same gradients, and AdamW is elementwise, so one call per parameter does the arithmetic
of one multi-tensor call.
"""

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import te_lab
from conftest import backend_params
from te_lab import models
from te_lab.kernels import FusedAdamW
from te_lab.kernels.adamw import ADAMW
from te_lab.optim import OverlappedStep, overlap_step
from te_lab.profiler import profile_statement
from te_lab.profiler.attribution import peak_live_bytes

STEPS = 3


def adamw(backend=None, lr=1e-2):
    return functools.partial(FusedAdamW, lr=lr, weight_decay=0.1, backend=backend)


def batches(model, count=STEPS):
    return [model.example_batch(2, 16, seed=index) for index in range(count)]


def train_plain(model, optimizer, batch_list, scheduler=None):
    for batch in batch_list:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def train_overlapped(model, batch_list, scheduler=None):
    for batch in batch_list:
        model(**batch).loss.backward()
        if scheduler is not None:
            scheduler.step()


def assert_identical(model, reference):
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param, expected), name


def assert_same_state(optimizer, reference_optimizer):
    state, expected = optimizer.state_dict(), reference_optimizer.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    assert state["state"].keys() == expected["state"].keys()
    for index, entries in expected["state"].items():
        assert state["state"][index].keys() == entries.keys()
        for key, tensor in entries.items():
            assert torch.equal(state["state"][index][key], tensor), (index, key)


def step_counter(optimizer):
    """Parameter id -> how many optimizer steps updated it (the hook narrows param_groups
    to the one parameter it steps)."""
    counts = {}

    def count(opt, args, kwargs):
        for group in opt.param_groups:
            for param in group["params"]:
                counts[id(param)] = counts.get(id(param), 0) + 1
    optimizer.register_step_pre_hook(count)
    return counts


def test_overlapped_step_equals_step_after_backward():
    model = models.llama("tiny", seed=0)
    reference = copy.deepcopy(model)
    data = batches(model)
    handle = overlap_step(model, adamw())
    counts = step_counter(handle.optimizer)
    optimizer = adamw()(reference.parameters())
    train_overlapped(model, data)
    train_plain(reference, optimizer, data)
    assert_identical(model, reference)
    assert_same_state(handle.optimizer, optimizer)
    # Grads are consumed by the updates; each parameter is stepped once per backward.
    assert all(param.grad is None for param in model.parameters())
    assert sorted(counts.values()) == [STEPS] * len(list(model.parameters()))
    assert handle.backward_passes == STEPS


def test_default_factory_is_fused_adamw():
    model = models.llama("tiny", seed=0)
    with overlap_step(model) as handle:
        assert type(handle.optimizer) is FusedAdamW
        assert [p for group in handle.optimizer.param_groups for p in group["params"]] == list(model.parameters())


def test_tied_weight_is_updated_once_after_its_last_use():
    model = models.gpt2("tiny", seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    reference = copy.deepcopy(model)
    data = batches(model)
    handle = overlap_step(model, adamw())
    counts = step_counter(handle.optimizer)
    train_overlapped(model, data)
    train_plain(reference, adamw()(reference.parameters()), data)
    # An update after the lm_head's contribution alone would miss the embedding's share.
    assert counts[id(model.lm_head.weight)] == STEPS
    assert_identical(model, reference)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_layers_train_like_the_plain_step(use_reentrant):
    model = models.llama("tiny", seed=0)
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        # Recomputation runs inside backward: it must see the weights before their update
        # (reentrant: inside a nested backward pass, where the layer's hooks fire).
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=use_reentrant)
    data = batches(model)
    overlap_step(model, adamw())
    train_overlapped(model, data)
    train_plain(reference, adamw()(reference.parameters()), data)
    assert_identical(model, reference)


class TwoHeads(nn.Module):
    """A trunk, two heads of which each step uses one, and a frozen scale."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.trunk = nn.Linear(8, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])
        self.scale = nn.Parameter(torch.ones(8), requires_grad=False)
        with torch.no_grad():
            for param in self.parameters():
                if param.requires_grad:
                        param.copy_(torch.randn(param.shape, generator=generator))

    def forward(self, x, head):
        return self.heads[head](torch.tanh(self.trunk(x) * self.scale)).square().mean()


def inputs(count):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", backend_params(ADAMW) + [pytest.param("reference", id="reference")])
def test_every_adamw_backend_steps_one_parameter_as_it_steps_all(backend, dtype):
    model = TwoHeads().to(dtype)
    reference = copy.deepcopy(model)
    handle = overlap_step(model, adamw(backend))
    optimizer = adamw(backend)([p for p in reference.parameters() if p.requires_grad])
    for x in inputs(STEPS):
        model(x.to(dtype), 0).backward()
        reference(x.to(dtype), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_identical(model, reference)
    assert_same_state(handle.optimizer, optimizer)


def test_parameters_without_gradients_and_frozen_parameters():
    model = TwoHeads()
    reference = copy.deepcopy(model)
    handle = overlap_step(model, adamw())
    assert all(param is not model.scale for group in handle.optimizer.param_groups for param in group["params"])
    optimizer = adamw()([p for p in reference.parameters() if p.requires_grad])
    for index, x in enumerate(inputs(4)):
        head = int(index == 3)  # head 1 gets its first gradient in the last step
        model(x, head).backward()
        reference(x, head).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert_identical(model, reference)
    assert_same_state(handle.optimizer, optimizer)
    assert torch.equal(model.scale, torch.ones(8))


def test_a_parameter_unfrozen_after_hooking_is_still_updated():
    model = TwoHeads()
    reference = copy.deepcopy(model)
    # The factory may ignore the trainable list: here it also takes the frozen scale.
    handle = overlap_step(model, lambda trainable: adamw()(model.parameters()))
    optimizer = adamw()(reference.parameters())
    for net in (model, reference):
        net.scale.requires_grad_(True)
    for x in inputs(2):
        model(x, 0).backward()
        reference(x, 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    # No hook on the scale: the end-of-backward sweep updated it.
    assert not torch.equal(model.scale, torch.ones(8)) and model.scale.grad is None
    assert_identical(model, reference)
    assert_same_state(handle.optimizer, optimizer)


def test_gradient_accumulation_updates_every_kth_backward():
    model = TwoHeads()
    reference = copy.deepcopy(model)
    handle = overlap_step(model, adamw(), accumulation_steps=3)
    optimizer = adamw()([p for p in reference.parameters() if p.requires_grad])
    for index, x in enumerate(inputs(6)):
        # Head 1 contributes only to each window's first micro-batch: its update comes
        # from the end-of-backward sweep, as optimizer.step() would still update it.
        head = int(index % 3 == 0)
        before = [param.clone() for param in model.parameters()]
        model(x, head).backward()
        reference(x, head).backward()
        if index % 3 < 2:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            for param, expected in zip(model.parameters(), reference.parameters()):
                assert (param.grad is None) == (expected.grad is None)
                if param.grad is not None:
                    assert torch.equal(param.grad, expected.grad)
            continue
        optimizer.step()
        optimizer.zero_grad()
        assert all(param.grad is None for param in model.parameters())
        assert_identical(model, reference)
    assert handle.backward_passes == 6
    assert_same_state(handle.optimizer, optimizer)


def test_learning_rate_schedules_and_param_groups():
    def grouped(params):
        # No weight decay on the norms: two groups, as real training scripts build them.
        decay = [p for p in params if p.dim() > 1]
        return FusedAdamW([{"params": decay}, {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                          lr=1e-2, weight_decay=0.1)

    model = models.llama("tiny", seed=0)
    reference = copy.deepcopy(model)
    data = batches(model, 4)
    handle = overlap_step(model, grouped)
    optimizer = grouped(list(reference.parameters()))
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
                 for opt in (handle.optimizer, optimizer)]
    with warnings.catch_warnings():
        # lr_scheduler.step() before optimizer.step() warns: here the hooks called it.
        warnings.simplefilter("error")
        train_overlapped(model, data[:2], schedules[0])
    train_plain(reference, optimizer, data[:2], schedules[1])
    for opt in (handle.optimizer, optimizer):
        for group in opt.param_groups:
            group["lr"] = 3e-3  # set by hand, for all groups
    train_overlapped(model, data[2:])
    train_plain(reference, optimizer, data[2:])
    assert handle.optimizer.param_groups[0]["lr"] == 3e-3
    assert_identical(model, reference)
    assert_same_state(handle.optimizer, optimizer)


def test_state_dict_loads_both_ways():
    model = models.llama("tiny", seed=0)
    reference = copy.deepcopy(model)
    data = batches(model, 4)
    handle = overlap_step(model, adamw())
    optimizer = adamw()(reference.parameters())
    train_overlapped(model, data[:2])
    train_plain(reference, optimizer, data[:2])
    # Mid-run, each takes the other's checkpoint: overlapped -> plain and plain -> overlapped.
    overlapped_state = copy.deepcopy(handle.optimizer.state_dict())
    handle.optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    optimizer.load_state_dict(overlapped_state)
    for opt in (handle.optimizer, optimizer):
        # load_state_dict made new group dicts; the hooks must read these.
        opt.param_groups[0]["lr"] = 2e-3
    train_overlapped(model, data[2:])
    train_plain(reference, optimizer, data[2:])
    assert_identical(model, reference)
    assert_same_state(handle.optimizer, optimizer)


def test_remove_and_context_manager():
    model = TwoHeads()
    x = inputs(1)[0]
    with overlap_step(model, adamw()) as handle:
        with pytest.raises(RuntimeError, match="already updated during backward"):
            overlap_step(model, adamw())
        before = model.trunk.weight.clone()
        model(x, 0).backward()
        assert not torch.equal(model.trunk.weight, before)
    assert handle.removed and "removed" in repr(handle)
    handle.remove()  # idempotent
    before = model.trunk.weight.clone()
    model(x, 0).backward()
    # Without the hooks backward leaves its gradients and updates nothing.
    assert model.trunk.weight.grad is not None and torch.equal(model.trunk.weight, before)
    model.zero_grad()
    assert isinstance(overlap_step(model, adamw()), OverlappedStep)  # the parameters are free again


def test_the_whole_model_gradients_never_coexist():
    layers = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)])
    sizes = [p.numel() * p.element_size() for p in layers.parameters()]
    x = torch.randn(1, 256)
    optimizer = adamw()(layers.parameters())

    def peak_of(step) -> int:
        step()  # creates the optimizer state before the measured step
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as trace:
            step()
        return peak_live_bytes(trace)

    def plain():
        layers(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    plain_peak = peak_of(plain)
    with overlap_step(layers, adamw()):
        overlapped_peak = peak_of(lambda: layers(x).sum().backward())
    # Plain: every gradient is alive at the step. Overlapped: one at a time (plus activations).
    assert plain_peak >= sum(sizes)
    assert overlapped_peak < 2 * max(sizes)


def test_clip_grad_norm_after_backward_sees_no_gradients():
    model = TwoHeads()
    with overlap_step(model, adamw()):
        model(inputs(1)[0], 0).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item() == 0.0


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_grad_norm=1.0), ValueError, "clipping by the global gradient norm needs every gradient"),
    (dict(grad_scaler=torch.amp.GradScaler("cpu")), ValueError, "skips the whole step when any gradient"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps must be a positive integer, got 0"),
    (dict(optimizer_factory=lambda params: "sgd"), TypeError, "returned a str; expected a torch.optim.Optimizer"),
    (dict(optimizer_factory=torch.optim.LBFGS), ValueError, "LBFGS's step re-evaluates the loss"),
    (dict(optimizer_factory=lambda params: FusedAdamW([nn.Parameter(torch.ones(2))])), ValueError,
     "is not a parameter of the model"),
    (dict(optimizer_factory=FusedAdamW([nn.Parameter(torch.ones(2))])), TypeError,
     "optimizer_factory must be a callable"),
])
def test_refusals_name_the_argument_and_the_alternative(kwargs, error, message):
    with pytest.raises(error, match=message):
        overlap_step(TwoHeads(), **kwargs)


def test_refuses_a_retained_graph_before_updating_anything():
    model = TwoHeads()
    before = copy.deepcopy(model.state_dict())
    with overlap_step(model, adamw()) as handle:
        loss = model(inputs(1)[0], 0)
        with pytest.raises(RuntimeError, match="retain_graph=True.*would read the weights this one updates"):
            loss.backward(retain_graph=True)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        # The pass was never opened: the next backward trains as usual.
        model.zero_grad()
        model(inputs(1)[0], 0).backward()
        assert handle.backward_passes == 1 and model.trunk.weight.grad is None


def test_refuses_parameters_that_already_hold_gradients_and_non_modules():
    model = TwoHeads()
    model(inputs(1)[0], 0).backward()
    with pytest.raises(ValueError, match="already holds a gradient.*zero_grad"):
        overlap_step(model)
    with pytest.raises(TypeError, match="model must be an nn.Module, got function"):
        overlap_step(lambda x: x)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_refuses_ddp_and_sharded_models():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    # One gloo rank over an in-memory store: no port, no second process.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = TwoHeads()
        with pytest.raises(ValueError, match="DistributedDataParallel, which all-reduces gradients"):
            overlap_step(nn.parallel.DistributedDataParallel(model))
        mesh = init_device_mesh("cpu", (1,))
        model.trunk.weight = nn.Parameter(distribute_tensor(model.trunk.weight.detach(), mesh))
        with pytest.raises(RuntimeError, match="'trunk.weight' of this TwoHeads is a DTensor.*optimizer.step"):
            overlap_step(model)
    finally:
        dist.destroy_process_group()


# ---- on the fused model, and in the profiler ------------------------------------------


@pytest.fixture(scope="module")
def fused_llama():
    """The tiny Llama, hooked before fusing (the parameters are the same objects after
    fuse), its initial weights, and the fused model's batches."""
    model = models.llama("tiny", seed=0)
    initial = copy.deepcopy(model.state_dict())
    handle = overlap_step(model, adamw())
    data = batches(model)
    # The probes differentiate with torch.autograd.grad, which writes no .grad: no update.
    te_lab.fuse(model, sample=data[0], progress=False)
    handle.remove()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, initial[name]), name
    return model, initial, data


@pytest.mark.slow
def test_fused_model_overlapped_equals_plain_step(fused_llama):
    model, initial, data = fused_llama
    assert te_lab.is_fused(model)
    with overlap_step(model, adamw()) as handle:
        train_overlapped(model, data)
        overlapped = copy.deepcopy(model.state_dict())
        overlapped_optimizer = handle.optimizer
    model.load_state_dict(initial)
    optimizer = adamw()(model.parameters())
    train_plain(model, optimizer, data)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, overlapped[name]), name
    assert_same_state(overlapped_optimizer, optimizer)
    model.load_state_dict(initial)


def phases(report, mode):
    events = sorted((e for e in report.timeline if e.mode == mode), key=lambda e: e.start_us)
    return ([e for e in events if e.phase == "backward"], [e for e in events if e.phase == "optimizer"])


@pytest.mark.slow
def test_profiled_step_shows_updates_between_backward_ops(fused_llama):
    model, initial, data = fused_llama
    names = [name for name, _ in model.named_parameters()]

    def overlapped_step():
        model(**data[0]).loss.backward()

    with overlap_step(model, adamw()):
        report = profile_statement(overlapped_step, {"model": model}, steps=1, warmup=0, backward=False)
    for mode in ("eager", "fused"):
        backward, updates = phases(report, mode)
        # One update per parameter, named for it, inside the backward pass.
        assert sorted(e.path for e in updates) == sorted(names)
        assert backward[0].start_us < updates[0].start_us
        # Every update but the embedding's (its gradient is the last one backward makes)
        # is followed by more backward work.
        followed = [u for u in updates if any(b.start_us >= u.start_us + u.duration_us for b in backward)]
        assert len(followed) == len(updates) - 1, mode
        assert {e.path for e in updates} - {e.path for e in followed} == {"model.embed_tokens.weight"}
    overlapped_report = report

    optimizer = adamw()(model.parameters())

    def plain_step():
        model(**data[0]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    report = profile_statement(plain_step, {"model": model}, steps=1, warmup=0, backward=False)
    for mode in ("eager", "fused"):
        backward, updates = phases(report, mode)
        # optimizer.step() after backward: one update of all parameters, after the last backward op.
        assert [e.name for e in updates] == ["te_lab::adamw_step"]
        assert updates[0].start_us >= max(b.start_us + b.duration_us for b in backward)
    model.load_state_dict(initial)
    # The dashboard's timeline draws the updates as a phase of their own.
    figures = pytest.importorskip("te_lab.widgets.figures")
    drawn = [trace for trace in figures.timeline_figure(overlapped_report).data if trace.name == "optimizer"]
    assert sum(len(trace.x) for trace in drawn) == 2 * len(names)  # eager and fused
