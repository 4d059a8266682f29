// The multi-step schedule's copies: how the state is cut into parts, the
// copy dispatcher, host memory and the state buffers the parts land in
// (multistep_internal.h).
#include <algorithm>
#include <cstring>
#include <map>
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

// Staged buffers (multistep_internal.h): 4 KiB for one the slot layout puts
// in the large region, else 64 bytes.
size_t StagedAlign(size_t nbytes) { return nbytes >= kLargeTensorBytes ? kStoreAlign : kAlign; }

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

size_t StagedOffset(size_t* end, size_t nbytes) {
  const size_t a = StagedAlign(nbytes);
  const size_t off = (*end + a - 1) / a * a;
  *end = off + (nbytes + a - 1) / a * a;
  return off;
}

void ZeroStagedTail(uint8_t* buffer, size_t nbytes) {
  const size_t a = StagedAlign(nbytes);
  std::memset(buffer + nbytes, 0, (nbytes + a - 1) / a * a - nbytes);
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
      offset_[t][r] = StagedOffset(&bytes, tensors[t].numel * sizeof(float));
    }
  }
  if (arena_.size() != bytes || arena_.data() == nullptr) {
    if (!arena_.Reset(copy, bytes) && bytes > 0) {
      return Status::Unavailable("multistep: cannot allocate " + std::to_string(bytes) +
                                 " bytes of host memory for the state");
    }
  }
  // The engine writes whole 4 KiB units out of these buffers: the bytes
  // after each tensor up to its extent's end are the slot's zero padding.
  // Nothing else writes there (copies and replay stay inside the tensor).
  for (size_t t = 0; t < tensors.size() && arena_.data() != nullptr; ++t) {
    for (int r = 0; r < kNumRoles; ++r) {
      if (offset_[t][r] != kNone) {
        ZeroStagedTail(arena_.data() + offset_[t][r], tensors[t].numel * sizeof(float));
      }
    }
  }
  return Status::OK();
}

float* StateBuffers::Role(int t, StateRole role) const {
  const size_t off = offset_[t][static_cast<int>(role)];
  if (off == kNone) return nullptr;
  return reinterpret_cast<float*>(arena_.data() + off);
}

// ---------------------------------------------------------------- outputs

Status Refresh(std::vector<OptimizerTensor>* tensors, std::span<const OptimizerTensor> refreshed) {
  if (refreshed.size() != tensors->size()) {
    return Status::InvalidArgument("multistep: refreshed tensor list has a different length "
                                   "than Begin's");
  }
  for (size_t t = 0; t < tensors->size(); ++t) {
    auto& dst = (*tensors)[t];
    if (refreshed[t].numel != dst.numel) {
      return Status::InvalidArgument("multistep: tensor '" + dst.name +
                                     "' changed size during a window");
    }
    dst.param = refreshed[t].param;
    dst.exp_avg = refreshed[t].exp_avg;
    dst.exp_avg_sq = refreshed[t].exp_avg_sq;
    dst.max_exp_avg_sq = refreshed[t].max_exp_avg_sq;
    dst.momentum_buffer = refreshed[t].momentum_buffer;
  }
  return Status::OK();
}

void MatchOutputs(const optim::OptimizerConfig& config, const std::vector<OptimizerTensor>& tensors,
                  std::vector<OutputTensor>* outputs) {
  std::map<const void*, std::pair<int, StateRole>> owned;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (int r = 0; r < kNumRoles; ++r) {
      const auto role = static_cast<StateRole>(r);
      const float* src = RoleSource(tensors[t], role);
      if (UsesRole(config, role) && src != nullptr) owned[src] = {static_cast<int>(t), role};
    }
  }
  for (auto& o : *outputs) {
    const auto it = o.tensor < 0 && o.spec.dtype == DType::kFloat32 && o.spec.nbytes > 0
                        ? owned.find(o.data)
                        : owned.end();
    if (it == owned.end() || tensors[it->second.first].numel * sizeof(float) != o.spec.nbytes) {
      continue;
    }
    o.tensor = it->second.first;
    o.role = it->second.second;
    o.data = nullptr;
    o.device = Device{};
  }
}

Status CopyOtherOutputs(CopyEngine* copy, HostArena* arena, std::vector<OutputTensor>* outputs) {
  size_t bytes = 0;
  for (const auto& o : *outputs) {
    if (o.tensor < 0) (void)StagedOffset(&bytes, o.spec.nbytes);
  }
  // Grows only; the Engine writes these buffers as they are (staged).
  if (arena->size() < bytes && !arena->Reset(copy, bytes)) {
    return Status::Unavailable("multistep: cannot allocate " + std::to_string(bytes) +
                               " bytes of host memory for the other tensors");
  }
  size_t end = 0;
  for (auto& o : *outputs) {
    if (o.tensor >= 0) continue;
    const size_t off = StagedOffset(&end, o.spec.nbytes);
    if (o.spec.nbytes > 0) {
      uint8_t* dst = arena->data() + off;
      ZeroStagedTail(dst, o.spec.nbytes);
      if (o.device.kind == DeviceKind::kHost) {
        std::memcpy(dst, o.data, o.spec.nbytes);
      } else {
        NONSTOP_RETURN_IF_ERROR(copy->Copy(o.data, o.device, dst, o.spec.nbytes)->Wait());
      }
      o.data = dst;
    }
    o.device = Device{};
  }
  return Status::OK();
}

std::vector<OutputTensor> DefaultOutputs(const optim::OptimizerConfig& config,
                                         const std::vector<OptimizerTensor>& tensors) {
  std::vector<OutputTensor> out;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (int r = 0; r < kNumRoles; ++r) {
      const auto role = static_cast<StateRole>(r);
      if (!UsesRole(config, role)) continue;
      OutputTensor o;
      o.spec.name = tensors[t].name + "/" + std::string(StateRoleName(role));
      o.spec.dtype = DType::kFloat32;
      o.spec.shape = {static_cast<int64_t>(tensors[t].numel)};
      o.spec.nbytes = tensors[t].numel * sizeof(float);
      o.tensor = static_cast<int>(t);
      o.role = role;
      out.push_back(std::move(o));
    }
  }
  return out;
}

bool SameRegistration(const std::vector<TensorRef>& a, const std::vector<TensorRef>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].data != b[i].data || a[i].staged != b[i].staged || a[i].spec.name != b[i].spec.name ||
        a[i].spec.dtype != b[i].spec.dtype || a[i].spec.shape != b[i].spec.shape ||
        a[i].spec.nbytes != b[i].spec.nbytes) {
      return false;
    }
  }
  return true;
}

}  // namespace multistep_internal
}  // namespace nonstop
