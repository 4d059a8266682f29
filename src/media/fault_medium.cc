#include "media/fault_medium.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "media/media_internal.h"
#include "media/sticky_medium.h"

namespace nonstop {
namespace {

const char* OpName(FaultOp op) {
  switch (op) {
    case FaultOp::kWrite:
      return "write";
    case FaultOp::kRead:
      return "read";
    case FaultOp::kSync:
      return "sync";
    case FaultOp::kResize:
      return "resize";
  }
  return "?";
}

std::string RangeText(const char* op, uint64_t offset, size_t n) {
  return std::string(op) + " at " + std::to_string(offset) + " (+" + std::to_string(n) +
         " bytes)";
}

// Copies `n` bytes to `offset` of `image`, growing it (with zeros) as a file
// grows when written past its end.
void ApplyWrite(std::vector<uint8_t>& image, uint64_t offset, const uint8_t* p, size_t n) {
  if (n == 0) return;
  if (image.size() < offset + n) image.resize(offset + n);
  std::memcpy(image.data() + offset, p, n);
}

constexpr uint64_t kPage = 4096;

struct PageSpan {
  uint64_t page, lo, hi;  // [lo, hi): the bytes of [offset, offset + n) in page
};

// The 4096-byte pages that [offset, offset + n) touches. (A list, not a
// callback: a lambda is analysed for locks on its own, without mu_.)
std::vector<PageSpan> PagesOf(uint64_t offset, uint64_t n) {
  std::vector<PageSpan> spans;
  const uint64_t end = offset + n;
  for (uint64_t lo = offset; lo < end;) {
    const uint64_t page = lo / kPage;
    const uint64_t hi = std::min(end, (page + 1) * kPage);
    spans.push_back({page, lo, hi});
    lo = hi;
  }
  return spans;
}

}  // namespace

class FaultMedium final : public Medium {
 public:
  FaultMedium(std::shared_ptr<FaultDisk> disk, uint64_t generation)
      : disk_(std::move(disk)), generation_(generation) {}

  Status Write(uint64_t offset, const void* buf, size_t n) override {
    return disk_->DoWrite(generation_, offset, buf, n);
  }
  Status Read(uint64_t offset, void* buf, size_t n) override {
    return disk_->DoRead(generation_, offset, buf, n);
  }
  Status Sync() override { return disk_->DoSync(generation_); }
  Status Resize(uint64_t size) override { return disk_->DoResize(generation_, size); }
  uint64_t Size() const override { return disk_->DoSize(generation_); }
  size_t Alignment() const override { return disk_->opts_.alignment; }
  MediumKind kind() const override { return disk_->opts_.kind; }
  std::string Describe() const override {
    return "fault-injecting (align " + std::to_string(disk_->opts_.alignment) + ")";
  }

