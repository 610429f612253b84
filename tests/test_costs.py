"""te_lab.kernels.costs: every te_lab custom op has a cost function, registered with its
FusedOp; each matches a hand count on one shape; the benchmark cases read the same
model. (Eager against fused, per op kind of the demo models: test_profiler.py for the
Llama, below for GPT-2.)"""

import pytest
import torch

import te_lab
from te_lab import models
from te_lab.benchmarks.cases import Size, op_cases, tensor_spec
from te_lab.kernels.costs import TensorSpec
from te_lab.kernels.registry import registered_ops
from te_lab.profiler.estimates import cost_of

F32, BF16 = 4, 2


def spec(*shape, itemsize=F32) -> TensorSpec:
    return TensorSpec(tuple(shape), itemsize)


def te_lab_custom_ops() -> set[str]:
    """Every te_lab op by name. The C++ overloads (``te_lab::<op>.cpp``, and
    ``te_lab::cross_entropy_backward.cpp_in_place``) are left out: profiles record them under
    the op's own name, with its arguments but ``backend``."""
    return {name for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("te_lab::") and "." not in name}


def test_every_te_lab_custom_op_has_a_cost_registered_with_its_fused_op():
    costed = {name: op.name for op in registered_ops().values() for name in op.costs}
    assert te_lab_custom_ops() <= set(costed), te_lab_custom_ops() - set(costed)
    assert all(op.costs for op in registered_ops().values()), [op.name for op in registered_ops().values()
                                                               if not op.costs]
    assert costed["te_lab::linear"] == "linear" and costed["te_lab::rms_norm_backward"] == "rms_norm"


