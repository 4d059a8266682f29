// The mapped media: mmap + msync, and libpmem2 (non-temporal copies + drain on
// DAX, msync on page-granularity mappings).
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "media/fd_medium.h"

#ifdef NONSTOP_HAVE_PMEM2
#include <libpmem2.h>
#endif

namespace nonstop::media {
namespace {

// What a mapped medium shares, whatever maps it: the fd, the mapping, the
// bounds checks and the dirty range that Sync flushes. A write must fall
// inside the mapping: a mapped medium cannot grow by writing past its end
// (that would be SIGBUS), so callers Resize first.
class MappedMedium : public MediumBase {
 public:
  MappedMedium(MediumKind kind, std::string path, int fd, bool read_only = false)
      : kind_(kind), path_(std::move(path)), fd_(fd), read_only_(read_only),
        in_memory_(fd >= 0 && OnMemoryFileSystem(fd)) {}
  ~MappedMedium() override {
    if (fd_ >= 0) ::close(fd_);
  }
  MappedMedium(const MappedMedium&) = delete;
  MappedMedium& operator=(const MappedMedium&) = delete;

  Status Write(uint64_t offset, const void* buf, size_t n) override {
    if (n == 0) return Status::OK();
    if (offset > size_ || n > size_ - offset) {
      return Status::InvalidArgument("write " + path_ + " at " + std::to_string(offset) +
                                     " (+" + std::to_string(n) + " bytes): past the end of the " +
                                     "mapping (size " + std::to_string(size_) +
                                     "); Resize the medium first");
    }
    CopyIn(base_ + offset, buf, n);
    dirty_.Add(offset, n);
    return Status::OK();
  }

  Status Read(uint64_t offset, void* buf, size_t n) override {
    NONSTOP_RETURN_IF_ERROR(CheckReadRange(path_, offset, n, size_));
    if (n > 0) std::memcpy(buf, base_ + offset, n);
    return Status::OK();
  }

  Status Sync() override {
    uint64_t begin = 0;
    uint64_t end = 0;
    if (!dirty_.Take(&begin, &end)) return Status::OK();
    Status st = Persist(begin, std::min<uint64_t>(end, size_));
    if (!st.ok()) dirty_.Add(begin, end - begin);  // still dirty: a retry must flush it again
    return st;
  }

  Status Resize(uint64_t size) override {
    // Dirty pages stay dirty in the page cache across the remap; the dirty
    // range is kept (and clipped by Sync), so a later Sync still flushes them.
    Unmap();
    Status st = ResizeFile(fd_, path_, size);
    if (!st.ok()) {
      // Stay usable at whatever size the file has now.
      Result<uint64_t> now = FileSize(fd_, path_);
      if (now.ok()) (void)Map(*now);
      return st;
    }
    return Map(size);
  }

  uint64_t Size() const override { return size_; }
  size_t Alignment() const override { return 1; }
  bool InMemory() const override { return in_memory_; }
  MediumKind kind() const override { return kind_; }

  // Gives `fd` back to the caller (a failed open: the caller closes it).
  void Disown() {
    Unmap();
    fd_ = -1;
  }

  // Maps the whole file at its current size (nothing for an empty file).
  virtual Status Map(uint64_t size) = 0;
  virtual void Unmap() = 0;

 protected:
  virtual void CopyIn(char* dst, const void* src, size_t n) = 0;
  virtual Status Persist(uint64_t begin, uint64_t end) = 0;

  // msync(MS_SYNC) of [begin, end), widened to whole pages as msync requires.
  Status Msync(uint64_t begin, uint64_t end) {
    if (begin >= end) return Status::OK();
    static const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t start = begin / kPage * kPage;
    if (::msync(base_ + start, end - start, MS_SYNC) != 0) {
      return Status::FromErrno("msync " + path_ + " at " + std::to_string(start) + " (+" +
                                   std::to_string(end - start) + " bytes)",
                               errno);
    }
    return Status::OK();
  }

  const MediumKind kind_;
  const std::string path_;
  int fd_;  // -1 after Disown()
  const bool read_only_;  // mapped PROT_READ (OpenMedium refuses writes before they get here)
  const bool in_memory_;  // tmpfs/ramfs (fstatfs at open)
  // Set by Map/Unmap, which run only in Open and Resize (never concurrently
  // with other calls, per the Medium contract).
  char* base_ = nullptr;
  uint64_t size_ = 0;
  DirtyRange dirty_;
};

class MmapMedium final : public MappedMedium {
 public:
  MmapMedium(std::string path, int fd, std::string why, bool read_only)
      : MappedMedium(MediumKind::kMmap, std::move(path), fd, read_only) {
    if (!why.empty()) AddNote(std::move(why));
  }
  ~MmapMedium() override { Unmap(); }

  Status Map(uint64_t size) override {
    size_ = 0;
    if (size == 0) return Status::OK();
    const int prot = read_only_ ? PROT_READ : PROT_READ | PROT_WRITE;
    void* p = ::mmap(nullptr, size, prot, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      return Status::FromErrno("mmap " + path_ + " (" + std::to_string(size) + " bytes)", errno);
    }
    base_ = static_cast<char*>(p);
    size_ = size;
    return Status::OK();
  }

  void Unmap() override {
    if (base_ != nullptr) ::munmap(base_, size_);
    base_ = nullptr;
    size_ = 0;
  }

