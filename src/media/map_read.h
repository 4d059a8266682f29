// A read-only mapping of a range of a file opened as a Medium, for a reader
// that only looks at the bytes (the peer tier's sender checks, hashes and
// sends them: no copy into a buffer first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "nonstop/medium.h"
#include "nonstop/status.h"

namespace nonstop::media {

// The mapped bytes: the page cache's pages, read-only; valid while the
// object lives.
class ReadMapping {
 public:
  virtual ~ReadMapping() = default;
  virtual const char* data() const = 0;
  virtual size_t size() const = 0;
};

// [offset, offset + n) of `m` mapped read-only and populated (no page
// faults when it is read). Only a plain file medium (buffered or O_DIRECT,
// under the read-only and the sticky-fsync wrappers OpenMedium puts
// around it) maps; any other medium or wrapper -- a fault-injecting one
// above all -- is Unavailable, so its callers fall back to Medium::Read and
// see its faults. The range must lie within the file (Corruption, as a
// read). The file must not shrink under the mapping: a read of a page cut
// off is SIGBUS (the callers map their own replica and segment files,
// which nothing truncates).
Result<std::unique_ptr<ReadMapping>> MapForRead(Medium& m, uint64_t offset, uint64_t n);

}  // namespace nonstop::media
