// te_lab::cross_entropy.cpp and te_lab::cross_entropy_backward.cpp: softmax cross-entropy
// over the vocabulary on the CPU, the loss and its gradient in one forward pass, with the
// autograd formula in C++ (kernels/cross_entropy.py states the math; where autograd
// releases the graph after it, the backward scales the gradient in place, through
// te_lab::cross_entropy_backward.cpp_in_place, whose schema declares the mutation). And
// te_lab::cross_entropy_over_logits.cpp, for fused_linear_cross_entropy's chunks: the same
// forward, writing the gradient over the logits it was given.
//
// Per row: one pass for the max and the sum of the logits, one computing exp(x - max)
// into a row buffer (the only exp per element) and its sum, one writing the gradient from
// that buffer. The row is small enough to stay in cache across the three. With a soft-cap
// c, the first pass writes c * tanh(x / c) into the buffer (and 1 - tanh^2, the gradient's
// factor, into a second one), and the others read the capped logits from there.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "activations.h"
#include "dispatched.h"
#include "rows.h"
#include "torch_internals.h"

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LossOptions {
  int64_t ignore_index;
  double label_smoothing, z_loss;
  double softcap;  // 0: none
};

// Every label is ignore_index or a class in [0, vocab): checked before any row is read.
void check_labels(const int64_t* labels, int64_t rows, int64_t vocab, int64_t ignore_index) {
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t label = labels[row];
    TORCH_CHECK_VALUE(label == ignore_index || (0 <= label && label < vocab), "cross_entropy: labels contains ", label,
                      ", which is neither ignore_index (", ignore_index, ") nor a class index in [0, ", vocab, ")");
  }
}

// Losses into loss[rows]; where grad is not null, d loss / d logits into it (it may be
// logits itself: each row is read into the exp buffer before it is written).
template <typename T, typename Acc>
void forward_rows(const T* logits, const int64_t* labels, Acc* loss, T* grad, int64_t rows, int64_t vocab,
                  const LossOptions& options) {
  using V = Vec<Acc>;
  const Acc smoothing = static_cast<Acc>(options.label_smoothing);
  const Acc z_loss = static_cast<Acc>(options.z_loss);
  const Acc uniform = smoothing / static_cast<Acc>(vocab);
  const bool capped = options.softcap != 0.0;
  const Acc cap = static_cast<Acc>(options.softcap);
  at::parallel_for(0, rows, rows_per_task(vocab), [&](int64_t begin, int64_t end) {
    // exps holds the capped logits until the second pass replaces them by their exps.
    std::vector<Acc> exps(vocab), slopes(capped ? vocab : 0);
    Acc a[BLOCK];
    for (int64_t row = begin; row < end; ++row) {
      const T* x = logits + row * vocab;
      T* g = grad == nullptr ? nullptr : grad + row * vocab;
      const int64_t label = labels[row];
      if (label == options.ignore_index) {
        loss[row] = Acc(0);
        if (g != nullptr) std::fill(g, g + vocab, T(0));
        continue;
      }
      V maxima(-std::numeric_limits<Acc>::infinity()), sums(Acc(0));
      for (int64_t start = 0; start < vocab; start += BLOCK) {
        const int64_t count = std::min(BLOCK, vocab - start);
        const Acc* values = load_block(x + start, a, count);
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          V v = V::loadu(values + j, c);
          if (capped) {
            const V t = tanh_of<Acc>(v / V(cap));
            (V(Acc(1)) - t * t).store(slopes.data() + start + j, c);
            v = t * V(cap);
            v.store(exps.data() + start + j, c);
          }
          // a partial vector's padding is 0: it takes the max of the loaded lanes only
          maxima = c == V::size() ? at::vec::maximum(maxima, v)
                                  : V::set(maxima, at::vec::maximum(maxima, v), c);
          sums = sums + v;
        });
      }
      const Acc row_max = at::vec::vec_reduce_all<Acc>(
          [](V& p, V& q) { return at::vec::maximum(p, q); }, maxima);
      const Acc x_label = capped ? exps[label] : static_cast<Acc>(x[label]);
      V exp_sums(Acc(0));
      for (int64_t start = 0; start < vocab; start += BLOCK) {
        const int64_t count = std::min(BLOCK, vocab - start);
        const Acc* values = capped ? exps.data() + start : load_block(x + start, a, count);
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          const V e = exp_of<Acc>(V::loadu(values + j, c) - V(row_max));
          e.store(exps.data() + start + j, c);
          exp_sums = exp_sums + (c == V::size() ? e : V::set(V(Acc(0)), e, c));
        });
      }
      const Acc sum_exp = sum_of(exp_sums);
      const Acc lse = row_max + std::log(sum_exp);
      loss[row] = (Acc(1) - smoothing) * (lse - x_label) + smoothing * (lse - sum_of(sums) / static_cast<Acc>(vocab)) +
                  z_loss * lse * lse;
      if (g == nullptr) continue;
      const V scale((Acc(1) + Acc(2) * z_loss * lse) / sum_exp);
      Acc out_buf[BLOCK];
      for (int64_t start = 0; start < vocab; start += BLOCK) {
        const int64_t count = std::min(BLOCK, vocab - start);
        Acc* out = output_block(g + start, out_buf);
        for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
          (V::loadu(exps.data() + start + j, c) * scale - V(uniform)).store(out + j, c);
        });
        if (start <= label && label < start + count) out[label - start] -= Acc(1) - smoothing;
        if (capped) {
          for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
            (V::loadu(out + j, c) * V::loadu(slopes.data() + start + j, c)).store(out + j, c);
          });
        }
        store_block(out, g + start, count);
      }
    }
  });
}

