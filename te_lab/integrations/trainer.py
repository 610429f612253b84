"""``te_lab.TrainerCallback``: fuse the model a Hugging Face ``Trainer`` trains, at the
start of training, in one line::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[te_lab.TrainerCallback()])

At ``on_train_begin`` the callback takes the first batch of the training dataloader as
``te_lab.fuse``'s sample (with the RNG forked, so the run's shuffling and dropout are
those of an unfused run), fuses the model (a PEFT model too: the rules fuse around
LoRA layers), prints the report's summary and keeps the report as ``callback.report``.
With ``profile_html=path`` it then profiles training steps on that batch, eager against
fused (``te_lab.profile``), keeps the result as ``callback.profile_report`` and writes the
dashboard to ``path``.

By then the Trainer has run ``Accelerator.prepare``, which under mixed precision
(``bf16=True`` / ``fp16=True``) wraps the model's forward in autocast. The fused LM head
replaces that forward, so the callback fuses beneath the wrapper: it takes the wrapper
off, fuses, and wraps the fused forward the way ``Accelerator.prepare`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Optional, Union

import transformers

from te_lab.profiler import profile
from te_lab.surgery import fuse
from te_lab.surgery.inspection import tensor_like
from te_lab.surgery.probe import quiet_state

# Where Accelerator.prepare keeps the forward it wrapped for mixed precision.
ACCELERATE_WRAPPED = "_original_forward"


class TrainerCallback(transformers.TrainerCallback):
    """Fuse the Trainer's model when training begins; see the module doc.

    - ``only`` / ``exclude`` / ``backend``: as :func:`te_lab.fuse`.
    - ``profile_html``: a path; when given, one profile of training steps (forward and
      backward, eager against fused) on the first batch is written there as HTML.
    - ``profile_steps``: timed steps per mode for that profile.
    - ``verbose``: print the fusion report's summary (and the HTML's path).
    """

    def __init__(self, *, only=None, exclude=None, backend: str = "auto",
                 profile_html: Optional[Union[str, Path]] = None, profile_steps: int = 3, verbose: bool = True):
        if profile_html is not None and not isinstance(profile_html, (str, Path)):
            raise TypeError(f"te_lab.TrainerCallback: profile_html must be a path (str or pathlib.Path) or None, "
                            f"got {type(profile_html).__name__}")
        if not isinstance(profile_steps, int) or isinstance(profile_steps, bool) or profile_steps < 1:
            raise ValueError(f"te_lab.TrainerCallback: profile_steps must be a positive int, got {profile_steps!r}")
        self.fuse_options = dict(only=only, exclude=exclude, backend=backend)
        self.profile_html = None if profile_html is None else Path(profile_html)
        self.profile_steps = profile_steps
        self.verbose = verbose
        self.report = None
        self.profile_report = None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if model is None or self.report is not None:
            return  # fused once, by the first train() of this callback
        _, device = tensor_like(model)
        batch = _first_batch(train_dataloader, device)
        with _beneath_accelerate_autocast(model):
            self.report = fuse(model, sample=batch, progress=False, **self.fuse_options)
        if self.verbose:
            print(self.report.summary())
        if self.profile_html is not None and batch is not None and self.report.fused:
            with quiet_state([], device):  # dropout in the profiled steps leaves the run's RNG alone
                model.train()
                self.profile_report = profile(model, batch, steps=self.profile_steps, warmup=1)
            from te_lab.widgets.export import write_html

            written = write_html(self.profile_report, self.profile_html)
            if self.verbose:
                print(f"te_lab.TrainerCallback: profile of a training step written to {written}")


def _first_batch(dataloader, device) -> Optional[dict]:
    """The dataloader's first batch as keyword arguments, drawn with the RNG forked (a
    sampler draws its shuffling seed from it), or ``None`` when there is none."""
    if dataloader is None:
        return None
    with quiet_state([], device):
        batch = next(iter(dataloader), None)
    return dict(batch) if isinstance(batch, Mapping) else None


class _beneath_accelerate_autocast:
    """Take off the autocast wrapper Accelerator.prepare put on ``model.forward`` for the
    block, then wrap whatever forward the block left as Accelerator.prepare does."""

    def __init__(self, model):
        self.model = model
        self.wrapped = ACCELERATE_WRAPPED in model.__dict__ and "forward" in model.__dict__

    def __enter__(self):
        if self.wrapped:
            model = self.model
            original = model.__dict__.pop(ACCELERATE_WRAPPED)
            del model.forward
            if original != model.forward:  # an instance forward of its own, under the wrapper
                model.forward = original

    def __exit__(self, *exc_info):
        if self.wrapped:
            from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

            model = self.model
            model.__dict__[ACCELERATE_WRAPPED] = model.forward
            model.forward = convert_outputs_to_fp32(get_mixed_precision_context_manager(True)(model.forward))
        return False
