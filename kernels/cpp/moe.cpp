// te_lab::moe.cpp and te_lab::moe_backward.cpp: a Mixture-of-Experts block's experts on the
// CPU (kernels/moe.py states the math, the layouts and the activations), with the autograd
// formula in C++: one call from Python per direction, the loop over experts in C++.
//
// The token-expert pairs are sorted by expert (a stable counting sort), so each expert's rows
// are one contiguous slice of the permuted rows. Each direction then runs one pipeline per
// expert, its slices still in cache from one step to the next: forward, gather the expert's
// tokens, GEMM with gate_up (its bias added by the GEMM), the gated activation, GEMM with
// down; backward, GEMM with down, the activation's gradient (recomputing the activation
// for down's weight gradient in the same pass), down's weight gradient, gather the tokens
// again, GEMM with gate_up and gate_up's weight gradient. The GEMMs are ATen's (MKL) on the
// slices; the experts are spread over at::parallel_for's threads in ranges of about equal
// rows. Un-permuting is a gather, not a scatter: each token sums its k rows in one pass over
// the tokens (no zero-filled output, no atomics). The float32 and float64 halved activations
// run inline on at::vec (activations.h); the interleaved, clamped and half-precision ones
// run ATen's ops on each slice.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
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

struct Options {
  bool transposed, interleaved;
  std::string activation;
  double alpha, limit;

  bool clamped() const { return activation == "clamped_swiglu"; }
};

at::ScalarType compute_type(const Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The pairs sorted by expert (a stable counting sort of the flattened [tokens, top_k]
// routing): each sorted row's flat index t * top_k + j, each flat index's sorted row, each
// sorted row's expert, and the row offsets of the experts (experts + 1 of them).
struct Permutation {
  Tensor order, position, experts;
  std::vector<int64_t> offsets;
  int64_t top_k;

  int64_t rows() const { return offsets.back(); }
  const int64_t* order_data() const { return order.const_data_ptr<int64_t>(); }
};

Permutation permutation(const Tensor& indices, int64_t n_experts) {
  const Tensor flat = indices.contiguous().view({-1});
  const int64_t rows = flat.numel();
  const int64_t* expert_of = flat.const_data_ptr<int64_t>();
  Permutation p;
  p.top_k = indices.size(1);
  p.offsets.assign(n_experts + 1, 0);
  for (int64_t f = 0; f < rows; ++f) {
    const int64_t e = expert_of[f];
    TORCH_CHECK(e >= 0 && e < n_experts, "te_lab::moe: indices holds an expert index outside [0, ", n_experts,
                ") (the experts of gate_up): ", e);
    ++p.offsets[e + 1];
  }
  for (int64_t e = 0; e < n_experts; ++e) p.offsets[e + 1] += p.offsets[e];
  p.order = at::empty({rows}, flat.options());
  p.position = at::empty({rows}, flat.options());
  p.experts = at::empty({rows}, flat.options());
  int64_t* order = p.order.mutable_data_ptr<int64_t>();
  int64_t* position = p.position.mutable_data_ptr<int64_t>();
  int64_t* experts = p.experts.mutable_data_ptr<int64_t>();
  std::vector<int64_t> next(p.offsets.begin(), p.offsets.end() - 1);
  for (int64_t f = 0; f < rows; ++f) {
    const int64_t row = next[expert_of[f]]++;
    order[row] = f;
    position[f] = row;
    experts[row] = expert_of[f];
  }
  return p;
}

// f(expert, first row, rows) for every expert, on at::parallel_for's threads: each thread
// takes a run of consecutive experts holding about as many rows as the others'.
template <typename F>
void for_each_expert(const std::vector<int64_t>& offsets, const F& f) {
  const int64_t n_experts = static_cast<int64_t>(offsets.size()) - 1, rows = offsets.back();
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_experts));
  // The task of an expert: where the middle of its rows falls (non-decreasing in the expert).
  const auto task_of = [&](int64_t e) {
    return rows == 0 ? 0 : std::min(tasks - 1, (offsets[e] + offsets[e + 1]) * tasks / (2 * rows));
  };
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = 0; e < n_experts; ++e) {
      const int64_t task = task_of(e);
      if (task >= begin && task < end) f(e, offsets[e], offsets[e + 1] - offsets[e]);
    }
  });
}

