// FaultDisk: a simulated device for crash and error tests, after LevelDB's
// db/fault_injection_test.cc. It remembers which writes were synced; a
// simulated power loss drops (or tears, at 512-byte sectors) everything that
// was not, and chosen calls can be made to fail with an errno.
//
// Usage:
//   auto disk = FaultDisk::Create();
//   std::unique_ptr<Medium> m = disk->Open();
//   ... m->Write(...), m->Sync() ...
//   disk->Crash(CrashMode::kTornUnsynced, seed);
//   std::unique_ptr<Medium> after = disk->Open();  // sees the post-crash image
//
// Thread safety: every method of FaultDisk, and every call on the media it
// opens, may run concurrently. One mutex guards the disk, so concurrent
// writers are correct but serialized (a test device, not a fast one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "nonstop/medium.h"
#include "nonstop/status.h"

namespace nonstop {

enum class CrashMode {
  // Every write since the last successful Sync is lost.
  kDropUnsynced,
  // Each unsynced write is, at random, lost, kept whole, or torn: each 512-byte
  // device sector it touches is independently kept or lost. No sector is ever
  // partly written. Writes are replayed in issue order, so of two overlapping
  // kept writes the later one wins. Unsynced Resizes are kept or lost at random.
  kTornUnsynced,
  // The process dies, the machine does not: every write (synced or not) is
  // kept, as the kernel's page cache and a tmpfs keep them.
  kProcess,
};

// The calls that InjectError and CrashOnCall count.
enum class FaultOp { kWrite = 0, kRead = 1, kSync = 2, kResize = 3 };

struct FaultDiskOptions {
  size_t alignment = 1;  // Alignment() of opened media, enforced as O_DIRECT would
  MediumKind kind = MediumKind::kBuffered;  // what opened media report as kind()
  // Linux's fsync-failure semantics: when an injected Sync error fires, the
  // writes not yet synced are dropped from the durable image's future (lost
  // at a crash) but are no longer dirty, so the next Sync returns OK without
  // making them durable. That is what the kernel does after a writeback error
  // (the pages are marked clean and the error is reported once), and why a
  // writer must never trust a file after a failed fsync (media/sticky_medium.h).
  // Off: a failed Sync leaves the writes pending, and a retry makes them durable.
  bool forget_failed_syncs = false;
  // With forget_failed_syncs, the extent map as ext4 (Linux 6.x) keeps it
  // (issue 24; docs/FORMAT.md "After a failed fsync"): a page (4096 bytes)
  // that no successful Sync has written yet is unwritten (a Resize's new
  // bytes, fallocated, read as zeros). When a failed Sync drops a write into
  // an unwritten page, the page goes stale: the kernel keeps it cached with
  // its block mapped, and a later write of it, synced with OK, reaches the
  // disk but never converts the extent, so it is lost at a crash (the page
  // reads as before). A crash empties the cache: the page is plain unwritten
  // again. Pages written once by a successful Sync behave as without it.
  bool unwritten_extents = false;
  // Open() wraps each medium in the sticky-sync guard every Env-opened medium
  // has (media/sticky_medium.h): after a failed Sync, every later Write,
  // Resize and Sync on that medium fails. (The fault Env uses
  // forget_failed_syncs and wraps its media in the same guard itself.)
  bool sticky_sync = false;
};

class FaultMedium;

class FaultDisk : public std::enable_shared_from_this<FaultDisk> {
 public:
  static constexpr uint64_t kSectorSize = 512;

  static std::shared_ptr<FaultDisk> Create(FaultDiskOptions opts = {});

  FaultDisk(const FaultDisk&) = delete;
  FaultDisk& operator=(const FaultDisk&) = delete;

  // A Medium over this disk's current image. Media opened before a Crash()
  // return IOError "device crashed" on every call afterwards, so a test's
  // background threads cannot write into the post-crash image.
  std::unique_ptr<Medium> Open();

