// How te_lab's C++ autograd kernels call their backward ops: through the dispatcher, so
// that profiles record te_lab::<op>_backward, as they do on the Python path.

#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace te_lab_cpu {

// The overload `overload` (by default `cpp`) of the op `name` ("te_lab::<op>"), typed like
// the kernel `Fn`.
template <typename Fn>
c10::TypedOperatorHandle<Fn> cpp_overload(const char* name, const char* overload = "cpp") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Fn>();
}

}  // namespace te_lab_cpu
