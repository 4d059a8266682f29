// OpenMediumOnFd: picks a backend by kind, and the kAuto fallback chain.
// (OpenMedium, which opens a path through the Env, is in src/env.)
#include <unistd.h>

#include <deque>
#include <string>
#include <utility>

#include "media/fd_medium.h"
#include "media/map_read.h"
#include "media/media_internal.h"
#include "media/medium_wrapper.h"
#include "media/sticky_medium.h"
#include "nonstop/medium.h"

namespace nonstop {

const char* MediumKindName(MediumKind k) {
  switch (k) {
    case MediumKind::kAuto:
      return "auto";
    case MediumKind::kBuffered:
      return "buffered";
    case MediumKind::kDirect:
      return "direct";
    case MediumKind::kUring:
      return "uring";
    case MediumKind::kMmap:
      return "mmap";
    case MediumKind::kPmem:
      return "pmem";
  }
  return "unknown";
}

namespace {

// The plain ReadQueue: each read is done in Submit, through the medium's own
// Read (so a wrapper that injects faults or counts reads sees every one), and
// Next hands the results back in order.
class SyncReadQueue final : public ReadQueue {
 public:
  SyncReadQueue(Medium& m, unsigned depth) : m_(m), depth_(depth) {}
  Status Submit(uint64_t offset, void* buf, size_t n, uint64_t tag) override {
    if (done_.size() >= depth_) {
      return Status::FailedPrecondition("read queue full (" + std::to_string(depth_) + ")");
    }
    done_.push_back(ReadDone{tag, m_.Read(offset, buf, n)});
    return Status::OK();
  }
  Result<ReadDone> Next() override {
    if (done_.empty()) return Status::FailedPrecondition("no read is outstanding");
    ReadDone d = std::move(done_.front());
    done_.pop_front();
    return d;
  }
  unsigned depth() const override { return depth_; }
  unsigned outstanding() const override { return static_cast<unsigned>(done_.size()); }

 private:
  Medium& m_;
  const unsigned depth_;
  std::deque<ReadDone> done_;
};

}  // namespace

std::unique_ptr<ReadQueue> Medium::OpenReadQueue(unsigned depth) {
  return std::make_unique<SyncReadQueue>(*this, depth < 1 ? 1 : depth);
}

bool ParseMediumKind(std::string_view name, MediumKind* out) {
  for (MediumKind k : {MediumKind::kAuto, MediumKind::kBuffered, MediumKind::kDirect,
                       MediumKind::kUring, MediumKind::kMmap, MediumKind::kPmem}) {
    if (name == MediumKindName(k)) {
      *out = k;
      return true;
    }
  }
  return false;
}

namespace media {

std::string MediumBase::Describe() const {
  std::string out = Name();
  std::vector<std::string> parts = Details();
  parts.insert(parts.end(), notes_.begin(), notes_.end());
  if (parts.empty()) return out;
  out += " (";
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += "; ";
    out += parts[i];
  }
  return out + ")";
}

}  // namespace media

