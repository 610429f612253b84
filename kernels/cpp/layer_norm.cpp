// te_lab::layer_norm.cpp and te_lab::layer_norm_backward.cpp: LayerNorm on the CPU through
// ATen's own row kernels (native_layer_norm and its backward), with the residual add
// around them and the op's autograd formula in C++, so that an eager call and its
// backward never return to Python (kernels/layer_norm.py states the math; its `native`
// backend is the same computation reached through Python).
//
// The residual stream's gradient is added into ATen's input gradient in place, where
// eager autograd sums the two into a fresh tensor. A weight offset (Nemotron's LayerNorm1P
// scales by 1 + weight) is added to the weight ATen is given; its weight gradient does not
// read the weight, so it is the gradient of the weight itself.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "dispatched.h"
#include "rows.h"

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ATen keeps mean and rstd in the input dtype for half-precision inputs without float32
// parameters: inputs and parameters go to the compute dtype (rows.h) first.
std::optional<Tensor> in_dtype(const std::optional<Tensor>& t, at::ScalarType dtype) {
  return given(t) ? std::optional<Tensor>(t->to(dtype)) : std::nullopt;
}

// weight + offset in the compute dtype (the weight, cast, without an offset).
std::optional<Tensor> offset_weight(const std::optional<Tensor>& weight, at::ScalarType dtype, double offset) {
  if (!given(weight) || offset == 0.0) return in_dtype(weight, dtype);
  return std::optional<Tensor>(at::add(weight->to(dtype), offset));
}

// (y, h, mean, rstd); h is empty without a residual, mean and rstd have one value per row.
std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_forward(const Tensor& x, const std::optional<Tensor>& residual,
                                                              const std::optional<Tensor>& weight,
                                                              const std::optional<Tensor>& bias, double eps,
                                                              double weight_offset) {
  const Tensor h = given(residual) ? at::add(x, *residual) : x;
  const auto acc = compute_dtype(h.scalar_type());
  const int64_t n = h.dim() == 0 ? 1 : h.size(-1);
  auto [y, mean, rstd] =
      at::native_layer_norm(h.to(acc), {n}, offset_weight(weight, acc, weight_offset), in_dtype(bias, acc), eps);
  return {y.to(x.scalar_type()), given(residual) ? h : at::empty({0}, x.options()), mean.view({-1}),
          rstd.view({-1})};
}

// (dx, dweight, dbias), the parameter gradients empty unless asked for.
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const std::optional<Tensor>& dh,
                                                       const Tensor& h, const std::optional<Tensor>& weight,
                                                       const std::optional<Tensor>& bias, const Tensor& mean,
                                                       const Tensor& rstd, double weight_offset, bool need_dw,
                                                       bool need_db) {
  const auto acc = rstd.scalar_type();
  const int64_t n = h.dim() == 0 ? 1 : h.size(-1);
  need_dw = need_dw && given(weight);
  need_db = need_db && given(bias);
  auto [dx, dw, db] = at::native_layer_norm_backward(dy.to(acc), h.to(acc), {n}, mean.view({-1, 1}),
                                                     rstd.view({-1, 1}), offset_weight(weight, acc, weight_offset),
                                                     in_dtype(bias, acc),
                                                     {true, need_dw, need_db});
  if (given(dh)) dx.add_(*dh);
  // an empty tensor each for gradients not asked for: outputs never alias (the schema says so)
  return {dx.to(h.scalar_type()), need_dw ? dw.to(weight->scalar_type()) : at::empty({0}, h.options()),
          need_db ? db.to(bias->scalar_type()) : at::empty({0}, h.options())};
}

std::tuple<Tensor, Tensor, Tensor> call_backward(const Tensor& dy, const std::optional<Tensor>& dh, const Tensor& h,
                                                 const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                                                 const Tensor& mean, const Tensor& rstd, double weight_offset, bool need_dw,
                                                 bool need_db) {
  static const auto op = cpp_overload<decltype(layer_norm_backward)>("te_lab::layer_norm_backward");
  return op.call(dy, dh, h, weight, bias, mean, rstd, weight_offset, need_dw, need_db);
}

std::optional<Tensor> saved(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& residual,
                               const std::optional<Tensor>& weight, const std::optional<Tensor>& bias, double eps,
                               double weight_offset, c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::layer_norm.cpp.
    static const auto op = cpp_overload<decltype(layer_norm_forward)>("te_lab::layer_norm");
    auto [y, h, mean, rstd] = op.redispatch(keys_below_autograd(keys), x, residual, weight, bias, eps, weight_offset);
    const bool has_residual = given(residual);
    ctx->save_for_backward({has_residual ? h : x, given(weight) ? *weight : Tensor(), given(bias) ? *bias : Tensor(),
                            mean, rstd});
    ctx->saved_data["has_residual"] = has_residual;
    ctx->saved_data["weight_offset"] = weight_offset;
    ctx->mark_non_differentiable(has_residual ? variable_list{mean, rstd} : variable_list{h, mean, rstd});
    ctx->set_materialize_grads(false);
    return {y, h, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const Tensor& h = s[0];
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    // Edges exist for the tensors given: x, then the residual, the weight and the bias where given.
    const size_t weight_edge = has_residual ? 2 : 1;
    const bool need_dw = s[1].defined() && ctx->needs_input_grad(weight_edge);
    const bool need_db = s[2].defined() && ctx->needs_input_grad(weight_edge + (s[1].defined() ? 1 : 0));
    const Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(h);
    const std::optional<Tensor> dh = has_residual && grads[1].defined() ? std::optional<Tensor>(grads[1]) : std::nullopt;
    auto [dx, dw, db] = call_backward(dy, dh, h, saved(s[1]), saved(s[2]), s[3], s[4],
                                      ctx->saved_data["weight_offset"].toDouble(), need_dw, need_db);
    return {dx, has_residual ? dx : Tensor(), need_dw ? dw : Tensor(), need_db ? db : Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_autograd(c10::DispatchKeySet keys, const Tensor& x, const std::optional<Tensor>& residual,
                                                               const std::optional<Tensor>& weight,
                                                               const std::optional<Tensor>& bias, double eps,
                                                               double weight_offset) {
  auto outputs = LayerNormFunction::apply(x, residual, weight, bias, eps, weight_offset, keys);
  return {outputs[0], outputs[1], outputs[2], outputs[3]};
}

}  // namespace

// The schemas are kernels/layer_norm.py's (define_op), less `backend`.
TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("layer_norm.cpp", &layer_norm_forward);
  m.impl("layer_norm_backward.cpp", &layer_norm_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("layer_norm.cpp", &layer_norm_autograd); }

}  // namespace te_lab_cpu
