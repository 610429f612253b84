"""The optimizer step overlapped with backward: each parameter is updated as soon as its
gradient is final, from a post-accumulate-grad hook, instead of all at once after backward.

One optimizer holds every parameter, exactly as for a plain ``optimizer.step()`` after
backward; the hook steps it over the one parameter whose gradient just became final (its
``param_groups`` narrowed to that parameter for the call) and then drops the gradient.
Because it is the same optimizer object, its ``state_dict()`` is the plain one (it loads
into a plain optimizer and back), ``param_groups[i]["lr"]`` sets the learning rate, and
LR schedulers drive it unchanged.

Why the numbers equal the plain step: autograd runs a parameter's ``AccumulateGrad`` node
only after every node that reads the parameter has run (a tied weight's after its last
use), so backward never sees an updated weight; and an elementwise optimizer (Adam, AdamW,
SGD, ...) computes the same arithmetic over one tensor as over many.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.weak import WeakIdKeyDictionary

from te_lab import distributed
from te_lab.kernels import FusedAdamW
from te_lab.kernels.torch_internals import backward_keeps_graph, queue_callback
from te_lab.profiler.regions import OPTIMIZER_PREFIX

NAME = "te_lab.optim.overlap_step"

# Parameter -> the OverlappedStep whose hook updates it, so no parameter is stepped twice.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class OverlappedStep:
    """What :func:`overlap_step` returns: the hooks that update ``model``'s parameters
    during backward, and the ``optimizer`` that does it.

    ``remove()`` (or leaving a ``with`` block) takes the hooks off; afterwards backward
    leaves gradients in ``.grad`` again and ``optimizer.step()`` trains as usual.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, accumulation_steps: int):
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.backward_passes = 0
        names = {id(param): name for name, param in model.named_parameters()}
        self._parameters = [(names[id(param)], param) for group in optimizer.param_groups for param in group["params"]]
        self._lock = threading.Lock()
        self._open_backward: Optional[_BackwardPass] = None
        self._handles = []
        self.removed = False
        for name, param in self._parameters:
            _OWNERS[param] = self
            # A frozen parameter gets no hook; unfrozen later, the end-of-backward sweep steps it.
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook(name)))

    def remove(self) -> None:
        """Take the hooks off (idempotent). Gradients accumulated in an unfinished
        accumulation window stay in ``.grad``."""
        self.removed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for _, param in self._parameters:
            if _OWNERS.get(param) is self:
                del _OWNERS[param]

    def __enter__(self) -> "OverlappedStep":
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self._handles)} hooks"
        return (f"OverlappedStep({type(self.optimizer).__name__}, {len(self._parameters)} parameters, {state}, "
                f"accumulation_steps={self.accumulation_steps}, backward_passes={self.backward_passes})")

    # ---- during backward ---------------------------------------------------------------

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def on_gradient_final(param: torch.Tensor) -> None:
            with self._lock:
                backward = self._open_backward
                if backward is None:
                    _refuse_retained_graph()
                    backward = self._open_backward = _BackwardPass(self)
                    # Runs once the whole backward pass has finished.
                    queue_callback(self._end_backward)
                if backward.steps:
                    self._step(name, param, backward)
        return on_gradient_final

    def _end_backward(self) -> None:
        with self._lock:
            backward, self._open_backward = self._open_backward, None
            if backward.steps:
                # What plain optimizer.step() would also update: parameters whose gradient
                # came only from earlier micro-batches, or that have no hook (unfrozen later).
                for name, param in self._parameters:
                    if param.grad is not None:
                        self._step(name, param, backward)
            self.backward_passes += 1

    def _step(self, name: str, param: torch.Tensor, backward: "_BackwardPass") -> None:
        optimizer = self.optimizer
        groups = optimizer.param_groups
        # A shallow copy of the parameter's group: lr and the other settings as they are now.
        optimizer.param_groups = [{**backward.group_of[id(param)], "params": [param]}]
        try:
            with record_function(OPTIMIZER_PREFIX + name):
                optimizer.step()
        finally:
            optimizer.param_groups = groups
        # Consumed: the gradient's memory is freed now, not at zero_grad.
        param.grad = None


def _refuse_retained_graph() -> None:
    # A torch build that cannot tell goes unchecked.
    if backward_keeps_graph():
        raise RuntimeError(
            f"{NAME}: backward(retain_graph=True) (or create_graph=True) keeps the graph for another backward, "
            f"which would read the weights this one updates in place (autograd would refuse it, after this "
            f"backward had already updated every parameter). Expected a backward "
            f"that frees its graph; for several backward passes through one graph, remove() the hooks and call "
            f"optimizer.step() after the last")


class _BackwardPass:
    """One backward pass as the hooks see it."""

    def __init__(self, owner: OverlappedStep):
        # Whether this pass ends an accumulation window, i.e. updates.
        self.steps = (owner.backward_passes + 1) % owner.accumulation_steps == 0
        # Looked up once per pass: load_state_dict replaces the group dicts, and a
        # scheduler edits them between passes.
        self.group_of = {id(param): group for group in owner.optimizer.param_groups for param in group["params"]}


