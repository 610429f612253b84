"""The fusion ceiling: each mode's step split into compute (GEMMs, attention) and the rest,
the step if the rest cost only its bytes at the bandwidth, and te_lab's share of the gain:
on hand-made numbers, on a real profiled step (the GEMMs found once each, their bytes by
hand) and in a real profile's summary, JSON and figure."""

import pytest
import torch
from torch import nn

import te_lab
from te_lab import models
from te_lab.profiler import ceiling
from te_lab.profiler.attribution import attribute
from te_lab.profiler.report import SMALL_AVAILABLE_GAIN, FusionCeiling, ProfileReport


def _ceiling(eager_ms=10.0, fused_ms=9.6, compute_ms=8.5, rest_bytes=150_000_000, fused_rest_bytes=100_000_000,
             bandwidth=100.0, fused_compute_ms=None) -> FusionCeiling:
    eager = ceiling.mode_split(eager_ms, compute_ms, 200_000_000 + rest_bytes, 200_000_000)
    fused = ceiling.mode_split(fused_ms, compute_ms if fused_compute_ms is None else fused_compute_ms,
                               200_000_000 + fused_rest_bytes, 200_000_000)
    return ceiling.fusion_ceiling(eager_ms, fused_ms, eager, fused, bandwidth, "hand-made")


def test_the_ceiling_costs_the_fewer_rest_bytes_at_the_bandwidth_with_compute_unchanged():
    found = _ceiling()
    assert (found.eager.compute_ms, found.eager.rest_ms) == pytest.approx((8.5, 1.5))
    assert found.eager.compute_share == pytest.approx(0.85)
    assert found.rest_bytes == 100_000_000  # the fused mode's: fewer than eager's 150 MB
    assert found.rest_floor_ms == pytest.approx(1.0)  # 100 MB at 100 GB/s
    assert found.ceiling_step_ms == pytest.approx(9.5)
    assert found.ceiling_speedup == pytest.approx(10 / 9.5)
    assert found.achieved_gain == pytest.approx(10 / 9.6 - 1)
    assert found.share_of_available == pytest.approx((10 / 9.6 - 1) / (10 / 9.5 - 1))
    assert found.verdict().startswith("te_lab got 0.04 of the 0.05 available (79%; GEMMs and attention are 85%")
    assert "near the ceiling" in found.verdict()


def test_the_verdict_tells_fusion_cannot_help_from_not_good_enough():
    saturated = _ceiling(compute_ms=9.9, rest_bytes=1_000_000, fused_rest_bytes=1_000_000, fused_ms=10.1)
    assert 0 < saturated.available_gain < SMALL_AVAILABLE_GAIN
    assert "fusion cannot help this model much on this device" in saturated.verdict()
    assert "GEMMs and attention are 99% of the eager step" in saturated.verdict()
    behind = _ceiling(compute_ms=4.0, rest_bytes=50_000_000, fused_rest_bytes=50_000_000, fused_ms=9.0)
    assert behind.ceiling_step_ms == pytest.approx(4.5)
    assert behind.share_of_available == pytest.approx((10 / 9 - 1) / (10 / 4.5 - 1))
    assert "te_lab's fusion is not good enough yet" in behind.verdict()


def test_faster_gemms_in_the_fused_step_lower_the_ceiling_and_are_named():
    # te_lab's linear op on another GEMM library: 2 ms of the 2.5 ms gained
    found = _ceiling(fused_ms=7.5, fused_compute_ms=6.5)
    assert found.compute_ms == 6.5 and found.ceiling_step_ms == pytest.approx(7.5)
    assert found.share_of_available == pytest.approx(1.0)
    assert "2 ms of it from the fused step's faster GEMMs and attention" in found.verdict()
    assert "faster GEMMs" not in _ceiling().verdict()


def test_a_rest_already_faster_than_its_bytes_leaves_no_gain_and_compute_never_passes_the_step():
    found = _ceiling(compute_ms=9.0, rest_bytes=500_000_000, fused_rest_bytes=500_000_000)
    assert found.ceiling_step_ms == pytest.approx(10.0)  # never slower than the eager step
    assert found.available_gain == pytest.approx(0.0) and found.share_of_available is None
    split = ceiling.mode_split(5.0, 7.0, 10, 20)
    assert (split.compute_ms, split.rest_ms, split.rest_bytes) == (5.0, 0.0, 0)
    assert ceiling.fusion_ceiling(0.0, 1.0, split, split, 100.0, "") is None
    assert ceiling.fusion_ceiling(1.0, 1.0, split, split, 0.0, "") is None


