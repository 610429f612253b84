"""te_lab.profiler.estimates: bytes moved and FLOPs per op, checked against hand counts."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from te_lab.kernels import available_backends, registered_ops, rms_norm
from te_lab.profiler.estimates import BYTES_FORMULA, element_size, op_cost

F32, BF16 = "float", "c10::BFloat16"
# How the profiler records te_lab::rms_norm(x, residual=None, weight, eps, weight_offset, backend).
RMS_NORM_SHAPES = [[4, 8, 256], [], [256], [], [], []]
RMS_NORM_DTYPES = [F32, "", F32, "Scalar", "Scalar", ""]


def test_element_sizes_of_profiler_dtype_strings():
    assert element_size("float") == 4
    assert element_size("c10::BFloat16") == element_size("c10::Half") == 2
    assert element_size("double") == element_size("long int") == 8
    assert element_size("bool") == 1
    assert element_size("") is None and element_size("Scalar") is None and element_size("ScalarList") is None


def test_rms_norm_reads_x_and_weight_and_writes_y_and_rstd():
    cost = op_cost("te_lab::rms_norm", RMS_NORM_SHAPES, RMS_NORM_DTYPES)
    assert cost.bytes_read == (4 * 8 * 256 + 256) * 4
    assert cost.bytes_written == 4 * 8 * 256 * 4 + 4 * 8 * 4  # y, then one float32 rstd per row
    assert cost.bytes_moved == cost.bytes_read + cost.bytes_written
    assert cost.flops == 4 * 4 * 8 * 256
    assert "rstd" in cost.formula


def test_rms_norm_with_a_residual_also_writes_h():
    shapes = [[4, 8, 256], [4, 8, 256], [256], [], [], []]
    cost = op_cost("te_lab::rms_norm", shapes, [F32, F32, F32, "Scalar", "Scalar", ""])
    assert cost.bytes_read == (2 * 4 * 8 * 256 + 256) * 4
    assert cost.bytes_written == 2 * 4 * 8 * 256 * 4 + 4 * 8 * 4
    assert cost.flops == 5 * 4 * 8 * 256


def test_mm_writes_the_product_and_takes_the_profilers_flops():
    cost = op_cost("aten::mm", [[64, 128], [128, 256]], [F32, F32], profiler_flops=2 * 64 * 128 * 256)
    assert cost.bytes_read == (64 * 128 + 128 * 256) * 4
    assert cost.bytes_written == 64 * 256 * 4
    assert cost.flops == 2 * 64 * 128 * 256
    assert "torch.profiler" in cost.formula
    # Without the profiler's count, ours gives the same number.
    assert op_cost("aten::mm", [[64, 128], [128, 256]], [F32, F32]).flops == 2 * 64 * 128 * 256


def test_bf16_halves_the_bytes_of_the_same_shapes():
    fp32 = op_cost("aten::mm", [[64, 128], [128, 256]], [F32, F32])
    bf16 = op_cost("aten::mm", [[64, 128], [128, 256]], [BF16, BF16])
    assert (bf16.bytes_read, bf16.bytes_written) == (fp32.bytes_read // 2, fp32.bytes_written // 2)
    assert bf16.flops == fp32.flops


def test_addmm_reads_the_bias_and_writes_the_product():
    cost = op_cost("aten::addmm", [[256], [64, 128], [128, 256], [], []], [F32, F32, F32, "Scalar", "Scalar"])
    assert cost.bytes_read == (256 + 64 * 128 + 128 * 256) * 4
    assert cost.bytes_written == 64 * 256 * 4


def test_elementwise_mul_writes_one_output_like_its_largest_input():
    cost = op_cost("aten::mul", [[64, 128], [64, 128]], [F32, F32])
    assert (cost.bytes_read, cost.bytes_written, cost.flops) == (2 * 64 * 128 * 4, 64 * 128 * 4, 64 * 128)
    # A Python number is recorded as a 0-dim tensor (shape [], a real dtype): one element read.
    by_number = op_cost("aten::mul", [[64, 128], []], [F32, "double"])
    assert by_number.bytes_read == 64 * 128 * 4 + 8


def test_data_movement_has_no_flops():
    assert op_cost("aten::cat", [[64, 128], [64, 128]], [F32, F32]).flops == 0
    copy = op_cost("aten::copy_", [[64, 128], [64, 128], []], [BF16, F32, "Scalar"])
    assert (copy.bytes_read, copy.bytes_written) == (64 * 128 * 4, 64 * 128 * 2)


def test_attention_flops_and_outputs_follow_its_formula():
    q, kv = [2, 4, 16, 32], [2, 4, 64, 32]
    forward = op_cost("te_lab::attention", [q, kv, kv, [], [], [], []], [F32, F32, F32, "", "Scalar", "Scalar", ""])
    assert forward.flops == 4 * 2 * 4 * 16 * 64 * 32
    assert forward.bytes_written == 2 * 4 * 16 * 32 * 4 + 2 * 4 * 16 * 4  # out like q, lse per query row
    backward = op_cost("te_lab::attention_backward", [q, q, kv, kv, [], q, [2, 4, 16], [], [], []],
                       [F32, F32, F32, F32, "", F32, F32, "Scalar", "Scalar", ""])
    assert backward.flops == 5 * 2 * 2 * 4 * 16 * 64 * 32  # 2.5 x the forward
    assert backward.bytes_written == (2 * 4 * 16 * 32 + 2 * 2 * 4 * 64 * 32) * 4


def test_unknown_ops_fall_back_to_the_largest_input():
    cost = op_cost("my_lib::op", [[10], [20]], [F32, F32])
    assert (cost.bytes_read, cost.bytes_written, cost.flops) == (30 * 4, 20 * 4, 0)
    assert "largest input" in cost.formula and "estimated" in BYTES_FORMULA


@pytest.mark.parametrize("name", ["aten::mm", "aten::addmm", "aten::sum", "aten::copy_", "te_lab::rms_norm",
                                  "te_lab::layer_norm_backward", "te_lab::glu_backward", "te_lab::rope",
                                  "te_lab::attention", "te_lab::fused_linear_cross_entropy_backward"])
@pytest.mark.parametrize("shapes,dtypes", [([], []), ([[3]], []), ([[2, 3], [4]], [F32]),
                                           ([[0, 0], [0]], [F32, F32]), ([[-1], None], [F32, F32]),
                                           ([[]] * 10, [F32] * 10)])
def test_odd_inputs_never_raise(name, shapes, dtypes):
    cost = op_cost(name, shapes, dtypes)
    assert min(cost.bytes_read, cost.bytes_written, cost.flops) >= 0


@pytest.mark.parametrize("backend", [name for name in ("inductor", "cpp")
                                     if name in available_backends(registered_ops()["rms_norm"], torch.device("cpu"))])
def test_a_profiled_rms_norm_event_is_read_as_expected(backend):
    x, weight = torch.randn(4, 8, 256), torch.randn(256)
    rms_norm(x, weight, backend=backend)  # compile outside the profiled region
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        rms_norm(x, weight, backend=backend)
    event = next(e for e in prof.profiler.kineto_results.events() if e.name() == "te_lab::rms_norm")
    # The C++ overload takes the op's arguments but the last (backend), under the op's name.
    arguments = len(RMS_NORM_SHAPES) - (backend == "cpp")
    assert (event.shapes(), event.dtypes()) == (RMS_NORM_SHAPES[:arguments], RMS_NORM_DTYPES[:arguments])
    assert op_cost(event.name(), event.shapes(), event.dtypes(), event.flops()) == \
        op_cost("te_lab::rms_norm", RMS_NORM_SHAPES, RMS_NORM_DTYPES)
    cost = op_cost(event.name(), event.shapes(), event.dtypes(), event.flops())
    assert (cost.bytes_read, cost.bytes_written) == ((4 * 8 * 256 + 256) * 4, 4 * 8 * 256 * 4 + 4 * 8 * 4)
