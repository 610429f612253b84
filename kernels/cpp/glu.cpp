// te_lab::glu.cpp and te_lab::glu_backward.cpp: the gated activation act(gate) * up on the
// CPU, one pass per direction, with its autograd formula in C++ (kernels/glu.py states
// the math; kernels/activations.py the activations and their clamped derivatives).
//
// gate and up come as two [..., N] tensors, or as one [..., 2N] gate-up tensor (up
// undefined): each row's first half is the gate, its second half up, and the gradient is
// then one [..., 2N] tensor.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "activations.h"
#include "dispatched.h"
#include "rows.h"

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Row r's gate starts at gate + r * gate_stride, its up at up + r * up_stride (for a
// gate-up tensor: the same row, N elements on).
struct Halves {
  int64_t rows, n, gate_stride, up_stride;
};

Halves halves_of(const Tensor& gate, const std::optional<Tensor>& up) {
  const bool concatenated = !(up.has_value() && up->defined());
  const int64_t width = gate.size(-1);
  const int64_t n = concatenated ? width / 2 : width;
  const int64_t rows = width == 0 ? 0 : gate.numel() / width;
  return {rows, n, width, concatenated ? width : n};
}

template <typename T, typename Acc>
void forward_rows(const T* gate, const T* up, T* y, const Halves& shape, Activation activation) {
  using V = Vec<Acc>;
  at::parallel_for(0, shape.rows, rows_per_task(shape.n), [&](int64_t begin, int64_t end) {
    Acc a[BLOCK], b[BLOCK], out_buf[BLOCK];
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t start = 0; start < shape.n; start += BLOCK) {
        const int64_t count = std::min(BLOCK, shape.n - start);
        const Acc* gates = load_block(gate + row * shape.gate_stride + start, a, count);
        const Acc* ups = load_block(up + row * shape.up_stride + start, b, count);
        T* dst = y + row * shape.n + start;
        Acc* out = output_block(dst, out_buf);
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          (activate(activation, V::loadu(gates + j, c)) * V::loadu(ups + j, c)).store(out + j, c);
        });
        store_block(out, dst, count);
      }
    }
  });
}

Tensor glu_forward(const Tensor& gate_in, const std::optional<Tensor>& up_in, c10::string_view activation_name) {
  const Activation activation = activation_named(std::string(activation_name));
  const Tensor gate = gate_in.contiguous();
  const bool concatenated = !(up_in.has_value() && up_in->defined());
  const Tensor up = concatenated ? gate : up_in->contiguous();
  const Halves shape = halves_of(gate, up_in);
  auto sizes = gate.sizes().vec();
  sizes.back() = shape.n;
  Tensor y = at::empty(sizes, gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "te_lab::glu.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const scalar_t* gate_data = gate.const_data_ptr<scalar_t>();
    forward_rows<scalar_t, Acc>(gate_data, concatenated ? gate_data + shape.n : up.const_data_ptr<scalar_t>(),
                                y.mutable_data_ptr<scalar_t>(), shape, activation);
  });
  return y;
}

// dgate = dy * up * act'(gate), dup = dy * act(gate), written where dgate / dup point (for
// a gate-up input: the two halves of one [rows, 2N] gradient).
template <typename T, typename Acc>
void backward_rows(const T* dy, const T* gate, const T* up, T* dgate, T* dup, const Halves& shape,
                   Activation activation) {
  using V = Vec<Acc>;
  at::parallel_for(0, shape.rows, rows_per_task(shape.n), [&](int64_t begin, int64_t end) {
    Acc a[BLOCK], b[BLOCK], g[BLOCK], dgate_buf[BLOCK], dup_buf[BLOCK];
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t start = 0; start < shape.n; start += BLOCK) {
        const int64_t count = std::min(BLOCK, shape.n - start);
        const Acc* dys = load_block(dy + row * shape.n + start, a, count);
        const Acc* gates = load_block(gate + row * shape.gate_stride + start, g, count);
        const Acc* ups = load_block(up + row * shape.up_stride + start, b, count);
        T* dgate_dst = dgate + row * shape.gate_stride + start;
        T* dup_dst = dup + row * shape.up_stride + start;
        Acc* dgates = output_block(dgate_dst, dgate_buf);
        Acc* dups = output_block(dup_dst, dup_buf);
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          const V dyv = V::loadu(dys + j, c);
          const auto [act, grad] = activate_with_grad(activation, V::loadu(gates + j, c));
          (dyv * V::loadu(ups + j, c) * grad).store(dgates + j, c);
          (dyv * act).store(dups + j, c);
        });
        store_block(dgates, dgate_dst, count);
        store_block(dups, dup_dst, count);
      }
    }
  });
}

