// te_lab::moe.cpp and te_lab::moe_backward.cpp: a Mixture-of-Experts block's experts on the
// CPU (kernels/moe.py states the math, the layouts and the activations), with the autograd
// formula in C++: one call from Python per direction, the loop over experts in C++.
//
// The token-expert pairs are sorted by expert (a stable sort), so each expert's rows are one
// contiguous slice of the permuted input; each projection is one pass over the experts, an
// ATen GEMM per expert written straight into its slice of the output (the bias added by the
// GEMM itself), the experts spread over at::parallel_for's threads. The concatenated gated
// activations run on te_lab::glu's C++ kernels; the interleaved and clamped ones on ATen's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dispatched.h"

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Options {
  bool transposed, interleaved;
  std::string activation;
  double alpha, limit;

  bool clamped() const { return activation == "clamped_swiglu"; }
};

bool given(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

at::ScalarType compute_type(const Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The pairs sorted by expert: each sorted row's position in the flattened [tokens, top_k]
// routing, its token, its expert, and the row offsets of the experts (experts + 1 of them).
struct Permutation {
  Tensor order, tokens, experts;
  std::vector<int64_t> offsets;
};

Permutation permutation(const Tensor& indices, int64_t n_experts) {
  const Tensor flat = indices.reshape({-1});
  Permutation p;
  p.order = at::argsort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  p.tokens = at::div(p.order, indices.size(1), "floor");
  p.experts = flat.index_select(0, p.order);
  const Tensor counts = at::bincount(flat, {}, n_experts);
  TORCH_CHECK(counts.size(0) == n_experts, "te_lab::moe: indices holds an expert index outside [0, ", n_experts,
              ") (the experts of gate_up)");
  const int64_t* count = counts.const_data_ptr<int64_t>();
  p.offsets.assign(n_experts + 1, 0);
  for (int64_t e = 0; e < n_experts; ++e) p.offsets[e + 1] = p.offsets[e] + count[e];
  return p;
}

// [R, N]: each expert's slice of rows [R, K] times weight[e] ([K, N]) or, with transpose,
// weight[e]^T ([N, K] stored), plus bias[e] where given. Tensors are detached: worker
// threads do not inherit the caller's below-autograd guard.
Tensor grouped_mm(const Tensor& rows, const Tensor& weight, const std::optional<Tensor>& bias,
                  const std::vector<int64_t>& offsets, bool transpose) {
  const int64_t n = transpose ? weight.size(1) : weight.size(2);
  Tensor out = at::empty({rows.size(0), n}, rows.options());
  const Tensor a = rows.detach(), w = weight.detach();
  const Tensor b = given(bias) ? bias->detach() : Tensor();
  at::parallel_for(0, weight.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t start = offsets[e], count = offsets[e + 1] - offsets[e];
      if (count == 0) continue;
      Tensor slice = out.narrow(0, start, count);
      const Tensor we = transpose ? w.select(0, e).t() : w.select(0, e);
      if (b.defined()) {
        at::addmm_out(slice, b.select(0, e), a.narrow(0, start, count), we);
      } else {
        at::mm_out(slice, a.narrow(0, start, count), we);
      }
    }
  });
  return out;
}

// [E, M, N]: each expert's slice of left [R, M], transposed, times its slice of right [R, N].
Tensor grouped_outer(const Tensor& left, const Tensor& right, const std::vector<int64_t>& offsets) {
  const int64_t n_experts = static_cast<int64_t>(offsets.size()) - 1;
  Tensor out = at::empty({n_experts, left.size(1), right.size(1)}, left.options());
  const Tensor l = left.detach(), r = right.detach();
  at::parallel_for(0, n_experts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t start = offsets[e], count = offsets[e + 1] - offsets[e];
      Tensor slice = out.select(0, e);
      if (count == 0) {
        slice.zero_();
      } else {
        at::mm_out(slice, l.narrow(0, start, count).t(), r.narrow(0, start, count));
      }
    }
  });
  return out;
}

// [E, N]: the sum of each expert's rows, in the compute type, cast to `type`.
Tensor segment_sums(const Tensor& rows, const Tensor& experts, int64_t n_experts, at::ScalarType type) {
  Tensor sums = at::zeros({n_experts, rows.size(1)}, rows.options().dtype(compute_type(rows)));
  return sums.index_add_(0, experts, rows.to(compute_type(rows))).to(type);
}

std::tuple<Tensor, Tensor> halves(const Tensor& h, bool interleaved) {
  const int64_t width = h.size(1) / 2;
  if (interleaved) return {h.slice(1, 0, h.size(1), 2), h.slice(1, 1, h.size(1), 2)};
  return {h.narrow(1, 0, width), h.narrow(1, width, width)};
}

