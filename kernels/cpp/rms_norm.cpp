// te_lab::rms_norm.cpp and te_lab::rms_norm_backward.cpp: RMSNorm's CPU kernels, one pass
// over each row per direction, with the op's autograd formula in C++ so that an eager
// call and its backward never return to Python (kernels/cpu_kernels.py builds this file;
// kernels/rms_norm.py defines the overloads' schemas).
//
// Forward, per row:  h = x (+ residual);  rstd = 1 / sqrt(mean(h^2) + eps);
//                    y = h * rstd * (weight + offset)
// Backward, per row: g = dy * (weight + offset);  x_hat = h * rstd;
//                    dx = rstd * (g - x_hat * mean(g * x_hat)) (+ dh)
//                    dweight = sum over rows of dy * x_hat
// Math runs in float32 (float64 for float64 inputs), as kernels/rms_norm.py's reference.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "dispatched.h"
#include "rows.h"

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// weight + offset in the compute type, or ones without a weight: the scale the math applies.
template <typename Acc>
std::vector<Acc> row_scale(const std::optional<Tensor>& weight, int64_t n, double offset) {
  std::vector<Acc> scale(n, Acc(1));
  if (weight.has_value() && weight->defined()) {
    const Tensor w = weight->to(c10::CppTypeToScalarType<Acc>::value).contiguous();
    const Acc* data = w.const_data_ptr<Acc>();
    for (int64_t j = 0; j < n; ++j) scale[j] = data[j] + static_cast<Acc>(offset);
  }
  return scale;
}

template <typename T, typename Acc>
void forward_rows(const T* x, const T* residual, const Acc* scale, T* y, T* h, Acc* rstd, int64_t rows, int64_t n,
                  Acc eps) {
  using V = Vec<Acc>;
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    Acc a[BLOCK], b[BLOCK];
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * n;
      const T* rr = residual == nullptr ? nullptr : residual + row * n;
      T* hr = h == nullptr ? nullptr : h + row * n;
      V squares(Acc(0));
      for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t count = std::min(BLOCK, n - start);
        const Acc* values = load_block(xr + start, a, count);
        if (rr != nullptr) {  // h = x + residual, rounded to T as the next residual stream is
          const Acc* r = load_block(rr + start, b, count);
          Acc* sums = output_block(hr + start, a);
          for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
            (V::loadu(values + j, c) + V::loadu(r + j, c)).store(sums + j, c);
          });
          store_block(sums, hr + start, count);
          values = load_block(hr + start, a, count);
        }
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          const V v = V::loadu(values + j, c);
          squares = squares + v * v;
        });
      }
      const Acc s = Acc(1) / std::sqrt(sum_of(squares) / static_cast<Acc>(n) + eps);
      rstd[row] = s;
      const T* src = rr == nullptr ? xr : hr;
      for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t count = std::min(BLOCK, n - start);
        const Acc* values = load_block(src + start, a, count);
        Acc* out = output_block(y + row * n + start, b);
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          (V::loadu(values + j, c) * V(s) * V::loadu(scale + start + j, c)).store(out + j, c);
        });
        store_block(out, y + row * n + start, count);
      }
    }
  });
}

// (y, h, rstd); h is empty without a residual.
std::tuple<Tensor, Tensor, Tensor> rms_norm_forward(const Tensor& x_in, const std::optional<Tensor>& residual_in,
                                                    const std::optional<Tensor>& weight, double eps,
                                                    double weight_offset) {
  const Tensor x = x_in.contiguous();
  const bool has_residual = residual_in.has_value() && residual_in->defined();
  const Tensor residual = has_residual ? residual_in->contiguous() : Tensor();
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  Tensor y = at::empty_like(x);
  Tensor h = has_residual ? at::empty_like(x) : at::empty({0}, x.options());
  Tensor rstd = at::empty({rows}, x.options().dtype(compute_dtype(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "te_lab::rms_norm.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const std::vector<Acc> scale = row_scale<Acc>(weight, n, weight_offset);
    forward_rows<scalar_t, Acc>(x.const_data_ptr<scalar_t>(),
                                has_residual ? residual.const_data_ptr<scalar_t>() : nullptr, scale.data(),
                                y.mutable_data_ptr<scalar_t>(), has_residual ? h.mutable_data_ptr<scalar_t>() : nullptr,
                                rstd.mutable_data_ptr<Acc>(), rows, n, static_cast<Acc>(eps));
  });
  return {y, h, rstd};
}

// Rows split into ``tasks`` ranges; task t adds its rows' dy * x_hat into dw_partial's row t.
template <typename T, typename Acc>
void backward_rows(const T* dy, const T* dh, const T* h, const Acc* scale, const Acc* rstd, T* dx, Acc* dw_partial,
                   int64_t rows, int64_t n, int64_t tasks) {
  using V = Vec<Acc>;
  const int64_t per_task = (rows + tasks - 1) / tasks;
  at::parallel_for(0, tasks, 1, [&](int64_t first_task, int64_t last_task) {
    Acc a[BLOCK], b[BLOCK], c_buf[BLOCK], out_buf[BLOCK];
    for (int64_t task = first_task; task < last_task; ++task) {
      Acc* dw = dw_partial == nullptr ? nullptr : dw_partial + task * n;
      const int64_t end = std::min(rows, (task + 1) * per_task);
      for (int64_t row = task * per_task; row < end; ++row) {
        const T* dyr = dy + row * n;
        const T* hr = h + row * n;
        const Acc s = rstd[row];
        V products(Acc(0));  // sum of g * h, g = dy * scale
        for (int64_t start = 0; start < n; start += BLOCK) {
          const int64_t count = std::min(BLOCK, n - start);
          const Acc* dys = load_block(dyr + start, a, count);
          const Acc* hs = load_block(hr + start, b, count);
          for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
            products = products + V::loadu(dys + j, c) * V::loadu(scale + start + j, c) * V::loadu(hs + j, c);
          });
        }
        const V mean(sum_of(products) * s / static_cast<Acc>(n));  // mean of g * x_hat
        for (int64_t start = 0; start < n; start += BLOCK) {
          const int64_t count = std::min(BLOCK, n - start);
          const Acc* dys = load_block(dyr + start, a, count);
          const Acc* hs = load_block(hr + start, b, count);
          const Acc* dhs = dh == nullptr ? nullptr : load_block(dh + row * n + start, c_buf, count);
          Acc* out = output_block(dx + row * n + start, out_buf);
          for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
            const V dyv = V::loadu(dys + j, c);
            const V x_hat = V::loadu(hs + j, c) * V(s);
            V grad = (dyv * V::loadu(scale + start + j, c) - x_hat * mean) * V(s);
            if (dhs != nullptr) grad = grad + V::loadu(dhs + j, c);
            if (dw != nullptr) (V::loadu(dw + start + j, c) + dyv * x_hat).store(dw + start + j, c);
            grad.store(out + j, c);
          });
          store_block(out, dx + row * n + start, count);
        }
      }
    }
  });
}