// The rows [first, first + count) of the permuted input: x's row of each sorted row's token.
void gather_tokens(const Tensor& x, const Permutation& p, int64_t first, int64_t count, Tensor& xs) {
  const int64_t row_bytes = x.size(1) * x.element_size();
  const char* source = static_cast<const char*>(x.const_data_ptr());
  char* destination = static_cast<char*>(xs.mutable_data_ptr());
  const int64_t* order = p.order_data();
  for (int64_t row = first; row < first + count; ++row) {
    std::memcpy(destination + row * row_bytes, source + (order[row] / p.top_k) * row_bytes, row_bytes);
  }
}

// out [count, N] = rows [count, K] times weight_e ([K, N]) or, with transpose, weight_e^T
// ([N, K] stored), plus bias_e where defined.
void expert_mm(Tensor out, const Tensor& rows, const Tensor& weight_e, const Tensor& bias_e, bool transpose) {
  const Tensor w = transpose ? weight_e.t() : weight_e;
  if (bias_e.defined()) {
    at::addmm_out(out, bias_e, rows, w);
  } else {
    at::mm_out(out, rows, w);
  }
}

// out [tokens, N] (Acc) = the sum over each token's k flat indices f of scale[f] times the
// row position[f] of rows [R, N] (scale 1 where null): the un-permutation, by token.
template <typename Acc>
void gather_sum(const Acc* rows, const Acc* scale, const int64_t* position, Acc* out, int64_t tokens, int64_t top_k,
                int64_t width) {
  using V = Vec<Acc>;
  at::parallel_for(0, tokens, rows_per_task(width * top_k), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for_each_vector<Acc>(width, [&](int64_t j, int64_t c) {
        V sum(Acc(0));
        for (int64_t slot = 0; slot < top_k; ++slot) {
          const int64_t f = t * top_k + slot;
          const V row = V::loadu(rows + position[f] * width + j, c);
          sum = sum + (scale == nullptr ? row : V(scale[f]) * row);
        }
        sum.store(out + t * width + j, c);
      });
    }
  });
}

// Tokens' sums of their rows (scaled by flat_scale, [tokens * top_k] in token order, where
// defined), in rows' type, which is the compute type.
Tensor unpermute(const Tensor& rows, const Tensor& flat_scale, const Permutation& p, int64_t tokens) {
  Tensor out = at::empty({tokens, rows.size(1)}, rows.options());
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "te_lab::moe.cpp", [&] {
    gather_sum<scalar_t>(rows.const_data_ptr<scalar_t>(),
                         flat_scale.defined() ? flat_scale.const_data_ptr<scalar_t>() : nullptr,
                         p.position.const_data_ptr<int64_t>(), out.mutable_data_ptr<scalar_t>(), tokens, p.top_k,
                         rows.size(1));
  });
  return out;
}

// For each sorted row r (flat index f, token t): dy[r] = weights[f] * dout[t] and
// dweights[f] = dout[t] . y[r], all in Acc.
template <typename Acc>
void weighted_rows_backward(const Acc* dout, const Acc* y, const Acc* weights, const Permutation& p, int64_t width,
                            Acc* dy, Acc* dweights) {
  using V = Vec<Acc>;
  const int64_t* order = p.order_data();
  at::parallel_for(0, p.rows(), rows_per_task(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t f = order[r];
      const Acc* g = dout + (f / p.top_k) * width;
      const V w(weights[f]);
      V dot(Acc(0));
      for_each_vector<Acc>(width, [&](int64_t j, int64_t c) {
        const V gj = V::loadu(g + j, c);
        dot = dot + gj * V::loadu(y + r * width + j, c);
        (gj * w).store(dy + r * width + j, c);
      });
      dweights[f] = sum_of(dot);
    }
  });
}

