"""GPU kernel figures from Kineto activities, on synthetic traces (this CPU has no GPU
trace to read): each activity answers the calls the real ones do."""

from dataclasses import dataclass

import pytest

from te_lab.profiler.attribution import HostOp, LaunchIndex
from te_lab.profiler.device_kernels import (achieved_occupancy, busy_ns, device_kernels, idle_split_ns,
                                            sm_efficiency)


@dataclass
class Activity:
    kind: str
    label: str
    start: int
    length: int
    correlation: int
    metadata: str = ""

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
