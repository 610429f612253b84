// How te_lab's C++ autograd kernels call their ops: the backward through the dispatcher, so
// that profiles record te_lab::<op>_backward, as they do on the Python path; the forward
// redispatched below autograd (keys_below_autograd), so that dispatch modes (fake tensors,
// torch.library.opcheck's schema checks) see te_lab::<op>.cpp as one op.

#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace te_lab_cpu {

// The overload `overload` (by default `cpp`) of the op `name` ("te_lab::<op>"), typed like
// the kernel `Fn`.
template <typename Fn>
c10::TypedOperatorHandle<Fn> cpp_overload(const char* name, const char* overload = "cpp") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Fn>();
}

// The keys an autograd kernel, given the keys it was called with (its first argument),
// redispatches its op with to run below autograd, as PyTorch's own autograd kernels do: a
// redispatch makes no second profiler record of the op, and dispatch modes see it.
inline c10::DispatchKeySet keys_below_autograd(c10::DispatchKeySet keys) {
  return keys & c10::after_ADInplaceOrView_keyset;
}

}  // namespace te_lab_cpu