// (dx, dweight); dweight, in the weight's dtype, is empty unless need_dw.
std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& dy_in, const std::optional<Tensor>& dh_in,
                                             const Tensor& h_in, const std::optional<Tensor>& weight,
                                             const Tensor& rstd_in, double weight_offset, bool need_dw) {
  const Tensor h = h_in.contiguous();
  const Tensor dy = dy_in.contiguous();
  const bool has_dh = dh_in.has_value() && dh_in->defined();
  const Tensor dh = has_dh ? dh_in->contiguous() : Tensor();
  const Tensor rstd = rstd_in.contiguous();
  const int64_t n = h.dim() == 0 ? 1 : h.size(-1);
  const int64_t rows = n == 0 ? 0 : h.numel() / n;
  need_dw = need_dw && weight.has_value() && weight->defined();
  const int64_t tasks = partial_sum_tasks(rows, n);
  Tensor dx = at::empty_like(h);
  Tensor partial = need_dw ? at::zeros({tasks, n}, h.options().dtype(compute_dtype(h.scalar_type()))) : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "te_lab::rms_norm_backward.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const std::vector<Acc> scale = row_scale<Acc>(weight, n, weight_offset);
    backward_rows<scalar_t, Acc>(dy.const_data_ptr<scalar_t>(), has_dh ? dh.const_data_ptr<scalar_t>() : nullptr,
                                 h.const_data_ptr<scalar_t>(), scale.data(), rstd.const_data_ptr<Acc>(),
                                 dx.mutable_data_ptr<scalar_t>(), need_dw ? partial.mutable_data_ptr<Acc>() : nullptr,
                                 rows, n, tasks);
  });
  if (!need_dw) return {dx, at::empty({0}, h.options())};
  const Tensor dw = tasks == 1 ? partial.select(0, 0) : partial.sum(0);
  return {dx, dw.to(weight->scalar_type())};
}

std::tuple<Tensor, Tensor> call_backward(const Tensor& dy, const std::optional<Tensor>& dh, const Tensor& h,
                                         const std::optional<Tensor>& weight, const Tensor& rstd, double offset,
                                         bool need_dw) {
  static const auto op = cpp_overload<decltype(rms_norm_backward)>("te_lab::rms_norm_backward");
  return op.call(dy, dh, h, weight, rstd, offset, need_dw);
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& residual,
                               const std::optional<Tensor>& weight, double eps, double weight_offset,
                               c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::rms_norm.cpp.
    static const auto op = cpp_overload<decltype(rms_norm_forward)>("te_lab::rms_norm");
    auto [y, h, rstd] = op.redispatch(keys_below_autograd(keys), x, residual, weight, eps, weight_offset);
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
    return {dx, has_residual ? dx : Tensor(), need_dw ? dw : Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> rms_norm_autograd(c10::DispatchKeySet keys, const Tensor& x, const std::optional<Tensor>& residual,
                                                     const std::optional<Tensor>& weight, double eps,
                                                     double weight_offset) {
  auto outputs = RmsNormFunction::apply(x, residual, weight, eps, weight_offset, keys);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace

// The schemas are kernels/rms_norm.py's (define_op), less `backend`.
TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("rms_norm.cpp", &rms_norm_forward);
  m.impl("rms_norm_backward.cpp", &rms_norm_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("rms_norm.cpp", &rms_norm_autograd); }

}  // namespace te_lab_cpu
