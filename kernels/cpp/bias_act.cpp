// te_lab::bias_act.cpp and te_lab::bias_act_backward.cpp: y = act(x + bias) on the CPU,
// one pass per direction, with the autograd formula in C++ (kernels/bias_act.py states
// the math: only x is saved and x + bias recomputed in the backward).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "activations.h"
#include "dispatched.h"
#include "rows.h"

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The bias in the compute type, or zeros without one.
template <typename Acc>
std::vector<Acc> bias_in(const std::optional<Tensor>& bias, int64_t n) {
  std::vector<Acc> values(n, Acc(0));
  if (given(bias)) {
    const Tensor b = bias->to(c10::CppTypeToScalarType<Acc>::value).contiguous();
    TORCH_CHECK_VALUE(b.numel() == n, "bias_act: bias has ", b.numel(), " elements; expected ", n);
    std::copy(b.const_data_ptr<Acc>(), b.const_data_ptr<Acc>() + n, values.begin());
  }
  return values;
}

template <typename T, typename Acc>
void forward_rows(const T* x, const Acc* bias, T* y, int64_t rows, int64_t n, Activation activation) {
  using V = Vec<Acc>;
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    Acc a[BLOCK], out_buf[BLOCK];
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t count = std::min(BLOCK, n - start);
        const Acc* values = load_block(x + row * n + start, a, count);
        Acc* out = output_block(y + row * n + start, out_buf);
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          activate(activation, V::loadu(values + j, c) + V::loadu(bias + start + j, c)).store(out + j, c);
        });
        store_block(out, y + row * n + start, count);
      }
    }
  });
}

Tensor bias_act_forward(const Tensor& x_in, const std::optional<Tensor>& bias, c10::string_view activation_name) {
  const Activation activation = activation_named(std::string(activation_name));
  const Tensor x = x_in.contiguous();
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "te_lab::bias_act.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const std::vector<Acc> b = bias_in<Acc>(bias, n);
    forward_rows<scalar_t, Acc>(x.const_data_ptr<scalar_t>(), b.data(), y.mutable_data_ptr<scalar_t>(), rows, n,
                                activation);
  });
  return y;
}

// dx = dy * act'(x + bias); rows split into ``tasks`` ranges, task t adding its rows' dx
// into dbias_partial's row t (null when the bias needs no gradient).
template <typename T, typename Acc>
void backward_rows(const T* dy, const T* x, const Acc* bias, T* dx, Acc* dbias_partial, int64_t rows, int64_t n,
                   int64_t tasks, Activation activation) {
  using V = Vec<Acc>;
  const int64_t per_task = (rows + tasks - 1) / tasks;
  at::parallel_for(0, tasks, 1, [&](int64_t first_task, int64_t last_task) {
    Acc a[BLOCK], b[BLOCK], out_buf[BLOCK];
    for (int64_t task = first_task; task < last_task; ++task) {
      Acc* dbias = dbias_partial == nullptr ? nullptr : dbias_partial + task * n;
      const int64_t end = std::min(rows, (task + 1) * per_task);
      for (int64_t row = task * per_task; row < end; ++row) {
        for (int64_t start = 0; start < n; start += BLOCK) {
          const int64_t count = std::min(BLOCK, n - start);
          const Acc* dys = load_block(dy + row * n + start, a, count);
          const Acc* xs = load_block(x + row * n + start, b, count);
          Acc* out = output_block(dx + row * n + start, out_buf);
          for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
            const V z = V::loadu(xs + j, c) + V::loadu(bias + start + j, c);
            const V dz = V::loadu(dys + j, c) * activate_with_grad(activation, z).second;
            if (dbias != nullptr) (V::loadu(dbias + start + j, c) + dz).store(dbias + start + j, c);
            dz.store(out + j, c);
          });
          store_block(out, dx + row * n + start, count);
        }
      }
    }
  });
}

// (dx, dbias); dbias, in the bias's dtype, is empty unless need_dbias.
std::tuple<Tensor, Tensor> bias_act_backward(const Tensor& dy_in, const Tensor& x_in,
                                             const std::optional<Tensor>& bias, c10::string_view activation_name,
                                             bool need_dbias) {
  const Activation activation = activation_named(std::string(activation_name));
  const Tensor x = x_in.contiguous();
  const Tensor dy = dy_in.contiguous();
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  need_dbias = need_dbias && given(bias);
  const int64_t tasks = partial_sum_tasks(rows, n);
  Tensor dx = at::empty_like(x);
  Tensor partial = need_dbias ? at::zeros({tasks, n}, x.options().dtype(compute_dtype(x.scalar_type()))) : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "te_lab::bias_act_backward.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const std::vector<Acc> b = bias_in<Acc>(bias, n);
    backward_rows<scalar_t, Acc>(dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), b.data(),
                                 dx.mutable_data_ptr<scalar_t>(), need_dbias ? partial.mutable_data_ptr<Acc>() : nullptr,
                                 rows, n, tasks, activation);
  });
  if (!need_dbias) return {dx, at::empty({0}, x.options())};
  const Tensor dbias = tasks == 1 ? partial.select(0, 0) : partial.sum(0);
  return {dx, dbias.to(bias->scalar_type())};
}

std::tuple<Tensor, Tensor> call_backward(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& bias,
                                         c10::string_view activation, bool need_dbias) {
  static const auto op = cpp_overload<decltype(bias_act_backward)>("te_lab::bias_act_backward");
  return op.call(dy, x, bias, activation, need_dbias);
}

class BiasActFunction : public torch::autograd::Function<BiasActFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& bias,
                        c10::string_view activation, c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::bias_act.cpp.
    static const auto op = cpp_overload<decltype(bias_act_forward)>("te_lab::bias_act");
    Tensor y = op.redispatch(keys_below_autograd(keys), x, bias, activation);
    ctx->save_for_backward({x, given(bias) ? *bias : Tensor()});
    ctx->saved_data["activation"] = std::string(activation);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::optional<Tensor> bias = saved[1].defined() ? std::optional<Tensor>(saved[1]) : std::nullopt;
    const bool need_dbias = bias.has_value() && ctx->needs_input_grad(1);
    auto [dx, dbias] = call_backward(grads[0], saved[0], bias, ctx->saved_data["activation"].toStringRef(), need_dbias);
    return {dx, need_dbias ? dbias : Tensor(), Tensor(), Tensor()};
  }
};

Tensor bias_act_autograd(c10::DispatchKeySet keys, const Tensor& x, const std::optional<Tensor>& bias, c10::string_view activation) {
  return BiasActFunction::apply(x, bias, activation, keys);
}

}  // namespace

// The schemas are kernels/bias_act.py's (define_op), less `backend`.
TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("bias_act.cpp", &bias_act_forward);
  m.impl("bias_act_backward.cpp", &bias_act_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("bias_act.cpp", &bias_act_autograd); }

}  // namespace te_lab_cpu