std::tuple<Tensor, Tensor> halves(const Tensor& h, bool interleaved) {
  const int64_t width = h.size(1) / 2;
  if (interleaved) return {h.slice(1, 0, h.size(1), 2), h.slice(1, 1, h.size(1), 2)};
  return {h.narrow(1, 0, width), h.narrow(1, width, width)};
}

Tensor activate_tensor(const Tensor& x, const std::string& activation) {
  if (activation == "silu") return at::silu(x);
  if (activation == "relu_squared") return at::relu(x).square();
  return at::gelu(x, activation == "gelu_tanh" ? "tanh" : "none");
}

// Whether the gated activation of h runs inline on at::vec: float32 or float64 halves, not
// gpt-oss's clamped form (the others run ATen's ops, op by op as Hugging Face's experts).
bool inline_activation(const Tensor& h, const Options& o) {
  return (h.scalar_type() == at::kFloat || h.scalar_type() == at::kDouble) && !o.interleaved && !o.clamped();
}

// a [rows, I] = act(gate) * up of h [rows, 2I] (gate its first half, up its second).
template <typename Acc>
void gated_rows(const Acc* h, Acc* a, int64_t rows, int64_t width, Activation activation) {
  using V = Vec<Acc>;
  for (int64_t r = 0; r < rows; ++r) {
    const Acc* gate = h + r * 2 * width;
    for_each_vector<Acc>(width, [&](int64_t j, int64_t c) {
      (activate(activation, V::loadu(gate + j, c)) * V::loadu(gate + width + j, c)).store(a + r * width + j, c);
    });
  }
}

// From h [rows, 2I] and da [rows, I]: dh (dgate = da * up * act'(gate), dup = da * act(gate))
// and the activation a = act(gate) * up again, for down's weight gradient.
template <typename Acc>
void gated_rows_backward(const Acc* h, const Acc* da, Acc* a, Acc* dh, int64_t rows, int64_t width,
                         Activation activation) {
  using V = Vec<Acc>;
  for (int64_t r = 0; r < rows; ++r) {
    const Acc* gate = h + r * 2 * width;
    Acc* dgate = dh + r * 2 * width;
    for_each_vector<Acc>(width, [&](int64_t j, int64_t c) {
      const V d = V::loadu(da + r * width + j, c), up = V::loadu(gate + width + j, c);
      const auto [act, grad] = activate_with_grad(activation, V::loadu(gate + j, c));
      (d * up * grad).store(dgate + j, c);
      (d * act).store(dgate + width + j, c);
      (act * up).store(a + r * width + j, c);
    });
  }
}

// The gated activation with ATen's ops, op by op in h's dtype as Hugging Face's experts
// compute it (see kernels/moe.py).
Tensor gated(const Tensor& h, const Options& o) {
  auto [gate, up] = halves(h, o.interleaved);
  if (!o.clamped()) return activate_tensor(gate, o.activation) * up;
  const Tensor g = gate.clamp_max(o.limit), u = up.clamp(-o.limit, o.limit);
  return (u + 1) * (g * at::sigmoid(g * o.alpha));
}

// dh [R, 2I] in h's layout from da [R, I], with ATen's ops (the concatenated halves of
// half-precision h on te_lab::glu's kernel, which computes in float32).
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
    dup = d * activate_tensor(gate, o.activation);
  }
  const Tensor dh = o.interleaved ? at::stack({dgate, dup}, -1) : at::cat({dgate, dup}, -1);
  return dh.reshape(h.sizes()).to(h.scalar_type());
}

