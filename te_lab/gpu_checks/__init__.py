"""te_lab's GPU checks (``te_lab.gpu_checks``), apart from the benchmark suite.

Without a GPU: every Triton kernel compiled for real GPUs from launches recorded on the
CPU (``python -m te_lab.gpu_checks.gpu_kernels``: :mod:`.kernel_scenarios`,
:mod:`.kernel_launches`, :mod:`.kernel_compile`) and the kernel sources read for what
Moore Threads' Triton rejects (:mod:`.kernel_lint`). On a GPU: ``te-lab gpu-check``
(:mod:`.gpu_check`, with its bf16 training stage :mod:`.training_check`), which times
through the suite's harness (``te_lab.benchmarks``).
"""
