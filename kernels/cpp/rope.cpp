// te_lab::rope.cpp and te_lab::rope_backward.cpp: rotary position embedding of q and k
// on the CPU, one pass per direction, with the autograd formula in C++ (kernels/rope.py
// states the math: the backward is the forward with each pair's sin entries swapped and
// negated, and cos and sin get no gradient). With QK-norm weights, each head row is
// RMS-normalized before its rotation in the same pass, and the backward runs the norm's
// backward after rotating the gradient back, from the saved q and k.
//
// q and k may have any strides. Outputs are laid out as the Python op lays them out: like
// q and k where both are transposed views of memory in the other layout (Hugging Face's
// projections), else contiguous.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "dispatched.h"
#include "rows.h"

namespace te_lab_cpu {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// cos and sin in the compute type, [table_batch, seq, rotary_dim] contiguous (the
// caller's tensors where they already are); for the backward the sin table is a
// transposed copy (each pair's entries swapped and negated).
template <typename Acc>
struct Tables {
  Tensor cos_table, sin_table;
  const Acc* cos;
  const Acc* sin;
  int64_t batch, seq, rotary_dim;
};

template <typename Acc>
Tables<Acc> tables_of(const Tensor& cos_in, const Tensor& sin_in, bool interleaved, bool transposed) {
  TORCH_CHECK_VALUE(cos_in.dim() == 2 || cos_in.dim() == 3, "rope: cos must be [seq, rotary_dim] or "
                    "[batch, seq, rotary_dim], got shape ", cos_in.sizes());
  TORCH_CHECK_VALUE(sin_in.sizes() == cos_in.sizes(), "rope: sin has shape ", sin_in.sizes(), "; expected ",
                    cos_in.sizes(), " like cos");
  const auto acc = c10::CppTypeToScalarType<Acc>::value;
  Tables<Acc> t;
  t.cos_table = cos_in.to(acc, false, false, at::MemoryFormat::Contiguous);
  t.sin_table = sin_in.to(acc, false, /*copy=*/transposed, at::MemoryFormat::Contiguous);
  t.batch = cos_in.dim() == 3 ? cos_in.size(0) : 1;
  t.seq = cos_in.size(-2);
  t.rotary_dim = cos_in.size(-1);
  TORCH_CHECK_VALUE(t.rotary_dim % 2 == 0, "rope: rotary_dim (cos's last dim) must be even, got ", t.rotary_dim);
  t.cos = t.cos_table.template const_data_ptr<Acc>();
  t.sin = t.sin_table.template const_data_ptr<Acc>();
  if (transposed) {
    const int64_t half = t.rotary_dim / 2;
    Acc* sin = t.sin_table.template mutable_data_ptr<Acc>();
    for (int64_t row = 0; row < t.batch * t.seq; ++row) {
      Acc* s = sin + row * t.rotary_dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
        const Acc a = s[first];
        s[first] = -s[second];
        s[second] = -a;
      }
    }
  }
  return t;
}

// Where x's rows of head_dim elements start: x is [batch, d1, d2, head_dim] with unit
// stride in its last dim; the sequence is d2 in "bhsd", d1 in "bshd".
struct Rows {
  int64_t batch, d1, d2, head_dim, stride0, stride1, stride2;
  bool seq_is_d2;

  int64_t count() const { return batch * d1 * d2; }
  int64_t offset(int64_t row) const {
    const int64_t i2 = row % d2, i1 = (row / d2) % d1, b = row / (d1 * d2);
    return b * stride0 + i1 * stride1 + i2 * stride2;
  }
  int64_t batch_of(int64_t row) const { return row / (d1 * d2); }
  int64_t seq_of(int64_t row) const { return seq_is_d2 ? row % d2 : (row / d2) % d1; }
};

Rows rows_of(const Tensor& x, bool seq_is_d2) {
  return {x.size(0), x.size(1), x.size(2), x.size(3), x.stride(0), x.stride(1), x.stride(2), seq_is_d2};
}

// The tables fit the rows `in` walks.
template <typename Acc>
void check_tables(const Tables<Acc>& t, const Rows& in) {
  TORCH_CHECK_VALUE(in.seq_is_d2 ? in.d2 == t.seq : in.d1 == t.seq, "rope: cos has seq ", t.seq,
                    "; expected the seq of q and k");
  TORCH_CHECK_VALUE(t.batch == 1 || t.batch == in.batch, "rope: cos has batch ", t.batch, "; expected 1 or ",
                    in.batch);
  TORCH_CHECK_VALUE(t.rotary_dim <= in.head_dim, "rope: rotary_dim ", t.rotary_dim, " exceeds head_dim ", in.head_dim);
}

