// An in-memory Transport for the tier's tests: objects in a map, streamed
// in chunks of part_bytes, with failures to inject (a put, a streamed read
// or a delete failing from its nth call on). The real stores (obstore, a
// shared file system) are the Python transports, covered by the Python tests.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "tier/transport.h"

namespace nonstop::tier {

class MemoryTransport final : public Transport {
 public:
  explicit MemoryTransport(Env* env, uint64_t part_bytes = 4096) : env_(env), part_(part_bytes) {}

  std::string url() const override { return "mem://bucket/job"; }
  uint64_t part_bytes() const override { return part_; }

  Status PutFile(const std::string& key, const std::string& dir, const std::string& name,
                 double /*bps*/) override {
    NONSTOP_RETURN_IF_ERROR(Fail(&puts_, fail_put_from));
    NONSTOP_RETURN_IF_ERROR(Held());
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, env_->OpenDirectory(dir, false));
    MediumOptions ro;
    ro.read_only = true;
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m,
                             d->OpenFile(name, MediumKind::kBuffered, ro));
    std::string data(m->Size(), '\0');
    NONSTOP_RETURN_IF_ERROR(m->Read(0, data.data(), data.size()));
    MutexLock l(&mu_);
    objects[key] = std::move(data);
    return Status::OK();
  }
  Status PutBytes(const std::string& key, std::string_view data) override {
    NONSTOP_RETURN_IF_ERROR(Fail(&puts_, fail_put_from));
    MutexLock l(&mu_);
    objects[key] = std::string(data);
    return Status::OK();
  }
  Result<std::string> GetBytes(const std::string& key, uint64_t limit) override {
    MutexLock l(&mu_);
    auto it = objects.find(key);
    if (it == objects.end()) return Status::NotFound(url() + ": " + key + ": not found");
    if (it->second.size() > limit) {
      return Status::Corruption(url() + "/" + key + " is more than a nonstop document");
    }
    return it->second;
  }
  Status GetChunks(const std::string& key, const std::function<Status(uint64_t)>& on_size,
                   const std::function<Status(std::string_view)>& on_chunk) override {
    std::string data;
    {
      MutexLock l(&mu_);
      auto it = objects.find(key);
      if (it == objects.end()) return Status::NotFound(url() + ": " + key + ": not found");
      data = it->second;
    }
    NONSTOP_RETURN_IF_ERROR(on_size(data.size()));
    int n = 0;
    for (size_t at = 0; at < data.size(); at += part_, ++n) {
      if (fail_chunk_from >= 0 && n >= fail_chunk_from) {
        return Status::IOError(url() + ": reading " + key + ": the connection went away");
      }
      NONSTOP_RETURN_IF_ERROR(on_chunk(std::string_view(data).substr(at, part_)));
    }
    return Status::OK();
  }
  Result<std::vector<StoredObject>> List(const std::string& prefix) override {
    NONSTOP_RETURN_IF_ERROR(Fail(&lists_, fail_list_from));
    MutexLock l(&mu_);
    std::vector<StoredObject> out;
    for (const auto& [k, v] : objects) {
      if (k.compare(0, prefix.size(), prefix) == 0) out.push_back({k, v.size()});
    }
    return out;
  }
  void Abort() override {
    MutexLock l(&mu_);
    aborted_ = true;
    cv_.SignalAll();
  }
  Status Delete(const std::vector<std::string>& keys) override {
    NONSTOP_RETURN_IF_ERROR(Fail(&deletes_, fail_delete_from));
    MutexLock l(&mu_);
    for (const std::string& k : keys) objects.erase(k);
    return Status::OK();
  }

  // For tests with an uploader thread running (guarded): the next `n` puts
  // fail, then they succeed again.
  void FailNextPuts(int n) {
    MutexLock l(&mu_);
    fail_next_puts_ = n;
  }
  // hold=true: each PutFile waits until Release (or Abort, which fails it;
  // ignore_abort: it waits for Release alone, a transfer that cannot stop).
  void HoldPuts(bool ignore_abort = false) {
    MutexLock l(&mu_);
    hold_ = true;
    ignore_abort_ = ignore_abort;
  }
  void Release() {
    MutexLock l(&mu_);
    hold_ = false;
    cv_.SignalAll();
  }
  // How many PutFile calls wait in HoldPuts now.
  int held() const {
    MutexLock l(&mu_);
    return held_;
  }
  bool Has(const std::string& key) const {
    MutexLock l(&mu_);
    return objects.count(key) > 0;
  }
  uint64_t puts() const {
    MutexLock l(&mu_);
    return static_cast<uint64_t>(puts_);
  }

  // Test access (single-threaded tests read and change it directly).
  std::map<std::string, std::string> objects;
  int fail_put_from = -1;     // the nth put (0-based) and every later one fails
  int fail_chunk_from = -1;   // a streamed read fails at its nth chunk
  int fail_delete_from = -1;  // the nth delete call and every later one fails
  int fail_list_from = -1;

 private:
  Status Fail(int* count, int from) NO_THREAD_SAFETY_ANALYSIS {
    MutexLock l(&mu_);
    const int n = (*count)++;
    if (from >= 0 && n >= from) return Status::IOError(url() + ": the store went away");
    if (count == &puts_ && fail_next_puts_ > 0) {
      --fail_next_puts_;
      return Status::IOError(url() + ": the store went away\n(and a second line)");
    }
    return Status::OK();
  }
  Status Held() {
    MutexLock l(&mu_);
    ++held_;
    cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return !hold_ || (aborted_ && !ignore_abort_); });
    --held_;
    if (hold_) return Status::Aborted(url() + ": upload aborted (close_timeout_s passed)");
    return Status::OK();
  }

  Env* env_;
  uint64_t part_;
  mutable Mutex mu_;
  CondVar cv_;
  int fail_next_puts_ GUARDED_BY(mu_) = 0;
  bool hold_ GUARDED_BY(mu_) = false;
  bool ignore_abort_ GUARDED_BY(mu_) = false;
  bool aborted_ GUARDED_BY(mu_) = false;
  int held_ GUARDED_BY(mu_) = 0;
  int puts_ GUARDED_BY(mu_) = 0;
  int deletes_ GUARDED_BY(mu_) = 0;
  int lists_ GUARDED_BY(mu_) = 0;
};

}  // namespace nonstop::tier
