// Internals shared by the Medium backends in src/media. Not part of the public API.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "nonstop/medium.h"
#include "nonstop/status.h"

namespace nonstop::media {

// Every backend derives from MediumBase so that OpenMedium(kAuto) can attach
// the reasons the faster kinds were skipped to Describe():
//   "buffered pwrite+fdatasync (O_DIRECT: ...; io_uring: ...)".
class MediumBase : public Medium {
 public:
  std::string Describe() const final;
  // Appends one note ("io_uring: <why it was not used>") to Describe().
  void AddNote(std::string note) { notes_.push_back(std::move(note)); }

 protected:
  // The backend's name ("io_uring+O_DIRECT") and its details ("qd 16", "align 512").
  virtual std::string Name() const = 0;
  virtual std::vector<std::string> Details() const { return {}; }

 private:
  std::vector<std::string> notes_;
};

// Sets or clears O_DIRECT on the open file `fd` (fcntl F_SETFL). Unavailable,
// with advice, where the file system refuses O_DIRECT (tmpfs before Linux 6.6,
// some FUSE and network file systems).
Status SetDirect(int fd, const std::string& path, bool direct);
Result<uint64_t> FileSize(int fd, const std::string& path);
// Whether the open file `fd` is on tmpfs or ramfs (fstatfs; false when it
// cannot tell): Medium::InMemory.
bool OnMemoryFileSystem(int fd);

// pwrite/pread loops that retry EINTR and partial transfers. A read that hits
// end of file is Corruption (the Medium contract forbids silent short reads).
Status WriteFull(int fd, const std::string& path, uint64_t offset, const void* buf, size_t n);
Status ReadFull(int fd, const std::string& path, uint64_t offset, void* buf, size_t n);

// ftruncate to `size`, then allocates the blocks with fallocate(2) so later
// writes cannot hit ENOSPC. File systems without fallocate (EOPNOTSUPP) are
// accepted as they are; ENOSPC and other errors are returned.
Status ResizeFile(int fd, const std::string& path, uint64_t size);

// The O_DIRECT alignment for the open file `fd`: the larger of statx's
// STATX_DIOALIGN memory and offset alignments (Linux 6.1+), else the logical
// block size of the device (BLKSSZGET for a block device, sysfs for a file on
// one), else 4096. `source` receives how it was found, for Describe().
size_t DirectAlignment(int fd, const std::string& path, std::string* source);

// InvalidArgument unless `buf`, `offset` and `n` are multiples of `align`.
Status CheckAligned(const char* op, const std::string& path, uint64_t offset, const void* buf,
                    size_t n, size_t align);
// Corruption when [offset, offset + n) reaches past `size`.
Status CheckReadRange(const std::string& path, uint64_t offset, size_t n, uint64_t size);

// Raises `size` to at least `end` (a concurrent running maximum).
inline void RaiseTo(std::atomic<uint64_t>& size, uint64_t end) {
  uint64_t cur = size.load(std::memory_order_relaxed);
  while (cur < end && !size.compare_exchange_weak(cur, end, std::memory_order_relaxed)) {
  }
}

std::string FormatBytes(uint64_t n);

// The byte range written since the last sync of a mapped medium, so that
// Sync() flushes only that range. Thread-safe.
class DirtyRange {
 public:
  void Add(uint64_t offset, uint64_t n);
  // Returns the range and resets it; false when nothing is dirty.
  bool Take(uint64_t* begin, uint64_t* end);

 private:
  Mutex mu_;
  uint64_t begin_ GUARDED_BY(mu_) = UINT64_MAX;
  uint64_t end_ GUARDED_BY(mu_) = 0;
};

// Constructors of the backends, each on a file the Env already opened (`fd`,
// O_RDWR or, with opts.read_only, O_RDONLY; `path` is for messages only).
// On success the medium owns `fd`; on failure the caller still does (so that
// kAuto can try the next kind on the same file). Each returns Unavailable
// (with the reason) when its kind cannot work on this file or in this build.
Result<std::unique_ptr<MediumBase>> OpenBufferedMedium(int fd, const std::string& path,
                                                       const MediumOptions& opts);
Result<std::unique_ptr<MediumBase>> OpenDirectMedium(int fd, const std::string& path,
                                                     const MediumOptions& opts);
Result<std::unique_ptr<MediumBase>> OpenUringMedium(int fd, const std::string& path,
                                                    const MediumOptions& opts);
Result<std::unique_ptr<MediumBase>> OpenMmapMedium(int fd, const std::string& path,
                                                   const MediumOptions& opts);
Result<std::unique_ptr<MediumBase>> OpenPmemMedium(int fd, const std::string& path,
                                                   const MediumOptions& opts);

// The Medium of `kind` over the open file `fd`, which it takes over (closed
// on failure too). This is how an Env turns a file it opened (openat with
// O_NOFOLLOW, O_EXCL for new files) into a Medium: the backend, then the
// read-only guard (opts.read_only), then the sticky-sync guard
// (media/sticky_medium.h) that every Env-opened medium goes through.
Result<std::unique_ptr<Medium>> OpenMediumOnFd(int fd, const std::string& path, MediumKind kind,
                                               const MediumOptions& opts);

}  // namespace nonstop::media