// Where the tables' row for row `row` of rows `in` starts.
template <typename Acc>
inline int64_t table_row(const Tables<Acc>& t, const Rows& in, int64_t row) {
  return ((t.batch == 1 ? 0 : in.batch_of(row)) * t.seq + in.seq_of(row)) * t.rotary_dim;
}

template <typename T, typename Acc>
void rotate_rows(const T* x, const Rows& in, T* out, const Rows& to, const Tables<Acc>& t, bool interleaved) {
  using V = Vec<Acc>;
  const int64_t rotary = t.rotary_dim, half = rotary / 2, head_dim = in.head_dim;
  check_tables(t, in);
  at::parallel_for(0, in.count(), rows_per_task(head_dim), [&](int64_t begin, int64_t end) {
    Acc a_buf[BLOCK], b_buf[BLOCK], first_buf[BLOCK], second_buf[BLOCK];
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + in.offset(row);
      T* outr = out + to.offset(row);
      const Acc* c = t.cos + table_row(t, in, row);
      const Acc* s = t.sin + table_row(t, in, row);
      if (interleaved) {  // pairs (2i, 2i + 1): strided lanes, a scalar loop
        for (int64_t i = 0; i < rotary; i += 2) {
          const Acc a = static_cast<Acc>(xr[i]), b = static_cast<Acc>(xr[i + 1]);
          outr[i] = static_cast<T>(a * c[i] - b * s[i]);
          outr[i + 1] = static_cast<T>(b * c[i + 1] + a * s[i + 1]);
        }
      } else {  // pairs (i, i + half): two contiguous halves, vectorized
        for (int64_t start = 0; start < half; start += BLOCK) {
          const int64_t count = std::min(BLOCK, half - start);
          const Acc* as = load_block(xr + start, a_buf, count);
          const Acc* bs = load_block(xr + half + start, b_buf, count);
          Acc* firsts = output_block(outr + start, first_buf);
          Acc* seconds = output_block(outr + half + start, second_buf);
          for_each_vector<Acc>(count, [&](int64_t j, int64_t n) {
            const V a = V::loadu(as + j, n), b = V::loadu(bs + j, n);
            const int64_t i = start + j;
            (a * V::loadu(c + i, n) - b * V::loadu(s + i, n)).store(firsts + j, n);
            (b * V::loadu(c + half + i, n) + a * V::loadu(s + half + i, n)).store(seconds + j, n);
          });
          store_block(firsts, outr + start, count);
          store_block(seconds, outr + half + start, count);
        }
      }
      std::copy(xr + rotary, xr + head_dim, outr + rotary);  // dims past rotary_dim pass through
    }
  });
}

// One row's rotary dims rotated from y (in the compute type) into out (the backward's tables
// give the transposed rotation); dims past rotary_dim are left to the caller.
template <typename T, typename Acc>
inline void rotate_row(const Acc* y, T* out, const Acc* c, const Acc* s, int64_t rotary, bool interleaved) {
  const int64_t half = rotary / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
    const Acc a = y[first], b = y[second];
    out[first] = static_cast<T>(a * c[first] - b * s[first]);
    out[second] = static_cast<T>(b * c[second] + a * s[second]);
  }
}

// 1 / sqrt(mean(x^2) + eps) of a row already in the compute type.
template <typename Acc>
inline Acc rstd_of(const Acc* x, int64_t n, Acc eps) {
  Acc squares = 0;
  for (int64_t j = 0; j < n; ++j) squares += x[j] * x[j];
  return Acc(1) / std::sqrt(squares / static_cast<Acc>(n) + eps);
}

// QK-norm: each row of x RMS-normalized and scaled (scale = weight + offset), then rotated.
template <typename T, typename Acc>
void normalize_rotate_rows(const T* x, const Rows& in, T* out, const Rows& to, const Tables<Acc>& t,
                           bool interleaved, const Acc* scale, Acc eps) {
  const int64_t head_dim = in.head_dim, rotary = t.rotary_dim;
  check_tables(t, in);
  at::parallel_for(0, in.count(), rows_per_task(head_dim), [&](int64_t begin, int64_t end) {
    std::vector<Acc> y(head_dim);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + in.offset(row);
      T* outr = out + to.offset(row);
      for (int64_t j = 0; j < head_dim; ++j) y[j] = static_cast<Acc>(xr[j]);
      const Acc r = rstd_of(y.data(), head_dim, eps);
      for (int64_t j = 0; j < head_dim; ++j) y[j] = y[j] * r * scale[j];
      const int64_t tr = table_row(t, in, row);
      rotate_row(y.data(), outr, t.cos + tr, t.sin + tr, rotary, interleaved);
      for (int64_t j = rotary; j < head_dim; ++j) outr[j] = static_cast<T>(y[j]);
    }
  });
}