# (op, arguments by position, bytes read, bytes written, FLOPs), counted by hand:
# T tokens x H hidden, float32 unless said.
T, H, V, F = 64, 256, 1000, 688
N = T * H
HAND_COUNTS = [
    # y, rstd per row; 4 FLOPs per element
    ("te_lab::rms_norm", [spec(T, H), None, spec(H)], (N + H) * 4, N * 4 + T * 4, 4 * N),
    # dy, h, w, rstd read; dx, dw written; 8 per element
    ("te_lab::rms_norm_backward", [spec(T, H), None, spec(T, H), spec(H), spec(T)], (2 * N + H + T) * 4,
     (N + H) * 4, 8 * N),
    # x, residual, w, b read; y, h, mean, rstd written; 7 + 1 per element
    ("te_lab::layer_norm", [spec(T, H), spec(T, H), spec(H), spec(H)], (2 * N + 2 * H) * 4, (2 * N + 2 * T) * 4,
     8 * N),
    ("te_lab::layer_norm_backward", [spec(T, H), None, spec(T, H), spec(H), spec(H), spec(T), spec(T)],
     (2 * N + 2 * H + 2 * T) * 4, (N + 2 * H) * 4, 11 * N),
    # bfloat16 gate and up: y like gate; 5 per element
    ("te_lab::glu", [spec(T, F, itemsize=BF16), spec(T, F, itemsize=BF16)], 2 * T * F * 2, T * F * 2, 5 * T * F),
    ("te_lab::glu_backward", [spec(T, F), spec(T, F), spec(T, F)], 3 * T * F * 4, 2 * T * F * 4, 10 * T * F),
    ("te_lab::bias_act", [spec(T, 4 * H), spec(4 * H)], (4 * N + 4 * H) * 4, 4 * N * 4, 5 * 4 * N),
    ("te_lab::bias_act_backward", [spec(T, 4 * H), spec(T, 4 * H), spec(4 * H)], (8 * N + 4 * H) * 4,
     (4 * N + 4 * H) * 4, 8 * 4 * N),
    # q [1, 4, 64, 32], k [1, 2, 64, 32], cos/sin [64, 32]: 3 FLOPs per rotated element
    ("te_lab::rope", [spec(1, 4, 64, 32), spec(1, 2, 64, 32), spec(64, 32), spec(64, 32)],
     (8192 + 4096 + 2 * 2048) * 4, (8192 + 4096) * 4, 3 * (8192 + 4096)),
    ("te_lab::rope_backward", [spec(1, 4, 64, 32), spec(1, 2, 64, 32), spec(64, 32), spec(64, 32)],
     (8192 + 4096 + 2 * 2048) * 4, (8192 + 4096) * 4, 3 * (8192 + 4096)),
    # with QK-norm weights [32]: 4 FLOPs more per element forward; the backward also reads
    # q and k and writes the weights' gradients, 11 FLOPs per element for the norm
    ("te_lab::rope", [spec(1, 4, 64, 32), spec(1, 2, 64, 32), spec(64, 32), spec(64, 32), None, None, spec(32),
                      spec(32)], (8192 + 4096 + 2 * 2048 + 2 * 32) * 4, (8192 + 4096) * 4, 7 * (8192 + 4096)),
    ("te_lab::rope_backward", [spec(1, 4, 64, 32), spec(1, 2, 64, 32), spec(64, 32), spec(64, 32), None, None,
                               spec(1, 4, 64, 32), spec(1, 2, 64, 32), spec(32), spec(32)],
     (2 * (8192 + 4096) + 2 * 2048 + 2 * 32) * 4, (8192 + 4096 + 2 * 32) * 4, 14 * (8192 + 4096)),
    # q, k, v [2, 4, 64, 32]: out like q and a float32 lse per query row; 4 b h s s d
    ("te_lab::attention", [spec(2, 4, 64, 32)] * 3, 3 * 16384 * 4, 16384 * 4 + 2 * 4 * 64 * 4,
     4 * 2 * 4 * 64 * 64 * 32),
    # dout, q, k, v, (mask), out, lse read; dq, dk, dv written; 2.5x the forward
    ("te_lab::attention_backward", [spec(2, 4, 64, 32)] * 4 + [None, spec(2, 4, 64, 32), spec(2, 4, 64)],
     (5 * 16384 + 512) * 4, 3 * 16384 * 4, 10 * 2 * 4 * 64 * 64 * 32),
    # logits [T, V], int64 labels: per-token losses and the gradient written; 8 per logit
    ("te_lab::cross_entropy", [spec(T, V), spec(T, itemsize=8)], T * V * 4 + T * 8, T * 4 + T * V * 4, 8 * T * V),
    ("te_lab::cross_entropy_backward", [spec(T, V), spec(T)], (T * V + T) * 4, T * V * 4, T * V),
    # hidden [T, H], weight [V, H], labels: the three products and the loss, no logits written
    ("te_lab::fused_linear_cross_entropy", [spec(T, H), spec(V, H), None, spec(T, itemsize=8)],
     (N + V * H) * 4 + T * 8, T * 4 + (N + V * H) * 4, 3 * 2 * T * V * H + 8 * T * V),
    # a summed loss: the stored gradients scaled by dloss
    ("te_lab::fused_linear_cross_entropy_backward", [spec(), spec(T, H), spec(V, H), None],
     (1 + N + V * H) * 4, (N + V * H) * 4, N + V * H),
    ("te_lab::fused_linear_cross_entropy_scale_", [spec(), spec(T, H), spec(V, H), None],
     (1 + N + V * H) * 4, (N + V * H) * 4, N + V * H),
    # x [2, 32, H] @ weight [F, H]^T: 2 m n k, as aten::mm counts it
    ("te_lab::linear", [spec(2, 32, H), spec(F, H), None], (N + F * H) * 4, T * F * 4, 2 * T * F * H),
    ("te_lab::linear_backward", [spec(2, 32, F), spec(2, 32, H), spec(F, H)], (T * F + N + F * H) * 4,
     (N + F * H) * 4, 4 * T * F * H),
    # x [T, H], top-2 of E = 4 experts of width I = 32, R = 2T rows: h [R, 2I], y [R, H] written;
    # the two products 2 R 2I H + 2 R H I, 5 per activation output, 2 per weighted output element
    ("te_lab::moe", [spec(T, H), spec(T, 2), spec(T, 2, itemsize=8), spec(4, 64, H), spec(4, H, 32), None, None],
     (N + 2 * T + 4 * 64 * H + 4 * H * 32) * 4 + 2 * T * 8, (N + 2 * T * (64 + H)) * 4,
     2 * (2 * T) * 64 * H + 2 * (2 * T) * H * 32 + 2 * T * (5 * 32 + 2 * H)),
    # dout, x, weights, indices, gate_up, down, h, y read; dx, dweights, dgate_up, ddown written; twice the
    # products, 10 per activation element, 4 per element of the weighted rows
    ("te_lab::moe_backward", [spec(T, H), spec(T, H), spec(T, 2), spec(T, 2, itemsize=8), spec(4, 64, H),
                              spec(4, H, 32), None, None, spec(2 * T, 64), spec(2 * T, H)],
     (2 * N + 2 * T + 4 * 64 * H + 4 * H * 32 + 2 * T * (64 + H)) * 4 + 2 * T * 8,
     (N + 2 * T + 4 * 64 * H + 4 * H * 32) * 4,
     4 * (2 * T) * 64 * H + 4 * (2 * T) * H * 32 + 2 * T * (10 * 32 + 4 * H)),
    # parameters [F, H] and [H]: p, g, m, v read, p, m, v written; 14 per element
    ("te_lab::adamw_step", [spec(F, H), spec(H)], 4 * (F * H + H) * 4, 3 * (F * H + H) * 4, 14 * (F * H + H)),
]


