// The multi-step (GoCkpt) schedule; see include/nonstop/multistep.h and
// docs/MULTISTEP.md.
//
// Three threads take part:
//   * the training thread calls Begin, the hooks and SetOutputs;
//   * the copy dispatcher hands copies to the CopyEngine, at most
//     `copy_window` at a time, gradient copies before state copies, so a
//     gradient never waits for more than `copy_window` state blocks;
//   * the finisher waits for a closed window's copies, replays the parts on
//     the CPU and persists the result through the Engine.
#include "nonstop/multistep.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "engine/multistep_internal.h"

namespace nonstop {

std::string_view StateRoleName(StateRole role) {
  switch (role) {
    case StateRole::kParam:
      return "param";
    case StateRole::kExpAvg:
      return "exp_avg";
    case StateRole::kExpAvgSq:
      return "exp_avg_sq";
    case StateRole::kMaxExpAvgSq:
      return "max_exp_avg_sq";
    case StateRole::kMomentumBuffer:
      return "momentum_buffer";
  }
  return "unknown";
}

namespace multistep_internal {

std::vector<Part> PlanParts(const std::vector<size_t>& numels, size_t block_elements, int parts) {
  std::vector<Part> out(std::max(parts, 1));
  size_t total = 0;
  for (size_t n : numels) total += n;
  if (block_elements == 0) block_elements = 1;
  const size_t blocks = (total + block_elements - 1) / block_elements;
  const size_t k = out.size();
  size_t tensor = 0, tensor_begin = 0;  // flat offset of `tensor`'s first element
  for (size_t p = 0; p < k; ++p) {
    // Parts are contiguous block ranges of near-equal size (the first parts
    // take the remainder: they have the most time left for their gradients).
    const size_t b0 = blocks * p / k, b1 = blocks * (p + 1) / k;
    out[p].flat_begin = std::min(total, b0 * block_elements);
    out[p].flat_end = std::min(total, b1 * block_elements);
    for (size_t b = b0; b < b1; ++b) {
      const size_t lo = b * block_elements, hi = std::min(total, lo + block_elements);
      Block block;
      size_t pos = lo;
      while (pos < hi) {
        while (tensor < numels.size() && tensor_begin + numels[tensor] <= pos) {
          tensor_begin += numels[tensor];
          ++tensor;
        }
        const size_t end = std::min(hi, tensor_begin + numels[tensor]);
        block.pieces.push_back({static_cast<int>(tensor), pos - tensor_begin, end - tensor_begin});
        pos = end;
      }
      out[p].blocks.push_back(std::move(block));
    }
  }
  return out;
}

}  // namespace multistep_internal

namespace {

using multistep_internal::Block;
using multistep_internal::Part;
using multistep_internal::Piece;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr int kNumRoles = 5;
constexpr size_t kAlign = 64;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A set of copies waited on together (one part's state, one step's gradients).
struct Batch {
  Mutex mu;
  CondVar cv;
  int remaining GUARDED_BY(mu) = 0;
  Status error GUARDED_BY(mu);  // first error wins
  // Before the batch's copies are queued: how many there are.
  void Expect(int n) {
    MutexLock lock(&mu);
    remaining = n;
  }
  void Done(const Status& s) {
    MutexLock lock(&mu);
    if (!s.ok() && error.ok()) error = s;
    if (--remaining == 0) cv.SignalAll();
  }
  Status Wait() {
    MutexLock lock(&mu);
    cv.Wait(&mu, [&]() REQUIRES(mu) { return remaining == 0; });
    return error;
  }
  bool Ready() {
    MutexLock lock(&mu);
    return remaining == 0;
  }
};

// One copy (at most one block), or a zero fill when src is null (a state
// that does not exist yet).
struct CopyItem {
  const void* src = nullptr;
  Device device;
  void* dst = nullptr;
  size_t bytes = 0;
  std::shared_ptr<Batch> batch;
};

// Hands copies to a CopyEngine in priority order, `window` at a time.
class CopyDispatcher {
 public:
  CopyDispatcher(CopyEngine* engine, int window)
      : engine_(engine), window_(std::max(1, window)), thread_([this] { Run(); }) {}
  ~CopyDispatcher() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    thread_.join();
  }

  // Queues `items` (all of one batch) at high (gradients) or low priority.
  void Enqueue(std::vector<CopyItem> items, bool high) {
    if (items.empty()) return;
    {
      MutexLock lock(&mu_);
      auto& q = high ? high_ : low_;
      for (auto& it : items) q.push_back(std::move(it));
    }
    cv_.SignalAll();
  }

 private:
  struct InFlight {
    std::unique_ptr<CopyCompletion> completion;
    std::shared_ptr<Batch> batch;
  };

