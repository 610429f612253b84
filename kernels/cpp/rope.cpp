// te_lab::rope.cpp and te_lab::rope_backward.cpp: rotary position embedding of q and k
// on the CPU, one pass per direction, with the autograd formula in C++ (kernels/rope.py
// states the math: the backward is the forward with each pair's sin entries swapped and
// negated, and cos and sin get no gradient).
//
// q and k may have any strides. Outputs are laid out as the Python op lays them out: like
// q and k where both are transposed views of memory in the other layout (Hugging Face's
// projections), else contiguous.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

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

template <typename T, typename Acc>
void rotate_rows(const T* x, const Rows& in, T* out, const Rows& to, const Tables<Acc>& t, bool interleaved) {
  using V = Vec<Acc>;
  const int64_t rotary = t.rotary_dim, half = rotary / 2, head_dim = in.head_dim;
  TORCH_CHECK_VALUE(in.seq_is_d2 ? in.d2 == t.seq : in.d1 == t.seq, "rope: cos has seq ", t.seq,
                    "; expected the seq of q and k");
  TORCH_CHECK_VALUE(t.batch == 1 || t.batch == in.batch, "rope: cos has batch ", t.batch, "; expected 1 or ",
                    in.batch);
  TORCH_CHECK_VALUE(rotary <= head_dim, "rope: rotary_dim ", rotary, " exceeds head_dim ", head_dim);
  at::parallel_for(0, in.count(), rows_per_task(head_dim), [&](int64_t begin, int64_t end) {
    Acc a_buf[BLOCK], b_buf[BLOCK], first_buf[BLOCK], second_buf[BLOCK];
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + in.offset(row);
      T* outr = out + to.offset(row);
      const int64_t table_row = ((t.batch == 1 ? 0 : in.batch_of(row)) * t.seq + in.seq_of(row)) * rotary;
      const Acc* c = t.cos + table_row;
      const Acc* s = t.sin + table_row;
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

std::tuple<Tensor, Tensor> rotate(const Tensor& q_in, const Tensor& k_in, const Tensor& cos, const Tensor& sin,
                                  bool interleaved, c10::string_view layout, bool transposed) {
  TORCH_CHECK_VALUE(layout == "bhsd" || layout == "bshd", "rope: layout must be 'bhsd' or 'bshd', got '",
                    std::string(layout), "'");
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_in.dim() == 4, "rope: q and k must have 4 dims, got ", q_in.sizes(), " and ",
                    k_in.sizes());
  TORCH_CHECK_VALUE(q_in.scalar_type() == k_in.scalar_type(), "rope: k must have q's dtype");
  check_on_cpu(q_in, k_in, cos, sin);
  // Rows are walked in memory order: in the other layout's dims where q and k follow it.
  const bool other = follows_other_layout(q_in, k_in);
  const bool seq_is_d2 = (layout == "bhsd") != other;
  std::vector<Tensor> outputs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q_in.scalar_type(), "te_lab::rope.cpp", [&] {
    using Acc = at::opmath_type<scalar_t>;
    const Tables<Acc> tables = tables_of<Acc>(cos, sin, interleaved, transposed);
    for (const Tensor& x_in : {q_in, k_in}) {
      const Tensor in_memory = other ? x_in.transpose(1, 2) : x_in;
      const Tensor x = in_memory.stride(-1) == 1 ? in_memory : in_memory.contiguous();
      Tensor out = at::empty(x.sizes(), x.options());
      rotate_rows<scalar_t, Acc>(x.const_data_ptr<scalar_t>(), rows_of(x, seq_is_d2), out.mutable_data_ptr<scalar_t>(),
                                 rows_of(out, seq_is_d2), tables, interleaved);
      outputs.push_back(other ? out.transpose(1, 2) : out);
    }
  });
  return {outputs[0], outputs[1]};
}

std::tuple<Tensor, Tensor> rope_forward(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                        bool interleaved, c10::string_view layout) {
  return rotate(q, k, cos, sin, interleaved, layout, false);
}

std::tuple<Tensor, Tensor> rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& cos, const Tensor& sin,
                                         bool interleaved, c10::string_view layout) {
  return rotate(dq, dk, cos, sin, interleaved, layout, true);
}

std::tuple<Tensor, Tensor> call_backward(const Tensor& dq, const Tensor& dk, const Tensor& cos, const Tensor& sin,
                                         bool interleaved, c10::string_view layout) {
  static const auto op = cpp_overload<decltype(rope_backward)>("te_lab::rope_backward");
  return op.call(dq, dk, cos, sin, interleaved, layout);
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, bool interleaved, c10::string_view layout,
                               c10::DispatchKeySet keys) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Below autograd, redispatched (dispatched.h): dispatch modes see te_lab::rope.cpp.
    static const auto op = cpp_overload<decltype(rope_forward)>("te_lab::rope");
    auto [q_out, k_out] = op.redispatch(keys_below_autograd(keys), q, k, cos, sin, interleaved, layout);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["layout"] = std::string(layout);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dq, dk] = call_backward(grads[0], grads[1], saved[0], saved[1], ctx->saved_data["interleaved"].toBool(),
                                  ctx->saved_data["layout"].toStringRef());
    // cos and sin are constants of the model (functions of positions), never trained.
    return {dq, dk, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> rope_autograd(c10::DispatchKeySet keys, const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                         bool interleaved, c10::string_view layout) {
  check_on_cpu(q, k, cos, sin);  // before the redispatch, which would pick another device's kernel
  auto outputs = RopeFunction::apply(q, k, cos, sin, interleaved, layout, keys);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(te_lab, m) {
  m.def("rope.cpp(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, str layout) -> (Tensor, Tensor)");
  m.def("rope_backward.cpp(Tensor dq, Tensor dk, Tensor cos, Tensor sin, bool interleaved, str layout)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(te_lab, CPU, m) {
  m.impl("rope.cpp", &rope_forward);
  m.impl("rope_backward.cpp", &rope_backward);
}

TORCH_LIBRARY_IMPL(te_lab, Autograd, m) { m.impl("rope.cpp", &rope_autograd); }

}  // namespace te_lab_cpu
