// The multi-step (GoCkpt) schedule's orchestration; see
// include/nonstop/multistep.h and docs/MULTISTEP.md. The parts, copies and
// buffers are in multistep_copy.cc, the gradient log in multistep_gradlog.cc,
// the CPU replay in multistep_replay.cc (multistep_internal.h lists them).
//
// Three threads take part:
//   * the training thread calls Begin, the hooks and SetOutputs;
//   * the copy dispatcher (CopyDispatcher) hands copies to the CopyEngine, at
//     most `copy_window` at a time, gradient copies before state copies, so a
//     gradient never waits for more than `copy_window` state blocks;
//   * the finisher waits for a closed window's copies, replays the parts on
//     the CPU and persists the result through the Engine.
#include "nonstop/multistep.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "engine/multistep_internal.h"

namespace nonstop {

namespace {

using multistep_internal::Batch;
using multistep_internal::Block;
using multistep_internal::CopyDispatcher;
using multistep_internal::CopyItem;
using multistep_internal::kNumRoles;
using multistep_internal::LoggedStep;
using multistep_internal::Part;
using multistep_internal::Piece;
using multistep_internal::RoleSource;
using multistep_internal::WaitBatches;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

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
  int64_t begin = 0;                            // N
  std::vector<double> begin_step;               // per tensor at Begin (kRestore's plan)
  std::vector<uint8_t> begin_state;
  std::vector<OutputTensor> outputs;
  std::string meta;
};

// The state the optimizer makes at a tensor's first update.
const float* FirstState(const optim::OptimizerConfig& c, const OptimizerTensor& t) {
  return c.algorithm == optim::Algorithm::kSgd ? t.momentum_buffer : t.exp_avg;
}

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
    begin_step_count_.clear();
    begin_state_.clear();
    for (const auto& t : tensors_) {
      begin_step_count_.push_back(t.step);
      begin_state_.push_back(FirstState(config_, t) != nullptr);
    }
    NONSTOP_RETURN_IF_ERROR(Plan());
    begin_step_ = step;
    pos_ = 1;
    active_ = true;
    outputs_set_ = false;
    outputs_.clear();
    meta_.clear();
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
      Status s = grad_log_.Record(j, tensors_, groups, skipped, grads);
      if (!s.ok()) return Abort(s);
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
      Status st = multistep_internal::Refresh(&tensors_, refreshed);
      if (!st.ok()) return Abort(st);
    }
    const LoggedStep& e = grad_log_.step(j);
    if (!e.skipped) {
      for (size_t t = 0; t < tensors_.size(); ++t) applied_[t] += e.has_grad[t];
    }
    pos_ = j + 1;
    EnqueuePart(j);
    return Status::OK();
  }

  bool needs_refresh() const override {
    return active_ && std::any_of(tensors_.begin(), tensors_.end(), [&](const auto& t) {
             return FirstState(config_, t) == nullptr;
           });
  }

  Status SetOutputs(std::vector<OutputTensor> outputs, std::string meta_json) override {
    if (!active_ || pos_ != K()) {
      return Status::FailedPrecondition(
          "multistep: SetOutputs belongs after the update of step " +
          std::to_string(version()) + " while its window is open");
    }
    const auto t0 = Clock::now();
    multistep_internal::MatchOutputs(config_, tensors_, &outputs);
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
      }
    }
    // Tensors the optimizer does not own are copied now, at version N+K-1.
    NONSTOP_RETURN_IF_ERROR(multistep_internal::CopyOtherOutputs(copy_.get(), &extras_, &outputs));
    outputs_ = std::move(outputs);
    meta_ = std::move(meta_json);
    outputs_set_ = true;
    AddStall(Since(t0), /*state=*/false);
    return Status::OK();
  }

  Status CountUpdate(bool scaler_inside) override {
    if (scaler_inside && opts_.replay == MultistepReplay::kRestore) {
      return Status::InvalidArgument(
          "mode='multistep': GradScaler steps this fused optimizer itself (it unscales and "
          "skips overflow steps inside the kernel, out of the log's sight): use fused=False "
          "with GradScaler");
    }
    if (++updates_ > 1 && active_) {
      return Status::InvalidArgument(
          "mode='multistep' needs one optimizer.step() per ckpt.step(); call ckpt.step(step) "
          "after every training step");
    }
    return Status::OK();
  }

  int64_t next_step() const override { return last_step_ ? *last_step_ + 1 : 0; }

  Result<bool> MarkStep(int64_t step, bool due) override {
    last_step_ = step;
    if (updates_ == 0 && active_) {  // no optimizer.step() this step: GradScaler skipped it
      NONSTOP_RETURN_IF_ERROR(OnUpdateBegin(step, {}, /*skipped=*/true, {}));
      NONSTOP_RETURN_IF_ERROR(OnUpdateEnd(step, {}));
    }
    updates_ = 0;
    due_ = due_ || due;
    if (!due_ || active_) return false;
    due_ = false;
    return true;
  }

  bool RequestCheckpoint() override {
    if (!active_) return true;
    due_ = true;
    return false;
  }

  bool outputs_due() const override { return active_ && !outputs_set_ && pos_ == K(); }

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
    s.host_bytes = state_.bytes() + grad_log_.bytes() + extras_.size();
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
    state_.Free();
    grad_log_.Free();
    extras_.Reset(nullptr, 0);
    return s;
  }

 private:
  int K() const { return std::max(1, opts_.parts); }

  bool UsesRole(StateRole r) const { return multistep_internal::UsesRole(config_, r); }
  float* RoleBuffer(int t, StateRole r) const { return state_.Role(t, r); }

  // Lays out parts, state buffers and the gradient log; reuses the buffers
  // when the layout is unchanged.
  Status Plan() {
    std::vector<size_t> numels;
    numels.reserve(tensors_.size());
    for (const auto& t : tensors_) numels.push_back(t.numel);
    const size_t block_elements = std::max<uint64_t>(1, opts_.block_bytes / sizeof(float));
    parts_ = multistep_internal::PlanParts(numels, block_elements, K());
    NONSTOP_RETURN_IF_ERROR(state_.Plan(copy_.get(), config_, tensors_));
    return grad_log_.Plan(copy_.get(), tensors_, parts_);
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
          const float* src = RoleSource(t, role);
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
    uint64_t bytes = 0;
    auto batch = grad_log_.Enqueue(j, tensors_, grads, opts_.block_bytes, dispatcher_.get(), &bytes);
    AddBytes(0, bytes);
    grad_pending_.push_back(batch);
    batches_.push_back(batch);
  }

  // Hands the closed window to the finisher.
  void CloseWindow() {
    auto job = std::make_unique<WindowJob>();
    job->window = window_index_;
    job->version = version();
    job->config = config_;
    job->batches = std::move(batches_);
    job->log = grad_log_.TakeLog();
    job->piece_step = std::move(piece_step_);
    job->piece_has_momentum = std::move(piece_has_momentum_);
    job->begin = begin_step_;
    job->begin_step = begin_step_count_;
    job->begin_state = begin_state_;
    if (outputs_set_) {
      job->outputs = std::move(outputs_);
      job->meta = std::move(meta_);
    } else {
      job->outputs = multistep_internal::DefaultOutputs(config_, tensors_);
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
    if (opts_.replay == MultistepReplay::kHost) {
      NONSTOP_RETURN_IF_ERROR(Replay(job));
    } else {
      // The parts stay at their versions; the gradient log and the plan go
      // with them, and the restorer replays (docs/MULTISTEP.md).
      std::vector<OutputTensor> gradients;
      const std::string plan = multistep_internal::RestorePlan(
          ReplayInputOf(job), &grad_log_, job.begin, job.begin_step, job.begin_state, &gradients);
      job.meta = multistep_internal::AddToMeta(job.meta, "multistep_plan", plan);
      for (auto& g : gradients) job.outputs.push_back(std::move(g));
    }
    const double replay_s = Since(t0);
    // The buffers are the checkpoint's staging: the Engine writes them to
    // the medium as they are (TensorRef::staged), through its one write path
    // and committer; nothing copies them again.
    std::vector<TensorRef> refs;
    refs.reserve(job.outputs.size());
    for (const auto& o : job.outputs) {
      TensorRef r;
      r.spec = o.spec;
      r.data = o.tensor >= 0 ? RoleBuffer(o.tensor, o.role) : o.data;
      r.staged = true;
      refs.push_back(std::move(r));
    }
    uint64_t counter = 0;
    {
      MutexLock lock(&engine_mu_);
      if (!multistep_internal::SameRegistration(refs, registered_)) {
        NONSTOP_RETURN_IF_ERROR(engine_->Register(refs));
        registered_ = refs;
      }
      NONSTOP_ASSIGN_OR_RETURN(counter, engine_->BeginCheckpoint(job.version));
      // EndCheckpoint queues every tensor's writes, then may return an
      // earlier checkpoint's failure: the writes run either way, so the
      // buffers are waited for either way. The next window may overwrite
      // them once WaitCopied says every unit is written.
      Status ended = engine_->EndCheckpoint(counter, job.version, std::move(job.meta));
      Status written = engine_->WaitCopied();
      if (!ended.ok() && !written.ok()) {
        MutexLock lock(&mu_);  // each failure is reported once, none lost
        errors_.push_back(written);
      }
      NONSTOP_RETURN_IF_ERROR(ended);
      NONSTOP_RETURN_IF_ERROR(written);
    }
    MutexLock lock(&mu_);
    if (auto* ws = WindowStats(job.window)) {
      ws->replay_s = replay_s;
      ws->counter = counter;
    }
    return Status::OK();
  }

  // Brings every part to the window's version (multistep_replay.cc).
  Status Replay(const WindowJob& job) {
    return multistep_internal::ReplayWindow(ReplayInputOf(job), state_);
  }

  multistep_internal::ReplayInput ReplayInputOf(const WindowJob& job) {
    multistep_internal::ReplayInput in;
    in.config = &job.config;
    in.tensors = &tensors_;
    in.parts = &parts_;
    in.log = &job.log;
    in.gradients = &grad_log_;
    in.piece_step = &job.piece_step;
    in.piece_has_momentum = &job.piece_has_momentum;
    in.threads = opts_.replay_threads;
    in.mkl_vms_sqrt = opts_.mkl_vms_sqrt;
    return in;
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
  multistep_internal::StateBuffers state_;
  multistep_internal::GradientLog grad_log_;
  multistep_internal::HostArena extras_;  // SetOutputs' copies (tensor < 0)
  std::vector<int64_t> applied_;  // per tensor: updates applied since Begin
  std::vector<double> begin_step_count_;  // per tensor: Adam's step count at Begin
  std::vector<uint8_t> begin_state_;      // per tensor: its optimizer state existed at Begin
  std::vector<std::vector<double>> piece_step_;
  std::vector<std::vector<uint8_t>> piece_has_momentum_;
  std::vector<std::shared_ptr<Batch>> batches_, state_pending_, grad_pending_;
  std::vector<OutputTensor> outputs_;
  std::string meta_;
  bool outputs_set_ = false;
  // The driver's steps (CountUpdate, MarkStep, RequestCheckpoint): training thread.
  int updates_ = 0;                  // updates counted since the last MarkStep
  std::optional<int64_t> last_step_;  // the last marked step
  bool due_ = false;                 // a checkpoint waits for the open window to close
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