// The backward of normalize_rotate_rows (tables transposed): per row, g = the gradient
// rotated back, then dx = rstd * (g * scale - x_hat * mean(g * scale * x_hat)); task t of
// `tasks` adds its rows' g * x_hat into dw_partial's row t.
template <typename T, typename Acc>
void normalize_rotate_back_rows(const T* dout, const Rows& d_rows, const T* x, const Rows& x_rows, T* dx,
                                const Rows& dx_rows, const Tables<Acc>& t, bool interleaved, const Acc* scale,
                                Acc eps, Acc* dw_partial, int64_t tasks) {
  const int64_t head_dim = d_rows.head_dim, rotary = t.rotary_dim, rows = d_rows.count();
  const int64_t per_task = (rows + tasks - 1) / tasks;
  check_tables(t, d_rows);
  at::parallel_for(0, tasks, 1, [&](int64_t first_task, int64_t last_task) {
    std::vector<Acc> d(head_dim), g(head_dim), xs(head_dim);
    for (int64_t task = first_task; task < last_task; ++task) {
      Acc* dw = dw_partial + task * head_dim;
      const int64_t end = std::min(rows, (task + 1) * per_task);
      for (int64_t row = task * per_task; row < end; ++row) {
        const T* dr = dout + d_rows.offset(row);
        const T* xr = x + x_rows.offset(row);
        T* dxr = dx + dx_rows.offset(row);
        for (int64_t j = 0; j < head_dim; ++j) {
          d[j] = static_cast<Acc>(dr[j]);
          xs[j] = static_cast<Acc>(xr[j]);
        }
        const int64_t tr = table_row(t, d_rows, row);
        rotate_row(d.data(), g.data(), t.cos + tr, t.sin + tr, rotary, interleaved);
        std::copy(d.begin() + rotary, d.end(), g.begin() + rotary);
        const Acc r = rstd_of(xs.data(), head_dim, eps);
        Acc products = 0;  // sum of g * scale * x_hat
        for (int64_t j = 0; j < head_dim; ++j) products += g[j] * scale[j] * (xs[j] * r);
        const Acc mean = products / static_cast<Acc>(head_dim);
        for (int64_t j = 0; j < head_dim; ++j) {
          const Acc x_hat = xs[j] * r;
          dxr[j] = static_cast<T>((g[j] * scale[j] - x_hat * mean) * r);
          dw[j] += g[j] * x_hat;
        }
      }
    }
  });
}

// weight + offset in the compute type.
template <typename Acc>
std::vector<Acc> norm_scale(const Tensor& weight, double offset) {
  const Tensor w = weight.to(c10::CppTypeToScalarType<Acc>::value).contiguous();
  const Acc* data = w.const_data_ptr<Acc>();
  std::vector<Acc> scale(w.numel());
  for (int64_t j = 0; j < w.numel(); ++j) scale[j] = data[j] + static_cast<Acc>(offset);
  return scale;
}

// Both q and k transposed views of memory laid out in the other layout: outputs follow them.
bool follows_other_layout(const Tensor& q, const Tensor& k) {
  return !(q.is_contiguous() && k.is_contiguous()) && q.transpose(1, 2).is_contiguous() &&
         k.transpose(1, 2).is_contiguous();
}

// Refuses another device's memory, naming the devices given.
void check_on_cpu(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK_VALUE(q.is_cpu() && k.is_cpu() && cos.is_cpu() && sin.is_cpu(),
                    "rope: q, k, cos and sin must be on the CPU, got ", q.device(), ", ", k.device(), ", ",
                    cos.device(), " and ", sin.device());
}

