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

// One finished read of a ReadQueue: the tag given to Submit, and how it went.
struct ReadDone {
  uint64_t tag = 0;
  Status status;
};

// Reads of one medium kept in flight together (Medium::OpenReadQueue), so
// that the device works on the next ones while the caller checks the last.
// A queue is used by one thread at a time; its medium must outlive it.
class ReadQueue {
 public:
  // Waits for every read still in flight (they write into the caller's
  // buffers), so a buffer may be freed once its queue is gone.
  virtual ~ReadQueue() = default;
  // Starts reading `n` bytes at `offset` into `buf`, under the same rules as
  // Medium::Read (alignment; past Size() is Corruption). At most depth()
  // reads may be outstanding (submitted and not yet returned by Next). An
  // error here means the read was not started (nothing to wait for).
  virtual Status Submit(uint64_t offset, void* buf, size_t n, uint64_t tag) = 0;
  // Waits for one outstanding read to finish, in any order: whole (a short
  // transfer is continued inside) or failed, as `status`. FailedPrecondition
  // when none is outstanding.
  virtual Result<ReadDone> Next() = 0;
  virtual unsigned depth() const = 0;
  // Reads outstanding now.
  virtual unsigned outstanding() const = 0;
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
  // A queue of up to `depth` (>= 1) reads in flight at once. The io_uring
  // medium keeps them in the kernel together; every other medium (and any
  // wrapper that changes reads, such as a fault-injecting one) gets the
  // plain queue, which performs each read in Submit through this->Read.
  virtual std::unique_ptr<ReadQueue> OpenReadQueue(unsigned depth);
  // Whether the file lives in memory (tmpfs, ramfs: /dev/shm): no writeback,
  // so no unwritten extent can go stale, and a page reads as zeros until it
  // is written. The slot file then skips writing zeros over its slots.
  virtual bool InMemory() const { return false; }
};

// OpenMedium(path, kind, opts), which opens a file by path, goes through the
// Env: it is declared in nonstop/env.h.

}  // namespace nonstop