def test_the_compute_ops_are_the_gemms_and_attention_kernels():
    for name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::_grouped_mm", "te_lab::linear",
                 "te_lab::linear_backward", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"):
        assert ceiling.is_compute(name), name
    for name in ("aten::add", "aten::softmax", "te_lab::rms_norm", "aten::copy_", "te_lab::glu"):
        assert not ceiling.is_compute(name), name


def test_a_real_step_counts_each_gemm_once_with_its_bytes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    x = torch.randn(40, 64)
    with torch.profiler.profile(record_shapes=True, with_flops=True) as profiler:
        model(x).sum().backward()
    trace = attribute(profiler, "eager", None, on_gpu=False, costs=True)
    events = profiler.events()
    gemms = [e for e in events if e.name in ("aten::addmm", "aten::mm")]
    # aten::linear encloses the forward addmm: counted once, by the enclosing op's time
    linears = [e for e in events if e.name == "aten::linear"]
    assert len(linears) == 2
    outermost = linears + [e for e in gemms if not any(
        a.name in ceiling.COMPUTE_OPS for a in _ancestors(e))]
    assert trace.compute_us == pytest.approx(sum(e.time_range.elapsed_us() for e in outermost))
    # bytes by hand: forward x@W1^T+b1, h@W2^T+b2; backward dh = dy@W2, dW2 = dy^T@h, dx = dh'@W1, dW1 = dh'^T@x
    f = 4

    def mm(m, k, n, bias=False):
        return f * (m * k + k * n + m * n + (n if bias else 0))

    forward = mm(40, 64, 96, bias=True) + mm(40, 96, 32, bias=True)
    backward = mm(40, 32, 96) + mm(32, 40, 96) + mm(96, 40, 64)  # dx of the first layer is not needed
    assert trace.compute_bytes == forward + backward
    assert trace.step_bytes > trace.compute_bytes  # GELU, its backward, the sum and the bias gradients


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    model = models.llama("tiny")
    batch = model.example_batch(2, 32)
    te_lab.fuse(model, sample=batch, progress=False)
    return te_lab.profile(model, batch, steps=4, warmup=1)


def test_a_real_profile_carries_the_ceiling_in_its_summary_json_and_figure(report):
    found = report.ceiling
    assert found is not None
    for mode, split in (("eager", found.eager), ("fused", found.fused)):
        assert 0 < split.compute_ms < report.modes[mode].step_median_ms
        assert split.compute_ms + split.rest_ms == pytest.approx(report.modes[mode].step_median_ms)
        assert split.rest_bytes > 0 and split.compute_bytes > 0
    assert found.rest_bytes == min(found.eager.rest_bytes, found.fused.rest_bytes)
    assert found.compute_ms == min(found.eager.compute_ms, found.fused.compute_ms)
    assert found.compute_ms <= found.ceiling_step_ms <= report.modes["eager"].step_median_ms
    assert found.bandwidth_gbs > 0 and found.bandwidth_source.startswith("fastest measured copy")
    assert ProfileReport.from_json(report.to_json()).ceiling == found
    summary = report.summary()
    assert f"fusion ceiling:             {found.ceiling_speedup:.2f}x at most: {found.verdict()}" in summary
    assert "compute ms (GEMMs, attention)" in summary and "rest ms (MiB moved)" in summary
    assert "fusion_ceiling" in report.formulas
    pytest.importorskip("plotly")
    from te_lab.widgets.figures import ceiling_figure

    figure = ceiling_figure(report)
    assert [trace.name for trace in figure.data] == ["GEMMs and attention", "the rest"]
    assert list(figure.data[0].x) == pytest.approx([found.eager.compute_ms, found.fused.compute_ms,
                                                    found.compute_ms])
    assert list(figure.data[1].x) == pytest.approx([found.eager.rest_ms, found.fused.rest_ms, found.rest_floor_ms])
    assert figure.layout.title.text == found.verdict()


def test_the_figure_says_why_without_a_ceiling(report):
    pytest.importorskip("plotly")
    from te_lab.widgets.figures import ceiling_figure

    empty = ProfileReport.from_json(report.to_json())
    empty.ceiling = None
    assert "no fusion ceiling" in ceiling_figure(empty).layout.annotations[0].text
