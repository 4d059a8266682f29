// The bytes of one object store prefix (or a plain directory used as one):
// what a RemoteTier needs from a store, nothing of its layout. A plain path
// is PathTransport (path_transport.h); Python hands in its obstore
// transport through an adapter (src/python/remote_bindings.cc); the tests
// use an in-memory one.
//
// Errors are Status: NotFound for a missing object, Corruption for an
// object that is not what it must be (a document over its limit, a link),
// IOError for a store that failed or cannot be reached.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::tier {

struct StoredObject {
  std::string key;  // relative to the prefix
  uint64_t size = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  // The prefix, for messages ("s3://bucket/prefix", or a path).
  virtual std::string url() const = 0;
  // The preferred unit of a part's checksums and of a streamed read.
  virtual uint64_t part_bytes() const = 0;

  // Uploads file `name` of the local directory `dir` (opened through the
  // Env seam, never a link). `bps` > 0: at most that many bytes a second.
  virtual Status PutFile(const std::string& key, const std::string& dir, const std::string& name,
                         double bps) = 0;
  virtual Status PutBytes(const std::string& key, std::string_view data) = 0;
  // A small object: NotFound when missing, Corruption when over `limit`.
  virtual Result<std::string> GetBytes(const std::string& key, uint64_t limit) = 0;
  // Streams an object: `on_size` once with its stated size, then `on_chunk`
  // for each buffer in order; a non-OK return of either stops the read and
  // is returned. NotFound when missing.
  virtual Status GetChunks(const std::string& key,
                           const std::function<Status(uint64_t size)>& on_size,
                           const std::function<Status(std::string_view chunk)>& on_chunk) = 0;
  // Every object under `prefix` ("" for all).
  virtual Result<std::vector<StoredObject>> List(const std::string& prefix) = 0;
  // Deletes the keys that exist (a missing one is not an error).
  virtual Status Delete(const std::vector<std::string>& keys) = 0;
  // Any thread: a transfer under way (a throttled PutFile) stops as soon as
  // it can and fails; later ones too (the uploader closing past its deadline).
  virtual void Abort() {}
};

}  // namespace nonstop::tier
