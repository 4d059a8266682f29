// Medium: where checkpoint bytes go. One Medium is one open file (or one
// simulated device) addressed by byte offset.
//
// Thread safety: Write/Read/Sync may be called concurrently from many threads
// on disjoint byte ranges (the writer pool does). Resize must not overlap
// other calls.
//
// Durability contract (what the store relies on):
//   - Bytes written by a Write that returned OK are durable once a later Sync()
//     returns OK. Before that, a crash may drop them, keep them, or tear them
//     at sector granularity (512 bytes); nothing else.
//   - A failed Write or Sync leaves the medium usable; the caller decides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "nonstop/status.h"

namespace nonstop {

enum class MediumKind {
  kAuto,      // best that works here: io_uring+O_DIRECT, O_DIRECT, buffered
  kBuffered,  // pwrite + fdatasync
  kDirect,    // O_DIRECT pwrite (+ fdatasync for metadata), alignment from statx
  kUring,     // io_uring with O_DIRECT, registered buffers where possible
  kMmap,      // mmap + msync
  kPmem,      // libpmem2: non-temporal copies + drain on DAX, msync otherwise
};

const char* MediumKindName(MediumKind k);
bool ParseMediumKind(std::string_view name, MediumKind* out);

struct MediumOptions {
  bool create = false;  // create the file if missing
  // Open for reading only (O_RDONLY, mappings PROT_READ), so that a read-only
  // file or mount can be read: Write and Resize fail (FailedPrecondition),
  // Sync has nothing to do. Not together with create.
  bool read_only = false;
  // For kAuto: the kinds that did not work are reported in Medium::Describe().
};

class Medium {
 public:
  virtual ~Medium() = default;

  // Positional write of `n` bytes at `offset`. For media with Alignment() > 1,
  // `buf`, `offset` and `n` must all be multiples of Alignment(); the store
  // and the engine only issue such writes. Partial writes are retried inside;
  // a Status error means the range is in an unknown state.
  virtual Status Write(uint64_t offset, const void* buf, size_t n) = 0;
  // Positional read; reading past Size() is an error (Corruption), never a
  // silent short read.
  virtual Status Read(uint64_t offset, void* buf, size_t n) = 0;
  // Makes every previously completed Write durable.
  virtual Status Sync() = 0;
  // Grows (or shrinks) the medium to `size` bytes, allocating the blocks
  // (fallocate where supported) so later writes cannot hit ENOSPC.
  virtual Status Resize(uint64_t size) = 0;
  virtual uint64_t Size() const = 0;
  // Required alignment of buffers, offsets and lengths for Write/Read (1 = any).
  virtual size_t Alignment() const = 0;
  virtual MediumKind kind() const = 0;
  // One line for logs and `nonstop bench`: "io_uring+O_DIRECT (qd 16, align 512)".
  virtual std::string Describe() const = 0;
  // How many bytes of [offset, offset + n) are in the page cache now (whole
  // pages counted, capped at n), without reading or faulting anything in
  // (the restore reads cached ranges buffered and the rest with O_DIRECT).
  // Unavailable where the medium cannot tell.
  virtual Result<uint64_t> CachedBytes(uint64_t offset, uint64_t n) {
    (void)offset;
    (void)n;
    return Status::Unavailable("this medium cannot tell what is cached");
  }
};

// OpenMedium(path, kind, opts), which opens a file by path, goes through the
// Env: it is declared in nonstop/env.h.

}  // namespace nonstop