namespace {

using media::MediumBase;

Result<std::unique_ptr<MediumBase>> OpenKind(int fd, const std::string& path, MediumKind kind,
                                             const MediumOptions& opts) {
  switch (kind) {
    case MediumKind::kBuffered:
      return media::OpenBufferedMedium(fd, path, opts);
    case MediumKind::kDirect:
      return media::OpenDirectMedium(fd, path, opts);
    case MediumKind::kUring:
      return media::OpenUringMedium(fd, path, opts);
    case MediumKind::kMmap:
      return media::OpenMmapMedium(fd, path, opts);
    case MediumKind::kPmem:
      return media::OpenPmemMedium(fd, path, opts);
    case MediumKind::kAuto:
      break;
  }
  return Status::Internal("OpenKind: kAuto has no backend of its own");
}

// io_uring first (deepest queue, least CPU per byte), then O_DIRECT pwrite,
// then buffered. Only errors that say "this kind cannot work here" move on to
// the next kind; anything else (NotFound, EACCES, ...) would fail the
// slower kinds the same way and is returned as it is.
// All kinds are tried on the one file the Env opened (O_DIRECT is switched
// on and off with fcntl), so a file created with O_EXCL is created once.
Result<std::unique_ptr<MediumBase>> OpenAuto(int fd, const std::string& path,
                                             const MediumOptions& opts) {
  std::vector<std::string> reasons;
  for (MediumKind k : {MediumKind::kUring, MediumKind::kDirect}) {
    Result<std::unique_ptr<MediumBase>> m = OpenKind(fd, path, k, opts);
    if (m.ok()) {
      // "O_DIRECT pwrite (align 512 from statx; io_uring: <why not>)".
      for (std::string& r : reasons) m.value()->AddNote(std::move(r));
      return m;
    }
    if (m.status().code() != StatusCode::kUnavailable) return m.status();
    reasons.push_back(std::string(k == MediumKind::kUring ? "io_uring: " : "O_DIRECT: ") +
                      m.status().message());
  }
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<MediumBase> m,
                           media::OpenBufferedMedium(fd, path, opts));
  // The brief's order: the reason closest to the choice first.
  for (auto it = reasons.rbegin(); it != reasons.rend(); ++it) m->AddNote(std::move(*it));
  return m;
}

// A medium opened with MediumOptions::read_only: reads go to the backend
// (whose file is O_RDONLY, its mapping PROT_READ); writes stop here, before
// they could reach a read-only mapping.
class ReadOnlyMedium final : public media::MediumWrapper {
 public:
  ReadOnlyMedium(std::string path, std::unique_ptr<Medium> m)
      : MediumWrapper(std::move(m)), path_(std::move(path)) {}
  Medium& wrapped() { return inner(); }
  Status Write(uint64_t offset, const void*, size_t n) override {
    return Refuse("write " + path_ + " at " + std::to_string(offset) + " (+" + std::to_string(n) +
                  " bytes)");
  }
  Status Sync() override { return Status::OK(); }  // nothing was written
  // Reads are the inner medium's, unchanged: its queue (io_uring's included).
  std::unique_ptr<ReadQueue> OpenReadQueue(unsigned depth) override {
    return inner().OpenReadQueue(depth);
  }
  Status Resize(uint64_t size) override {
    return Refuse("resize " + path_ + " to " + std::to_string(size) + " bytes");
  }

 private:
  static Status Refuse(const std::string& what) {
    return Status::FailedPrecondition(what + ": the medium was opened read-only");
  }
  const std::string path_;
};

}  // namespace

namespace media {

Result<std::unique_ptr<ReadMapping>> MapForRead(Medium& m, uint64_t offset, uint64_t n) {
  Medium* at = &m;
  for (;;) {
    if (auto* s = dynamic_cast<StickySyncMedium*>(at)) {
      at = &s->wrapped();
    } else if (auto* r = dynamic_cast<ReadOnlyMedium*>(at)) {
      at = &r->wrapped();
    } else {
      break;
    }
  }
  if (auto* f = dynamic_cast<FdMedium*>(at)) return f->MapForRead(offset, n);
  return Status::Unavailable("this medium cannot map a range: " + m.Describe());
}

Result<std::unique_ptr<Medium>> OpenMediumOnFd(int fd, const std::string& path, MediumKind kind,
                                               const MediumOptions& opts) {
  Result<std::unique_ptr<MediumBase>> m =
      kind == MediumKind::kAuto ? OpenAuto(fd, path, opts) : OpenKind(fd, path, kind, opts);
  if (!m.ok()) {
    ::close(fd);
    return m.status();
  }
  std::unique_ptr<Medium> out;
  if (opts.read_only) {
    m.value()->AddNote("read-only");
    out.reset(new ReadOnlyMedium(path, std::move(m).value()));
  } else {
    out = std::move(m).value();
  }
  return std::unique_ptr<Medium>(new StickySyncMedium(path, std::move(out)));
}

}  // namespace media

}  // namespace nonstop
