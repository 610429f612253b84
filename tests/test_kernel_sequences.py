"""te_lab.profiler.kernel_sequences: the frequent kernel sequences of an operator, checked against
Holistic Trace Analysis' own get_frequent_cuda_kernel_sequences on every trace of tests/data/gpu-traces
where HTA's runs, and on tiny hand-written Kineto traces; and the fusion opportunities of a GpuTrace
(chains of memory-bound kernels per stream), on those and on real traces."""

import gzip
import json
import logging
import pathlib
import shutil

import numpy as np
import pytest

import te_lab
from te_lab.profiler.kernel_sequences import (
    KernelSequence,
    frequent_kernel_sequences,
    kernel_launches,
    trace_opportunities,
)
from te_lab.profiler.kineto import file_activities
from te_lab.profiler.opportunity_table import ranked

DATA = pathlib.Path(__file__).parent / "data" / "gpu-traces"
MiB = 2**20


class _NumpyForHtaCallStack:
    """numpy as HTA 0.5's call stack module sees it, with one fix: its duplicate check hands
    ``np.unique(..., axis=0)`` an object array (pandas 3 no longer downcasts the ``replace``
    before it), which numpy refuses with a TypeError; the check only logs. Object arrays
    are compared as numbers there; everything else is numpy's."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def unique(array, **kwargs):
        return np.unique(array.astype(float) if array.dtype == object else array, **kwargs)


@pytest.fixture(scope="module")
def hta_run(tmp_path_factory):
    """HTA's frequent sequences of (trace, operator, min_pattern_len), one TraceAnalysis per trace."""
    analysis = pytest.importorskip("hta.trace_analysis", reason="holistictraceanalysis is in the dev extra")
    call_stack = pytest.importorskip("hta.common.trace_call_stack")
    logging.getLogger("hta").setLevel(logging.ERROR)
    analyses = {}
    output = tmp_path_factory.mktemp("hta-overlaid")

    def run(name, operator, min_pattern_len, document=None):
        """HTA's rows for the trace file ``name``, or for ``document`` (a Kineto JSON) under that name."""
        if name not in analyses:
            directory = tmp_path_factory.mktemp(name)
            if document is None:
                shutil.copy(DATA / f"{name}.json.gz", directory)
            else:
                (directory / f"{name}.json").write_text(json.dumps(document))
            analyses[name] = analysis.TraceAnalysis(trace_dir=str(directory))
        frame = analyses[name].get_frequent_cuda_kernel_sequences(operator, str(output),
                                                                  min_pattern_len=min_pattern_len, visualize=False)
        return [(row["pattern"], row["count"], row["GPU kernel duration (us)"], row["CPU op duration (us)"])
                for _, row in frame.iterrows()]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(call_stack, "np", _NumpyForHtaCallStack())
        yield run


# (trace, operator, min_pattern_len): the operators each trace holds, HTA's docs' aten::linear first.
# Not here: v100-ns-resolution, where HTA's call tree raises on the events its rounding to whole µs
# makes negative (see test_a_nanosecond_trace_counts_every_step_but_the_last), and mi250-rocm-train,
# whose kernels run on stream 0, which HTA links to no host call (see the test after this one).
HTA_CASES = [
    ("a100-alexnet-train", "aten::linear", 3),
    ("a100-alexnet-train", "aten::conv2d", 3),
    ("a100-alexnet-train", "aten::", 1),
    ("a100-multi-stream-event-sync", "aten::mm", 1),
    ("a100-triton-kernel", "Torch-Compiled Region", 1),
    ("hta-sampled-rank0", "aten::linear", 1),
    ("hta-sampled-rank0", "aten::mm", 1),
    ("hta-sampled-rank0", "aten::layer_norm", 1),
    ("hta-sampled-rank0", "autograd::engine::evaluate_function", 3),
]


@pytest.mark.parametrize("name, operator, min_pattern_len", HTA_CASES)
def test_the_sequences_equal_holistic_trace_analysis(hta_run, name, operator, min_pattern_len):
    expected = hta_run(name, operator, min_pattern_len)
    trace = te_lab.open_trace(DATA / f"{name}.json.gz")
    sequences = frequent_kernel_sequences(trace, operator, min_pattern_len=min_pattern_len, top_k=None)
    assert expected, "each case holds a pattern"
    assert [(s.hta_pattern, s.count) for s in sequences] == [(pattern, count) for pattern, count, _, _ in expected]
    assert frequent_kernel_sequences(trace, operator, min_pattern_len=min_pattern_len) == sequences[:5]
    for sequence, (_, count, device_us, host_us) in zip(sequences, expected):
        # HTA rounds a trace with fractional µs (the Triton one) to whole µs, each event by under 1 µs
        tolerance = count * (len(sequence.kernels) + 1)
        assert sequence.device_us == pytest.approx(device_us, abs=tolerance)
        assert sequence.host_us == pytest.approx(host_us, abs=tolerance)


