// Every torch C++ API the C++ kernels use beyond the extension API (<torch/library.h>,
// <torch/autograd.h>, ATen and c10's dispatcher), in one place, as kernels/torch_internals.py
// holds the Python ones: a torch upgrade that moves one breaks the build here first.
// tests/test_torch_internals.py checks that no other C++ source includes torch's internals.

#pragma once

#include <torch/csrc/autograd/graph_task.h>

namespace te_lab_cpu {

// Inside a backward pass: whether it keeps the graph for another (retain_graph or
// create_graph), i.e. whether a tensor the running node saved may be read again. torch has
// no public API for it (pytorch/pytorch#65536 asks for one); this is the engine's own
// answer, the one kernels/torch_internals.py's backward_keeps_graph reads from Python.
inline bool backward_keeps_graph() { return torch::autograd::get_current_graph_task_keep_graph(); }

}  // namespace te_lab_cpu
