"""The fusion ceiling: how fast the step could get if fusion did all it can.

Fusion removes memory traffic and launches between ops; it does not make a GEMM or an
attention kernel's products faster. So each mode's step is split, measured, into
*compute* (the GEMMs: matmul, linear, addmm, bmm, grouped GEMMs, their backward; and the
attention kernels' products) and *the rest* (element-wise ops, norms, softmax, casts,
copies, the Python between ops), and the ceiling is the step in which the compute runs
as fast as either mode ran it and the rest costs only its bytes at the device's
bandwidth (the measured copy bandwidth on the CPU; the vendor's figure for a listed GPU):

    ceiling step = min(eager, fused compute time) + the rest's bytes / bandwidth

(The faster compute, not eager's alone: te_lab's ``linear`` op may run a projection on
another GEMM library where that measures faster, and on one 2-core EPYC oneDNN's GEMMs
ran a 4-layer 135M-shaped Llama's step at 0.45x of MKL's time: eager's compute as the
floor then put te_lab at 4.4x "the ceiling".)

The rest's bytes are the fewer of the two modes' (each op's inputs read and outputs
written, by the cost model): the fused mode's kernels already move only what they must.
The available gain is ``eager step / ceiling step - 1``; te_lab's gain is ``speedup - 1``
and its share of the available one tells "fusion cannot help this model here" (a small
available gain: the GEMMs are the step) from "te_lab's fusion is not good enough yet"
(a large available gain, a small share).
"""

from __future__ import annotations

from typing import Optional

from .report import FusionCeiling, ModeSplit

# Ops whose time is their products': fusion leaves them as they are. Counted where no
# other op of this set encloses them (aten::linear's addmm is one GEMM, not two).
GEMM_OPS = frozenset({
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
    "aten::_grouped_mm", "aten::_int_mm", "aten::mkldnn_linear", "mkldnn::_linear_pointwise",
    "te_lab::linear", "te_lab::linear_backward",
})
ATTENTION_OPS = frozenset({
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
})
COMPUTE_OPS = GEMM_OPS | ATTENTION_OPS | {f"{name}_backward" for name in ATTENTION_OPS} | {
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}

FORMULA = ("ceiling step = min(eager, fused compute ms) + rest bytes / bandwidth; compute: the GEMMs (mm, addmm, bmm, "
           "linear, grouped GEMMs, te_lab::linear, forward and backward) and attention kernels' products, each "
           "op's time where no such op encloses it (CPU: its host time less its recorded events' cost, x the "
           "step's attribution scale; GPUs: its kernels' device time), median over the profiled steps; rest = the "
           "unprofiled step median - compute; rest bytes: the fewer of the two modes' bytes read and written "
           "by every op outside compute (cost model, detail step; an op costed as a whole, te_lab's fused linear "
           "cross-entropy, is outside it even where GEMMs run inside); bandwidth: the report's ceilings; available "
           "gain = eager step / ceiling step - 1; te_lab's gain = speedup - 1; share = te_lab's / available")


def is_compute(name: str) -> bool:
    """Whether op ``name``'s time is its products' (a GEMM or an attention kernel)."""
    return name in COMPUTE_OPS


def mode_split(step_ms: float, compute_ms: float, step_bytes: int, compute_bytes: int) -> ModeSplit:
    """One mode's step split into compute and the rest (compute never above the step)."""
    compute_ms = min(max(compute_ms, 0.0), step_ms)
    return ModeSplit(compute_ms, step_ms - compute_ms, max(compute_bytes, 0), max(step_bytes - compute_bytes, 0))


def fusion_ceiling(eager_step_ms: float, fused_step_ms: float, eager: ModeSplit, fused: ModeSplit,
                   bandwidth_gbs: float, bandwidth_source: str) -> Optional[FusionCeiling]:
    """The ceiling from both modes' splits (see the module doc); None without a step
    time or a bandwidth to cost the rest at."""
    if eager_step_ms <= 0 or fused_step_ms <= 0 or bandwidth_gbs <= 0:
        return None
    rest_bytes = min(eager.rest_bytes, fused.rest_bytes) if fused.rest_bytes > 0 else eager.rest_bytes
    rest_floor_ms = rest_bytes / (bandwidth_gbs * 1e9) * 1e3
    compute_ms = min(eager.compute_ms, fused.compute_ms)
    ceiling_ms = min(compute_ms + rest_floor_ms, eager_step_ms)
    return FusionCeiling(eager_step_ms, fused_step_ms, eager, fused, compute_ms, rest_bytes, rest_floor_ms,
                         ceiling_ms, bandwidth_gbs, bandwidth_source)