def overlap_step(model: nn.Module, optimizer_factory: Optional[Callable] = None, *, accumulation_steps: int = 1,
                 max_grad_norm: Optional[float] = None, grad_scaler=None) -> OverlappedStep:
    """Update each of ``model``'s parameters during backward, as soon as its gradient is
    final, with the optimizer ``optimizer_factory(params)`` builds from the model's
    trainable parameters (default: te_lab's ``FusedAdamW`` with its defaults).

    ``loss.backward()`` then is the whole training step: there is no ``optimizer.step()``
    or ``zero_grad()`` to call, and afterwards every ``.grad`` is ``None`` (each gradient
    is dropped right after its update, so the whole model's gradients never coexist).
    The result equals ``loss.backward(); optimizer.step(); optimizer.zero_grad()``.

    - ``accumulation_steps=k``: gradient accumulation over micro-batches. Every k-th
      backward pass updates (with the gradient summed over the window); the ones before
      it leave their gradients in ``.grad``. A backward pass counts when it reaches a
      parameter of the optimizer.
    - The returned :class:`OverlappedStep` holds the ``optimizer``: set
      ``param_groups[i]["lr"]``, attach an LR scheduler, save and load its
      ``state_dict()`` as usual (the plain optimizer's format). ``remove()`` / ``with``
      takes the hooks off.
    - ``max_grad_norm`` and ``grad_scaler`` are refused (each raises ``ValueError`` with
      the reason): clipping by the global norm and GradScaler's skip-on-inf both need
      every gradient before the first update. ``clip_grad_norm_`` after backward sees no
      gradients.

    Not supported (refused where detectable): a model wrapped in
    ``DistributedDataParallel`` or sharded by FSDP2 (their gradient reductions run after
    the hooks; wrapping after ``overlap_step`` is not detected); optimizers whose update
    couples parameters or needs a closure (LBFGS; an optimizer's step hooks run once per
    parameter, seeing only it in ``param_groups``); parameters added with
    ``add_param_group`` later (make a new ``overlap_step``); ``use_reentrant=True``
    checkpointing with ``accumulation_steps > 1`` (a pass is counted when the graph task
    of its first hook ends, which may be a nested one); ``backward(retain_graph=True)``
    (a second backward through the graph would read updated weights; raises
    ``RuntimeError``). ``torch.autograd.grad`` writes no ``.grad``, so it updates nothing
    (nor do ``te_lab.fuse``'s probes or ``te_lab.profile``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{NAME}: model must be an nn.Module, got {type(model).__name__}")
    if max_grad_norm is not None:
        raise ValueError(
            f"{NAME}: max_grad_norm={max_grad_norm!r} cannot be combined with overlapped updates: clipping by the "
            f"global gradient norm needs every gradient before the first update, and overlap_step updates each "
            f"parameter as soon as its own gradient is final. Expected max_grad_norm=None; to clip, train without "
            f"overlap_step (loss.backward(); torch.nn.utils.clip_grad_norm_(...); optimizer.step())")
    if grad_scaler is not None:
        raise ValueError(
            f"{NAME}: grad_scaler={type(grad_scaler).__name__} cannot be combined with overlapped updates: a "
            f"GradScaler skips the whole step when any gradient is inf/NaN, which is known only after the last "
            f"gradient, by when overlap_step has updated the others. Expected grad_scaler=None; train in bfloat16 "
            f"autocast (no scaler needed), or without overlap_step")
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
        raise ValueError(f"{NAME}: accumulation_steps must be a positive integer, got {accumulation_steps!r}")
    _refuse_distributed(model)
    trainable = [param for param in model.parameters() if param.requires_grad]
    factory = FusedAdamW if optimizer_factory is None else optimizer_factory
    if not callable(factory):
        raise TypeError(f"{NAME}: optimizer_factory must be a callable taking the parameters and returning a "
                        f"torch.optim.Optimizer, got {type(factory).__name__}")
    optimizer = factory(trainable)
    _check_optimizer(model, optimizer)
    return OverlappedStep(model, optimizer, accumulation_steps)


def _refuse_distributed(model: nn.Module) -> None:
    if distributed.is_data_parallel(model):
        raise ValueError(
            f"{NAME}: model is wrapped in DistributedDataParallel, which all-reduces gradients in hooks of its own; "
            f"an update applied before the all-reduce would use this rank's local gradient. Expected an unwrapped "
            f"model; under DDP, call optimizer.step() after backward")
    distributed.refuse_sharded(model, NAME, "their gradients are reduced across ranks after accumulation, so an "
                                            "update applied in the hook would miss the other ranks' share; under "
                                            "FSDP, call optimizer.step() after backward")


def _check_optimizer(model: nn.Module, optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{NAME}: optimizer_factory returned a {type(optimizer).__name__}; expected a "
                        f"torch.optim.Optimizer")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"{NAME}: LBFGS's step re-evaluates the loss through a closure over all parameters; "
                         f"expected an optimizer that updates each parameter from its own gradient (e.g. AdamW, SGD)")
    in_model = {id(param) for param in model.parameters()}
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            where = f"parameter {param_index} of param group {group_index}"
            if id(param) not in in_model:
                raise ValueError(f"{NAME}: {where} of the optimizer is not a parameter of the model; expected "
                                 f"only the model's parameters")
            if param.grad is not None:
                raise ValueError(
                    f"{NAME}: {where} already holds a gradient, which the first update would add to its new one; "
                    f"expected none (call optimizer.zero_grad() or model.zero_grad() first)")
            owner = _OWNERS.get(param)
            if owner is not None:
                raise RuntimeError(f"{NAME}: {where} is already updated during backward by {owner!r}, which would "
                                   f"update it twice; call its remove() first")
