"""te_lab's benchmark suite (importable as ``te_lab.benchmarks``): per-op and end-to-end
measurements against eager PyTorch, torch.compile and Liger-Kernel. The GPU checks (the
Triton kernels' static compile check and ``te-lab gpu-check``) are ``te_lab.gpu_checks``.

``python -m te_lab.benchmarks.suite --help`` runs the suite; ``te_lab.benchmarks.suite``
offers ``add_arguments(parser)`` and ``run(args)`` to other command lines.
"""
