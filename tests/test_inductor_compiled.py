"""kernels/inductor_compiled.py: reference math lowered by Inductor and called without
torch.compile's runtime gives the math's numbers for every call it serves."""

import pytest
import torch

from te_lab.kernels.inductor_compiled import inductor_compiled


def _scaled_difference(a, b, scale: float):
    return (a - b) * scale, a.sum(-1)


@pytest.fixture
def compiled():
    # A fresh function per test: each has its own graphs and remembered signatures.
    def scaled_difference(a, b, scale: float):
        return _scaled_difference(a, b, scale)
    return inductor_compiled(scaled_difference)


def test_one_tensor_passed_twice_does_not_make_later_calls_assume_it(compiled):
    a = torch.randn(8, 16)
    first = compiled(a, a, 2.0)
    torch.testing.assert_close(first[0], torch.zeros(8, 16))
    b = torch.randn(8, 16)
    for got, expected in zip(compiled(a, b, 2.0), _scaled_difference(a, b, 2.0)):
        torch.testing.assert_close(got, expected)


def test_sizes_that_change_the_graph_get_their_own(compiled):
    # A graph traced with a row of one element takes that size as a constant.
    for shape in [(4, 1), (4, 2), (1, 3), (5, 3), (7, 16)]:
        a, b = torch.randn(shape), torch.randn(shape)
        for got, expected in zip(compiled(a, b, 0.5), _scaled_difference(a, b, 0.5)):
            torch.testing.assert_close(got, expected)


def test_non_tensor_arguments_are_part_of_the_specialisation(compiled):
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(compiled(a, b, 1.0)[0], a - b)
    torch.testing.assert_close(compiled(a, b, 3.0)[0], (a - b) * 3.0)


def test_non_contiguous_inputs_give_the_same_numbers(compiled):
    a, b = torch.randn(16, 8).t(), torch.randn(16, 8).t()
    for got, expected in zip(compiled(a, b, 2.0), _scaled_difference(a, b, 2.0)):
        torch.testing.assert_close(got, expected)
