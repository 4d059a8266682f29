// CPU optimizer replay for multi-step (GoCkpt) checkpoints.
//
// In `multistep` mode the parts of a checkpoint reach the host at different
// versions. Replay brings a part from version v to v+k by re-running k
// optimizer steps on its fp32 host buffers with the gradients and per-step
// hyperparameters recorded during training.
//
// The kernels reproduce torch's CPU arithmetic bit for bit, operation for
// operation: the same float roundings, the same fused multiply-adds, the same
// double-precision scalar math. What they match (verified against the source
// and the behaviour of torch 2.13.0 on CPU):
//
//   * torch.optim.AdamW / Adam / SGD with foreach=None, fused=None on CPU
//     tensors. For CPU tensors `_default_to_fused_or_foreach` picks neither
//     foreach nor fused, so the per-tensor ("single tensor") path runs.
//   * ATen's x86 kernels (AVX2 and AVX512 CPU capability). In those, lerp_,
//     addcmul_ and add(alpha=) are fused multiply-adds in both the vectorised
//     body and the scalar tail; addcdiv_, div, mul are single roundings.
//   * sqrt: torch's x86 Linux wheels compute fp32 Tensor.sqrt() with MKL's
//     vmsSqrt in high-accuracy mode (ATen/cpu/vml.h), which is not correctly
//     rounded: about 1 in 6 results is 1 ULP from the exact square root.
//     Builds without MKL (aarch64, macOS) round it correctly. Replay uses a
//     correctly rounded sqrt unless ReplayOptions::mkl_vms_sqrt hands it
//     torch's own vmsSqrt (exported by libtorch_cpu.so), which it then calls
//     exactly as ATen does. vmsSqrt's result for an element does not depend on
//     its position in the call (checked on this machine), so blocks and
//     threads do not change it.
//
// Gradients may be fp32, bf16 or fp16. torch itself requires a parameter's
// gradient to have the parameter's dtype; mixed-precision setups with fp32
// master weights upcast low-precision gradients with `.float()`, which is
// exact. Replay does the same exact upcast, so a bf16/fp16 gradient replays
// identically to its fp32 copy.
//
// NaN payloads are not promised to match (only that NaN stays NaN).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "nonstop/status.h"
#include "nonstop/types.h"

namespace nonstop::optim {

enum class Algorithm : uint8_t {
  kSgd = 0,
  kAdam = 1,   // L2 weight decay added to the gradient (unless decoupled)
  kAdamW = 2,  // Adam with decoupled weight decay: param *= 1 - lr * wd
};

// How the first moment is updated.
enum class FirstMoment : uint8_t {
  // exp_avg.lerp_(grad, 1 - beta1): torch >= 2.0 (verified in 2.13).
  kLerp = 0,
  // exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1): torch 1.x.
  kMulAdd = 1,
};

// How sqrt(bias_correction2) is computed in Python double precision.
enum class BiasCorrection2Sqrt : uint8_t {
  kPowHalf = 0,  // bias_correction2 ** 0.5: torch 2.13
  kSqrt = 1,     // math.sqrt(bias_correction2) (_dispatch_sqrt): earlier 2.x and 1.x
};

// Per-parameter-group settings that do not change between steps.
struct OptimizerConfig {
  Algorithm algorithm = Algorithm::kAdamW;
  bool amsgrad = false;  // Adam/AdamW: keep and use max_exp_avg_sq
  FirstMoment first_moment = FirstMoment::kLerp;
  BiasCorrection2Sqrt bias_correction2_sqrt = BiasCorrection2Sqrt::kPowHalf;
};

// One optimizer step of one parameter group, as torch saw it: every value is
// the Python float (double) that was in param_groups[i] for that step.
struct StepHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9;         // Adam/AdamW
  double beta2 = 0.999;       // Adam/AdamW
  double eps = 1e-8;          // Adam/AdamW
  double weight_decay = 0.0;  // all
  double momentum = 0.0;      // SGD
  double dampening = 0.0;     // SGD
  bool nesterov = false;      // SGD
  bool maximize = false;      // all
  // True when the step was skipped (GradScaler found inf/NaN): nothing is
  // applied and the step count does not advance. The gradient may be null.
  bool skipped = false;
  // Adam/AdamW: the step count torch used (state["step"] after its += 1), or 0
  // to accept whatever the replayed count is. A mismatch is an error.
  double step = 0.0;
};

// A gradient buffer of the part's element count.
struct GradView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;  // kFloat32, kBFloat16 or kFloat16
};

struct StepRecord {
  StepHyperparameters hyper;
  GradView grad;
};

// The state of one part: fp32 host buffers of `numel` elements each, updated
// in place. Buffers an algorithm does not use may be null.
struct PartState {
  size_t numel = 0;
  float* param = nullptr;
  float* exp_avg = nullptr;          // Adam/AdamW
  float* exp_avg_sq = nullptr;       // Adam/AdamW
  float* max_exp_avg_sq = nullptr;   // Adam/AdamW with amsgrad
  float* momentum_buffer = nullptr;  // SGD with momentum != 0
  // Adam/AdamW: state["step"] as a number (torch keeps it as a float32
  // tensor; replay advances it in float32 as torch does).
  double step = 0.0;
  // SGD: false until the first step with momentum has created the buffer
  // (torch's momentum_buffer is None before it); the first step copies the
  // gradient into it.
  bool has_momentum_buffer = false;
};

// MKL's vmsSqrt (LP64): r[i] = sqrt(a[i]) for i < n, in VML `mode`.
using MklVmsSqrtFn = void (*)(int n, const float* a, float* r, int64_t mode);
// The mode ATen passes: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
inline constexpr int64_t kAtenVmlMode = 0x2 | 0x140000 | 0x100;

struct ReplayOptions {
  // Threads that split the part's elements; 0 = std::thread::hardware_concurrency().
  // Results are bitwise identical for every thread count.
  int num_threads = 0;
  // Elements per cache block: every step is applied to one block before the
  // next block is read, so the state crosses memory once per replay instead
  // of once per step. 0 = step by step over the whole range.
  size_t block_elements = 8192;
  // Adam/AdamW: torch's MKL sqrt (see the top of this file); null = correctly
  // rounded sqrt. Find it with FindMklVmsSqrt.
  MklVmsSqrtFn mkl_vms_sqrt = nullptr;
};

// Looks up vmsSqrt in an already loaded shared library (e.g. torch's
// libtorch_cpu.so) without loading anything new. Null if absent.
MklVmsSqrtFn FindMklVmsSqrt(const std::string& loaded_library_path);

// Applies `steps` in order to `state` (version v -> v + number of applied
// steps). On error nothing has been modified.
Status Replay(const OptimizerConfig& config, std::span<const StepRecord> steps,
              PartState* state, const ReplayOptions& options = {});

// Which kernel variant runs on this CPU: "avx512", "avx2" or "generic".
std::string KernelIsa();

}  // namespace nonstop::optim