 private:
  const std::shared_ptr<FaultDisk> disk_;
  const uint64_t generation_;
};

std::shared_ptr<FaultDisk> FaultDisk::Create(FaultDiskOptions opts) {
  if (opts.alignment == 0) opts.alignment = 1;
  return std::shared_ptr<FaultDisk>(new FaultDisk(opts));
}

std::unique_ptr<Medium> FaultDisk::Open() {
  std::unique_ptr<Medium> m;
  {
    MutexLock lock(&mu_);
    m = std::make_unique<FaultMedium>(shared_from_this(), generation_);
  }
  if (!opts_.sticky_sync) return m;
  return std::make_unique<media::StickySyncMedium>("fault-injecting device", std::move(m));
}

void FaultDisk::Crash(CrashMode mode, uint64_t seed) {
  MutexLock lock(&mu_);
  CrashLocked(mode, seed);
}

void FaultDisk::CrashLocked(CrashMode mode, uint64_t seed) {
  if (mode == CrashMode::kProcess) {
    durable_ = visible_;
  } else if (mode == CrashMode::kTornUnsynced) {
    std::mt19937_64 rng(seed);
    for (const LogEntry& e : log_) {
      if (e.is_resize) {
        if (rng() & 1) durable_.resize(e.offset);
        continue;
      }
      const uint64_t end = e.offset + e.bytes.size();
      switch (rng() % 3) {
        case 0:  // lost
          break;
        case 1:  // kept whole
          ApplyWrite(durable_, e.offset, e.bytes.data(), e.bytes.size());
          break;
        default:  // torn: each device sector it touches kept or lost alone
          for (uint64_t s = e.offset; s < end;) {
            const uint64_t piece_end = std::min(end, (s / kSectorSize + 1) * kSectorSize);
            if (rng() & 1) {
              ApplyWrite(durable_, s, e.bytes.data() + (s - e.offset), piece_end - s);
            }
            s = piece_end;
          }
          break;
      }
    }
  }
  log_.clear();
  log_.shrink_to_fit();
  stale_pages_.clear();  // the page cache is gone
  visible_ = durable_;
  ++generation_;
  ++crashes_;
}

void FaultDisk::AddRule(Rule r) {
  MutexLock lock(&mu_);
  r.at_call += calls_[static_cast<int>(r.op)];
  rules_.push_back(r);
}

void FaultDisk::CrashOnCall(FaultOp op, uint64_t nth_call, CrashMode mode, uint64_t seed) {
  AddRule({op, nth_call, /*persistent=*/false, /*crash=*/true, 0, mode, seed});
}

void FaultDisk::InjectError(FaultOp op, uint64_t nth_call, int err) {
  AddRule({op, nth_call, /*persistent=*/false, /*crash=*/false, err,
           CrashMode::kDropUnsynced, 0});
}

void FaultDisk::InjectErrorFrom(FaultOp op, uint64_t nth_call, int err) {
  AddRule({op, nth_call, /*persistent=*/true, /*crash=*/false, err,
           CrashMode::kDropUnsynced, 0});
}

void FaultDisk::ClearErrors() {
  MutexLock lock(&mu_);
  rules_.clear();
}

Status FaultDisk::BeginCallLocked(FaultOp op, uint64_t generation, const std::string& what) {
  if (generation != generation_) {
    return Status::IOError(what + " on fault-injecting device: device crashed " +
                           "(simulated power loss; open a new medium to see the disk)");
  }
  const uint64_t call = ++calls_[static_cast<int>(op)];
  for (auto it = rules_.begin(); it != rules_.end(); ++it) {
    const Rule r = *it;
    if (r.op != op || !(call == r.at_call || (r.persistent && call > r.at_call))) continue;
    if (!r.persistent) rules_.erase(it);
    if (r.crash) {
      CrashLocked(r.mode, r.seed);
      return Status::IOError(what + " on fault-injecting device: device crashed " +
                             "(scheduled crash on " + OpName(op) + " call " +
                             std::to_string(call) + ")");
    }
    if (op == FaultOp::kSync && opts_.forget_failed_syncs) {
      // Linux: the failed writeback's pages are clean now; their data never
      // reaches the durable image, and the next sync has nothing to do.
      if (opts_.unwritten_extents) {
        for (const LogEntry& e : log_) {
          if (e.is_resize) continue;
          for (const PageSpan& sp : PagesOf(e.offset, e.bytes.size())) {
            if (written_pages_.count(sp.page) == 0) stale_pages_.insert(sp.page);
          }
        }
      }
      log_.clear();
    }
    return Status::FromErrno("fault-injected " + what, r.err);
  }
  return Status::OK();
}

Status FaultDisk::DoWrite(uint64_t generation, uint64_t offset, const void* buf, size_t n) {
  const std::string what = RangeText("write", offset, n);
  NONSTOP_RETURN_IF_ERROR(
      media::CheckAligned("write", "fault-injecting device", offset, buf, n, opts_.alignment));
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(BeginCallLocked(FaultOp::kWrite, generation, what));
  const auto* p = static_cast<const uint8_t*>(buf);
  ApplyWrite(visible_, offset, p, n);
  if (n > 0) log_.push_back({false, offset, std::vector<uint8_t>(p, p + n)});
  ++writes_;
  return Status::OK();
}

Status FaultDisk::DoRead(uint64_t generation, uint64_t offset, void* buf, size_t n) {
  NONSTOP_RETURN_IF_ERROR(
      media::CheckAligned("read", "fault-injecting device", offset, buf, n, opts_.alignment));
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(
      BeginCallLocked(FaultOp::kRead, generation, RangeText("read", offset, n)));
  NONSTOP_RETURN_IF_ERROR(
      media::CheckReadRange("fault-injecting device", offset, n, visible_.size()));
  if (n > 0) std::memcpy(buf, visible_.data() + offset, n);
  return Status::OK();
}

Status FaultDisk::DoSync(uint64_t generation) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(BeginCallLocked(FaultOp::kSync, generation, "sync"));
  // Replaying the log costs what was written since the last sync, not the
  // size of the disk.
  for (const LogEntry& e : log_) {
    if (e.is_resize) {
      durable_.resize(e.offset);
      if (opts_.unwritten_extents) {  // a shrink's cut pages are unwritten again
        const uint64_t first_cut = (e.offset + kPage - 1) / kPage;
        written_pages_.erase(written_pages_.lower_bound(first_cut), written_pages_.end());
      }
    } else if (!opts_.unwritten_extents) {
      ApplyWrite(durable_, e.offset, e.bytes.data(), e.bytes.size());
    } else {
      bool lost = false;
      for (const PageSpan& sp : PagesOf(e.offset, e.bytes.size())) {
        if (stale_pages_.count(sp.page) != 0) {
          lost = true;  // on the disk, but the extent still reads as before
          continue;
        }
        ApplyWrite(durable_, sp.lo, e.bytes.data() + (sp.lo - e.offset), sp.hi - sp.lo);
        written_pages_.insert(sp.page);
      }
      if (lost) ++lost_writes_;
    }
  }
  log_.clear();
  ++syncs_;
  return Status::OK();
}

Status FaultDisk::DoResize(uint64_t generation, uint64_t size) {
  MutexLock lock(&mu_);
  NONSTOP_RETURN_IF_ERROR(
      BeginCallLocked(FaultOp::kResize, generation, "resize to " + std::to_string(size)));
  visible_.resize(size);
  log_.push_back({true, size, {}});
  return Status::OK();
}

uint64_t FaultDisk::DoSize(uint64_t generation) const {
  MutexLock lock(&mu_);
  // A crashed medium has no size it can vouch for; 0 makes every read fail.
  return generation == generation_ ? visible_.size() : 0;
}

std::vector<uint8_t> FaultDisk::Snapshot() const {
  MutexLock lock(&mu_);
  return visible_;
}

std::vector<uint8_t> FaultDisk::DurableSnapshot() const {
  MutexLock lock(&mu_);
  return durable_;
}

uint64_t FaultDisk::size() const {
  MutexLock lock(&mu_);
  return visible_.size();
}

uint64_t FaultDisk::writes() const {
  MutexLock lock(&mu_);
  return writes_;
}

uint64_t FaultDisk::syncs() const {
  MutexLock lock(&mu_);
  return syncs_;
}

uint64_t FaultDisk::crashes() const {
  MutexLock lock(&mu_);
  return crashes_;
}

uint64_t FaultDisk::lost_writes() const {
  MutexLock lock(&mu_);
  return lost_writes_;
}

size_t FaultDisk::unsynced_ops() const {
  MutexLock lock(&mu_);
  return log_.size();
}

}  // namespace nonstop
