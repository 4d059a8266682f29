// Internals of the multi-step (GoCkpt) schedule (include/nonstop/multistep.h,
// docs/MULTISTEP.md), one file per role:
//   multistep_copy.cc     the parts (PlanParts), the copy dispatcher (priority
//                         order, `copy_window` at a time), host memory, the
//                         state buffers the parts are copied into
//   multistep_gradlog.cc  the gradient log: what each step of a window fed
//                         the optimizer, and its gradients on the host
//   multistep_replay.cc   the CPU replay that brings every part to the
//                         window's version, or (MultistepReplay::kRestore)
//                         the plan a restorer applies with torch's optimizer
//   multistep.cc          the orchestration: Begin, the hooks, the finisher
//                         thread, persisting through the Engine
// PlanParts is also used by multistep_test.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "nonstop/copy_engine.h"
#include "nonstop/multistep.h"
#include "nonstop/optim.h"
#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop::multistep_internal {

// Elements [begin, end) of one tensor.
struct Piece {
  int tensor = 0;
  size_t begin = 0, end = 0;
};

// One block: up to block_elements consecutive elements of the flattened
// parameters (several small tensors may share a block).
struct Block {
  std::vector<Piece> pieces;
};

// One part: consecutive blocks, [flat_begin, flat_end) of the flattened parameters.
struct Part {
  size_t flat_begin = 0, flat_end = 0;
  std::vector<Block> blocks;
};

// Splits tensors of `numels` elements (flattened in order) into `parts` parts
// of whole blocks, as equal as blocks allow. Parts may be empty when there are
// fewer blocks than parts.
std::vector<Part> PlanParts(const std::vector<size_t>& numels, size_t block_elements, int parts);

constexpr int kNumRoles = 5;

// Whether an optimizer of `config` keeps state `role`.
bool UsesRole(const optim::OptimizerConfig& config, StateRole role);
// Where `role` of `t` lives now (null: not created yet, read as zeros).
const float* RoleSource(const OptimizerTensor& t, StateRole role);

// A set of copies waited on together (one part's state, one step's gradients).
class Batch {
 public:
  // Before the batch's copies are queued: how many there are.
  void Expect(int n) EXCLUDES(mu_);
  void Done(const Status& s) EXCLUDES(mu_);
  // Until every copy is done; the first error.
  Status Wait() EXCLUDES(mu_);
  bool Ready() EXCLUDES(mu_);

 private:
  Mutex mu_;
  CondVar cv_;
  int remaining_ GUARDED_BY(mu_) = 0;
  Status error_ GUARDED_BY(mu_);  // first error wins
};

// Waits for every batch in *pending and clears it; the first error.
Status WaitBatches(std::vector<std::shared_ptr<Batch>>* pending);

// One copy (at most one block), or a zero fill when src is null (a state
// that does not exist yet).
struct CopyItem {
  const void* src = nullptr;
  Device device;
  void* dst = nullptr;
  size_t bytes = 0;
  std::shared_ptr<Batch> batch;
};

// Hands copies to a CopyEngine in priority order, `window` at a time, on its
// own thread: gradient copies (high) before state copies (low), so a gradient
// never waits for more than `window` state blocks.
class CopyDispatcher {
 public:
  CopyDispatcher(CopyEngine* engine, int window);
  ~CopyDispatcher();
  CopyDispatcher(const CopyDispatcher&) = delete;
  CopyDispatcher& operator=(const CopyDispatcher&) = delete;

  // Queues `items` (all of one batch) at high (gradients) or low priority.
  void Enqueue(std::vector<CopyItem> items, bool high) EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);

  CopyEngine* const engine_;
  const int window_;
  Mutex mu_;
  CondVar cv_;
  std::deque<CopyItem> high_ GUARDED_BY(mu_), low_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started after everything it uses
};