// (losses, gradient) of logits [rows, vocab]; the gradient is written into grad when it is
// defined, else not computed.
Tensor forward_into(const Tensor& logits, const Tensor& labels_in, const Tensor& grad, const LossOptions& options) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "cross_entropy: logits must be [tokens, vocab], got shape ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const Tensor labels = labels_in.to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(labels.numel() == rows, "cross_entropy: labels has ", labels.numel(), " elements; expected ", rows,
                    ", one per row of logits");
  check_labels(labels.const_data_ptr<int64_t>(), rows, vocab, options.ignore_index);
  Tensor loss = at::empty({rows}, logits.options().dtype(compute_dtype(logits.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "te_lab::cross_entropy.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    forward_rows<scalar_t, Acc>(logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(),
                                loss.mutable_data_ptr<Acc>(), grad.defined() ? grad.mutable_data_ptr<scalar_t>() : nullptr,
                                rows, vocab, options);
  });
  return loss;
}

// (losses, gradient or an empty tensor), as the Python op returns them.
std::tuple<Tensor, Tensor> cross_entropy_forward(const Tensor& logits_in, const Tensor& labels, int64_t ignore_index,
                                                 double label_smoothing, double z_loss, double softcap,
                                                 bool compute_grad) {
  const Tensor logits = logits_in.contiguous();
  Tensor grad = compute_grad ? at::empty_like(logits) : Tensor();
  Tensor loss = forward_into(logits, labels, grad, {ignore_index, label_smoothing, z_loss, softcap});
  return {loss, compute_grad ? grad : at::empty({0}, logits.options())};
}

// The losses; the gradient is written over logits, which the caller no longer needs.
Tensor cross_entropy_over_logits(Tensor& logits, const Tensor& labels, int64_t ignore_index, double label_smoothing,
                                 double z_loss, double softcap) {
  TORCH_CHECK_VALUE(logits.is_contiguous(), "cross_entropy_over_logits: logits must be contiguous");
  return forward_into(logits, labels, logits, {ignore_index, label_smoothing, z_loss, softcap});
}

// out = grad scaled by each row's upstream gradient, computed in the loss's precision and
// rounded once to the logits' dtype; out may be grad itself (each element is read before
// it is written).
void scale_rows(const Tensor& grad, const Tensor& dloss_in, Tensor& out) {
  const int64_t rows = grad.dim() == 2 ? grad.size(0) : 0, vocab = grad.dim() == 2 ? grad.size(1) : 0;
  const Tensor dloss = dloss_in.to(compute_dtype(grad.scalar_type())).contiguous();
  TORCH_CHECK_VALUE(dloss.numel() == rows, "cross_entropy_backward: dloss has ", dloss.numel(), " elements; expected ",
                    rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "te_lab::cross_entropy_backward.cpp",
                                  [&] {
    using Acc = at::opmath_type<scalar_t>;
    using V = Vec<Acc>;
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const Acc* d = dloss.const_data_ptr<Acc>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_per_task(vocab), [&](int64_t begin, int64_t end) {
      Acc a[BLOCK], out_buf[BLOCK];
      for (int64_t row = begin; row < end; ++row) {
        const V scale(d[row]);
        for (int64_t start = 0; start < vocab; start += BLOCK) {
          const int64_t count = std::min(BLOCK, vocab - start);
          const Acc* values = load_block(g + row * vocab + start, a, count);
          Acc* results = output_block(o + row * vocab + start, out_buf);
          for_each_vector<Acc>(count, [&](int64_t j, int64_t c) {
            (V::loadu(values + j, c) * scale).store(results + j, c);
          });
          store_block(results, o + row * vocab + start, count);
        }
      }
    });
  });
}

