// te_lab::rms_norm.cpp and te_lab::rms_norm_backward.cpp: RMSNorm's CPU kernels, one pass
// over each row per direction, with the op's autograd formula in C++ so that an eager
// call and its backward never return to Python (kernels/cpu_kernels.py builds this file).
//
// Forward, per row:  h = x (+ residual);  rstd = 1 / sqrt(mean(h^2) + eps);
//                    y = h * rstd * (weight + offset)
// Backward, per row: g = dy * (weight + offset);  x_hat = h * rstd;
//                    dx = rstd * (g - x_hat * mean(g * x_hat)) (+ dh)
//                    dweight = sum over rows of dy * x_hat
// Math runs in float32 (float64 for float64 inputs), as kernels/rms_norm.py's reference.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per parallel task: about 16K elements, so that small inputs stay on one thread.
int64_t rows_per_task(int64_t n_cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n_cols, 1)); }

// The weight as the math uses it: in the compute dtype, contiguous (a no-op when it is already).
std::optional<Tensor> compute_weight(const std::optional<Tensor>& weight, at::ScalarType compute) {
  if (!weight.has_value() || !weight->defined()) return std::nullopt;
  return weight->to(compute).contiguous();
}

at::ScalarType compute_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

template <typename T, typename Acc>
void forward_rows(const T* x, const T* residual, const Acc* weight, T* y, T* h, Acc* rstd, int64_t rows,
                  int64_t n, Acc eps, Acc offset) {
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* src = x + row * n;
      if (residual != nullptr) {
        const T* r = residual + row * n;
        T* hr = h + row * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) hr[j] = static_cast<T>(static_cast<Acc>(src[j]) + static_cast<Acc>(r[j]));
        src = hr;
      }
      Acc squares = 0;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < n; ++j) {
        const Acc v = static_cast<Acc>(src[j]);
        squares += v * v;
      }
      const Acc s = Acc(1) / std::sqrt(squares / static_cast<Acc>(n) + eps);
      rstd[row] = s;
      T* out = y + row * n;
      if (weight != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(static_cast<Acc>(src[j]) * s * (weight[j] + offset));
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(static_cast<Acc>(src[j]) * s);
      }
    }
  });
}

// (y, h, rstd); h is empty without a residual.
std::tuple<Tensor, Tensor, Tensor> rms_norm_forward(const Tensor& x_in, const std::optional<Tensor>& residual_in,
                                                    const std::optional<Tensor>& weight_in, double eps,
                                                    double weight_offset) {
  const Tensor x = x_in.contiguous();
  const bool has_residual = residual_in.has_value() && residual_in->defined();
  const Tensor residual = has_residual ? residual_in->contiguous() : Tensor();
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const auto compute = compute_dtype(x.scalar_type());
  const std::optional<Tensor> weight = compute_weight(weight_in, compute);
  Tensor y = at::empty_like(x);
  Tensor h = has_residual ? at::empty_like(x) : at::empty({0}, x.options());
  Tensor rstd = at::empty({rows}, x.options().dtype(compute));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "te_lab::rms_norm.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    forward_rows<scalar_t, Acc>(x.const_data_ptr<scalar_t>(),
                                has_residual ? residual.const_data_ptr<scalar_t>() : nullptr,
                                weight.has_value() ? weight->const_data_ptr<Acc>() : nullptr,
                                y.mutable_data_ptr<scalar_t>(), has_residual ? h.mutable_data_ptr<scalar_t>() : nullptr,
                                rstd.mutable_data_ptr<Acc>(), rows, n, static_cast<Acc>(eps),
                                static_cast<Acc>(weight_offset));
  });
  return {y, h, rstd};
}

template <typename T, typename Acc>
void backward_rows(const T* dy, const T* dh, const T* h, const Acc* weight, const Acc* rstd, T* dx, Acc* dw_partial,
                   int64_t rows, int64_t n, Acc offset, int64_t tasks) {
  const int64_t per_task = (rows + tasks - 1) / tasks;
  at::parallel_for(0, tasks, 1, [&](int64_t first_task, int64_t last_task) {
    for (int64_t task = first_task; task < last_task; ++task) {
      Acc* dw = dw_partial == nullptr ? nullptr : dw_partial + task * n;
      const int64_t end = std::min(rows, (task + 1) * per_task);
      for (int64_t row = task * per_task; row < end; ++row) {
        const T* dyr = dy + row * n;
        const T* hr = h + row * n;
        const Acc s = rstd[row];
        Acc products = 0;
#pragma omp simd reduction(+ : products)
        for (int64_t j = 0; j < n; ++j) {
          const Acc g = weight == nullptr ? static_cast<Acc>(dyr[j]) : static_cast<Acc>(dyr[j]) * (weight[j] + offset);
          products += g * static_cast<Acc>(hr[j]) * s;
        }
        const Acc mean = products / static_cast<Acc>(n);
        T* dxr = dx + row * n;
        const T* dhr = dh == nullptr ? nullptr : dh + row * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const Acc x_hat = static_cast<Acc>(hr[j]) * s;
          const Acc g = weight == nullptr ? static_cast<Acc>(dyr[j]) : static_cast<Acc>(dyr[j]) * (weight[j] + offset);
          Acc grad = s * (g - x_hat * mean);
          if (dhr != nullptr) grad += static_cast<Acc>(dhr[j]);
          dxr[j] = static_cast<T>(grad);
        }
        if (dw != nullptr) {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) dw[j] += static_cast<Acc>(dyr[j]) * static_cast<Acc>(hr[j]) * s;
        }
      }
    }
  });
}