def test_the_rocm_trace_s_stream_0_kernels_count_where_hta_links_none(hta_run):
    """HTA links no kernel on stream 0 to its launch; on a copy whose device events run on
    stream 1 it finds exactly what te_lab finds on the trace itself."""
    assert hta_run("mi250-rocm-train", "aten::", 1) == []
    trace = te_lab.open_trace(DATA / "mi250-rocm-train.json.gz")
    assert {k.stream for k in trace.kernels} == {0}
    sequences = frequent_kernel_sequences(trace, "aten::", min_pattern_len=1, top_k=None)
    assert sequences[0].hta_pattern == "aten::to|Memcpy HtoD (Host -> Device)" and sequences[0].count == 2
    with gzip.open(DATA / "mi250-rocm-train.json.gz", "rt") as handle:
        document = json.load(handle)
    for event in document["traceEvents"]:
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"):
            event["tid"] = event["args"]["stream"] = 1
    expected = hta_run("mi250-rocm-train-stream-1", "aten::", 1, document)
    assert [(s.hta_pattern, s.count) for s in sequences] == [(pattern, count) for pattern, count, _, _ in expected]
    assert len(sequences) == 5


def test_a_nanosecond_trace_counts_every_step_but_the_last():
    """HTA reads a trace of several ProfilerSteps without its last; v100's 5 steps run 53 conv2d each."""
    trace = te_lab.open_trace(DATA / "v100-ns-resolution.json.gz")
    assert len(trace.steps) == 5 and trace.launches.names.count("aten::conv2d") == 5 * 53
    conv = frequent_kernel_sequences(trace, "aten::conv2d", min_pattern_len=1, top_k=None)
    assert sum(s.count for s in conv) == 4 * 53
    steps = frequent_kernel_sequences(trace, "ProfilerStep", min_pattern_len=1, top_k=None)
    assert sorted(s.operator for s in steps) == [step.name for step in trace.steps[:4]]
    assert all(s.count == 1 for s in steps)


class KinetoTrace:
    """A tiny Kineto trace as torch.profiler writes one: host calls on thread 1 (process 1),
    each kernel queued by a cudaLaunchKernel at ``host`` µs and run at ``start`` µs."""

    def __init__(self, device_name="NVIDIA A100-SXM4-80GB"):
        self.events = []
        self.device_name = device_name

    def op(self, name, ts, dur, tid=1, cat="cpu_op", dims=None, types=None):
        args = {"External id": len(self.events) + 1}
        if dims is not None:
            args.update({"Input Dims": dims, "Input type": types})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                            "args": args})

    def kernel(self, name, host, start, dur, stream=7, tid=1, cat="kernel"):
        correlation = len(self.events) + 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid,
                            "ts": host, "dur": 1, "args": {"correlation": correlation}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start, "dur": dur,
                            "args": {"correlation": correlation, "stream": stream, "device": 0}})

    def open(self, tmp_path):
        path = tmp_path / "trace.json"
        path.write_text(json.dumps({"traceEvents": self.events,
                                    "deviceProperties": [{"id": 0, "name": self.device_name, "numSms": 108}]}))
        return te_lab.open_trace(path)


def _blocks(trace):
    """my::block three times: kernels A B C, A B C, then A B (B from a helper op inside)."""
    for index, host in enumerate((0, 100, 200)):
        trace.op("my::block", host, 90)
        trace.kernel("A", host + 10, 1000 + 100 * index, 10)
        if index < 2:
            trace.kernel("B", host + 20, 1020 + 100 * index, 5)
            trace.kernel("C", host + 30, 1030 + 100 * index, 6)
        else:
            trace.op("my::helper", host + 15, 20)
            trace.kernel("B", host + 20, 1020 + 100 * index, 5)