// The stored gradient scaled by each row's upstream gradient, into a new tensor.
Tensor cross_entropy_backward(const Tensor& grad_in, const Tensor& dloss) {
  const Tensor grad = grad_in.contiguous();
  Tensor out = at::empty_like(grad);
  scale_rows(grad, dloss, out);
  return out;
}

// The same, written over grad and returned (te_lab::cross_entropy_backward.cpp_in_place,
// whose schema says so): for a caller that will not read grad again.
Tensor& cross_entropy_backward_in_place(Tensor& grad, const Tensor& dloss) {
  TORCH_CHECK_VALUE(grad.is_contiguous(), "cross_entropy_backward (in place): grad_logits must be contiguous");
  scale_rows(grad, dloss, grad);
  return grad;
}

// Through the dispatcher (profiles record te_lab::cross_entropy_backward): in place where
// the graph is released after this node and the saved gradient is contiguous.
Tensor call_backward(Tensor grad, const Tensor& dloss, bool in_place) {
  if (in_place && grad.is_contiguous()) {
    static const auto op = cpp_overload<decltype(cross_entropy_backward_in_place)>(
        "te_lab::cross_entropy_backward", "cpp_in_place");
    return op.call(grad, dloss);
  }
  static const auto op = cpp_overload<decltype(cross_entropy_backward)>("te_lab::cross_entropy_backward");
  return op.call(grad, dloss);
}

// The gradient computed in the forward lives only in the graph: the second output is
// empty, so that the backward may scale the gradient in place where the graph is not
// kept (autograd releases it after this node), instead of writing a second [rows, vocab]
// tensor (a fresh one costs its page faults). A call that records no graph returns the
// gradient, as the CPU kernel does.
class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                               double label_smoothing, double z_loss, double softcap, bool compute_grad,
                               c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::cross_entropy.cpp.
    static const auto op = cpp_overload<decltype(cross_entropy_forward)>("te_lab::cross_entropy");
    auto [loss, grad] = op.redispatch(keys_below_autograd(keys), logits, labels, ignore_index, label_smoothing, z_loss,
                                      softcap, compute_grad);
    ctx->save_for_backward({grad});
    ctx->set_materialize_grads(false);
    const Tensor none = at::empty({0}, logits.options());
    ctx->mark_non_differentiable({none});
    return {loss, none};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list none(8);
    if (!grads[0].defined()) return none;
    const Tensor grad = ctx->get_saved_variables()[0];
    TORCH_CHECK(grad.dim() == 2 || grads[0].sym_numel() == 0,
                "te_lab::cross_entropy: backward needs the gradient the forward computes (compute_grad=True)");
    variable_list result = none;
    result[0] = call_backward(grad, grads[0], !backward_keeps_graph());
    return result;
  }
};

std::tuple<Tensor, Tensor> cross_entropy_autograd(c10::DispatchKeySet keys, const Tensor& logits, const Tensor& labels, int64_t ignore_index,
                                                  double label_smoothing, double z_loss, double softcap,
                                                  bool compute_grad) {
  if (!(at::GradMode::is_enabled() && logits.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op = cpp_overload<decltype(cross_entropy_forward)>("te_lab::cross_entropy");
    return op.redispatch(keys_below_autograd(keys), logits, labels, ignore_index, label_smoothing, z_loss, softcap,
                         compute_grad);
  }
  auto outputs =
      CrossEntropyFunction::apply(logits, labels, ignore_index, label_smoothing, z_loss, softcap, compute_grad, keys);
  return {outputs[0], outputs[1]};
}

}  // namespace

// The schemas are kernels/cross_entropy.py's (define_op): te_lab::cross_entropy's less
// `backend`, and the other overloads as it declares them.
TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("cross_entropy.cpp", &cross_entropy_forward);
  m.impl("cross_entropy_backward.cpp", &cross_entropy_backward);
  m.impl("cross_entropy_backward.cpp_in_place", &cross_entropy_backward_in_place);
  m.impl("cross_entropy_over_logits.cpp", &cross_entropy_over_logits);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("cross_entropy.cpp", &cross_entropy_autograd); }

}  // namespace te_lab_cpu