// Host memory from the copy engine (pinned / pre-faulted), freed with it.
class HostArena {
 public:
  HostArena() = default;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;
  ~HostArena() { Reset(nullptr, 0); }
  // Frees the memory held and allocates `bytes` (none for 0 or no engine);
  // false when the allocation failed.
  bool Reset(CopyEngine* engine, size_t bytes);
  uint8_t* data() const { return p_; }
  size_t size() const { return bytes_; }

 private:
  CopyEngine* engine_ = nullptr;
  uint8_t* p_ = nullptr;
  size_t bytes_ = 0;
};

// Buffers the schedule hands to the Engine as staged (TensorRef::staged):
// one of `nbytes` of kLargeTensorBytes or more starts at a 4 KiB boundary and
// is followed by zeros to the next one; a smaller one is 64-byte aligned.
// StagedOffset places one at the end (*end) of an arena and moves the end
// past it; ZeroStagedTail zeroes the padding after its nbytes.
size_t StagedOffset(size_t* end, size_t nbytes);
void ZeroStagedTail(uint8_t* buffer, size_t nbytes);

// The host buffers of a window's state: one per tensor and role the
// optimizer keeps. The parts are copied into them and replayed there, and
// they are the checkpoint's staging: the Engine writes them to the medium
// as they are (staged), so the state is copied once, device to host.
class StateBuffers {
 public:
  // Lays out the buffers of `tensors`; reuses the memory when the size is unchanged.
  Status Plan(CopyEngine* copy, const optim::OptimizerConfig& config,
              const std::vector<OptimizerTensor>& tensors);
  // Role `role` of tensor t, or null when the optimizer does not keep it.
  float* Role(int t, StateRole role) const;
  size_t bytes() const { return arena_.size(); }
  void Free() { arena_.Reset(nullptr, 0); }

 private:
  static constexpr size_t kNone = ~size_t{0};
  HostArena arena_;
  std::vector<std::array<size_t, kNumRoles>> offset_;  // [tensor][role], kNone when unused
};

// OnUpdateEnd: the state pointers that appeared since Begin (`refreshed`,
// same order and sizes) replace those of *tensors.
Status Refresh(std::vector<OptimizerTensor>* tensors, std::span<const OptimizerTensor> refreshed);

// SetOutputs: an output given as bytes (tensor < 0) that is one of the
// window's tensors (float32, the same data pointer and size as its parameter
// or a state `config` keeps) becomes that tensor's reconstructed buffer
// (tensor, role): the caller passes every tensor of the state as it is.
void MatchOutputs(const optim::OptimizerConfig& config, const std::vector<OptimizerTensor>& tensors,
                  std::vector<OutputTensor>* outputs);

// SetOutputs: copies the outputs that are not reconstructed (tensor < 0)
// into *arena, laid out as staged buffers, and points them there (host).
Status CopyOtherOutputs(CopyEngine* copy, HostArena* arena, std::vector<OutputTensor>* outputs);

// Every reconstructed buffer as "<tensor name>/<role>" (no SetOutputs call).
std::vector<OutputTensor> DefaultOutputs(const optim::OptimizerConfig& config,
                                         const std::vector<OptimizerTensor>& tensors);

// Whether registering `a` would change nothing after registering `b`.
bool SameRegistration(const std::vector<TensorRef>& a, const std::vector<TensorRef>& b);

// One logged step of the window: what the optimizer saw.
struct LoggedStep {
  bool skipped = false;
  std::vector<optim::StepHyperparameters> groups;
  std::vector<uint8_t> has_grad;  // per tensor
  std::vector<DType> grad_dtype;  // per tensor
};

