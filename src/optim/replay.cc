// The replay driver: validates a log of steps, turns each step's Python-double
// hyperparameters into the float constants torch would use, and applies the
// steps to a part on several threads, one cache block at a time.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "nonstop/optim.h"
#include "optim/kernels.h"

namespace nonstop::optim {
namespace internal {

namespace {

const KernelTable& SelectKernels() {
  static const KernelTable table = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma")) {
      return Avx512KernelTable();
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return Avx2KernelTable();
    }
#endif
    return GenericKernelTable();
  }();
  return table;
}

}  // namespace

const KernelTable& Kernels() { return SelectKernels(); }

const KernelTable* const* AllKernelTables(size_t* count) {
  static const std::vector<KernelTable> tables = [] {
    std::vector<KernelTable> t{GenericKernelTable()};
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      t.push_back(Avx2KernelTable());
    }
    if (Kernels().isa == std::string("avx512")) t.push_back(Avx512KernelTable());
#endif
    return t;
  }();
  static const std::vector<const KernelTable*> pointers = [] {
    std::vector<const KernelTable*> p;
    for (const auto& t : tables) p.push_back(&t);
    return p;
  }();
  *count = pointers.size();
  return pointers.data();
}

}  // namespace internal

namespace {

using internal::AdamCoeffs;
using internal::SgdCoeffs;

// One applied (not skipped) step, ready for the kernels.
struct PlannedStep {
  AdamCoeffs adam;
  SgdCoeffs sgd;
  GradView grad;
};

bool IsAdam(Algorithm a) { return a == Algorithm::kAdam || a == Algorithm::kAdamW; }

// Float constants of one Adam step, computed as _single_tensor_adam computes
// them in Python (double) and rounded to float as ATen rounds a Python scalar
// for an fp32 tensor.
AdamCoeffs PlanAdam(const OptimizerConfig& config, const StepHyperparameters& h, double step) {
  AdamCoeffs c;
  c.amsgrad = config.amsgrad;
  c.maximize = h.maximize;
  if (h.weight_decay != 0.0) {
    if (config.algorithm == Algorithm::kAdamW) {
      c.weight_decay = internal::WeightDecay::kDecoupled;
      c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
    } else {
      c.weight_decay = internal::WeightDecay::kL2;
      c.wd = static_cast<float>(h.weight_decay);
    }
  }
  if (config.first_moment == FirstMoment::kLerp) {
    c.lerp_weight = static_cast<float>(1.0 - h.beta1);
    c.moment = std::abs(c.lerp_weight) < 0.5f ? internal::MomentRule::kLerpSmall
                                               : internal::MomentRule::kLerpLarge;
  } else {
    c.moment = internal::MomentRule::kMulAdd;
    c.beta1 = static_cast<float>(h.beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  }
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  // Python: beta ** step is float_pow -> libm pow for these finite operands.
  const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
  const double step_size = h.lr / bias_correction1;
  const double bc2_sqrt = config.bias_correction2_sqrt == BiasCorrection2Sqrt::kPowHalf
                              ? std::pow(bias_correction2, 0.5)
                              : std::sqrt(bias_correction2);
  c.bias_correction2_sqrt = static_cast<float>(bc2_sqrt);
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-step_size);
  return c;
}

SgdCoeffs PlanSgd(const StepHyperparameters& h, bool* has_buffer) {
  SgdCoeffs c;
  c.maximize = h.maximize;
  c.weight_decay = h.weight_decay != 0.0;
  c.wd = static_cast<float>(h.weight_decay);
  c.nesterov = h.nesterov;
  if (h.momentum != 0.0) {
    c.momentum_rule = *has_buffer ? internal::SgdMomentum::kUpdate : internal::SgdMomentum::kInit;
    *has_buffer = true;
  }
  c.momentum = static_cast<float>(h.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  c.neg_lr = static_cast<float>(-h.lr);
  return c;
}

std::string StepName(size_t i) { return "replay step " + std::to_string(i); }

Status CheckState(const OptimizerConfig& config, std::span<const StepRecord> steps,
                  const PartState& s) {
  if (s.numel == 0) return Status::OK();
  if (s.param == nullptr) return Status::InvalidArgument("replay: param buffer is null");
  if (IsAdam(config.algorithm)) {
    if (s.exp_avg == nullptr || s.exp_avg_sq == nullptr) {
      return Status::InvalidArgument("replay: Adam needs exp_avg and exp_avg_sq buffers");
    }
    if (config.amsgrad && s.max_exp_avg_sq == nullptr) {
      return Status::InvalidArgument("replay: amsgrad=True needs a max_exp_avg_sq buffer");
    }
  } else if (s.momentum_buffer == nullptr) {
    for (const StepRecord& r : steps) {
      if (!r.hyper.skipped && r.hyper.momentum != 0.0) {
        return Status::InvalidArgument("replay: SGD with momentum needs a momentum_buffer");
      }
    }
  }
  return Status::OK();
}

// Elements per call of an external sqrt: the moments, the sqrt and the update
// of one sub-block all stay in L1/L2.
constexpr size_t kSqrtChunk = 2048;

// One Adam step on [b, b + n) with torch's MKL sqrt between moments and update.
void AdamWithExternalSqrt(const internal::KernelTable& k, const AdamCoeffs& c,
                          MklVmsSqrtFn sqrt_fn, const float* grad, const PartState& s, size_t b,
                          size_t n, float* scratch) {
  for (size_t j = 0; j < n; j += kSqrtChunk) {
    const size_t m = std::min(kSqrtChunk, n - j);
    const size_t at = b + j;
    float* vmax = s.max_exp_avg_sq ? s.max_exp_avg_sq + at : nullptr;
    k.adam_moments(c, grad + j, s.param + at, s.exp_avg + at, s.exp_avg_sq + at, vmax, m);
    sqrt_fn(static_cast<int>(m), c.amsgrad ? vmax : s.exp_avg_sq + at, scratch, kAtenVmlMode);
    k.adam_apply(c, scratch, s.exp_avg + at, s.param + at, m);
  }
}

// Applies every planned step to elements [begin, end), one block at a time.
void ReplayRange(const OptimizerConfig& config, const std::vector<PlannedStep>& plan,
                 const PartState& s, size_t begin, size_t end, size_t block,
                 MklVmsSqrtFn sqrt_fn) {
  const internal::KernelTable& k = internal::Kernels();
  bool needs_upcast = false;
  for (const PlannedStep& p : plan) needs_upcast |= p.grad.dtype != DType::kFloat32;
  std::vector<float> upcast(needs_upcast ? std::min(block, end - begin) : 0);
  const bool adam = IsAdam(config.algorithm);
  std::vector<float> scratch(adam && sqrt_fn != nullptr ? kSqrtChunk : 0);
  for (size_t b = begin; b < end; b += block) {
    const size_t n = std::min(block, end - b);
    for (const PlannedStep& p : plan) {
      const float* grad;
      if (p.grad.dtype == DType::kFloat32) {
        grad = static_cast<const float*>(p.grad.data) + b;
      } else {
        k.upcast(static_cast<const uint16_t*>(p.grad.data) + b, p.grad.dtype, upcast.data(), n);
        grad = upcast.data();
      }
      if (adam && sqrt_fn != nullptr) {
        AdamWithExternalSqrt(k, p.adam, sqrt_fn, grad, s, b, n, scratch.data());
      } else if (adam) {
        k.adam(p.adam, grad, s.param + b, s.exp_avg + b, s.exp_avg_sq + b,
               s.max_exp_avg_sq ? s.max_exp_avg_sq + b : nullptr, n);
      } else {
        k.sgd(p.sgd, grad, s.param + b, s.momentum_buffer ? s.momentum_buffer + b : nullptr, n);
      }
    }
  }
}

}  // namespace

Status Replay(const OptimizerConfig& config, std::span<const StepRecord> steps, PartState* state,
              const ReplayOptions& options) {
  if (state == nullptr) return Status::InvalidArgument("replay: state is null");
  NONSTOP_RETURN_IF_ERROR(CheckState(config, steps, *state));

  // Plan every applied step first, so a bad record leaves the state untouched.
  std::vector<PlannedStep> plan;
  plan.reserve(steps.size());
  // torch keeps state["step"] in a float32 tensor and adds 1 to it.
  float step = static_cast<float>(state->step);
  bool has_buffer = state->has_momentum_buffer;
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepRecord& r = steps[i];
    if (r.hyper.skipped) continue;
    if (state->numel != 0 && r.grad.data == nullptr) {
      return Status::InvalidArgument(StepName(i) + ": gradient is null (mark skipped steps)");
    }
    if (r.grad.dtype != DType::kFloat32 && r.grad.dtype != DType::kBFloat16 &&
        r.grad.dtype != DType::kFloat16) {
      return Status::InvalidArgument(StepName(i) + ": gradient dtype " +
                                     std::string(DTypeName(r.grad.dtype)) +
                                     " unsupported; use float32, bfloat16 or float16");
    }
    PlannedStep p;
    p.grad = r.grad;
    if (IsAdam(config.algorithm)) {
      step = step + 1.0f;
      if (r.hyper.step != 0.0 && r.hyper.step != static_cast<double>(step)) {
        return Status::InvalidArgument(StepName(i) + ": recorded step count " +
                                       std::to_string(r.hyper.step) + " but the part is at " +
                                       std::to_string(step) + "; is the log for this version?");
      }
      p.adam = PlanAdam(config, r.hyper, static_cast<double>(step));
    } else {
      p.sgd = PlanSgd(r.hyper, &has_buffer);
    }
    plan.push_back(p);
  }