// (dx, dweight); dweight is empty unless need_dw. weight keeps its own dtype in dweight.
std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& dy_in, const std::optional<Tensor>& dh_in,
                                             const Tensor& h_in, const std::optional<Tensor>& weight_in,
                                             const Tensor& rstd_in, double weight_offset, bool need_dw) {
  const Tensor h = h_in.contiguous();
  const Tensor dy = dy_in.contiguous();
  const bool has_dh = dh_in.has_value() && dh_in->defined();
  const Tensor dh = has_dh ? dh_in->contiguous() : Tensor();
  const Tensor rstd = rstd_in.contiguous();
  const int64_t n = h.dim() == 0 ? 1 : h.size(-1);
  const int64_t rows = n == 0 ? 0 : h.numel() / n;
  const auto compute = compute_dtype(h.scalar_type());
  const std::optional<Tensor> weight = compute_weight(weight_in, compute);
  need_dw = need_dw && weight.has_value();
  const int64_t tasks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), rows / rows_per_task(n)));
  Tensor dx = at::empty_like(h);
  Tensor partial = need_dw ? at::zeros({tasks, n}, h.options().dtype(compute)) : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "te_lab::rms_norm_backward.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    backward_rows<scalar_t, Acc>(dy.const_data_ptr<scalar_t>(), has_dh ? dh.const_data_ptr<scalar_t>() : nullptr,
                                 h.const_data_ptr<scalar_t>(),
                                 weight.has_value() ? weight->const_data_ptr<Acc>() : nullptr,
                                 rstd.const_data_ptr<Acc>(), dx.mutable_data_ptr<scalar_t>(),
                                 need_dw ? partial.mutable_data_ptr<Acc>() : nullptr, rows, n,
                                 static_cast<Acc>(weight_offset), tasks);
  });
  if (!need_dw) return {dx, at::empty({0}, h.options())};
  Tensor dw = tasks == 1 ? partial.select(0, 0) : partial.sum(0);
  return {dx, dw.to(weight_in->scalar_type())};
}

std::tuple<Tensor, Tensor> call_backward(const Tensor& dy, const std::optional<Tensor>& dh, const Tensor& h,
                                         const std::optional<Tensor>& weight, const Tensor& rstd, double offset,
                                         bool need_dw) {
  // Through the dispatcher, so that profiles record te_lab::rms_norm_backward.
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("te_lab::rms_norm_backward", "cpp")
                       .typed<decltype(rms_norm_backward)>();
  return op.call(dy, dh, h, weight, rstd, offset, need_dw);
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& residual,
                               const std::optional<Tensor>& weight, double eps, double weight_offset) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, h, rstd] = rms_norm_forward(x, residual, weight, eps, weight_offset);
    const bool has_residual = residual.has_value() && residual->defined();
    ctx->save_for_backward({has_residual ? h : x, weight.has_value() ? *weight : Tensor(), rstd});
    ctx->saved_data["has_residual"] = has_residual;
    ctx->saved_data["weight_offset"] = weight_offset;
    ctx->mark_non_differentiable(has_residual ? variable_list{rstd} : variable_list{h, rstd});
    ctx->set_materialize_grads(false);
    return {y, h, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& h = saved[0];
    const std::optional<Tensor> weight = saved[1].defined() ? std::optional<Tensor>(saved[1]) : std::nullopt;
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    // Edges exist for the tensors given: x, then the residual where there is one, then the weight.
    const bool need_dw = weight.has_value() && ctx->needs_input_grad(has_residual ? 2 : 1);
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(h);
    const std::optional<Tensor> dh =
        has_residual && grads[1].defined() ? std::optional<Tensor>(grads[1]) : std::nullopt;
    auto [dx, dw] = call_backward(dy, dh, h, weight, saved[2], ctx->saved_data["weight_offset"].toDouble(), need_dw);
    return {dx, has_residual ? dx : Tensor(), need_dw ? dw : Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> rms_norm_autograd(const Tensor& x, const std::optional<Tensor>& residual,
                                                     const std::optional<Tensor>& weight, double eps,
                                                     double weight_offset) {
  auto outputs = RmsNormFunction::apply(x, residual, weight, eps, weight_offset);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(te_lab, m) {
  m.def("rms_norm.cpp(Tensor x, Tensor? residual, Tensor? weight, float eps, float weight_offset)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_backward.cpp(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd,"
        " float weight_offset, bool need_dw) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("rms_norm.cpp", &rms_norm_forward);
  m.impl("rms_norm_backward.cpp", &rms_norm_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("rms_norm.cpp", &rms_norm_autograd); }

}  // namespace te_lab_cpu