// Checks shared by both directions; whether rows are walked in the other layout's dims.
bool check_and_follow(const Tensor& q_in, const Tensor& k_in, const Tensor& cos, const Tensor& sin,
                      c10::string_view layout, const std::optional<Tensor>& q_weight,
                      const std::optional<Tensor>& k_weight) {
  TORCH_CHECK_VALUE(layout == "bhsd" || layout == "bshd", "rope: layout must be 'bhsd' or 'bshd', got '",
                    std::string(layout), "'");
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_in.dim() == 4, "rope: q and k must have 4 dims, got ", q_in.sizes(), " and ",
                    k_in.sizes());
  TORCH_CHECK_VALUE(q_in.scalar_type() == k_in.scalar_type(), "rope: k must have q's dtype");
  check_on_cpu(q_in, k_in, cos, sin);
  TORCH_CHECK_VALUE(given(q_weight) == given(k_weight), "rope: q_norm_weight and k_norm_weight come together");
  if (given(q_weight)) {
    for (const Tensor& w : {*q_weight, *k_weight}) {
      TORCH_CHECK_VALUE(w.is_cpu() && w.dim() == 1 && w.size(0) == q_in.size(3),
                        "rope: a norm weight must be [head_dim] on the CPU, got ", w.sizes(), " on ", w.device());
    }
  }
  return follows_other_layout(q_in, k_in);
}

// x viewed in memory order (the other layout's dims where `other`), its last dim dense.
Tensor in_memory_order(const Tensor& x, bool other) {
  const Tensor in_memory = other ? x.transpose(1, 2) : x;
  return in_memory.stride(-1) == 1 ? in_memory : in_memory.contiguous();
}

std::tuple<Tensor, Tensor> rope_forward(const Tensor& q_in, const Tensor& k_in, const Tensor& cos, const Tensor& sin,
                                        bool interleaved, c10::string_view layout,
                                        const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight,
                                        double eps, double offset) {
  // Rows are walked in memory order: in the other layout's dims where q and k follow it.
  const bool other = check_and_follow(q_in, k_in, cos, sin, layout, q_weight, k_weight);
  const bool seq_is_d2 = (layout == "bhsd") != other;
  std::vector<Tensor> outputs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q_in.scalar_type(), "te_lab::rope.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const Tables<Acc> tables = tables_of<Acc>(cos, sin, interleaved, false);
    for (int index = 0; index < 2; ++index) {
      const Tensor x = in_memory_order(index == 0 ? q_in : k_in, other);
      Tensor out = at::empty(x.sizes(), x.options());
      if (given(q_weight)) {
        const std::vector<Acc> scale = norm_scale<Acc>(index == 0 ? *q_weight : *k_weight, offset);
        normalize_rotate_rows<scalar_t, Acc>(x.const_data_ptr<scalar_t>(), rows_of(x, seq_is_d2),
                                             out.mutable_data_ptr<scalar_t>(), rows_of(out, seq_is_d2), tables,
                                             interleaved, scale.data(), static_cast<Acc>(eps));
      } else {
        rotate_rows<scalar_t, Acc>(x.const_data_ptr<scalar_t>(), rows_of(x, seq_is_d2),
                                   out.mutable_data_ptr<scalar_t>(), rows_of(out, seq_is_d2), tables, interleaved);
      }
      outputs.push_back(other ? out.transpose(1, 2) : out);
    }
  });
  return {outputs[0], outputs[1]};
}