  const size_t n = state->numel;
  if (n != 0 && !plan.empty()) {
    size_t threads = options.num_threads > 0 ? static_cast<size_t>(options.num_threads)
                                             : std::max(1u, std::thread::hardware_concurrency());
    // Split on 64-byte boundaries; at least 16K elements per thread.
    constexpr size_t kAlign = 16;
    constexpr size_t kMinPerThread = 16384;
    threads = std::max<size_t>(1, std::min(threads, (n + kMinPerThread - 1) / kMinPerThread));
    size_t per_thread = (n + threads - 1) / threads;
    per_thread = (per_thread + kAlign - 1) / kAlign * kAlign;
    const size_t block = options.block_elements == 0 ? n : options.block_elements;
    std::vector<std::thread> workers;
    for (size_t t = 1; t < threads; ++t) {
      const size_t begin = std::min(n, t * per_thread);
      const size_t end = std::min(n, begin + per_thread);
      if (begin == end) break;
      workers.emplace_back(ReplayRange, std::cref(config), std::cref(plan), std::cref(*state),
                           begin, end, block, options.mkl_vms_sqrt);
    }
    ReplayRange(config, plan, *state, 0, std::min(n, per_thread), block, options.mkl_vms_sqrt);
    for (auto& w : workers) w.join();
  }
  state->step = static_cast<double>(step);
  state->has_momentum_buffer = has_buffer;
  return Status::OK();
}

MklVmsSqrtFn FindMklVmsSqrt(const std::string& loaded_library_path) {
  void* handle = dlopen(loaded_library_path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  void* symbol = dlsym(handle, "vmsSqrt");
  dlclose(handle);  // drops only the reference RTLD_NOLOAD took
  return reinterpret_cast<MklVmsSqrtFn>(symbol);
}

std::string KernelIsa() { return internal::Kernels().isa; }

}  // namespace nonstop::optim