@pytest.mark.parametrize("name, arguments, read, written, flops", HAND_COUNTS, ids=[c[0] for c in HAND_COUNTS])
def test_each_cost_matches_the_hand_count(name, arguments, read, written, flops):
    cost = cost_of(name, arguments)
    assert (cost.bytes_read, cost.bytes_written, cost.flops) == (read, written, flops)
    assert cost.formula and "largest input" not in cost.formula  # the op's own rule, not the fallback


def test_every_custom_op_is_hand_counted_here():
    assert {name for name, *_ in HAND_COUNTS} == te_lab_custom_ops() | {"te_lab::adamw_step"}


def test_atens_layer_norm_is_counted_by_te_labs_rule():
    x, weight, bias, stats = spec(T, H), spec(H), spec(H), spec(T, 1)
    eager = cost_of("aten::native_layer_norm", [x, None, weight, bias, None])
    fused = cost_of("te_lab::layer_norm", [x, None, weight, bias])
    assert (eager.bytes_read, eager.bytes_written, eager.flops) == ((N + 2 * H) * 4, (N + 2 * T) * 4, 7 * N)
    assert eager == fused
    backward = cost_of("aten::native_layer_norm_backward", [x, x, None, stats, stats, weight, bias, None])
    assert (backward.bytes_read, backward.bytes_written, backward.flops) == ((2 * N + 2 * H + 2 * T) * 4,
                                                                            (N + 2 * H) * 4, 11 * N)


def test_te_lab_linear_and_aten_mm_count_a_product_alike():
    x, weight = spec(T, H), spec(F, H)
    linear = cost_of("te_lab::linear", [x, weight, None])
    mm = cost_of("aten::mm", [x, spec(H, F)])
    assert (linear.bytes_read, linear.bytes_written, linear.flops) == (mm.bytes_read, mm.bytes_written, mm.flops)


def test_the_benchmark_cases_read_the_same_model():
    (case,) = op_cases("linear", torch.device("cpu"), torch.float32, Size(tokens=64, hidden=128))
    x, weight = case.inputs
    assert case.costs()["forward"].bytes_moved == cost_of("te_lab::linear", [tensor_spec(x), tensor_spec(weight),
                                                                             None]).bytes_moved
    assert case.flops_for("forward+backward") == 3 * 2 * 64 * 128 * weight.shape[0]
    (norm,) = op_cases("rms_norm", torch.device("cpu"), torch.float32, Size(tokens=64, hidden=128))
    assert norm.bytes_for("forward") == cost_of("te_lab::rms_norm", [tensor_spec(norm.inputs[0]), None,
                                                                     tensor_spec(norm.inputs[1])]).bytes_moved


def check_eager_and_fused_count_alike(report, rel: float) -> None:
    """Per op kind: the same FLOPs in both modes (within ``rel``), and no more bytes fused."""
    for kind in report.kinds:
        if kind.key == "other":
            continue
        assert kind.fused.flops == pytest.approx(kind.eager.flops, rel=rel), kind.key
        assert kind.fused.bytes_moved <= kind.eager.bytes_moved, kind.key


def test_gpt2_kinds_count_alike_eager_and_fused():
    # the heaviest test here: one fuse and a one-step profile of the tiny GPT-2 (its Inductor
    # ops compile on first use: 5-20 s each where the on-disk cache is cold)
    model = models.gpt2("tiny", seed=0)
    batch = model.example_batch(2, 32)
    te_lab.fuse(model, sample=batch, progress=False)
    report = te_lab.profile(model, batch, steps=1, warmup=1)
    assert {kind.key for kind in report.kinds} >= {"norm", "attention", "mlp"}
    check_eager_and_fused_count_alike(report, rel=0.10)  # as test_profiler.py's Llama check says why