Tensor activate(const Tensor& x, const std::string& activation) {
  if (activation == "silu") return at::silu(x);
  if (activation == "relu_squared") return at::relu(x).square();
  return at::gelu(x, activation == "gelu_tanh" ? "tanh" : "none");
}

// The gated activation, op by op in h's dtype as Hugging Face's experts compute it (see
// kernels/moe.py); float32 and float64 concatenated halves run on te_lab::glu's kernel.
Tensor gated(const Tensor& h, const Options& o) {
  const bool full_precision = h.scalar_type() == at::kFloat || h.scalar_type() == at::kDouble;
  if (!o.interleaved && !o.clamped() && full_precision) {
    static const auto glu = cpp_overload<Tensor(const Tensor&, const std::optional<Tensor>&, c10::string_view)>(
        "te_lab::glu");
    return glu.call(h, std::nullopt, o.activation);
  }
  auto [gate, up] = halves(h, o.interleaved);
  if (!o.clamped()) return activate(gate, o.activation) * up;
  const Tensor g = gate.clamp_max(o.limit), u = up.clamp(-o.limit, o.limit);
  return (u + 1) * (g * at::sigmoid(g * o.alpha));
}

// dh [R, 2I] in h's layout from da [R, I].
Tensor gated_backward(const Tensor& da, const Tensor& h, const Options& o) {
  if (!o.interleaved && !o.clamped()) {
    static const auto glu_backward = cpp_overload<std::tuple<Tensor, Tensor>(
        const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view)>("te_lab::glu_backward");
    return std::get<0>(glu_backward.call(da, h, std::nullopt, o.activation));
  }
  const at::ScalarType acc = compute_type(h);
  auto [gate_half, up_half] = halves(h, o.interleaved);
  const Tensor gate = gate_half.to(acc), up = up_half.to(acc), d = da.to(acc);
  Tensor dgate, dup;
  if (o.clamped()) {
    // clamp passes the gradient where its input lies within the bounds, ends included.
    const Tensor g = gate.clamp_max(o.limit), u = up.clamp(-o.limit, o.limit);
    const Tensor sig = at::sigmoid(g * o.alpha);
    dup = d * (g * sig) * at::logical_and(up >= -o.limit, up <= o.limit);
    dgate = d * (u + 1) * (sig + o.alpha * g * sig * (1 - sig)) * (gate <= o.limit);
  } else {
    const Tensor up_grad = d * up;
    dgate = o.activation == "silu"           ? at::silu_backward(up_grad, gate)
            : o.activation == "relu_squared" ? up_grad * at::relu(gate) * 2
                                             : at::gelu_backward(up_grad, gate, o.activation == "gelu_tanh" ? "tanh" : "none");
    dup = d * activate(gate, o.activation);
  }
  const Tensor dh = o.interleaved ? at::stack({dgate, dup}, -1) : at::cat({dgate, dup}, -1);
  return dh.reshape(h.sizes()).to(h.scalar_type());
}

Options options_of(bool transposed, bool interleaved, c10::string_view activation, double alpha, double limit) {
  return {transposed, interleaved, std::string(activation), alpha, limit};
}

// (out [T, H], h [R, 2I], y [R, H]); h and y, in expert order, serve the backward.
std::tuple<Tensor, Tensor, Tensor> moe_forward(const Tensor& x_in, const Tensor& weights, const Tensor& indices,
                                               const Tensor& gate_up, const Tensor& down,
                                               const std::optional<Tensor>& gate_up_bias,
                                               const std::optional<Tensor>& down_bias, bool transposed,
                                               bool interleaved, c10::string_view activation, double alpha,
                                               double limit) {
  const Options o = options_of(transposed, interleaved, activation, alpha, limit);
  const Tensor x = x_in.contiguous();
  const Permutation p = permutation(indices, gate_up.size(0));
  const Tensor xs = x.index_select(0, p.tokens);
  const Tensor h = grouped_mm(xs, gate_up, gate_up_bias, p.offsets, !transposed);
  const Tensor y = grouped_mm(gated(h, o), down, down_bias, p.offsets, !transposed);
  const at::ScalarType acc = compute_type(x);
  const Tensor row_weights = weights.reshape({-1}).index_select(0, p.order).to(acc);
  Tensor out = at::zeros(x.sizes(), x.options().dtype(acc));
  // Each weighted expert output in the dtype of y * weight (as Hugging Face's experts), summed in acc.
  out.index_add_(0, p.tokens, (y.to(acc) * row_weights.unsqueeze(1)).to(at::result_type(y, weights)).to(acc));
  return {out.to(x.scalar_type()), h, y};
}