def test_sequences_counts_and_times_of_a_hand_made_trace(tmp_path):
    trace = KinetoTrace()
    _blocks(trace)
    gpu = trace.open(tmp_path)
    assert frequent_kernel_sequences(gpu, "my::block", min_pattern_len=2) == [
        KernelSequence("my::block", ("A", "B", "C"), 2, 2 * 21.0, 2 * 90.0),
        KernelSequence("my::block", ("A", "B"), 1, 15.0, 90.0)]
    # the default min_pattern_len is HTA's, 3; a substring matches as in HTA, and the helper, nested
    # in a block, is not counted again
    assert frequent_kernel_sequences(gpu, "my::block") == frequent_kernel_sequences(gpu, "my::")[:1]
    assert frequent_kernel_sequences(gpu, "my::", min_pattern_len=2)[0].hta_pattern == "my::block|A|B|C"
    assert [s.kernels for s in frequent_kernel_sequences(gpu, "my::", min_pattern_len=1, max_pattern_len=2)] \
        == [("A", "B")]
    assert len(frequent_kernel_sequences(gpu, "my::", min_pattern_len=1, top_k=1)) == 1
    assert frequent_kernel_sequences(gpu, "my::helper", min_pattern_len=1) == [
        KernelSequence("my::helper", ("B",), 1, 5.0, 20.0)]


def test_patterns_of_equal_count_rank_by_hta_s_pattern_string_and_streams_merge_by_start(tmp_path):
    trace = KinetoTrace()
    trace.op("my::x", 0, 50)
    trace.kernel("K", 10, 1000, 5, stream=7)
    trace.kernel("L", 20, 1003, 5, stream=8)  # starts before K ends, on another stream
    trace.op("my::w", 100, 50)
    trace.kernel("M", 110, 1100, 5)
    trace.kernel("K", 120, 1110, 5)
    sequences = frequent_kernel_sequences(trace.open(tmp_path), "my::", min_pattern_len=2)
    assert [s.hta_pattern for s in sequences] == ["my::w|M|K", "my::x|K|L"]


def test_the_backward_thread_hangs_under_the_main_thread_and_the_last_step_is_left_out(tmp_path):
    """As HTA: the backward thread's calls go under ``## backward ##``, so the aten::mul inside
    autograd's MulBackward0 is deeper than the forward one; the last ProfilerStep is not counted."""
    trace = KinetoTrace()
    for step, start in ((1, 0), (2, 1000)):
        trace.op(f"ProfilerStep#{step}", start, 900, cat="user_annotation")
        trace.op("aten::mul", start + 10, 40)
        trace.kernel("mul_a", start + 20, 5000 + start, 5)
        trace.kernel("mul_b", start + 30, 5010 + start, 5)
        trace.op("## backward ##", start + 500, 300, cat="user_annotation")
        trace.op("autograd::engine::evaluate_function: MulBackward0", start + 600, 100, tid=2)
        trace.op("aten::mul", start + 610, 80, tid=2)
        trace.kernel("mul_grad_a", start + 620, 5100 + start, 5, tid=2)
        trace.kernel("mul_grad_b", start + 630, 5110 + start, 5, tid=2)
    gpu = trace.open(tmp_path)
    assert frequent_kernel_sequences(gpu, "aten::mul", min_pattern_len=2) == [
        KernelSequence("aten::mul", ("mul_a", "mul_b"), 1, 10.0, 40.0)]
    backward = frequent_kernel_sequences(gpu, "autograd::", min_pattern_len=2)
    assert [(s.kernels, s.count) for s in backward] == [(("mul_grad_a", "mul_grad_b"), 1)]


