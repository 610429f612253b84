"""The shared activation math: derivatives match autograd and never go subnormal."""

import pytest
import torch

from conftest import assert_close
from te_lab.kernels.activations import ACTIVATIONS, activate, activation_grad


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_derivative_matches_autograd(name):
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(activate(name, x).sum(), x)
    assert_close(activation_grad(name, x.detach()), want, torch.float64, atol=1e-12)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_derivative_has_no_subnormal_values(name):
    # subnormal gradients make the GEMMs that consume them several times slower
    x = torch.linspace(-200, 200, 400001)
    grad = activation_grad(name, x)
    subnormal = (grad != 0) & (grad.abs() < torch.finfo(torch.float32).tiny)
    assert not subnormal.any(), x[subnormal][:5]
