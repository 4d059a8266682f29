#include "engine/slot_medium.h"

#include <utility>

namespace nonstop {
namespace {

std::string Join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace

SlotMedium::SlotMedium(std::unique_ptr<Medium> inner, std::string dir, std::string name,
                       Opener reopen)
    : inner_(std::move(inner)),
      dir_(std::move(dir)),
      name_(std::move(name)),
      opened_as_(Join(dir_, name_)),
      reopen_(std::move(reopen)) {}

std::string SlotMedium::path() const {
  ReaderLock l(&mu_);
  return Join(dir_, name_);
}

Status SlotMedium::Named(Status st) const {
  // The inner medium names the file by the path it was opened with; after a
  // rename that is the temp name, which no longer exists.
  if (st.ok()) return st;
  const std::string now = Join(dir_, name_);
  if (now == opened_as_) return st;
  std::string m = st.message();
  for (size_t at = m.find(opened_as_); at != std::string::npos;
       at = m.find(opened_as_, at + now.size())) {
    m.replace(at, opened_as_.size(), now);
  }
  return Status(st.code(), std::move(m));
}

Status SlotMedium::Sticky() const {
  MutexLock l(&err_mu_);
  return error_;
}

Status SlotMedium::Write(uint64_t offset, const void* buf, size_t n) {
  ReaderLock l(&mu_);
  if (sync_failed()) return Sticky();
  return Named(inner_->Write(offset, buf, n));
}

Status SlotMedium::Read(uint64_t offset, void* buf, size_t n) {
  ReaderLock l(&mu_);
  if (state_.load(std::memory_order_acquire) == kDead) return Sticky();
  return Named(inner_->Read(offset, buf, n));
}

Status SlotMedium::Sync() {
  ReaderLock l(&mu_);
  if (sync_failed()) return Sticky();
  Status st = Named(inner_->Sync());
  if (!st.ok()) {
    failures_.fetch_add(1, std::memory_order_acq_rel);
    MutexLock el(&err_mu_);
    if (state_.load(std::memory_order_acquire) == kOk) {
      error_ = Status::IOError("an fsync of " + Join(dir_, name_) + " failed (" + st.message() +
                               "): nothing written to it before is trusted");
      state_.store(kSyncFailed, std::memory_order_release);
    }
  }
  return st;
}

Status SlotMedium::Resize(uint64_t size) {
  ReaderLock l(&mu_);
  if (sync_failed()) return Sticky();
  return Named(inner_->Resize(size));
}

uint64_t SlotMedium::Size() const {
  ReaderLock l(&mu_);
  return inner_->Size();
}

size_t SlotMedium::Alignment() const {
  ReaderLock l(&mu_);
  return inner_->Alignment();
}

MediumKind SlotMedium::kind() const {
  ReaderLock l(&mu_);
  return inner_->kind();
}

std::string SlotMedium::Describe() const {
  ReaderLock l(&mu_);
  std::string d = inner_->Describe();
  const std::string now = Join(dir_, name_);
  if (now != opened_as_) {
    for (size_t at = d.find(opened_as_); at != std::string::npos;
         at = d.find(opened_as_, at + now.size())) {
      d.replace(at, opened_as_.size(), now);
    }
  }
  return d;
}

Status SlotMedium::Reopen() {
  WriterLock l(&mu_);
  if (state_.load(std::memory_order_acquire) != kSyncFailed) {
    return state_.load() == kOk ? Status::OK() : Sticky();
  }
  Result<std::unique_ptr<Medium>> fresh =
      reopen_ ? reopen_(name_, inner_->kind())
              : Result<std::unique_ptr<Medium>>(Status::Unavailable("no way to reopen it"));
  if (fresh.ok() && (*fresh)->Alignment() != inner_->Alignment()) {
    fresh = Status::Internal("reopened with another alignment");
  }
  MutexLock el(&err_mu_);
  if (!fresh.ok()) {
    error_ = Status::IOError("cannot reopen " + Join(dir_, name_) + " after a failed fsync (" +
                             fresh.status().message() +
                             "): no later checkpoint can commit; restart the job");
    state_.store(kDead, std::memory_order_release);
    return error_;
  }
  inner_ = std::move(fresh).value();
  opened_as_ = Join(dir_, name_);
  error_ = Status::OK();
  state_.store(kOk, std::memory_order_release);
  return Status::OK();
}

void SlotMedium::Renamed(std::string name) {
  WriterLock l(&mu_);
  name_ = std::move(name);
}

}  // namespace nonstop