// a_e = the gated activation of h_e (one expert's slices).
void gated_into(Tensor a_e, const Tensor& h_e, const Options& o) {
  if (!inline_activation(h_e, o)) {
    a_e.copy_(gated(h_e, o));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(h_e.scalar_type(), "te_lab::moe.cpp", [&] {
    gated_rows<scalar_t>(h_e.const_data_ptr<scalar_t>(), a_e.mutable_data_ptr<scalar_t>(), h_e.size(0),
                         a_e.size(1), activation_named(o.activation));
  });
}

// dh_e from da_e and h_e, and a_e = the gated activation of h_e again (one expert's slices).
void gated_backward_into(Tensor dh_e, Tensor a_e, const Tensor& da_e, const Tensor& h_e, const Options& o) {
  if (!inline_activation(h_e, o)) {
    dh_e.copy_(gated_backward(da_e, h_e, o));
    a_e.copy_(gated(h_e, o));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(h_e.scalar_type(), "te_lab::moe_backward.cpp", [&] {
    gated_rows_backward<scalar_t>(h_e.const_data_ptr<scalar_t>(), da_e.const_data_ptr<scalar_t>(),
                                  a_e.mutable_data_ptr<scalar_t>(), dh_e.mutable_data_ptr<scalar_t>(), h_e.size(0),
                                  a_e.size(1), activation_named(o.activation));
  });
}

// [E, N]: the sum of each expert's rows, in the compute type, cast to `type`.
Tensor segment_sums(const Tensor& rows, const Tensor& experts, int64_t n_experts, at::ScalarType type) {
  Tensor sums = at::zeros({n_experts, rows.size(1)}, rows.options().dtype(compute_type(rows)));
  return sums.index_add_(0, experts, rows.to(compute_type(rows))).to(type);
}

Options options_of(bool transposed, bool interleaved, c10::string_view activation, double alpha, double limit) {
  return {transposed, interleaved, std::string(activation), alpha, limit};
}

// Expert e's slice of a weight or bias, or an undefined tensor for an absent bias.
Tensor expert_slice(const Tensor& t, int64_t e) { return t.defined() ? t.select(0, e) : Tensor(); }

// Tensors as worker threads use them: detached (worker threads do not inherit the caller's
// below-autograd guard), an absent bias undefined.
Tensor detached(const std::optional<Tensor>& t) { return given(t) ? t->detach() : Tensor(); }

// (out [T, H], h [R, 2I], y [R, H]); h and y, in expert order, serve the backward.
std::tuple<Tensor, Tensor, Tensor> moe_forward(const Tensor& x_in, const Tensor& weights, const Tensor& indices,
                                               const Tensor& gate_up_in, const Tensor& down_in,
                                               const std::optional<Tensor>& gate_up_bias,
                                               const std::optional<Tensor>& down_bias, bool transposed,
                                               bool interleaved, c10::string_view activation, double alpha,
                                               double limit) {
  const Options o = options_of(transposed, interleaved, activation, alpha, limit);
  const Tensor x = x_in.contiguous().detach();
  const Tensor gate_up = gate_up_in.detach(), down = down_in.detach();
  const Tensor gate_up_b = detached(gate_up_bias), down_b = detached(down_bias);
  const Permutation p = permutation(indices, gate_up.size(0));
  const int64_t rows = p.rows(), hidden = x.size(1);
  const int64_t width = (transposed ? gate_up.size(2) : gate_up.size(1)) / 2;
  Tensor xs = at::empty({rows, hidden}, x.options()), a = at::empty({rows, width}, x.options());
  Tensor h = at::empty({rows, 2 * width}, x.options()), y = at::empty({rows, hidden}, x.options());
  for_each_expert(p.offsets, [&](int64_t e, int64_t first, int64_t count) {
    if (count == 0) return;
    gather_tokens(x, p, first, count, xs);
    const Tensor h_e = h.narrow(0, first, count), a_e = a.narrow(0, first, count);
    expert_mm(h_e, xs.narrow(0, first, count), gate_up.select(0, e), expert_slice(gate_up_b, e), !transposed);
    gated_into(a_e, h_e, o);
    expert_mm(y.narrow(0, first, count), a_e, down.select(0, e), expert_slice(down_b, e), !transposed);
  });
  const at::ScalarType acc = compute_type(x), weighted_type = at::result_type(y, weights);
  const Tensor flat_weights = weights.reshape({-1}).to(acc).contiguous();
  Tensor out;
  if (y.scalar_type() == acc && weighted_type == acc) {
    out = unpermute(y, flat_weights, p, x.size(0));
  } else {
    // Each weighted expert output in the dtype of y * weight (as Hugging Face's experts), summed in acc.
    const Tensor weighted = (y.to(acc) * flat_weights.index_select(0, p.order).unsqueeze(1)).to(weighted_type).to(acc);
    out = unpermute(weighted.contiguous(), Tensor(), p, x.size(0));
  }
  return {out.to(x.scalar_type()), h, y};
}

// (dx, dweights, dgate_up, ddown, dgate_up_bias, ddown_bias); a bias's gradient is empty
// where the bias is not given.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> moe_backward(
    const Tensor& dout, const Tensor& x_in, const Tensor& weights, const Tensor& indices, const Tensor& gate_up_in,
    const Tensor& down_in, const std::optional<Tensor>& gate_up_bias, const std::optional<Tensor>& down_bias,
    const Tensor& h_in, const Tensor& y, bool transposed, bool interleaved, c10::string_view activation,
    double alpha, double limit) {
  const Options o = options_of(transposed, interleaved, activation, alpha, limit);
  const Tensor x = x_in.contiguous().detach(), h = h_in.contiguous().detach();
  const Tensor gate_up = gate_up_in.detach(), down = down_in.detach();
  const int64_t n_experts = gate_up.size(0), hidden = x.size(1), width = h.size(1) / 2;
  const Permutation p = permutation(indices, n_experts);
  const int64_t rows = p.rows();
  const at::ScalarType acc = compute_type(x);
  const Tensor dout_acc = dout.detach().to(acc).contiguous(), y_acc = y.detach().to(acc).contiguous();
  const Tensor flat_weights = weights.detach().reshape({-1}).to(acc).contiguous();
  Tensor dy_acc = at::empty({rows, hidden}, x.options().dtype(acc)), dweights_acc = at::empty({rows}, dy_acc.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "te_lab::moe_backward.cpp", [&] {
    weighted_rows_backward<scalar_t>(dout_acc.const_data_ptr<scalar_t>(), y_acc.const_data_ptr<scalar_t>(),
                                     flat_weights.const_data_ptr<scalar_t>(), p, hidden,
                                     dy_acc.mutable_data_ptr<scalar_t>(), dweights_acc.mutable_data_ptr<scalar_t>());
  });
  const Tensor dy = dy_acc.to(x.scalar_type());
  Tensor da = at::empty({rows, width}, x.options()), a = at::empty({rows, width}, x.options());
  Tensor dh = at::empty({rows, 2 * width}, x.options()), xs = at::empty({rows, hidden}, x.options());
  Tensor dxs = at::empty({rows, hidden}, x.options());
  Tensor dgate_up = at::empty(gate_up.sizes(), gate_up.options()), ddown = at::empty(down.sizes(), down.options());
  for_each_expert(p.offsets, [&](int64_t e, int64_t first, int64_t count) {
    Tensor dgate_up_e = dgate_up.select(0, e), ddown_e = ddown.select(0, e);
    if (count == 0) {
      dgate_up_e.zero_();
      ddown_e.zero_();
      return;
    }
    const Tensor dy_e = dy.narrow(0, first, count), da_e = da.narrow(0, first, count);
    const Tensor a_e = a.narrow(0, first, count), dh_e = dh.narrow(0, first, count);
    const Tensor xs_e = xs.narrow(0, first, count);
    expert_mm(da_e, dy_e, down.select(0, e), Tensor(), transposed);
    gated_backward_into(dh_e, a_e, da_e, h.narrow(0, first, count), o);
    if (transposed) {
      at::mm_out(ddown_e, a_e.t(), dy_e);
    } else {
      at::mm_out(ddown_e, dy_e.t(), a_e);
    }
    gather_tokens(x, p, first, count, xs);
    expert_mm(dxs.narrow(0, first, count), dh_e, gate_up.select(0, e), Tensor(), transposed);
    if (transposed) {
      at::mm_out(dgate_up_e, xs_e.t(), dh_e);
    } else {
      at::mm_out(dgate_up_e, dh_e.t(), xs_e);
    }
  });
  const Tensor dx = unpermute(dxs.to(acc).contiguous(), Tensor(), p, x.size(0));
  // Two absent biases get two empty tensors: outputs of an op must not alias each other.
  return {dx.to(x.scalar_type()),
          dweights_acc.to(weights.scalar_type()).view(weights.sizes()),
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
