// Internal: the kernel bodies, compiled once per instruction set.
//
// A translation unit defines NONSTOP_OPTIM_ISA_NS (a namespace name),
// NONSTOP_OPTIM_ISA_NAME (a string) and NONSTOP_OPTIM_TABLE_FN (the function
// that returns its KernelTable), then includes this file. It must be compiled
// with -ffp-contract=off (no fusion the source does not ask for) and
// -fno-math-errno (so std::sqrt vectorises; it does not change results).
//
// Per element, the arithmetic below is torch 2.13's, op by op:
//
//   AdamW / Adam (torch/optim/adam.py, _single_tensor_adam):
//     param.mul_(1 - lr*wd)                  p = p * decay            [decoupled]
//     grad = grad.add(param, alpha=wd)       g = fma(p, wd, g)        [L2; ufunc add is fmadd]
//     exp_avg.lerp_(grad, 1-beta1)           m = fma(w, g-m, m)       [|w| < 0.5]
//                                            m = fma(w-1, g-m, g)     [|w| >= 0.5]
//     (1.x: exp_avg.mul_(b1).add_(g, 1-b1))  m = fma(g, 1-b1, m*b1)
//     exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2)
//                                            v = fma((1-b2)*g, g, v*b2)
//     torch.maximum(vmax, v, out=vmax)       [amsgrad]
//     denom = (v.sqrt() / bc2_sqrt).add_(eps)   [sqrt: see nonstop/optim.h on MKL]
//     param.addcdiv_(m, denom, value=-step_size)
//                                            p = p + (-step_size*m) / denom
//   SGD (torch/optim/sgd.py, _single_tensor_sgd):
//     grad.add(param, alpha=wd)              g = fma(p, wd, g)
//     buf = grad.clone() | buf.mul_(mom).add_(grad, alpha=1-damp)
//                                            b = g | b = fma(g, 1-damp, b*mom)
//     grad.add(buf, alpha=mom) [nesterov]    g = fma(b, mom, g)
//     param.add_(grad, alpha=-lr)            p = fma(g, -lr, p)
#ifndef NONSTOP_OPTIM_ISA_NS
#error "define NONSTOP_OPTIM_ISA_NS before including kernels_impl.h"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "optim/kernels.h"