// (dgate, dup); for a gate-up input the first is the whole [..., 2N] gradient and the
// second is empty.
std::tuple<Tensor, Tensor> glu_backward(const Tensor& dy_in, const Tensor& gate_in, const std::optional<Tensor>& up_in,
                                        c10::string_view activation_name) {
  const Activation activation = activation_named(std::string(activation_name));
  const Tensor dy = dy_in.contiguous();
  const Tensor gate = gate_in.contiguous();
  const bool concatenated = !(up_in.has_value() && up_in->defined());
  const Tensor up = concatenated ? gate : up_in->contiguous();
  const Halves shape = halves_of(gate, up_in);
  Tensor dgate = at::empty_like(gate);
  Tensor dup = concatenated ? at::empty({0}, gate.options()) : at::empty_like(up);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "te_lab::glu_backward.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const scalar_t* gate_data = gate.const_data_ptr<scalar_t>();
    scalar_t* dgate_data = dgate.mutable_data_ptr<scalar_t>();
    backward_rows<scalar_t, Acc>(dy.const_data_ptr<scalar_t>(), gate_data,
                                 concatenated ? gate_data + shape.n : up.const_data_ptr<scalar_t>(), dgate_data,
                                 concatenated ? dgate_data + shape.n : dup.mutable_data_ptr<scalar_t>(), shape,
                                 activation);
  });
  return {dgate, dup};
}

std::tuple<Tensor, Tensor> call_backward(const Tensor& dy, const Tensor& gate, const std::optional<Tensor>& up,
                                         c10::string_view activation) {
  static const auto op = cpp_overload<decltype(glu_backward)>("te_lab::glu_backward");
  return op.call(dy, gate, up, activation);
}

class GluFunction : public torch::autograd::Function<GluFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const std::optional<Tensor>& up,
                        c10::string_view activation, c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::glu.cpp.
    static const auto op = cpp_overload<decltype(glu_forward)>("te_lab::glu");
    Tensor y = op.redispatch(keys_below_autograd(keys), gate, up, activation);
    const bool has_up = up.has_value() && up->defined();
    ctx->save_for_backward({gate, has_up ? *up : Tensor()});
    ctx->saved_data["activation"] = std::string(activation);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::optional<Tensor> up = saved[1].defined() ? std::optional<Tensor>(saved[1]) : std::nullopt;
    auto [dgate, dup] = call_backward(grads[0], saved[0], up, ctx->saved_data["activation"].toStringRef());
    return {dgate, up.has_value() ? dup : Tensor(), Tensor(), Tensor()};
  }
};

Tensor glu_autograd(c10::DispatchKeySet keys, const Tensor& gate, const std::optional<Tensor>& up, c10::string_view activation) {
  return GluFunction::apply(gate, up, activation, keys);
}

}  // namespace

// The schemas are kernels/glu.py's (define_op), less `backend`.
TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("glu.cpp", &glu_forward);
  m.impl("glu_backward.cpp", &glu_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("glu.cpp", &glu_autograd); }

}  // namespace te_lab_cpu
