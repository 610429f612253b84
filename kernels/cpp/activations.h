// The activations te_lab's C++ kernels apply (gated MLPs, bias + activation), on
// at::vec::Vectorized, with their derivatives clamped as kernels/activations.py states:
// no subnormal gradients.

#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "rows.h"

namespace te_lab_cpu {

enum class Activation { gelu, gelu_tanh, silu, relu_squared };

inline Activation activation_named(const std::string& name) {
  if (name == "silu") return Activation::silu;
  if (name == "gelu") return Activation::gelu;
  if (name == "gelu_tanh") return Activation::gelu_tanh;
  if (name == "relu_squared") return Activation::relu_squared;
  TORCH_CHECK_VALUE(false, "activation must be 'gelu', 'gelu_tanh', 'silu' or 'relu_squared', got '", name, "'");
}

constexpr double kSqrtHalf = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kTanhScale = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kTanhCubic = 0.044715;
constexpr double kPdfClamp = 10.0;        // activations.py's _PDF_CLAMP: no subnormal gradients
constexpr double kSigmoidFloor = -80.0;   // activations.py's _SIGMOID_FLOOR

// erf, in float32 from Abramowitz and Stegun's formula 7.1.26 (absolute error below
// 1.5e-7: what Vectorized::erf computes, with exp_of's exponential); float64 keeps
// Vectorized::erf.
template <typename Acc>
Vec<Acc> erf_of(const Vec<Acc>& x) {
  using V = Vec<Acc>;
  if constexpr (std::is_same_v<Acc, float>) {
    const V a = x.abs();
    const V t = V(1.f) / (V(0.3275911f) * a + V(1.f));
    const V poly = (((V(1.061405429f) * t + V(-1.453152027f)) * t + V(1.421413741f)) * t + V(-0.284496736f)) * t +
                   V(0.254829592f);
    const V magnitude = V(1.f) - poly * t * exp_of<Acc>((a * a).neg());
    return V::blendv(magnitude, magnitude.neg(), x < V(0.f));
  } else {
    return x.erf();
  }
}

template <typename Acc>
Vec<Acc> sigmoid(const Vec<Acc>& x) {
  return Vec<Acc>(Acc(1)) / (Vec<Acc>(Acc(1)) + exp_of<Acc>(x.neg()));
}

// tanh, in float32 as 2 / (1 + exp(-2x)) - 1 on exp_of's exponential (absolute error
// about 1e-7, what the GELU it serves needs); float64 keeps Vectorized::tanh.
template <typename Acc>
Vec<Acc> tanh_of(const Vec<Acc>& x) {
  using V = Vec<Acc>;
  if constexpr (std::is_same_v<Acc, float>) {
    return V(2.f) / (V(1.f) + exp_of<Acc>(x * V(-2.f))) - V(1.f);
  } else {
    return x.tanh();
  }
}

template <typename Acc>
Vec<Acc> tanh_gelu_inner(const Vec<Acc>& x) {
  return tanh_of<Acc>(Vec<Acc>(Acc(kTanhScale)) * (x + Vec<Acc>(Acc(kTanhCubic)) * x * x * x));
}

template <typename Acc>
Vec<Acc> activate(Activation activation, const Vec<Acc>& x) {
  using V = Vec<Acc>;
  switch (activation) {
    case Activation::silu: return x * sigmoid(x);
    case Activation::gelu: return V(Acc(0.5)) * x * (V(Acc(1)) + erf_of<Acc>(x * V(Acc(kSqrtHalf))));
    case Activation::gelu_tanh: return V(Acc(0.5)) * x * (V(Acc(1)) + tanh_gelu_inner(x));
    case Activation::relu_squared: {
      const V positive = at::vec::maximum(x, V(Acc(0)));
      return positive * positive;
    }
  }
  return x;
}

// (act(x), act'(x)) from one evaluation of the shared terms.
template <typename Acc>
std::pair<Vec<Acc>, Vec<Acc>> activate_with_grad(Activation activation, const Vec<Acc>& x) {
  using V = Vec<Acc>;
  const V one(Acc(1)), half(Acc(0.5));
  switch (activation) {
    case Activation::silu: {
      const V sig = sigmoid(at::vec::maximum(x, V(Acc(kSigmoidFloor))));
      return {x * sig, sig * (one + x * (one - sig))};
    }
    case Activation::gelu: {
      const V cdf = half * (one + erf_of<Acc>(x * V(Acc(kSqrtHalf))));
      const V bounded = at::vec::minimum(at::vec::maximum(x, V(Acc(-kPdfClamp))), V(Acc(kPdfClamp)));
      return {x * cdf, cdf + bounded * exp_of<Acc>(V(Acc(-0.5)) * bounded * bounded) * V(Acc(kInvSqrt2Pi))};
    }
    case Activation::gelu_tanh: {
      const V t = tanh_gelu_inner(x);
      const V grad = half * (one + t) +
                     half * x * (one - t * t) * V(Acc(kTanhScale)) * (one + V(Acc(3 * kTanhCubic)) * x * x);
      return {half * x * (one + t), grad};
    }
    case Activation::relu_squared: {
      const V positive = at::vec::maximum(x, V(Acc(0)));
      return {positive * positive, V(Acc(2)) * positive};
    }
  }
  return {x, one};
}

}  // namespace te_lab_cpu