def test_calls_nest_by_their_intervals():
    """The parent is the innermost call open at the start; a call starting where another ends is
    its sibling, unless it lasts no time; of two starting together the longer holds the other."""
    events = [{"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}
              for name, ts, dur in (("outer", 0, 100), ("first", 0, 50), ("same start, shorter", 0, 20),
                                    ("touching", 50, 30), ("empty at the end", 80, 0), ("after", 100, 10))]
    launches = kernel_launches(file_activities({"traceEvents": events}))
    parent = {name: launches.names[p] if p >= 0 else None for name, p in zip(launches.names, launches.parents)}
    assert parent == {"outer": None, "first": "outer", "same start, shorter": "first", "touching": "outer",
                      "empty at the end": "touching", "after": None}
    assert launches.depths == [0, 1, 2, 1, 2, 0]


def _chain_trace():
    """Stream 7: add mul | GEMM (by name) | relu sigmoid | a kernel of aten::linear (a GEMM op)
    | exp log | memcpy | neg (alone); stream 8 meanwhile: abs tanh."""
    trace = KinetoTrace()
    host = 0
    device = 1000
    for name, op, cat in (("add_kernel", "aten::add", "kernel"), ("mul_kernel", "aten::mul", "kernel"),
                          ("ampere_sgemm_128x64_nn", "aten::something", "kernel"),
                          ("relu_kernel", "aten::relu", "kernel"), ("sigmoid_kernel", "aten::sigmoid", "kernel"),
                          ("epilogue_kernel", "aten::linear", "kernel"), ("exp_kernel", "aten::exp", "kernel"),
                          ("log_kernel", "aten::log", "kernel"), ("Memcpy DtoD (Device -> Device)", "aten::copy_",
                                                                   "gpu_memcpy"),
                          ("neg_kernel", "aten::neg", "kernel")):
        trace.op(op, host, 10)
        trace.kernel(name, host + 5, device, 4, cat=cat)
        host += 20
        device += 10
    trace.op("aten::abs", 300, 10)
    trace.kernel("abs_kernel", 305, 1002, 3, stream=8)
    trace.op("aten::tanh", 320, 10)
    trace.kernel("tanh_kernel", 325, 1012, 3, stream=8)
    return trace


def test_chains_split_at_gemms_copies_and_streams(tmp_path):
    gpu = _chain_trace().open(tmp_path)
    rows = {tuple(row.pattern): row for row in gpu.opportunities}
    assert set(rows) == {("add_kernel", "mul_kernel"), ("relu_kernel", "sigmoid_kernel"), ("exp_kernel", "log_kernel"),
                         ("abs_kernel", "tanh_kernel")}
    assert rows[("abs_kernel", "tanh_kernel")].module == "stream 8"
    assert all(row.module == "stream 7" for key, row in rows.items() if key[0] != "abs_kernel")
    row = rows[("add_kernel", "mul_kernel")]
    assert (row.mode, row.phase, row.instances, row.launches, row.time_ms) == ("trace", "forward", 1, 2, 0.008)
    assert row.bytes_unfused is None and row.fused_ms is None and "bytes unknown" in row.note
    assert "fusion opportunities: 4 pattern(s)" in gpu.summary()


def test_a_chain_inside_one_op_is_named_by_it_and_its_repeats_are_instances(tmp_path):
    trace = KinetoTrace()
    for index, (start, phase_op) in enumerate(((0, None), (200, "autograd::engine::evaluate_function: XBackward0"),
                                               (400, None))):
        if phase_op:
            trace.op(phase_op, start, 150)
        trace.op("my::region", start + 1, 100)
        trace.op("aten::add", start + 10, 20)
        trace.kernel("add_kernel", start + 15, 1000 + 100 * index, 4)
        trace.op("aten::mul", start + 40, 20)
        trace.kernel("mul_kernel", start + 45, 1010 + 100 * index, 6)
    rows = trace.open(tmp_path).opportunities
    assert [(row.module, row.phase, row.instances, row.launches, round(row.time_ms, 6)) for row in rows] == [
        ("my::region", "forward", 2, 4, 0.02), ("my::region", "backward", 1, 2, 0.01)]


def _shaped_chain(trace, square=(1024, 1024)):
    """aten::fill_ of 16 floats (a launch-sized op: 2 µs) | a GEMM | add -> mul (by a row) -> relu."""
    trace.op("aten::fill_", 0, 10, dims=[[16], []], types=["float", "Scalar"])
    trace.kernel("fill_kernel", 5, 1000, 2)
    trace.op("aten::mm", 20, 10, dims=[list(square), list(square)], types=["float", "float"])
    trace.kernel("ampere_sgemm_128x64_nn", 25, 1010, 50)
    trace.op("aten::add", 40, 10, dims=[list(square), list(square), []], types=["float", "float", "Scalar"])
    trace.kernel("add_kernel", 45, 1070, 20)
    trace.op("aten::mul", 60, 10, dims=[list(square), [square[1]]], types=["float", "float"])
    trace.kernel("mul_kernel", 65, 1100, 15)
    trace.op("aten::relu", 80, 10, dims=[list(square)], types=["float"])
    trace.kernel("relu_kernel", 85, 1120, 15)


def test_recorded_input_shapes_give_bytes_and_the_fused_time_at_the_device_s_bandwidth(tmp_path):
    trace = KinetoTrace("NVIDIA A100-SXM4-80GB")  # te_lab.device.PEAK_TABLE: 2039 GB/s
    _shaped_chain(trace)
    gpu = trace.open(tmp_path)
    [row] = gpu.opportunities
    assert row.pattern == ["add_kernel", "mul_kernel", "relu_kernel"] and row.module == "stream 7"
    # unfused: add reads 2 x 4 MiB and writes 4, mul reads 4 MiB + a 4 KiB row and writes 4, relu 4 + 4
    assert row.bytes_unfused == 28 * MiB + 4096
    # fused: add's inputs, mul's row (its other input is the running value), relu's output
    assert row.bytes_fused == 12 * MiB + 4096
    assert row.bandwidth_gbs == 2039.0
    # one launch per instance, timed by the trace's ops that move at most 4 KiB: the fill's 2 µs
    assert row.fused_ms == pytest.approx((12 * MiB + 4096) / 2039e9 * 1e3 + 0.002)
    assert row.time_ms == pytest.approx(0.050) and row.estimated_gain_ms == pytest.approx(0.05 - row.fused_ms)
    again = trace_opportunities(gpu, bandwidth_gbs=1000)[0]
    assert again.fused_ms == pytest.approx((12 * MiB + 4096) / 1e12 * 1e3 + 0.002)


def test_without_a_listed_bandwidth_the_bytes_stay_and_the_fused_time_is_unknown(tmp_path):
    trace = KinetoTrace("Some Future GPU")
    _shaped_chain(trace)
    gpu = trace.open(tmp_path)
    [row] = gpu.opportunities
    assert row.bytes_fused == 12 * MiB + 4096 and row.fused_ms is None and row.bandwidth_gbs is None
    assert "bandwidth_gbs=" in row.note
    assert trace_opportunities(gpu, bandwidth_gbs=2039)[0].fused_ms is not None


@pytest.mark.parametrize("name", ["hta-sampled-rank0", "v100-ns-resolution", "a100-alexnet-train"])
def test_the_opportunities_of_a_real_trace_add_up(name):
    trace = te_lab.open_trace(DATA / f"{name}.json.gz")
    rows = trace.opportunities
    assert rows and rows == ranked(rows) and {row.mode for row in rows} == {"trace"}
    for row in rows:
        assert row.instances >= 1 and row.launches == row.instances * len(row.pattern) and len(row.pattern) >= 2
    assert len({(row.module, row.phase, tuple(row.pattern)) for row in rows}) == len(rows)
    kernels = [k for k in trace.kernels if k.kind == "kernel"]
    assert sum(row.launches for row in rows) <= len(kernels)
    assert 0 < sum(row.time_ms for row in rows) <= sum(k.duration_ns for k in kernels) / 1e6
    assert "fusion opportunities" in trace.summary()


def test_the_multi_gpu_rank_s_recorded_shapes_give_its_rows_bytes():
    trace = te_lab.open_trace(DATA / "hta-sampled-rank0.json.gz")  # no deviceProperties: bandwidth unknown
    costed = [row for row in trace.opportunities if row.bytes_unfused is not None]
    assert costed and all(0 < row.bytes_fused <= row.bytes_unfused for row in costed)
    assert all(row.fused_ms is None for row in trace.opportunities)
    estimated = trace_opportunities(trace, bandwidth_gbs=2039)
    assert all(row.estimated_gain_ms >= 0 for row in estimated if row.bytes_fused is not None)


def test_bad_arguments_name_what_was_expected(tmp_path):
    trace = KinetoTrace()
    _blocks(trace)
    gpu = trace.open(tmp_path)
    with pytest.raises(ValueError, match=r"operator_name 'aten::linaer'.*most frequent CPU ops: my::block"):
        frequent_kernel_sequences(gpu, "aten::linaer")
    with pytest.raises(ValueError, match="operator_name must be a non-empty string"):
        frequent_kernel_sequences(gpu, "")
    for argument, value in (("min_pattern_len", 0), ("max_pattern_len", 0), ("top_k", 0), ("min_pattern_len", 1.5)):
        with pytest.raises(ValueError, match=f"{argument} must be a positive int"):
            frequent_kernel_sequences(gpu, "my::block", **{argument: value})
    with pytest.raises(ValueError, match=r"max_pattern_len \(2\) must be at least min_pattern_len \(3\)"):
        frequent_kernel_sequences(gpu, "my::block", max_pattern_len=2)
    with pytest.raises(TypeError, match=r"trace must be a GpuTrace \(te_lab.open_trace\(path\)"):
        frequent_kernel_sequences(str(DATA / "a100-alexnet-train.json.gz"), "aten::linear")
    with pytest.raises(ValueError, match="bandwidth_gbs must be a positive number"):
        trace_opportunities(gpu, bandwidth_gbs=0)
    # an operator the trace holds, whose calls launched fewer kernels than asked: no pattern, no error
    assert frequent_kernel_sequences(gpu, "my::helper") == []
