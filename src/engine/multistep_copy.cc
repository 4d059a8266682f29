// The multi-step schedule's copies: how the state is cut into parts, the
// copy dispatcher, host memory and the state buffers the parts land in
// (multistep_internal.h).
#include <algorithm>
#include <cstring>
#include <utility>

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

namespace {

constexpr size_t kAlign = 64;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

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

bool UsesRole(const optim::OptimizerConfig& config, StateRole role) {
  const bool adam = config.algorithm != optim::Algorithm::kSgd;
  switch (role) {
    case StateRole::kParam:
      return true;
    case StateRole::kExpAvg:
    case StateRole::kExpAvgSq:
      return adam;
    case StateRole::kMaxExpAvgSq:
      return adam && config.amsgrad;
    case StateRole::kMomentumBuffer:
      return !adam;
  }
  return false;
}

const float* RoleSource(const OptimizerTensor& t, StateRole role) {
  switch (role) {
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

// ---------------------------------------------------------------- batches

void Batch::Expect(int n) {
  MutexLock lock(&mu_);
  remaining_ = n;
}

void Batch::Done(const Status& s) {
  MutexLock lock(&mu_);
  if (!s.ok() && error_.ok()) error_ = s;
  if (--remaining_ == 0) cv_.SignalAll();
}

Status Batch::Wait() {
  MutexLock lock(&mu_);
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return remaining_ == 0; });
  return error_;
}

bool Batch::Ready() {
  MutexLock lock(&mu_);
  return remaining_ == 0;
}

Status WaitBatches(std::vector<std::shared_ptr<Batch>>* pending) {
  Status first;
  for (auto& b : *pending) {
    Status s = b->Wait();
    if (!s.ok() && first.ok()) first = s;
  }
  pending->clear();
  return first;
}

// ---------------------------------------------------------------- dispatcher

CopyDispatcher::CopyDispatcher(CopyEngine* engine, int window)
    : engine_(engine), window_(std::max(1, window)), thread_([this] { Run(); }) {}

CopyDispatcher::~CopyDispatcher() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void CopyDispatcher::Enqueue(std::vector<CopyItem> items, bool high) {
  if (items.empty()) return;
  {
    MutexLock lock(&mu_);
    auto& q = high ? high_ : low_;
    for (auto& it : items) q.push_back(std::move(it));
  }
  cv_.SignalAll();
}

void CopyDispatcher::Run() {
  struct InFlight {
    std::unique_ptr<CopyCompletion> completion;
    std::shared_ptr<Batch> batch;
  };
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
        in_flight.push_back({engine_->Copy(next.src, next.device, next.dst, next.bytes), next.batch});
      }
      continue;
    }
    // The window is full (or nothing is queued): retire the oldest copy.
    InFlight done = std::move(in_flight.front());
    in_flight.pop_front();
    done.batch->Done(done.completion->Wait());
  }
}

// ---------------------------------------------------------------- host memory

bool HostArena::Reset(CopyEngine* engine, size_t bytes) {
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

Status StateBuffers::Plan(CopyEngine* copy, const optim::OptimizerConfig& config,
                          const std::vector<OptimizerTensor>& tensors) {
  offset_.assign(tensors.size(), {});
  size_t bytes = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (int r = 0; r < kNumRoles; ++r) {
      if (!UsesRole(config, static_cast<StateRole>(r))) {
        offset_[t][r] = kNone;
        continue;
      }
      offset_[t][r] = bytes;
      bytes += AlignUp(tensors[t].numel * sizeof(float));
    }
  }
  if (arena_.size() != bytes || arena_.data() == nullptr) {
    if (!arena_.Reset(copy, bytes) && bytes > 0) {
      return Status::Unavailable("multistep: cannot allocate " + std::to_string(bytes) +
                                 " bytes of host memory for the state");
    }
  }
  return Status::OK();
}

float* StateBuffers::Role(int t, StateRole role) const {
  const size_t off = offset_[t][static_cast<int>(role)];
  if (off == kNone) return nullptr;
  return reinterpret_cast<float*>(arena_.data() + off);
}

}  // namespace multistep_internal
}  // namespace nonstop