namespace nonstop::optim::internal {
namespace NONSTOP_OPTIM_ISA_NS {
namespace {

// torch.maximum(a, b): NaN if either is NaN, else the larger; for equal
// values (+0 / -0) the second operand, as the vectorised kernel (vmaxps) does.
inline float TorchMaximum(float a, float b) {
  if (a != a) return a;
  return a > b ? a : b;
}

// kMomentsOnly: stop after the moments (the sqrt and the update follow in
// AdamApply, for an external sqrt).
template <WeightDecay kWd, MomentRule kMoment, bool kAmsgrad, bool kMaximize, bool kMomentsOnly>
void AdamBody(const AdamCoeffs& c, const float* __restrict grad, float* __restrict param,
              float* __restrict exp_avg, float* __restrict exp_avg_sq,
              float* __restrict max_exp_avg_sq, size_t n) {
  const float decay = c.decay;
  const float wd = c.wd;
  const float w = c.lerp_weight;
  const float w_minus_one = c.lerp_weight - 1.0f;
  const float beta1 = c.beta1;
  const float one_minus_beta1 = c.one_minus_beta1;
  const float beta2 = c.beta2;
  const float one_minus_beta2 = c.one_minus_beta2;
  const float bc2_sqrt = c.bias_correction2_sqrt;
  const float eps = c.eps;
  const float neg_step_size = c.neg_step_size;
  for (size_t i = 0; i < n; ++i) {
    float p = param[i];
    if constexpr (kWd == WeightDecay::kDecoupled) p = p * decay;
    float g = grad[i];
    if constexpr (kMaximize) g = -g;
    if constexpr (kWd == WeightDecay::kL2) g = std::fma(p, wd, g);
    float m = exp_avg[i];
    if constexpr (kMoment == MomentRule::kLerpSmall) {
      m = std::fma(w, g - m, m);
    } else if constexpr (kMoment == MomentRule::kLerpLarge) {
      m = std::fma(w_minus_one, g - m, g);
    } else {
      m = std::fma(g, one_minus_beta1, m * beta1);
    }
    exp_avg[i] = m;
    float v = std::fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2);
    exp_avg_sq[i] = v;
    if constexpr (kAmsgrad) {
      v = TorchMaximum(max_exp_avg_sq[i], v);
      max_exp_avg_sq[i] = v;
    }
    if constexpr (kMomentsOnly) {
      param[i] = p;
      continue;
    }
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    param[i] = p + (neg_step_size * m) / denom;
  }
}

template <WeightDecay kWd, MomentRule kMoment, bool kAmsgrad, bool kMaximize>
void AdamLoop(const AdamCoeffs& c, const float* grad, float* param, float* exp_avg,
              float* exp_avg_sq, float* max_exp_avg_sq, size_t n) {
  AdamBody<kWd, kMoment, kAmsgrad, kMaximize, false>(c, grad, param, exp_avg, exp_avg_sq,
                                                     max_exp_avg_sq, n);
}

template <WeightDecay kWd, MomentRule kMoment, bool kAmsgrad, bool kMaximize>
void AdamMomentsLoop(const AdamCoeffs& c, const float* grad, float* param, float* exp_avg,
                     float* exp_avg_sq, float* max_exp_avg_sq, size_t n) {
  AdamBody<kWd, kMoment, kAmsgrad, kMaximize, true>(c, grad, param, exp_avg, exp_avg_sq,
                                                    max_exp_avg_sq, n);
}

void AdamApply(const AdamCoeffs& c, const float* __restrict sqrt_v,
               const float* __restrict exp_avg, float* __restrict param, size_t n) {
  const float bc2_sqrt = c.bias_correction2_sqrt;
  const float eps = c.eps;
  const float neg_step_size = c.neg_step_size;
  for (size_t i = 0; i < n; ++i) {
    const float denom = sqrt_v[i] / bc2_sqrt + eps;
    param[i] = param[i] + (neg_step_size * exp_avg[i]) / denom;
  }
}

template <bool kWd, SgdMomentum kMomentum, bool kNesterov, bool kMaximize>
void SgdLoop(const SgdCoeffs& c, const float* __restrict grad, float* __restrict param,
             float* __restrict momentum_buffer, size_t n) {
  const float wd = c.wd;
  const float momentum = c.momentum;
  const float one_minus_dampening = c.one_minus_dampening;
  const float neg_lr = c.neg_lr;
  for (size_t i = 0; i < n; ++i) {
    const float p = param[i];
    float g = grad[i];
    if constexpr (kMaximize) g = -g;
    if constexpr (kWd) g = std::fma(p, wd, g);
    if constexpr (kMomentum != SgdMomentum::kNone) {
      float b;
      if constexpr (kMomentum == SgdMomentum::kInit) {
        b = g;
      } else {
        b = std::fma(g, one_minus_dampening, momentum_buffer[i] * momentum);
      }
      momentum_buffer[i] = b;
      if constexpr (kNesterov) {
        g = std::fma(b, momentum, g);
      } else {
        g = b;
      }
    }
    param[i] = std::fma(g, neg_lr, p);
  }
}

template <bool kMomentsOnly, WeightDecay kWd, MomentRule kMoment, bool kAmsgrad>
AdamFn PickAdamMaximize(bool maximize) {
  if constexpr (kMomentsOnly) {
    return maximize ? &AdamMomentsLoop<kWd, kMoment, kAmsgrad, true>
                    : &AdamMomentsLoop<kWd, kMoment, kAmsgrad, false>;
  } else {
    return maximize ? &AdamLoop<kWd, kMoment, kAmsgrad, true>
                    : &AdamLoop<kWd, kMoment, kAmsgrad, false>;
  }
}

template <bool kMomentsOnly, WeightDecay kWd, MomentRule kMoment>
AdamFn PickAdamAmsgrad(const AdamCoeffs& c) {
  return c.amsgrad ? PickAdamMaximize<kMomentsOnly, kWd, kMoment, true>(c.maximize)
                   : PickAdamMaximize<kMomentsOnly, kWd, kMoment, false>(c.maximize);
}

template <bool kMomentsOnly, WeightDecay kWd>
AdamFn PickAdamMoment(const AdamCoeffs& c) {
  switch (c.moment) {
    case MomentRule::kLerpSmall:
      return PickAdamAmsgrad<kMomentsOnly, kWd, MomentRule::kLerpSmall>(c);
    case MomentRule::kLerpLarge:
      return PickAdamAmsgrad<kMomentsOnly, kWd, MomentRule::kLerpLarge>(c);
    case MomentRule::kMulAdd:
      break;
  }
  return PickAdamAmsgrad<kMomentsOnly, kWd, MomentRule::kMulAdd>(c);
}

template <bool kMomentsOnly>
AdamFn PickAdam(const AdamCoeffs& c) {
  switch (c.weight_decay) {
    case WeightDecay::kNone:
      return PickAdamMoment<kMomentsOnly, WeightDecay::kNone>(c);
    case WeightDecay::kL2:
      return PickAdamMoment<kMomentsOnly, WeightDecay::kL2>(c);
    case WeightDecay::kDecoupled:
      break;
  }
  return PickAdamMoment<kMomentsOnly, WeightDecay::kDecoupled>(c);
}

void Adam(const AdamCoeffs& c, const float* grad, float* param, float* exp_avg,
          float* exp_avg_sq, float* max_exp_avg_sq, size_t n) {
  PickAdam<false>(c)(c, grad, param, exp_avg, exp_avg_sq, max_exp_avg_sq, n);
}

void AdamMoments(const AdamCoeffs& c, const float* grad, float* param, float* exp_avg,
                 float* exp_avg_sq, float* max_exp_avg_sq, size_t n) {
  PickAdam<true>(c)(c, grad, param, exp_avg, exp_avg_sq, max_exp_avg_sq, n);
}

template <bool kWd, SgdMomentum kMomentum, bool kNesterov>
SgdFn PickSgdMaximize(bool maximize) {
  return maximize ? &SgdLoop<kWd, kMomentum, kNesterov, true>
                  : &SgdLoop<kWd, kMomentum, kNesterov, false>;
}

template <bool kWd, SgdMomentum kMomentum>
SgdFn PickSgdNesterov(const SgdCoeffs& c) {
  return c.nesterov ? PickSgdMaximize<kWd, kMomentum, true>(c.maximize)
                    : PickSgdMaximize<kWd, kMomentum, false>(c.maximize);
}

template <bool kWd>
SgdFn PickSgdMomentum(const SgdCoeffs& c) {
  switch (c.momentum_rule) {
    case SgdMomentum::kNone:
      return PickSgdMaximize<kWd, SgdMomentum::kNone, false>(c.maximize);
    case SgdMomentum::kInit:
      return PickSgdNesterov<kWd, SgdMomentum::kInit>(c);
    case SgdMomentum::kUpdate:
      break;
  }
  return PickSgdNesterov<kWd, SgdMomentum::kUpdate>(c);
}

void Sgd(const SgdCoeffs& c, const float* grad, float* param, float* momentum_buffer, size_t n) {
  SgdFn fn = c.weight_decay ? PickSgdMomentum<true>(c) : PickSgdMomentum<false>(c);
  fn(c, grad, param, momentum_buffer, n);
}

// Exact conversions: every bf16 and fp16 value is representable in fp32.
void Upcast(const uint16_t* __restrict src, DType dtype, float* __restrict dst, size_t n) {
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      dst[i] = f;
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const uint32_t h = src[i];
    const uint32_t sign = (h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {  // inf, NaN (payload kept)
      bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {  // normal
      bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa * 2^-24, exact
      const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
      uint32_t mbits;
      std::memcpy(&mbits, &magnitude, sizeof mbits);
      bits = sign | mbits;
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    dst[i] = f;
  }
}

}  // namespace
}  // namespace NONSTOP_OPTIM_ISA_NS

KernelTable NONSTOP_OPTIM_TABLE_FN() {
  return KernelTable{&NONSTOP_OPTIM_ISA_NS::Adam,   &NONSTOP_OPTIM_ISA_NS::AdamMoments,
                     &NONSTOP_OPTIM_ISA_NS::AdamApply, &NONSTOP_OPTIM_ISA_NS::Sgd,
                     &NONSTOP_OPTIM_ISA_NS::Upcast, NONSTOP_OPTIM_ISA_NAME};
}

}  // namespace nonstop::optim::internal