  void Run() {
    std::deque<InFlight> in_flight;
    for (;;) {
      CopyItem next;
      bool have = false;
      {
        MutexLock lock(&mu_);
        if (in_flight.empty()) {
          cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stop_ || !high_.empty() || !low_.empty(); });
          if (high_.empty() && low_.empty()) return;  // stop_, queues drained
        }
        if (static_cast<int>(in_flight.size()) < window_ && (!high_.empty() || !low_.empty())) {
          auto& q = high_.empty() ? low_ : high_;
          next = std::move(q.front());
          q.pop_front();
          have = true;
        }
      }
      if (have) {
        if (next.src == nullptr) {
          std::memset(next.dst, 0, next.bytes);
          next.batch->Done(Status::OK());
        } else {
          in_flight.push_back(
              {engine_->Copy(next.src, next.device, next.dst, next.bytes), next.batch});
        }
        continue;
      }
      // The window is full (or nothing is queued): retire the oldest copy.
      InFlight done = std::move(in_flight.front());
      in_flight.pop_front();
      done.batch->Done(done.completion->Wait());
    }
  }

  CopyEngine* const engine_;
  const int window_;
  Mutex mu_;
  CondVar cv_;
  std::deque<CopyItem> high_ GUARDED_BY(mu_), low_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Host memory from the copy engine (pinned / pre-faulted), freed with it.
class HostArena {
 public:
  HostArena() = default;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;
  ~HostArena() { Reset(nullptr, 0); }
  bool Reset(CopyEngine* engine, size_t bytes) {
    if (p_ != nullptr) engine_->FreeHost(p_, bytes_);
    p_ = nullptr;
    bytes_ = 0;
    engine_ = engine;
    if (engine == nullptr || bytes == 0) return true;
    bool pinned = false;
    p_ = static_cast<uint8_t*>(engine->AllocHost(bytes, &pinned));
    if (p_ == nullptr) return false;
    bytes_ = bytes;
    return true;
  }
  uint8_t* data() const { return p_; }
  size_t size() const { return bytes_; }

 private:
  CopyEngine* engine_ = nullptr;
  uint8_t* p_ = nullptr;
  size_t bytes_ = 0;
};

// One logged step of the window: what the optimizer saw.
struct LoggedStep {
  bool skipped = false;
  std::vector<optim::StepHyperparameters> groups;
  std::vector<uint8_t> has_grad;  // per tensor
  std::vector<DType> grad_dtype;  // per tensor
};

// What the finisher needs to turn a closed window into a checkpoint.
struct WindowJob {
  size_t stats_index = 0;  // into recent_ (by window number)
  uint64_t window = 0;
  int64_t version = 0;
  optim::OptimizerConfig config;
  std::vector<std::shared_ptr<Batch>> batches;
  std::vector<LoggedStep> log;                  // index j-1 for step N+j, j = 1..K-1
  std::vector<std::vector<double>> piece_step;  // [part][piece order] Adam step at copy
  std::vector<std::vector<uint8_t>> piece_has_momentum;
  std::vector<OutputTensor> outputs;
  std::string meta;
};

class MultistepCheckpointImpl final : public MultistepCheckpoint {
 public:
  MultistepCheckpointImpl(Engine* engine, const MultistepOptions& o,
                          std::unique_ptr<CopyEngine> copy)
      : engine_(engine), opts_(o), copy_(std::move(copy)),
        dispatcher_(std::make_unique<CopyDispatcher>(copy_.get(), o.copy_window)),
        finisher_([this] { FinisherLoop(); }) {}

  ~MultistepCheckpointImpl() override { (void)Close(); }