 protected:
  std::string Name() const override { return "mmap+msync"; }
  void CopyIn(char* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  Status Persist(uint64_t begin, uint64_t end) override { return Msync(begin, end); }
};

Result<std::unique_ptr<MediumBase>> OpenMapped(std::unique_ptr<MappedMedium> m, int fd,
                                               const std::string& path) {
  Result<uint64_t> size = FileSize(fd, path);
  Status st = size.ok() ? m->Map(*size) : size.status();
  if (!st.ok()) {
    m->Disown();
    return st;
  }
  return std::unique_ptr<MediumBase>(std::move(m));
}

#ifdef NONSTOP_HAVE_PMEM2

std::string Pmem2Error(const std::string& what, int rc) {
  const char* msg = pmem2_errormsg();
  return what + ": " + (msg != nullptr && *msg != '\0' ? msg : std::strerror(rc < 0 ? -rc : rc));
}

class PmemMedium final : public MappedMedium {
 public:
  PmemMedium(std::string path, int fd) : MappedMedium(MediumKind::kPmem, std::move(path), fd) {}
  ~PmemMedium() override { Unmap(); }

  Status Map(uint64_t size) override {
    size_ = 0;
    if (size == 0) return Status::OK();
    pmem2_source* src = nullptr;
    pmem2_config* cfg = nullptr;
    int rc = pmem2_source_from_fd(&src, fd_);
    if (rc != 0) return Status::IOError(Pmem2Error("pmem2_source_from_fd " + path_, rc));
    rc = pmem2_config_new(&cfg);
    if (rc == 0) {
      // Accept any granularity: page granularity (ordinary files, tmpfs)
      // is handled with msync below; DAX gets cache-line or byte.
      rc = pmem2_config_set_required_store_granularity(cfg, PMEM2_GRANULARITY_PAGE);
    }
    if (rc == 0) rc = pmem2_map_new(&map_, cfg, src);
    std::string err = rc == 0 ? "" : Pmem2Error("pmem2_map_new " + path_, rc);
    pmem2_config_delete(&cfg);
    pmem2_source_delete(&src);
    if (rc != 0) {
      map_ = nullptr;
      return Status::IOError(err + "; use medium='mmap'");
    }
    base_ = static_cast<char*>(pmem2_map_get_address(map_));
    size_ = pmem2_map_get_size(map_);
    granularity_ = pmem2_map_get_store_granularity(map_);
    memcpy_ = pmem2_get_memcpy_fn(map_);
    drain_ = pmem2_get_drain_fn(map_);
    return Status::OK();
  }

  void Unmap() override {
    if (map_ != nullptr) pmem2_map_delete(&map_);
    map_ = nullptr;
    base_ = nullptr;
    size_ = 0;
  }

 protected:
  std::string Name() const override {
    if (map_ == nullptr) return "pmem (libpmem2, not mapped yet: empty file)";
    return IsDax() ? "pmem (libpmem2, DAX: non-temporal stores + drain)"
                   : "pmem (libpmem2, page granularity: msync)";
  }

  bool IsDax() const { return granularity_ != PMEM2_GRANULARITY_PAGE; }

  // On DAX, each Write drains its own non-temporal stores before returning.
  // A drain is an SFENCE, which orders only the calling CPU's stores: one
  // drain in Sync() on another thread would not cover the writer threads'
  // stores. So the fence is paid once per Write (one per persisted unit, a
  // multi-MB chunk in practice), and Sync() itself has nothing left to do.
  void CopyIn(char* dst, const void* src, size_t n) override {
    if (IsDax()) {
      memcpy_(dst, src, n, PMEM2_F_MEM_NONTEMPORAL | PMEM2_F_MEM_NODRAIN);
      drain_();
    } else {
      std::memcpy(dst, src, n);
    }
  }

  // Page granularity: msync directly rather than pmem2's persist function,
  // which returns void and cannot report an msync failure to us.
  Status Persist(uint64_t begin, uint64_t end) override {
    if (IsDax()) return Status::OK();
    return Msync(begin, end);
  }

 private:
  pmem2_map* map_ = nullptr;
  pmem2_granularity granularity_ = PMEM2_GRANULARITY_PAGE;
  pmem2_memcpy_fn memcpy_ = nullptr;
  pmem2_drain_fn drain_ = nullptr;
};

#endif  // NONSTOP_HAVE_PMEM2

}  // namespace

Result<std::unique_ptr<MediumBase>> OpenMmapMedium(int fd, const std::string& path,
                                                   const MediumOptions& opts) {
  NONSTOP_RETURN_IF_ERROR(SetDirect(fd, path, false));
  return OpenMapped(std::make_unique<MmapMedium>(path, fd, "", opts.read_only), fd, path);
}

Result<std::unique_ptr<MediumBase>> OpenPmemMedium(int fd, const std::string& path,
                                                   const MediumOptions& opts) {
  NONSTOP_RETURN_IF_ERROR(SetDirect(fd, path, false));
  if (opts.read_only) {  // reads need no persistence: a read-only mmap
    return OpenMapped(
        std::make_unique<MmapMedium>(path, fd, "pmem requested read-only", /*read_only=*/true),
        fd, path);
  }
#ifdef NONSTOP_HAVE_PMEM2
  return OpenMapped(std::make_unique<PmemMedium>(path, fd), fd, path);
#else
  return OpenMapped(std::make_unique<MmapMedium>(path, fd, "pmem requested; libpmem2 not built in",
                                                 /*read_only=*/false),
                    fd, path);
#endif
}

}  // namespace nonstop::media