// (dq, dk, dq_weight, dk_weight); the weights' gradients are empty without norm weights.
std::tuple<Tensor, Tensor, Tensor, Tensor> rope_backward(
    const Tensor& dq_in, const Tensor& dk_in, const Tensor& cos, const Tensor& sin, bool interleaved,
    c10::string_view layout, const std::optional<Tensor>& q_saved, const std::optional<Tensor>& k_saved,
    const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight, double eps, double offset) {
  const bool other = check_and_follow(dq_in, dk_in, cos, sin, layout, q_weight, k_weight);
  const bool normalized = given(q_weight);
  TORCH_CHECK_VALUE(!normalized || (given(q_saved) && given(k_saved)),
                    "rope: the backward of QK-norm needs the forward's q and k");
  const bool seq_is_d2 = (layout == "bhsd") != other;
  std::vector<Tensor> outputs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dq_in.scalar_type(), "te_lab::rope_backward.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const Tables<Acc> tables = tables_of<Acc>(cos, sin, interleaved, true);
    std::vector<Tensor> weight_grads;
    for (int index = 0; index < 2; ++index) {
      const Tensor d = in_memory_order(index == 0 ? dq_in : dk_in, other);
      Tensor dx = at::empty(d.sizes(), d.options());
      if (normalized) {
        const Tensor& weight = index == 0 ? *q_weight : *k_weight;
        const Tensor x = in_memory_order(index == 0 ? *q_saved : *k_saved, other);
        TORCH_CHECK_VALUE(x.sizes() == d.sizes(), "rope: the saved input has shape ", x.sizes(),
                          "; expected its gradient's ", d.sizes());
        const std::vector<Acc> scale = norm_scale<Acc>(weight, offset);
        const int64_t head_dim = d.size(3), rows = d.numel() / std::max<int64_t>(head_dim, 1);
        const int64_t tasks = partial_sum_tasks(rows, head_dim);
        Tensor partial = at::zeros({tasks, head_dim}, d.options().dtype(c10::CppTypeToScalarType<Acc>::value));
        normalize_rotate_back_rows<scalar_t, Acc>(
            d.const_data_ptr<scalar_t>(), rows_of(d, seq_is_d2), x.const_data_ptr<scalar_t>(), rows_of(x, seq_is_d2),
            dx.mutable_data_ptr<scalar_t>(), rows_of(dx, seq_is_d2), tables, interleaved, scale.data(),
            static_cast<Acc>(eps), partial.mutable_data_ptr<Acc>(), tasks);
        weight_grads.push_back((tasks == 1 ? partial.select(0, 0) : partial.sum(0)).to(weight.scalar_type()));
      } else {
        rotate_rows<scalar_t, Acc>(d.const_data_ptr<scalar_t>(), rows_of(d, seq_is_d2), dx.mutable_data_ptr<scalar_t>(),
                                   rows_of(dx, seq_is_d2), tables, interleaved);
        weight_grads.push_back(at::empty({0}, d.options()));
      }
      outputs.push_back(other ? dx.transpose(1, 2) : dx);
    }
    outputs.insert(outputs.end(), weight_grads.begin(), weight_grads.end());
  });
  return {outputs[0], outputs[1], outputs[2], outputs[3]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> call_backward(
    const Tensor& dq, const Tensor& dk, const Tensor& cos, const Tensor& sin, bool interleaved,
    c10::string_view layout, const std::optional<Tensor>& q, const std::optional<Tensor>& k,
    const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight, double eps, double offset) {
  static const auto op = cpp_overload<decltype(rope_backward)>("te_lab::rope_backward");
  return op.call(dq, dk, cos, sin, interleaved, layout, q, k, q_weight, k_weight, eps, offset);
}

std::optional<Tensor> optional_of(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, bool interleaved, c10::string_view layout,
                               const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight,
                               double eps, double offset, c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::rope.cpp.
    static const auto op = cpp_overload<decltype(rope_forward)>("te_lab::rope");
    auto [q_out, k_out] = op.redispatch(keys_below_autograd(keys), q, k, cos, sin, interleaved, layout, q_weight,
                                        k_weight, eps, offset);
    // QK-norm's backward recomputes each row's rstd from q and k themselves.
    if (given(q_weight)) {
      ctx->save_for_backward({cos, sin, q, k, *q_weight, *k_weight});
    } else {
      ctx->save_for_backward({cos, sin});
    }
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["layout"] = std::string(layout);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["offset"] = offset;
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool normalized = saved.size() == 6;
    const auto norm_input = [&](size_t i) { return normalized ? optional_of(saved[i]) : std::nullopt; };
    auto [dq, dk, dq_weight, dk_weight] =
        call_backward(grads[0], grads[1], saved[0], saved[1], ctx->saved_data["interleaved"].toBool(),
                      ctx->saved_data["layout"].toStringRef(), norm_input(2), norm_input(3), norm_input(4),
                      norm_input(5), ctx->saved_data["eps"].toDouble(), ctx->saved_data["offset"].toDouble());
    // cos and sin are constants of the model (functions of positions), never trained.
    return {dq,       dk,       Tensor(),
            Tensor(), Tensor(), Tensor(),
            normalized ? dq_weight : Tensor(), normalized ? dk_weight : Tensor(), Tensor(),
            Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> rope_autograd(c10::DispatchKeySet keys, const Tensor& q, const Tensor& k, const Tensor& cos,
                                         const Tensor& sin, bool interleaved, c10::string_view layout,
                                         const std::optional<Tensor>& q_weight, const std::optional<Tensor>& k_weight,
                                         double eps, double offset) {
  check_on_cpu(q, k, cos, sin);  // before the redispatch, which would pick another device's kernel
  auto outputs = RopeFunction::apply(q, k, cos, sin, interleaved, layout, q_weight, k_weight, eps, offset, keys);
  return {outputs[0], outputs[1]};
}

}  // namespace

// The schemas are kernels/rope.py's (define_op), less `backend`.
TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("rope.cpp", &rope_forward);
  m.impl("rope_backward.cpp", &rope_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("rope.cpp", &rope_autograd); }

}  // namespace te_lab_cpu