  Status Begin(int64_t step, const optim::OptimizerConfig& config,
               std::vector<OptimizerTensor> tensors) override {
    if (closed_) return Status::FailedPrecondition("multistep checkpoint is closed");
    if (active_) {
      return Status::FailedPrecondition("a multistep checkpoint window is already open (began "
                                        "after step " + std::to_string(begin_step_) + ")");
    }
    NONSTOP_RETURN_IF_ERROR(TakeError());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      if (t.param == nullptr && t.numel > 0) {
        return Status::InvalidArgument("multistep: tensor '" + t.name + "' has no data pointer");
      }
      if (t.group < 0) return Status::InvalidArgument("multistep: tensor '" + t.name +
                                                      "' has a negative group");
    }
    // The previous window's buffers must have been read by the engine.
    const auto t0 = Clock::now();
    {
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return !job_pending_; });
    }
    const double waited = Since(t0);
    NONSTOP_RETURN_IF_ERROR(TakeError());

    config_ = config;
    tensors_ = std::move(tensors);
    NONSTOP_RETURN_IF_ERROR(Plan());
    begin_step_ = step;
    pos_ = 1;
    active_ = true;
    outputs_set_ = false;
    outputs_.clear();
    meta_.clear();
    log_.assign(K() > 1 ? K() - 1 : 0, LoggedStep{});
    applied_.assign(tensors_.size(), 0);
    batches_.clear();
    piece_step_.assign(K(), {});
    piece_has_momentum_.assign(K(), {});
    window_start_ = Clock::now();
    {
      MutexLock lock(&mu_);
      MultistepWindowStats ws;
      ws.begin_step = step;
      ws.version = version();
      ws.stall_s = waited;
      stall_total_ += waited;
      recent_.push_back(ws);
      if (recent_.size() > 64) {
        recent_.erase(recent_.begin());
        ++recent_base_;
      }
      ++windows_;
      window_index_ = windows_ - 1;
    }
    EnqueuePart(0);
    return Status::OK();
  }

  bool active() const override { return active_; }
  int64_t version() const override { return begin_step_ + K() - 1; }

  bool GradientCopiesPending() override {
    std::erase_if(grad_pending_, [](const std::shared_ptr<Batch>& b) { return b->Ready(); });
    return !grad_pending_.empty();
  }

  Status OnBackwardBegin() override {
    if (grad_pending_.empty()) return Status::OK();
    const auto t0 = Clock::now();
    Status s = WaitBatches(&grad_pending_);
    AddStall(Since(t0), /*state=*/false);
    return s;
  }

  Status OnUpdateBegin(int64_t step, std::span<const optim::StepHyperparameters> groups,
                       bool skipped, std::span<const GradRef> grads) override {
    if (!active_) return Status::OK();
    const int j = pos_;
    if (step != begin_step_ + j) {
      return Abort(Status::FailedPrecondition(
          "multistep: expected the update of step " + std::to_string(begin_step_ + j) +
          ", got step " + std::to_string(step) + " (one update per step)"));
    }
    if (skipped) {
      MutexLock lock(&mu_);
      if (auto* ws = WindowStats(window_index_)) ++ws->skipped_steps;
    }
    if (j < K()) {
      LoggedStep& e = log_[j - 1];
      e.skipped = skipped;
      e.groups.assign(groups.begin(), groups.end());
      e.has_grad.assign(tensors_.size(), 0);
      e.grad_dtype.assign(tensors_.size(), DType::kFloat32);
      if (!skipped) {
        if (grads.size() != tensors_.size()) {
          return Abort(Status::InvalidArgument(
              "multistep: " + std::to_string(grads.size()) + " gradients for " +
              std::to_string(tensors_.size()) + " tensors"));
        }
        for (size_t t = 0; t < tensors_.size(); ++t) {
          if (tensors_[t].group >= static_cast<int>(groups.size())) {
            return Abort(Status::InvalidArgument("multistep: tensor '" + tensors_[t].name +
                                                 "' is in group " +
                                                 std::to_string(tensors_[t].group) + " of " +
                                                 std::to_string(groups.size())));
          }
          const DType d = grads[t].dtype;
          if (grads[t].data != nullptr && d != DType::kFloat32 && d != DType::kBFloat16 &&
              d != DType::kFloat16) {
            return Abort(Status::InvalidArgument("multistep: gradient of '" + tensors_[t].name +
                                                 "' is " + std::string(DTypeName(d)) +
                                                 "; use float32, bfloat16 or float16"));
          }
          e.has_grad[t] = grads[t].data != nullptr;
          e.grad_dtype[t] = d;
        }
      }
    }
    // The update is about to change the state: every part copied so far must
    // be on the host (its state batch done). A skipped step changes nothing,
    // except at the last step, which closes the window.
    if (!skipped || j == K()) {
      const auto t0 = Clock::now();
      Status s = WaitBatches(&state_pending_);
      AddStall(Since(t0), /*state=*/true);
      if (!s.ok()) return Abort(s);
    }
    if (j < K() && !skipped) {
      EnqueueGradients(j, grads);
      if (!opts_.overlap_gradients) {
        const auto t0 = Clock::now();
        Status s = WaitBatches(&grad_pending_);
        AddStall(Since(t0), /*state=*/false);
        if (!s.ok()) return Abort(s);
      }
    }
    if (j == K()) CloseWindow();
    return Status::OK();
  }

  Status OnUpdateEnd(int64_t step, std::span<const OptimizerTensor> refreshed) override {
    if (!active_) return Status::OK();
    const int j = pos_;
    if (step != begin_step_ + j) {
      return Abort(Status::FailedPrecondition("multistep: update end of step " +
                                              std::to_string(step) + ", expected step " +
                                              std::to_string(begin_step_ + j)));
    }
    if (!refreshed.empty()) {
      if (refreshed.size() != tensors_.size()) {
        return Abort(Status::InvalidArgument("multistep: refreshed tensor list has a different "
                                             "length than Begin's"));
      }
      for (size_t t = 0; t < tensors_.size(); ++t) {
        if (refreshed[t].numel != tensors_[t].numel) {
          return Abort(Status::InvalidArgument("multistep: tensor '" + tensors_[t].name +
                                               "' changed size during a window"));
        }
        auto& dst = tensors_[t];
        dst.param = refreshed[t].param;
        dst.exp_avg = refreshed[t].exp_avg;
        dst.exp_avg_sq = refreshed[t].exp_avg_sq;
        dst.max_exp_avg_sq = refreshed[t].max_exp_avg_sq;
        dst.momentum_buffer = refreshed[t].momentum_buffer;
      }
    }
    const LoggedStep& e = log_[j - 1];
    if (!e.skipped) {
      for (size_t t = 0; t < tensors_.size(); ++t) applied_[t] += e.has_grad[t];
    }
    pos_ = j + 1;
    EnqueuePart(j);
    return Status::OK();
  }

  Status SetOutputs(std::vector<OutputTensor> outputs, std::string meta_json) override {
    if (!active_ || pos_ != K()) {
      return Status::FailedPrecondition(
          "multistep: SetOutputs belongs after the update of step " +
          std::to_string(version()) + " while its window is open");
    }
    const auto t0 = Clock::now();
    size_t extra_bytes = 0;
    for (const auto& o : outputs) {
      if (o.tensor >= static_cast<int>(tensors_.size())) {
        return Status::InvalidArgument("multistep: output '" + o.spec.name +
                                       "' names tensor " + std::to_string(o.tensor) + " of " +
                                       std::to_string(tensors_.size()));
      }
      if (o.tensor >= 0) {
        const size_t n = tensors_[o.tensor].numel;
        if (o.spec.dtype != DType::kFloat32 || o.spec.nbytes != n * sizeof(float)) {
          return Status::InvalidArgument("multistep: output '" + o.spec.name +
                                         "' must be float32 of " + std::to_string(n) +
                                         " elements like tensor '" + tensors_[o.tensor].name +
                                         "'");
        }
        if (RoleBuffer(o.tensor, o.role) == nullptr) {
          return Status::InvalidArgument("multistep: output '" + o.spec.name + "': role " +
                                         std::string(StateRoleName(o.role)) +
                                         " is not kept for this optimizer");
        }
      } else {
        extra_bytes += AlignUp(o.spec.nbytes);
      }
    }
    // Tensors the optimizer does not own are copied now, at version N+K-1.
    if (extras_.size() < extra_bytes) extras_.resize(extra_bytes);
    size_t off = 0;
    for (auto& o : outputs) {
      if (o.tensor >= 0) continue;
      if (o.spec.nbytes > 0) {
        uint8_t* dst = extras_.data() + off;
        if (o.device.kind == DeviceKind::kHost) {
          std::memcpy(dst, o.data, o.spec.nbytes);
        } else {
          Status s = copy_->Copy(o.data, o.device, dst, o.spec.nbytes)->Wait();
          if (!s.ok()) return s;
        }
        o.data = dst;
      }
      o.device = Device{};
      off += AlignUp(o.spec.nbytes);
    }
    outputs_ = std::move(outputs);
    meta_ = std::move(meta_json);
    outputs_set_ = true;
    AddStall(Since(t0), /*state=*/false);
    return Status::OK();
  }

  Status Wait() override {
    {
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return !job_pending_; });
    }
    Status first = TakeError();
    Status s;
    {
      MutexLock lock(&engine_mu_);
      s = engine_->WaitCommitted(0);
    }
    return first.ok() ? s : first;
  }

  std::optional<CommittedCheckpoint> Latest() override {
    MutexLock lock(&engine_mu_);
    return engine_->Latest();
  }

  Status AdoptRestored(uint64_t counter) override {
    if (active_) {
      return Status::FailedPrecondition(
          "adopt_restored while a multistep window is open: restore before training");
    }
    {
      // Every window already handed to the background thread is persisted
      // (or failed) first, as Engine::AdoptRestored waits for its own work.
      MutexLock lock(&mu_);
      cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return !job_pending_; });
    }
    MutexLock lock(&engine_mu_);
    return engine_->AdoptRestored(counter);
  }

  MultistepStats Stats() override {
    MultistepStats s;
    MutexLock lock(&mu_);
    s.windows = windows_;
    s.persisted = persisted_;
    s.failed = failed_;
    s.stall_s_total = stall_total_;
    s.host_bytes = state_arena_.size() + grad_arena_.size() + extras_.size();
    s.copy_engine = copy_->Describe();
    s.recent = recent_;
    return s;
  }

  Status Close() override {
    if (closed_) return Status::OK();
    closed_ = true;
    // An open window is abandoned: its copies finish, nothing is persisted.
    if (active_) {
      (void)WaitBatches(&state_pending_);
      active_ = false;
    }
    (void)WaitBatches(&grad_pending_);
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.SignalAll();
    finisher_.join();
    dispatcher_.reset();
    Status s = TakeError();
    state_arena_.Reset(nullptr, 0);
    grad_arena_.Reset(nullptr, 0);
    return s;
  }

 private:
  int K() const { return std::max(1, opts_.parts); }

  bool UsesRole(StateRole r) const {
    const bool adam = config_.algorithm != optim::Algorithm::kSgd;
    switch (r) {
      case StateRole::kParam:
        return true;
      case StateRole::kExpAvg:
      case StateRole::kExpAvgSq:
        return adam;
      case StateRole::kMaxExpAvgSq:
        return adam && config_.amsgrad;
      case StateRole::kMomentumBuffer:
        return !adam;
    }
    return false;
  }

  static const float* Source(const OptimizerTensor& t, StateRole r) {
    switch (r) {
      case StateRole::kParam:
        return t.param;
      case StateRole::kExpAvg:
        return t.exp_avg;
      case StateRole::kExpAvgSq:
        return t.exp_avg_sq;
      case StateRole::kMaxExpAvgSq:
        return t.max_exp_avg_sq;
      case StateRole::kMomentumBuffer:
        return t.momentum_buffer;
    }
    return nullptr;
  }

  float* RoleBuffer(int t, StateRole r) const {
    const size_t off = role_offset_[t][static_cast<int>(r)];
    if (off == kNone) return nullptr;
    return reinterpret_cast<float*>(state_arena_.data() + off);
  }

  // Lays out parts and host buffers; reuses the buffers when the layout is
  // unchanged.
  Status Plan() {
    std::vector<size_t> numels;
    numels.reserve(tensors_.size());
    for (const auto& t : tensors_) numels.push_back(t.numel);
    const size_t block_elements = std::max<uint64_t>(1, opts_.block_bytes / sizeof(float));
    parts_ = multistep_internal::PlanParts(numels, block_elements, K());
    // State buffers: one per tensor and role.
    role_offset_.assign(tensors_.size(), {});
    size_t state_bytes = 0;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      for (int r = 0; r < kNumRoles; ++r) {
        if (!UsesRole(static_cast<StateRole>(r))) {
          role_offset_[t][r] = kNone;
          continue;
        }
        role_offset_[t][r] = state_bytes;
        state_bytes += AlignUp(tensors_[t].numel * sizeof(float));
      }
    }
    // Gradient buffers: step j (1..K-1) holds the prefix of parts 1..j, at
    // most 4 bytes per element (low-precision gradients use part of it).
    grad_offset_.assign(K(), std::vector<size_t>(tensors_.size(), 0));
    size_t grad_bytes = 0;
    for (int j = 1; j < K(); ++j) {
      const size_t prefix = parts_[j - 1].flat_end;
      size_t begin = 0;
      for (size_t t = 0; t < tensors_.size(); ++t) {
        const size_t covered = prefix > begin ? std::min(tensors_[t].numel, prefix - begin) : 0;
        grad_offset_[j][t] = grad_bytes;
        grad_bytes += AlignUp(covered * sizeof(float));
        begin += tensors_[t].numel;
      }
    }
    if (state_arena_.size() != state_bytes || state_arena_.data() == nullptr) {
      if (!state_arena_.Reset(copy_.get(), state_bytes) && state_bytes > 0) {
        return Status::Unavailable("multistep: cannot allocate " + std::to_string(state_bytes) +
                                   " bytes of host memory for the state");
      }
    }
    if (grad_arena_.size() != grad_bytes || grad_arena_.data() == nullptr) {
      if (!grad_arena_.Reset(copy_.get(), grad_bytes) && grad_bytes > 0) {
        return Status::Unavailable("multistep: cannot allocate " + std::to_string(grad_bytes) +
                                   " bytes of host memory for gradients");
      }
    }
    return Status::OK();
  }

  // Queues part p (0-based) of the state at its current version, block by
  // block, each parameter block followed by the same block of each state.
  void EnqueuePart(int p) {
    auto batch = std::make_shared<Batch>();
    std::vector<CopyItem> items;
    auto& steps = piece_step_[p];
    auto& momentum = piece_has_momentum_[p];
    uint64_t bytes = 0;
    for (const Block& block : parts_[p].blocks) {
      for (int r = 0; r < kNumRoles; ++r) {
        const auto role = static_cast<StateRole>(r);
        if (!UsesRole(role)) continue;
        for (const Piece& pc : block.pieces) {
          const OptimizerTensor& t = tensors_[pc.tensor];
          const float* src = Source(t, role);
          CopyItem it;
          it.src = src == nullptr ? nullptr : src + pc.begin;
          it.device = t.device;
          it.dst = RoleBuffer(pc.tensor, role) + pc.begin;
          it.bytes = (pc.end - pc.begin) * sizeof(float);
          it.batch = batch;
          if (src != nullptr) bytes += it.bytes;
          if (it.bytes > 0) items.push_back(std::move(it));
        }
      }
      for (const Piece& pc : block.pieces) {
        const OptimizerTensor& t = tensors_[pc.tensor];
        steps.push_back(t.step + applied_[pc.tensor]);
        momentum.push_back(t.momentum_buffer != nullptr);
      }
    }
    batch->Expect(static_cast<int>(items.size()));
    AddBytes(bytes, 0);
    state_pending_.push_back(batch);
    batches_.push_back(batch);
    dispatcher_->Enqueue(std::move(items), /*high=*/false);
  }

  // Queues the gradients of step j (1..K-1) of parts 1..j, in blocks.
  void EnqueueGradients(int j, std::span<const GradRef> grads) {
    auto batch = std::make_shared<Batch>();
    std::vector<CopyItem> items;
    const size_t prefix = parts_[j - 1].flat_end;
    size_t begin = 0;
    uint64_t bytes = 0;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      const size_t n = tensors_[t].numel;
      const size_t covered = prefix > begin ? std::min(n, prefix - begin) : 0;
      begin += n;
      if (covered == 0 || grads[t].data == nullptr) continue;
      const size_t esize = DTypeSize(grads[t].dtype);
      const size_t chunk = std::max<size_t>(esize, opts_.block_bytes / esize * esize);
      const auto* src = static_cast<const uint8_t*>(grads[t].data);
      uint8_t* dst = grad_arena_.data() + grad_offset_[j][t];
      for (size_t off = 0; off < covered * esize; off += chunk) {
        CopyItem it;
        it.src = src + off;
        it.device = grads[t].device;
        it.dst = dst + off;
        it.bytes = std::min(chunk, covered * esize - off);
        it.batch = batch;
        bytes += it.bytes;
        items.push_back(std::move(it));
      }
    }
    batch->Expect(static_cast<int>(items.size()));
    AddBytes(0, bytes);
    grad_pending_.push_back(batch);
    batches_.push_back(batch);
    dispatcher_->Enqueue(std::move(items), /*high=*/true);
  }

  static Status WaitBatches(std::vector<std::shared_ptr<Batch>>* pending) {
    Status first;
    for (auto& b : *pending) {
      Status s = b->Wait();
      if (!s.ok() && first.ok()) first = s;
    }
    pending->clear();
    return first;
  }

  // Hands the closed window to the finisher.
  void CloseWindow() {
    auto job = std::make_unique<WindowJob>();
    job->window = window_index_;
    job->version = version();
    job->config = config_;
    job->batches = std::move(batches_);
    job->log = std::move(log_);
    job->piece_step = std::move(piece_step_);
    job->piece_has_momentum = std::move(piece_has_momentum_);
    if (outputs_set_) {
      job->outputs = std::move(outputs_);
      job->meta = std::move(meta_);
    } else {
      job->outputs = DefaultOutputs();
      job->meta = "{}";
    }
    active_ = false;
    {
      MutexLock lock(&mu_);
      if (auto* ws = WindowStats(window_index_)) ws->window_s = Since(window_start_);
      job_ = std::move(job);
      job_pending_ = true;
    }
    cv_.SignalAll();
  }

  // Every reconstructed buffer as "<tensor name>/<role>".
  std::vector<OutputTensor> DefaultOutputs() const {
    std::vector<OutputTensor> out;
    for (size_t t = 0; t < tensors_.size(); ++t) {
      for (int r = 0; r < kNumRoles; ++r) {
        const auto role = static_cast<StateRole>(r);
        if (!UsesRole(role)) continue;
        OutputTensor o;
        o.spec.name = tensors_[t].name + "/" + std::string(StateRoleName(role));
        o.spec.dtype = DType::kFloat32;
        o.spec.shape = {static_cast<int64_t>(tensors_[t].numel)};
        o.spec.nbytes = tensors_[t].numel * sizeof(float);
        o.tensor = static_cast<int>(t);
        o.role = role;
        out.push_back(std::move(o));
      }
    }
    return out;
  }

  void FinisherLoop() {
    for (;;) {
      std::unique_ptr<WindowJob> job;
      {
        MutexLock lock(&mu_);
        cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stop_ || job_ != nullptr; });
        if (job_ == nullptr) return;
        job = std::move(job_);
      }
      Status s = Finish(*job);
      {
        MutexLock lock(&mu_);
        auto* ws = WindowStats(job->window);
        if (s.ok()) {
          ++persisted_;
        } else {
          ++failed_;
          errors_.push_back(s);
          if (ws != nullptr) ws->error = s.ToString();
        }
        job_pending_ = false;
      }
      cv_.SignalAll();
    }
  }

  // Waits for the window's copies, replays, persists (finisher thread).
  Status Finish(WindowJob& job) {
    for (auto& b : job.batches) NONSTOP_RETURN_IF_ERROR(b->Wait());
    const auto t0 = Clock::now();
    NONSTOP_RETURN_IF_ERROR(Replay(job));
    const double replay_s = Since(t0);
    std::vector<TensorRef> refs;
    refs.reserve(job.outputs.size());
    for (const auto& o : job.outputs) {
      TensorRef r;
      r.spec = o.spec;
      r.data = o.tensor >= 0 ? RoleBuffer(o.tensor, o.role) : o.data;
      refs.push_back(std::move(r));
    }
    uint64_t counter = 0;
    {
      MutexLock lock(&engine_mu_);
      if (!SameRefs(refs, registered_)) {
        NONSTOP_RETURN_IF_ERROR(engine_->Register(refs));
        registered_ = refs;
      }
      NONSTOP_ASSIGN_OR_RETURN(counter, engine_->Checkpoint(job.version, std::move(job.meta)));
      // The next window may overwrite the host buffers once they are read.
      NONSTOP_RETURN_IF_ERROR(engine_->WaitCopied());
    }
    MutexLock lock(&mu_);
    if (auto* ws = WindowStats(job.window)) {
      ws->replay_s = replay_s;
      ws->counter = counter;
    }
    return Status::OK();
  }

  static bool SameRefs(const std::vector<TensorRef>& a, const std::vector<TensorRef>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].data != b[i].data || a[i].spec.name != b[i].spec.name ||
          a[i].spec.dtype != b[i].spec.dtype || a[i].spec.shape != b[i].spec.shape ||
          a[i].spec.nbytes != b[i].spec.nbytes) {
        return false;
      }
    }
    return true;
  }

  // Brings every piece of every part to the window's version, in slices of
  // up to kSlice elements spread over the replay threads (elementwise
  // kernels: slicing does not change a bit).
  Status Replay(const WindowJob& job) {
    static constexpr size_t kSlice = 1 << 18;
    struct Work {
      int part;
      size_t piece_index;  // in the part's block order
      Piece piece;
      size_t lo, hi;       // element range within the tensor
    };
    std::vector<Work> work;
    for (int p = 0; p + 1 < K(); ++p) {  // the last part is already at the version
      size_t idx = 0;
      for (const Block& block : parts_[p].blocks) {
        for (const Piece& pc : block.pieces) {
          for (size_t lo = pc.begin; lo < pc.end; lo += kSlice) {
            work.push_back({p, idx, pc, lo, std::min(pc.end, lo + kSlice)});
          }
          ++idx;
        }
      }
    }
    if (work.empty()) return Status::OK();
    int threads = opts_.replay_threads > 0 ? opts_.replay_threads
                                           : static_cast<int>(std::thread::hardware_concurrency());
    threads = std::clamp<int>(threads, 1, static_cast<int>(work.size()));
    std::atomic<size_t> next{0};
    Mutex err_mu;
    Status first;
    auto run = [&] {
      std::vector<optim::StepRecord> steps;
      for (size_t w = next++; w < work.size(); w = next++) {
        const Work& wk = work[w];
        const int t = wk.piece.tensor;
        const int group = tensors_[t].group;
        steps.clear();
        // Part p (0-based) was copied at version N+p: it needs steps N+p+1..N+K-1.
        for (int j = wk.part + 1; j < K(); ++j) {
          const LoggedStep& e = job.log[j - 1];
          optim::StepRecord rec;
          if (!e.skipped && group < static_cast<int>(e.groups.size())) {
            rec.hyper = e.groups[group];
          }
          rec.hyper.skipped = e.skipped || !e.has_grad[t];
          rec.hyper.step = 0;  // the count is carried in PartState
          if (!rec.hyper.skipped) {
            const size_t esize = DTypeSize(e.grad_dtype[t]);
            rec.grad.data = grad_arena_.data() + grad_offset_[j][t] + wk.lo * esize;
            rec.grad.dtype = e.grad_dtype[t];
          }
          steps.push_back(rec);
        }
        optim::PartState st;
        st.numel = wk.hi - wk.lo;
        auto buf = [&](StateRole r) {
          float* b = RoleBuffer(t, r);
          return b == nullptr ? nullptr : b + wk.lo;
        };
        st.param = buf(StateRole::kParam);
        st.exp_avg = buf(StateRole::kExpAvg);
        st.exp_avg_sq = buf(StateRole::kExpAvgSq);
        st.max_exp_avg_sq = buf(StateRole::kMaxExpAvgSq);
        st.momentum_buffer = buf(StateRole::kMomentumBuffer);
        st.step = job.piece_step[wk.part][wk.piece_index];
        st.has_momentum_buffer = job.piece_has_momentum[wk.part][wk.piece_index] != 0;
        optim::ReplayOptions ro;
        ro.num_threads = 1;
        ro.mkl_vms_sqrt = opts_.mkl_vms_sqrt;
        Status s = optim::Replay(job.config, steps, &st, ro);
        if (!s.ok()) {
          MutexLock lock(&err_mu);
          if (first.ok()) {
            first = Status(s.code(), "multistep replay of '" + tensors_[t].name + "': " +
                                         s.message());
          }
        }
      }
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < threads; ++i) pool.emplace_back(run);
    run();
    for (auto& th : pool) th.join();
    return first;
  }

  // Ends the open window after an error: its copies finish, nothing is persisted.
  Status Abort(Status s) {
    (void)WaitBatches(&state_pending_);
    (void)WaitBatches(&grad_pending_);
    active_ = false;
    MutexLock lock(&mu_);
    ++failed_;
    if (auto* ws = WindowStats(window_index_)) ws->error = s.ToString();
    return s;
  }

  Status TakeError() {
    MutexLock lock(&mu_);
    if (errors_.empty()) return Status::OK();
    Status s = errors_.front();
    errors_.pop_front();
    return s;
  }

  MultistepWindowStats* WindowStats(uint64_t window) REQUIRES(mu_) {
    if (window < recent_base_ || window - recent_base_ >= recent_.size()) return nullptr;
    return &recent_[window - recent_base_];
  }

  void AddStall(double s, bool state) {
    MutexLock lock(&mu_);
    stall_total_ += s;
    if (auto* ws = WindowStats(window_index_)) {
      ws->stall_s += s;
      (state ? ws->state_wait_s : ws->grad_wait_s) += s;
    }
  }

  void AddBytes(uint64_t state, uint64_t grad) {
    MutexLock lock(&mu_);
    if (auto* ws = WindowStats(window_index_)) {
      ws->state_bytes += state;
      ws->grad_bytes += grad;
    }
  }

  static constexpr size_t kNone = ~size_t{0};

  Engine* const engine_;
  const MultistepOptions opts_;
  std::unique_ptr<CopyEngine> copy_;
  std::unique_ptr<CopyDispatcher> dispatcher_;

  // Training thread only.
  bool closed_ = false;
  bool active_ = false;
  int64_t begin_step_ = 0;
  int pos_ = 0;  // j: the window's current step is N + j
  optim::OptimizerConfig config_;
  std::vector<OptimizerTensor> tensors_;
  std::vector<Part> parts_;
  std::vector<std::array<size_t, kNumRoles>> role_offset_;
  std::vector<std::vector<size_t>> grad_offset_;  // [j][tensor]
  HostArena state_arena_, grad_arena_;
  std::vector<uint8_t> extras_;
  std::vector<LoggedStep> log_;
  std::vector<int64_t> applied_;  // per tensor: updates applied since Begin
  std::vector<std::vector<double>> piece_step_;
  std::vector<std::vector<uint8_t>> piece_has_momentum_;
  std::vector<std::shared_ptr<Batch>> batches_, state_pending_, grad_pending_;
  std::vector<OutputTensor> outputs_;
  std::string meta_;
  bool outputs_set_ = false;
  Clock::time_point window_start_;
  uint64_t window_index_ = 0;

  // Shared with the finisher.
  Mutex mu_;
  CondVar cv_;
  std::unique_ptr<WindowJob> job_ GUARDED_BY(mu_);
  bool job_pending_ GUARDED_BY(mu_) = false;  // a job is queued or running
  bool stop_ GUARDED_BY(mu_) = false;
  std::deque<Status> errors_ GUARDED_BY(mu_);
  std::vector<MultistepWindowStats> recent_ GUARDED_BY(mu_);
  uint64_t recent_base_ GUARDED_BY(mu_) = 0, windows_ GUARDED_BY(mu_) = 0,
                                            persisted_ GUARDED_BY(mu_) = 0,
                                            failed_ GUARDED_BY(mu_) = 0;
  double stall_total_ GUARDED_BY(mu_) = 0;  // written by the training thread

  Mutex engine_mu_;  // serialises calls into engine_
  std::vector<TensorRef> registered_ GUARDED_BY(engine_mu_);

  std::thread finisher_;  // last: started after everything it uses
};

}  // namespace

Result<std::unique_ptr<MultistepCheckpoint>> MultistepCheckpoint::Create(
    Engine* engine, const MultistepOptions& options, std::unique_ptr<CopyEngine> copy) {
  if (engine == nullptr) return Status::InvalidArgument("multistep: engine is null");
  if (options.parts < 1 || options.parts > 64) {
    return Status::InvalidArgument("multistep: parts must be 1..64, got " +
                                   std::to_string(options.parts));
  }
  if (options.block_bytes < 4096 || options.block_bytes % 4 != 0) {
    return Status::InvalidArgument("multistep: block_bytes must be a multiple of 4, >= 4096");
  }
  if (copy == nullptr) copy = MakeBestCopyEngine(1, nullptr);
  return std::unique_ptr<MultistepCheckpoint>(
      new MultistepCheckpointImpl(engine, options, std::move(copy)));
}

}  // namespace nonstop
