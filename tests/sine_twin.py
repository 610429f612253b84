"""A cheap stand-in fusion for the tests of fuse's machinery (probes, hooks, faults,
profile's errors): ``Sine`` computes sin(x) * scale, its twin ``FusedSine`` the same
math by another path (a shifted cosine), with no compiled kernel behind it."""

import contextlib

import torch
from torch import nn

import te_lab
from te_lab.modules import FusedModule


class Sine(nn.Module):
    """``twin_fault``, when set, is the exception type its twin raises when called."""

    twin_fault = None

    def __init__(self, width: int = 8, scale: float = 1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.full((width,), scale))

    def forward(self, x):
        return torch.sin(x) * self.scale


class FusedSine(FusedModule):
    def forward(self, x):
        if self.original.twin_fault is not None:
            raise self.original.twin_fault("injected by the test")
        return torch.cos(x - torch.pi / 2) * self.scale

    def kernel_names(self):
        return ["test::sine"]


@contextlib.contextmanager
def sine_rule(twin: type = FusedSine):
    """The rule ``sine`` registered for the block: every ``Sine`` gets a ``twin``."""
    def match(module):
        if isinstance(module, Sine):
            return te_lab.Match([te_lab.Variant(lambda options: twin(module))],
                                lambda: te_lab.ProbeInputs((torch.randn(4, module.scale.numel()),)))
        return None

    te_lab.register_rule(te_lab.FusionRule("sine", "other", "sin(x) as a shifted cos", match))
    try:
        yield
    finally:
        te_lab.unregister_rule("sine")