  // Simulated power loss (see CrashMode). `seed` makes torn crashes
  // reproducible: the same log and seed give the same image.
  void Crash(CrashMode mode, uint64_t seed);
  // The nth call of `op` from now (1-based) crashes the disk before it takes
  // effect, and returns "device crashed". For crash points inside a run.
  void CrashOnCall(FaultOp op, uint64_t nth_call, CrashMode mode, uint64_t seed);

  // The nth call of `op` from now (1-based) fails with errno `err` (EIO,
  // ENOSPC, ...) without changing the image; later calls succeed.
  void InjectError(FaultOp op, uint64_t nth_call, int err);
  // Every call of `op` from the nth one on fails with `err` (a persistently
  // full or dead disk) until ClearErrors().
  void InjectErrorFrom(FaultOp op, uint64_t nth_call, int err);
  // Removes all pending errors and scheduled crashes.
  void ClearErrors();

  // What a reader sees now (synced and unsynced writes applied).
  std::vector<uint8_t> Snapshot() const;
  // What would survive a kDropUnsynced crash now.
  std::vector<uint8_t> DurableSnapshot() const;
  uint64_t size() const;

  // Counters of successful calls, over the disk's life (crashes included).
  uint64_t writes() const;
  uint64_t syncs() const;
  uint64_t crashes() const;
  // Writes (and resizes) logged since the last successful Sync.
  size_t unsynced_ops() const;
  // unwritten_extents: synced writes that stale pages kept from the disk.
  uint64_t lost_writes() const;

 private:
  friend class FaultMedium;

  // One unsynced change: a write of `bytes` at `offset`, or a resize.
  struct LogEntry {
    bool is_resize = false;
    uint64_t offset = 0;  // or the new size, for a resize
    std::vector<uint8_t> bytes;
  };
  struct Rule {
    FaultOp op;
    uint64_t at_call;  // fires on this call count of `op`
    bool persistent;   // and on every later call
    bool crash;        // crash instead of failing with `err`
    int err;
    CrashMode mode;
    uint64_t seed;
  };

  explicit FaultDisk(FaultDiskOptions opts) : opts_(opts) {}

  // Counts a call of `op` and applies any matching rule. OK means proceed.
  Status BeginCallLocked(FaultOp op, uint64_t generation, const std::string& what) REQUIRES(mu_);
  void CrashLocked(CrashMode mode, uint64_t seed) REQUIRES(mu_);
  void AddRule(Rule r);

  // Called by FaultMedium, which passes the generation it was opened at.
  Status DoWrite(uint64_t generation, uint64_t offset, const void* buf, size_t n);
  Status DoRead(uint64_t generation, uint64_t offset, void* buf, size_t n);
  Status DoSync(uint64_t generation);
  Status DoResize(uint64_t generation, uint64_t size);
  uint64_t DoSize(uint64_t generation) const;

  const FaultDiskOptions opts_;
  mutable Mutex mu_;
  std::vector<uint8_t> visible_ GUARDED_BY(mu_);
  std::vector<uint8_t> durable_ GUARDED_BY(mu_);
  std::vector<LogEntry> log_ GUARDED_BY(mu_);  // unsynced changes in issue order
  uint64_t generation_ GUARDED_BY(mu_) = 0;  // bumped by each crash
  uint64_t calls_[4] GUARDED_BY(mu_) = {};  // per FaultOp
  std::vector<Rule> rules_ GUARDED_BY(mu_);
  uint64_t writes_ GUARDED_BY(mu_) = 0;
  uint64_t syncs_ GUARDED_BY(mu_) = 0;
  uint64_t crashes_ GUARDED_BY(mu_) = 0;
  // unwritten_extents: pages (offset / 4096) written by a successful Sync,
  // and pages gone stale (a failed Sync's write into an unwritten page).
  std::set<uint64_t> written_pages_ GUARDED_BY(mu_);
  std::set<uint64_t> stale_pages_ GUARDED_BY(mu_);
  uint64_t lost_writes_ GUARDED_BY(mu_) = 0;
};

}  // namespace nonstop
