"""GPU kernel figures from live Kineto activities, on synthetic traces (this CPU cannot
record a GPU trace): each activity answers the calls torch's live activities do. Real
traces read from files are tested in test_trace_files.py."""

from dataclasses import dataclass

import pytest

from te_lab.profiler import device_kernels as device_kernels_module
from te_lab.profiler.attribution import HostOp, LaunchIndex
from te_lab.profiler.device_kernels import (
    achieved_occupancy,
    busy_ns,
    device_figures,
    idle_split_ns,
    overlap_ns,
    sm_efficiency,
)
from te_lab.profiler.kineto import live_activities


@dataclass
class Activity:
    kind: str
    label: str
    start: int
    length: int
    correlation: int
    metadata: str = ""
    linked: int = 0  # the CPU op's id, for device activity and runtime calls

    def type(self):
        return self.kind

    def name(self):
        return self.label

    def timestamp(self):
        return self.start

    def duration(self):
        return self.length

    def correlation_id(self):
        return self.correlation

    def metadata_json(self):
        return self.metadata

    def resource_id(self):
        return 7  # the stream

    def linked_correlation_id(self):
        return self.linked

    def device_id(self):
        return 0


def device_kernels(activities):
    return device_kernels_module.device_kernels(live_activities(activities))


def kernel(start, length, correlation, grid, occupancy):
    return Activity("kernel", f"k{correlation}", start, length, correlation,
                    f'"grid": {grid}, "block": [128, 1, 1], "est. achieved occupancy %": {occupancy}')


TRACE = [
    Activity("cuda_runtime", "cudaLaunchKernel", 0, 5, 1),
    kernel(10, 100, 1, [66, 1, 1], 50),    # 66 blocks on 132 SMs: half the device
    Activity("cuda_runtime", "cudaLaunchKernel", 150, 5, 2),
    kernel(160, 100, 2, [264, 1, 1], 100),  # more blocks than SMs: the whole device
    Activity("cpu_op", "aten::mm", 0, 300, 3),
]


def test_kernels_carry_grid_occupancy_and_launch_time():
    first, second = device_kernels(TRACE)
    assert (first.blocks, first.occupancy, first.launched_ns) == (66, 0.5, 0)
    assert (second.blocks, second.start_ns, second.end_ns, second.stream) == (264, 160, 260, 7)


def test_busy_sm_efficiency_and_occupancy():
    kernels = device_kernels(TRACE)
    assert busy_ns(kernels) == 200
    assert sm_efficiency(kernels, 132, 400) == pytest.approx((0.5 * 100 + 1.0 * 100) / 400)
    assert achieved_occupancy(kernels) == pytest.approx(0.75)


def test_idle_time_splits_into_waiting_on_host_and_other():
    kernels = device_kernels(TRACE)
    host, other = idle_split_ns(kernels, 10, 310)
    # gap 110..160: the second launch began at 150, so 40 ns waited on the host, 10 ns other;
    # after the last kernel (260..310) nothing was launched: other
    assert (host, other) == (40, 10 + 50)


def test_overlapping_kernels_count_once_and_missing_fields_give_none():
    overlapping = [Activity("kernel", "a", 0, 100, 1), Activity("kernel", "b", 50, 100, 2)]
    kernels = device_kernels(overlapping)
    assert busy_ns(kernels) == 150
    assert sm_efficiency(kernels, 132, 200) is None
    assert achieved_occupancy(kernels) is None
    assert idle_split_ns(kernels, 0, 200) is None
    assert device_kernels([Activity("kernel", "c", 0, 10, 3, "not json")])[0].blocks is None


def test_kernels_take_the_path_and_phase_of_the_op_that_launched_them():
    # A backward op on the autograd thread starts inside a long forward op's interval:
    # its launches belong to it, the latest-starting op holding the launch time.
    ops = [HostOp(0, 100, "layers.0.mlp", "forward"), HostOp(120, 400, "layers.0", "forward"),
           HostOp(150, 200, "layers.1.attn", "backward")]
    index = LaunchIndex(list(reversed(ops)))
    first, second = device_kernels(TRACE)
    assert index.launcher(first.launched_ns) == ops[0]
    assert index.launcher(second.launched_ns) == ops[2]
    assert index.launcher(300) == ops[1]
    assert index.launcher(110) is None and index.launcher(None) is None


@pytest.mark.parametrize("launch_type, launch_name", [
    ("cuda_runtime", "cudaLaunchKernel"), ("cuda_driver", "cuLaunchKernel"),
    ("musa_runtime", "musaLaunchKernel"), ("musa_driver", "muLaunchKernel"),
    ("privateuse1_runtime", "musaLaunchKernel"), ("privateuse1_driver", "muLaunchKernel"),
])
def test_launches_are_found_under_cuda_musa_and_privateuse1_activity_names(launch_type, launch_name):
    (found,) = device_kernels([Activity(launch_type, launch_name, 40, 5, 9), kernel(50, 10, 9, [1, 1, 1], 10)])
    assert found.launched_ns == 40


def test_host_ops_carry_their_own_id_and_device_activity_the_linked_one():
    op, launch = Activity("cpu_op", "aten::mm", 0, 300, 42), Activity("cuda_runtime", "cudaLaunchKernel", 5, 5, 3,
                                                                       linked=42)
    device = Activity("kernel", "gemm", 10, 100, 3, linked=42)
    converted = live_activities([op, launch, device])
    # The CPU op's correlation id is its own id; the runtime's correlation id pairs launch and kernel.
    assert [(a.correlation, a.external_id) for a in converted] == [(0, 42), (3, 42), (3, 42)]
    assert device_kernels([op, launch, device])[0].op_id == 42


def test_figures_cover_computation_communication_and_their_overlap():
    activities = [Activity("cuda_runtime", "cudaLaunchKernel", 0, 1, 1), kernel(0, 100, 1, [132, 1, 1], 50),
                  Activity("cuda_runtime", "cudaLaunchKernel", 0, 1, 2),
                  Activity("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 100, 2),
                  Activity("cuda_runtime", "cudaMemcpyAsync", 0, 1, 3),
                  Activity("gpu_memcpy", "Memcpy DtoD", 300, 50, 3)]
    kernels = device_kernels(activities)
    assert overlap_ns([k for k in kernels if k.is_collective], [k for k in kernels if k.is_computation]) == 50
    figures = {f.name: f.value for f in device_figures(kernels, 0, 400, 132, "fused", "the test's span")}
    assert figures["device busy"] == pytest.approx((150 + 50) / 400)
    assert figures["device busy: computation"] == pytest.approx(100 / 400)
    assert figures["device busy: communication"] == pytest.approx(100 / 400)
    assert figures["communication overlapped with computation"] == pytest.approx(0.5)
    # the collective and the memcpy carry no grid: SM efficiency counts kernels only, and needs every grid
    assert figures["estimated SM efficiency"] is None
    assert figures["achieved occupancy"] == pytest.approx(0.5)  # the memcpy has none, and is not a kernel
    # idle: 150..300 (launched at 0: other) and 350..400 (other)
    assert figures["device idle: waiting on host"] == 0 and figures["device idle: other"] == pytest.approx(200 / 400)


def test_figures_cut_activity_outside_the_span():
    kernels = device_kernels([kernel(0, 100, 1, [132, 1, 1], 50)])
    figures = {f.name: f.value for f in device_figures(kernels, 50, 250, 132, "eager", "span")}
    assert figures["device busy"] == pytest.approx(50 / 200)
    (empty,) = device_figures([], 0, 100, 132, "eager", "span")
    assert (empty.name, empty.value, empty.note) == ("device busy", None, "no device activity in this span")
