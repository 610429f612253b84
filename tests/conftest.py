"""Shared test set-up: the device under test, tolerances, and Triton's interpreter.

On a machine without a GPU that Triton can drive, the Triton kernels run through
Triton's interpreter (TRITON_INTERPRET=1), so CI checks the very source that runs on
GPUs. The variable must be set before any kernel is defined, hence here, before
te_lab is imported.
"""

import importlib.util
import os

import torch

# torch.musa exists only once torch_musa is imported, so look for the package itself.
if not torch.cuda.is_available() and importlib.util.find_spec("torch_musa") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers, one per core of CI's machine) each
# worker computes on one thread: two workers of two OpenMP threads each on two cores
# spin against each other, which costs far more than the parallelism gains. Subprocesses
# the tests start (notebooks, the CLI, the distributed ranks) inherit the same limit.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import pytest  # noqa: E402

from te_lab import device as devices  # noqa: E402
from te_lab.kernels import available_backends  # noqa: E402
from te_lab.kernels.precision import TOLERANCES  # noqa: E402,F401 (tests import it from here)

DEVICE = devices.default_device()


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def interpreted(backend):
    """Whether ``backend`` runs Triton kernels through the CPU interpreter."""
    return backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"


def assert_close(actual, expected, dtype=None, backend=None, **overrides):
    """Compare in float64 with the tolerance of ``dtype`` (the inputs' dtype by default).

    Triton's interpreter converts float32 to bfloat16 by truncation where compiled Triton
    (and torch) round to nearest, so interpreted bf16 results may sit one bf16 step
    further from the reference: those comparisons allow twice the bf16 atol.
    """
    dtype = dtype or expected.dtype
    tolerance = dict(TOLERANCES[dtype])
    if dtype == torch.bfloat16 and interpreted(backend):
        tolerance["atol"] = 2 * tolerance["atol"]
    tolerance.update(overrides)
    torch.testing.assert_close(actual.double(), expected.double(), **tolerance)


def fused_backends(op):
    """The non-reference backends that can run ``op`` on the device under test."""
    return [name for name in available_backends(op, DEVICE) if name != "reference"]


def backend_params(op):
    """pytest params for every backend of ``op`` available here; Triton ones are marked
    ``triton_interpreter`` so the Triton 3.2 run can select exactly them."""
    return [
        pytest.param(name, id=name, marks=[pytest.mark.triton_interpreter] if name == "triton" else [])
        for name in fused_backends(op)
    ]


def grads_of(outputs, inputs, seed=0):
    """Gradients of a random linear function of ``outputs`` w.r.t. ``inputs``; the same
    seed gives the same upstream gradients for the fused op and the reference."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    total = 0
    for out in outputs:
        weight = torch.randn(out.shape, generator=generator, dtype=torch.float32).to(out.device, out.dtype)
        total = total + (out.float() * weight.float()).sum()
    return torch.autograd.grad(total, inputs)


def leaf(tensor):
    return tensor.detach().clone().requires_grad_(True)


# (label_smoothing, z_loss) combinations both loss ops are tested under.
LOSS_OPTIONS = [
    pytest.param(0.0, 0.0, id="plain"),
    pytest.param(0.1, 0.0, id="smoothing"),
    pytest.param(0.0, 1e-4, id="z-loss"),
    pytest.param(0.1, 1e-4, id="smoothing-z-loss"),
]


def assert_walks_column_blocks(log, op, block, rows_per_program):
    """``op``'s forward and backward kernels in a te_lab.gpu_checks LaunchLog were launched
    on column blocks of ``block`` (a row wider than one) with ``rows_per_program``."""
    launched = {record["kernel"].split(":")[1]: record["arguments"] for record in log.records.values()}
    for kernel in (f"_{op}_forward_kernel", f"_{op}_backward_kernel"):
        assert launched[kernel]["BLOCK"]["value"] == block and launched[kernel]["ONE_BLOCK"]["value"] is False
    assert launched[f"_{op}_backward_kernel"]["rows_per_program"]["value"] == rows_per_program