// (dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias); a bias's gradient is empty
// where the bias is not given.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> moe_backward(
    const Tensor& dout, const Tensor& x_in, const Tensor& weights, const Tensor& indices, const Tensor& gate_up,
    const Tensor& down, const std::optional<Tensor>& gate_up_bias, const std::optional<Tensor>& down_bias,
    const Tensor& h, const Tensor& y, bool transposed, bool interleaved, c10::string_view activation, double alpha,
    double limit) {
  const Options o = options_of(transposed, interleaved, activation, alpha, limit);
  const Tensor x = x_in.contiguous();
  const int64_t n_experts = gate_up.size(0);
  const Permutation p = permutation(indices, n_experts);
  const at::ScalarType acc = compute_type(x);
  const Tensor dy_token = dout.index_select(0, p.tokens).to(acc);
  const Tensor row_weights = weights.reshape({-1}).index_select(0, p.order).to(acc);
  const Tensor dweights = at::empty({p.order.size(0)}, weights.options())
                              .index_copy_(0, p.order, (dy_token * y.to(acc)).sum(-1).to(weights.scalar_type()))
                              .view(weights.sizes());
  const Tensor dy = (dy_token * row_weights.unsqueeze(1)).to(x.scalar_type());
  const Tensor da = grouped_mm(dy, down, std::nullopt, p.offsets, transposed);
  const Tensor a = gated(h, o);
  const Tensor ddown = transposed ? grouped_outer(a, dy, p.offsets) : grouped_outer(dy, a, p.offsets);
  const Tensor dh = gated_backward(da, h, o);
  const Tensor xs = x.index_select(0, p.tokens);
  const Tensor dxs = grouped_mm(dh, gate_up, std::nullopt, p.offsets, transposed);
  const Tensor dgate_up = transposed ? grouped_outer(xs, dh, p.offsets) : grouped_outer(dh, xs, p.offsets);
  Tensor dx = at::zeros(x.sizes(), x.options().dtype(acc));
  dx.index_add_(0, p.tokens, dxs.to(acc));
  // Two absent biases get two empty tensors: outputs of an op must not alias each other.
  return {dx.to(x.scalar_type()),
          dweights,
          dgate_up,
          ddown,
          given(gate_up_bias) ? segment_sums(dh, p.experts, n_experts, gate_up_bias->scalar_type())
                              : at::empty({0}, x.options()),
          given(down_bias) ? segment_sums(dy, p.experts, n_experts, down_bias->scalar_type())
                           : at::empty({0}, x.options())};
}

std::optional<Tensor> saved(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

class MoeFunction : public torch::autograd::Function<MoeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weights, const Tensor& indices,
                               const Tensor& gate_up, const Tensor& down, const std::optional<Tensor>& gate_up_bias,
                               const std::optional<Tensor>& down_bias, bool transposed, bool interleaved,
                               c10::string_view activation, double alpha, double limit, c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::moe.cpp.
    static const auto op = cpp_overload<decltype(moe_forward)>("te_lab::moe");
    auto [out, h, y] = op.redispatch(keys_below_autograd(keys), x, weights, indices, gate_up, down, gate_up_bias,
                                     down_bias, transposed, interleaved, activation, alpha, limit);
    ctx->save_for_backward({x, weights, indices, gate_up, down, given(gate_up_bias) ? *gate_up_bias : Tensor(),
                            given(down_bias) ? *down_bias : Tensor(), h, y});
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    ctx->mark_non_differentiable({h, y});
    return {out, h, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = cpp_overload<decltype(moe_backward)>("te_lab::moe_backward");
    const auto s = ctx->get_saved_variables();
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[0]);
    auto [dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias] =
        op.call(dout.contiguous(), s[0], s[1], s[2], s[3], s[4], saved(s[5]), saved(s[6]), s[7], s[8],
                ctx->saved_data["transposed"].toBool(), ctx->saved_data["interleaved"].toBool(),
                ctx->saved_data["activation"].toStringRef(), ctx->saved_data["alpha"].toDouble(),
                ctx->saved_data["limit"].toDouble());
    return {dx,
            dweights,
            Tensor(),
            dgate_up,
            ddown,
            s[5].defined() ? dgate_up_bias : Tensor(),
            s[6].defined() ? ddown_bias : Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> moe_autograd(c10::DispatchKeySet keys, const Tensor& x, const Tensor& weights,
                                                const Tensor& indices,
                                                const Tensor& gate_up, const Tensor& down,
                                                const std::optional<Tensor>& gate_up_bias,
                                                const std::optional<Tensor>& down_bias, bool transposed,
                                                bool interleaved, c10::string_view activation, double alpha,
                                                double limit) {
  auto outputs = MoeFunction::apply(x, weights, indices, gate_up, down, gate_up_bias, down_bias, transposed,
                                    interleaved, activation, alpha, limit, keys);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace

// The schemas are kernels/moe.py's (define_op), less `backend`.
TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("moe.cpp", &moe_forward);
  m.impl("moe_backward.cpp", &moe_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("moe.cpp", &moe_autograd); }

}  // namespace te_lab_cpu
