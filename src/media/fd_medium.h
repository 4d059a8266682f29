// FdMedium: a Medium over one file descriptor with pwrite/pread/fdatasync.
// The buffered and O_DIRECT kinds are this class; io_uring derives from it and
// replaces Write and Read.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "media/map_read.h"
#include "media/media_internal.h"

namespace nonstop::media {

// An open file as the fd media take it: the descriptor, its size and, for
// O_DIRECT, the alignment and how it was found (1 and "" for buffered I/O).
struct FdFile {
  int fd = -1;
  uint64_t size = 0;
  size_t alignment = 1;
  std::string alignment_source;
};

// Sets or clears O_DIRECT on `fd` (Unavailable with advice where the file
// system refuses it) and reads its size and O_DIRECT alignment. Does not
// take `fd` over.
Result<FdFile> PrepareFdFile(int fd, const std::string& path, bool direct);

class FdMedium : public MediumBase {
 public:
  // Takes ownership of `file.fd`.
  FdMedium(MediumKind kind, std::string path, FdFile file);
  ~FdMedium() override;
  FdMedium(const FdMedium&) = delete;
  FdMedium& operator=(const FdMedium&) = delete;

  Status Write(uint64_t offset, const void* buf, size_t n) override;
  Status Read(uint64_t offset, void* buf, size_t n) override;
  Status Sync() override;
  Status Resize(uint64_t size) override;
  uint64_t Size() const override { return size_.load(std::memory_order_relaxed); }
  size_t Alignment() const override { return alignment_; }
  // mincore(2) over a read-only shared mapping of the range.
  Result<uint64_t> CachedBytes(uint64_t offset, uint64_t n) override;
  // mmap(2) PROT_READ, MAP_SHARED | MAP_POPULATE of the pages of the
  // range (media::MapForRead, map_read.h).
  Result<std::unique_ptr<ReadMapping>> MapForRead(uint64_t offset, uint64_t n);
  MediumKind kind() const override { return kind_; }
  bool InMemory() const override { return in_memory_; }

 protected:
  std::string Name() const override;
  std::vector<std::string> Details() const override;

  const MediumKind kind_;
  const std::string path_;
  const int fd_;
  const size_t alignment_;
  const std::string alignment_source_;
  const bool in_memory_;  // tmpfs/ramfs (fstatfs at open)
  // The file size as this medium knows it: set by Resize, raised by writes
  // that extend the file. Read() checks against it.
  std::atomic<uint64_t> size_;
};

}  // namespace nonstop::media
