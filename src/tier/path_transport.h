// A plain directory (a shared file system) used as the remote: the file://
// and plain-path transport of the remote tier, all in C++ (no Python runs
// per byte). Each object is a file under the root, its key's components
// directories. Every file and directory operation goes through the Env
// seam, relative to directory fds with O_NOFOLLOW: a link anywhere under
// the root is refused or removed as a link, never followed.
//
//  - PutFile/PutBytes: written under KEY.tmp (created O_EXCL after removing
//    a stale one), fsynced, renamed over KEY, the directory fsynced; a
//    failed write or fsync leaves no KEY (the temp is removed). PutFile
//    keeps to `bps` bytes a second when bps > 0 and stops once Abort ran.
//  - GetBytes/GetChunks: a link or anything but a regular file is
//    Corruption; a missing object NotFound.
//  - List skips temps (*.tmp) and links, and nests at most 8 levels; an
//    object it cannot stat fails it (one removed meanwhile is skipped).
//  - Delete removes the files that are there (never through a link) and
//    then every step directory it left empty.
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/env.h"
#include "tier/transport.h"

namespace nonstop::tier {

class PathTransport final : public Transport {
 public:
  // `root` is the remote's directory (made on the first write); `env` is
  // not owned and outlives the transport.
  PathTransport(Env* env, std::string root, uint64_t part_bytes = 8 << 20);

  std::string url() const override { return root_; }
  uint64_t part_bytes() const override { return part_; }
  Status PutFile(const std::string& key, const std::string& dir, const std::string& name,
                 double bps) override;
  Status PutBytes(const std::string& key, std::string_view data) override;
  Result<std::string> GetBytes(const std::string& key, uint64_t limit) override;
  Status GetChunks(const std::string& key, const std::function<Status(uint64_t size)>& on_size,
                   const std::function<Status(std::string_view chunk)>& on_chunk) override;
  Result<std::vector<StoredObject>> List(const std::string& prefix) override;
  Status Delete(const std::vector<std::string>& keys) override;
  void Abort() override { aborted_.store(true); }

 private:
  // The directory holding `key` and its last name; with create, missing
  // directories are made (NotFound otherwise).
  Result<std::unique_ptr<Directory>> Parent(const std::string& key, bool create,
                                            std::string* name);
  // A readable regular file `key`: NotFound when missing, Corruption for a
  // link or anything else.
  Result<std::unique_ptr<Medium>> OpenObject(const std::string& key);
  Status Walk(Directory& d, const std::string& rel, int depth, std::vector<StoredObject>* out);

  Env* const env_;
  const std::string root_;
  const uint64_t part_;
  std::atomic<bool> aborted_{false};
};

}  // namespace nonstop::tier