// The gradient log of a window that begins after step N with K parts: for
// each step N+j (j = 1..K-1), what the optimizer saw (LoggedStep) and the
// gradients of parts 1..j, copied to the host (a prefix of the flattened
// parameters, at most 4 bytes per element; low-precision gradients use part
// of it). The training thread writes it; the finisher reads it after the
// window closed.
class GradientLog {
 public:
  // Lays out the buffers for `tensors` cut into `parts`; reuses the memory
  // when the size is unchanged. Starts an empty log of K-1 steps.
  Status Plan(CopyEngine* copy, const std::vector<OptimizerTensor>& tensors,
              const std::vector<Part>& parts);
  // Logs step N+j (1 <= j < K): its groups' hyperparameters, whether it was
  // skipped and, per tensor, whether it had a gradient and of which dtype.
  Status Record(int j, const std::vector<OptimizerTensor>& tensors,
                std::span<const optim::StepHyperparameters> groups, bool skipped,
                std::span<const GradRef> grads);
  const LoggedStep& step(int j) const { return log_[j - 1]; }
  // Queues the copies of step j's gradients of parts 1..j (`block_bytes`
  // per copy at most) as one batch; adds the bytes queued to *bytes.
  std::shared_ptr<Batch> Enqueue(int j, const std::vector<OptimizerTensor>& tensors,
                                 std::span<const GradRef> grads, uint64_t block_bytes,
                                 CopyDispatcher* dispatcher, uint64_t* bytes);
  // The closed window's log (index j-1 for step N+j); the buffers stay.
  std::vector<LoggedStep> TakeLog() { return std::move(log_); }
  // Step j's gradient of tensor t on the host (its dtype in the log).
  const uint8_t* Gradient(int j, int t) const { return arena_.data() + offset_[j][t]; }
  uint8_t* MutableGradient(int j, int t) { return arena_.data() + offset_[j][t]; }
  // Elements of tensor t whose step-j gradient is logged (those in parts 1..j).
  size_t Covered(int j, int t) const { return covered_[j][t]; }
  size_t bytes() const { return arena_.size(); }
  void Free() { arena_.Reset(nullptr, 0); }

 private:
  HostArena arena_;
  std::vector<std::vector<size_t>> offset_;   // [j][tensor]: bytes into arena_
  std::vector<std::vector<size_t>> covered_;  // [j][tensor]: its elements in parts 1..j
  std::vector<LoggedStep> log_;
};

// What the replay of one closed window reads.
struct ReplayInput {
  const optim::OptimizerConfig* config = nullptr;
  const std::vector<OptimizerTensor>* tensors = nullptr;
  const std::vector<Part>* parts = nullptr;  // K of them
  const std::vector<LoggedStep>* log = nullptr;
  const GradientLog* gradients = nullptr;
  // Per part, per piece (block order): Adam's step count when the piece was
  // copied, and whether SGD's momentum buffer existed then.
  const std::vector<std::vector<double>>* piece_step = nullptr;
  const std::vector<std::vector<uint8_t>>* piece_has_momentum = nullptr;
  int threads = 0;  // 0 = hardware concurrency
  optim::MklVmsSqrtFn mkl_vms_sqrt = nullptr;
};

// Brings every part in `state` to the window's version (part p was copied at
// version N+p and gets steps N+p+1..N+K-1), in slices spread over threads.
Status ReplayWindow(const ReplayInput& in, const StateBuffers& state);

// MultistepReplay::kRestore: what the restorer needs to do ReplayWindow's
// job itself. Per logged step j (1..K-1) in order: skipped or not, each
// group's hyperparameters, and per tensor with a logged gradient the prefix
// of its elements (parts 1..j) that takes the step, the gradient's output
// name, the step count torch holds before it (Adam: `begin_step` + the updates
// applied since Begin) and whether its optimizer state existed then. Appends
// the gradient log's buffers to *gradients (staged; their padding zeroed) and
// returns the plan as a JSON object. `begin_step`/`begin_state`: per tensor at
// Begin, Adam's step count and whether its state (exp_avg or momentum_buffer)
// existed.
std::string RestorePlan(const ReplayInput& in, GradientLog* log, int64_t begin,
                        const std::vector<double>& begin_step,
                        const std::vector<uint8_t>& begin_state,
                        std::vector<OutputTensor>* gradients);

// `meta` (a JSON object) with "key": value_json added as its first member.
std::string AddToMeta(const std::string& meta, const std::string& key,
                      const std::string& value_json);

}  // namespace nonstop::multistep_internal
