"""te_lab.profile's errors where users hit walls: nothing to differentiate, inputs of the
wrong form (in profile's own name, not fuse's), and options that mean the same in the
API, the command line and the magics (te_lab.options). A hand-made model with a cheap
twin: no compiled kernels."""

import pytest
import torch
from torch import nn

import te_lab
from sine_twin import Sine, sine_rule
from te_lab.cli import build_parser
from te_lab.profiler import profile_statement


class Embedded(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.act = Sine()

    def forward(self, ids):
        return self.act(self.embed(ids))


@pytest.fixture
def frozen_fused_model():
    with sine_rule():
        model = Embedded().requires_grad_(False)
        te_lab.fuse(model)
        assert te_lab.is_fused(model)
        yield model


def test_nothing_to_differentiate_says_so_and_forward_only_works(frozen_fused_model):
    ids = torch.randint(0, 16, (2, 5))
    with pytest.raises(ValueError, match=r"^te_lab\.profile: backward=True, but there is nothing to differentiate: "
                                         r"no parameter of the target requires grad and inputs hold no "
                                         r"floating-point tensor; pass backward=False"):
        te_lab.profile(frozen_fused_model, ids, steps=1, warmup=0)
    with pytest.raises(ValueError, match=r"^te_lab\.profile_statement: backward=True, but no parameter"):
        profile_statement(lambda: frozen_fused_model(ids), {"model": frozen_fused_model}, steps=1, warmup=0)
    report = te_lab.profile(frozen_fused_model, ids, steps=1, warmup=0, backward=False)
    assert report.modes["fused"].backward_median_ms is None and report.modes["eager"].step_median_ms > 0


def test_profile_errors_name_te_lab_profile(frozen_fused_model):
    with pytest.raises(TypeError, match=r"^te_lab\.profile: inputs must be a tensor, a tuple of positional "
                                        r"arguments or a dict of keyword arguments .* got set"):
        te_lab.profile(frozen_fused_model, {1, 2}, backward=False)
    with pytest.raises(TypeError, match=r"^te_lab\.fuse: sample must be a tensor"):
        te_lab.fuse(frozen_fused_model, sample={1, 2})


@pytest.mark.parametrize("option, value, message", [
    ("steps", 0, "steps must be a positive integer or 'auto', got 0"),
    ("warmup", -1, "warmup must be a non-negative integer, got -1"),
])
def test_count_options_are_checked_alike_by_the_api_and_the_cli(frozen_fused_model, option, value, message, capsys):
    with pytest.raises(ValueError, match=f"^te_lab.profile: {message}$"):
        te_lab.profile(frozen_fused_model, torch.zeros(1, 2, dtype=torch.long), backward=False, **{option: value})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--model", "llama-tiny", f"--{option}", str(value)])
    assert f"argument --{option}: {message}" in capsys.readouterr().err


def test_no_warmup_is_accepted_everywhere():
    args = build_parser().parse_args(["profile", "--model", "llama-tiny", "--warmup", "0"])
    assert args.warmup == 0  # the CLI refused it while the API and the magics took it
