// Row blocks in the compute dtype: what te_lab's C++ CPU kernels share. A row of T
// (float, double, bfloat16, half) is processed in blocks of up to BLOCK elements, read in
// the compute type Acc (float; double for double): in place where T is Acc, else
// converted into a buffer on the stack (and results converted back), and the math runs on at::vec::Vectorized<Acc>, which is AVX2 or AVX-512 code where the
// library was built for it (kernels/cpu_kernels.py passes torch's CPU capability).

#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

namespace te_lab_cpu {

constexpr int64_t BLOCK = 512;

template <typename Acc>
using Vec = at::vec::Vectorized<Acc>;

// Rows per parallel task: about 16K elements, so that small inputs stay on one thread.
inline int64_t rows_per_task(int64_t n_cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n_cols, 1)); }

// Tasks of a backward that sums its rows into one partial row per task (a weight's or a
// bias's gradient): one per thread at most, each of at least rows_per_task rows.
inline int64_t partial_sum_tasks(int64_t rows, int64_t n_cols) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / rows_per_task(n_cols)));
}

// Whether an optional tensor argument was given.
inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The dtype the math runs in: float64 for float64 inputs, else float32.
inline at::ScalarType compute_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

// count elements of src in the compute type: src itself where T is it, else converted
// into buffer.
template <typename T, typename Acc>
inline const Acc* load_block(const T* src, Acc* buffer, int64_t count) {
  if constexpr (std::is_same_v<T, Acc>) {
    return src;
  } else {
    for (int64_t j = 0; j < count; ++j) buffer[j] = static_cast<Acc>(src[j]);
    return buffer;
  }
}

// Where to write count results bound for dst: dst itself where T is the compute type, else
// buffer, which store_block then converts into dst.
template <typename T, typename Acc>
inline Acc* output_block(T* dst, Acc* buffer) {
  if constexpr (std::is_same_v<T, Acc>) {
    return dst;
  } else {
    return buffer;
  }
}

template <typename T, typename Acc>
inline void store_block(const Acc* results, T* dst, int64_t count) {
  if constexpr (!std::is_same_v<T, Acc>) {
    for (int64_t j = 0; j < count; ++j) dst[j] = static_cast<T>(results[j]);
  }
}

// f(offset, count) over [0, count) in steps of one vector; the last step may be partial
// (Vec::loadu(ptr, count) pads with zeros, store(ptr, count) writes count elements).
template <typename Acc, typename F>
inline void for_each_vector(int64_t count, const F& f) {
  constexpr int64_t step = Vec<Acc>::size();
  int64_t j = 0;
  for (; j + step <= count; j += step) f(j, step);
  if (j < count) f(j, count - j);
}

// Whether V has exp_u20, ATen's inline exponential within 20 ULP (newer torch versions).
template <typename V, typename = void>
struct has_exp_u20 : std::false_type {};
template <typename V>
struct has_exp_u20<V, std::void_t<decltype(std::declval<const V&>().exp_u20())>> : std::true_type {};

// exp in the kernels' inner loops. In float32 ATen's inline exponential: Vectorized::exp is a
// call into Sleef per vector, which on the AVX-512 CPU made an erf-based GELU 1.4x slower
// than with the inline one; its 20 ULP (1.2e-6 relative) are below float32 kernels'
// tolerances. float64 keeps the accurate one (gradcheck runs in it).
template <typename Acc>
Vec<Acc> exp_of(const Vec<Acc>& x) {
  if constexpr (std::is_same_v<Acc, float> && has_exp_u20<Vec<Acc>>::value) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

template <typename Acc>
inline Acc sum_of(const Vec<Acc>& partial) {
  return at::vec::vec_reduce_all<Acc>([](Vec<Acc>& a, Vec<Acc>& b) { return a + b; }, partial);
}

}  // namespace te_lab_cpu
