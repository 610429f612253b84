// The activations te_lab's C++ kernels apply (gated MLPs, bias + activation), on
// at::vec::Vectorized, with their derivatives clamped as kernels/activations.py states:
// no subnormal gradients.

#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "rows.h"

namespace te_lab_cpu {

enum class Activation { gelu, gelu_tanh, silu };

inline Activation activation_named(const std::string& name) {
  if (name == "silu") return Activation::silu;
  if (name == "gelu") return Activation::gelu;
  if (name == "gelu_tanh") return Activation::gelu_tanh;
  TORCH_CHECK_VALUE(false, "activation must be 'gelu', 'gelu_tanh' or 'silu', got '", name, "'");
}

constexpr double kSqrtHalf = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kTanhScale = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kTanhCubic = 0.044715;
constexpr double kPdfClamp = 10.0;        // activations.py's _PDF_CLAMP: no subnormal gradients
constexpr double kSigmoidFloor = -80.0;   // activations.py's _SIGMOID_FLOOR

template <typename Acc>
Vec<Acc> sigmoid(const Vec<Acc>& x) {
  return Vec<Acc>(Acc(1)) / (Vec<Acc>(Acc(1)) + x.neg().exp());
}

template <typename Acc>
Vec<Acc> tanh_gelu_inner(const Vec<Acc>& x) {
  return (Vec<Acc>(Acc(kTanhScale)) * (x + Vec<Acc>(Acc(kTanhCubic)) * x * x * x)).tanh();
}

template <typename Acc>
Vec<Acc> activate(Activation activation, const Vec<Acc>& x) {
  using V = Vec<Acc>;
  switch (activation) {
    case Activation::silu: return x * sigmoid(x);
    case Activation::gelu: return V(Acc(0.5)) * x * (V(Acc(1)) + (x * V(Acc(kSqrtHalf))).erf());
    case Activation::gelu_tanh: return V(Acc(0.5)) * x * (V(Acc(1)) + tanh_gelu_inner(x));
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
      const V cdf = half * (one + (x * V(Acc(kSqrtHalf))).erf());
      const V bounded = at::vec::minimum(at::vec::maximum(x, V(Acc(-kPdfClamp))), V(Acc(kPdfClamp)));
      return {x * cdf, cdf + bounded * (V(Acc(-0.5)) * bounded * bounded).exp() * V(Acc(kInvSqrt2Pi))};
    }
    case Activation::gelu_tanh: {
      const V t = tanh_gelu_inner(x);
      const V grad = half * (one + t) +
                     half * x * (one - t * t) * V(Acc(kTanhScale)) * (one + V(Acc(3 * kTanhCubic)) * x * x);
      return {half * x * (one + t), grad};
    }
  }
  return {x, one};
}

}  // namespace te_lab_cpu
