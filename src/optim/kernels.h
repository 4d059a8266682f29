// Internal: the per-step optimizer kernels behind nonstop/optim.h.
//
// Every kernel is a plain loop over elements [0, n) whose per-element
// arithmetic is written out to match ATen's CPU kernels operation for
// operation. The loops are compiled with -ffp-contract=off, so the compiler
// fuses nothing on its own; std::fma appears exactly where ATen fuses. Since
// each element's arithmetic is the same however the loop is vectorised or
// split, any split of the range (threads, cache blocks) gives identical bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "nonstop/types.h"

namespace nonstop::optim::internal {

enum class WeightDecay : uint8_t { kNone = 0, kL2 = 1, kDecoupled = 2 };
enum class MomentRule : uint8_t { kLerpSmall = 0, kLerpLarge = 1, kMulAdd = 2 };
enum class SgdMomentum : uint8_t { kNone = 0, kInit = 1, kUpdate = 2 };

// Float constants of one Adam/AdamW step, rounded from Python doubles as
// torch rounds them when it wraps a Python scalar for an fp32 tensor.
struct AdamCoeffs {
  WeightDecay weight_decay = WeightDecay::kNone;
  MomentRule moment = MomentRule::kLerpSmall;
  bool amsgrad = false;
  bool maximize = false;
  float decay = 1.0f;          // 1 - lr * wd (decoupled)
  float wd = 0.0f;             // wd (L2)
  float lerp_weight = 0.1f;    // 1 - beta1 (kLerp*)
  float beta1 = 0.9f;          // kMulAdd
  float one_minus_beta1 = 0.1f;  // kMulAdd alpha
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1.0f;
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;  // -(lr / bias_correction1)
};

struct SgdCoeffs {
  SgdMomentum momentum_rule = SgdMomentum::kNone;
  bool weight_decay = false;
  bool nesterov = false;
  bool maximize = false;
  float wd = 0.0f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float neg_lr = -1e-3f;
};

using AdamFn = void (*)(const AdamCoeffs& c, const float* grad, float* param, float* exp_avg,
                        float* exp_avg_sq, float* max_exp_avg_sq, size_t n);
using SgdFn = void (*)(const SgdCoeffs& c, const float* grad, float* param,
                       float* momentum_buffer, size_t n);
// The Adam step split in two around the square root, for an external sqrt:
// moments updates param (decoupled decay), exp_avg, exp_avg_sq, max_exp_avg_sq
// and apply finishes param from sqrt(second moment) and exp_avg.
using AdamMomentsFn = void (*)(const AdamCoeffs& c, const float* grad, float* param,
                               float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                               size_t n);
using AdamApplyFn = void (*)(const AdamCoeffs& c, const float* sqrt_v, const float* exp_avg,
                             float* param, size_t n);
// Exact upcast of n bf16 or fp16 values (bit patterns) to fp32.
using UpcastFn = void (*)(const uint16_t* src, DType dtype, float* dst, size_t n);

struct KernelTable {
  AdamFn adam;
  AdamMomentsFn adam_moments;
  AdamApplyFn adam_apply;
  SgdFn sgd;
  UpcastFn upcast;
  const char* isa;
};

// The best table for this CPU (chosen once).
const KernelTable& Kernels();
// Every variant compiled into this build, best last; for tests.
const KernelTable* const* AllKernelTables(size_t* count);

KernelTable GenericKernelTable();
#if defined(__x86_64__)
KernelTable Avx2KernelTable();
KernelTable Avx512KernelTable();
#endif

}  // namespace nonstop::optim::internal
