"""te_lab's benchmark suite (importable as ``te_lab.benchmarks``): per-op and end-to-end
measurements against eager PyTorch, torch.compile and Liger-Kernel, and the GPU check.

``python -m te_lab.benchmarks.suite --help`` runs the suite; ``te_lab.benchmarks.suite``
offers ``add_arguments(parser)`` and ``run(args)`` to other command lines.
"""
