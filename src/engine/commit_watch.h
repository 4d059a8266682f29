// CommitWatch: the outcome of each checkpoint a caller tracks, delivered to a
// waiter as the engine finishes it (the Python front end's per-checkpoint
// handles and on_commit; python/nonstop/_handle.py, docs/PYTHON.md).
//
// The engine reports every finished checkpoint (Finished) and, in
// distributed mode, every globally agreed step it writes (Agreed). The
// training thread tracks the counters it hands out (Track); a finished
// checkpoint not tracked yet is kept (the last 64) until it is. One waiter
// blocks in Next() until tracked checkpoints are settled: failed, or
// committed and, with `agreement`, agreed on (the agreed step >= its step:
// only then did every rank commit it). No polling: each report wakes it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "nonstop/engine.h"

namespace nonstop {

// How one tracked checkpoint settled.
struct WatchOutcome {
  enum class Kind {
    kCommitted,  // committed (and agreed on, with agreement)
    kFailed,     // failed writing or committing: an I/O error
    kCancelled,  // superseded, abandoned for a newer one, or its outcome is unknown
  };
  uint64_t counter = 0;
  int64_t step = 0;
  Kind kind = Kind::kCommitted;
  std::optional<CheckpointStats> record;  // the engine's; nullopt when settled by Abandon
  std::string error;                      // one line; empty when committed
};

class CommitWatch {
 public:
  explicit CommitWatch(bool agreement) : agreement_(agreement) {}

  // A handle waits for checkpoint `counter` of `step`; settled at once
  // (for the next Next()) when it finished already.
  void Track(uint64_t counter, int64_t step) EXCLUDES(mu_);
  // The engine finished checkpoint `rec.counter` (committed or not).
  void Finished(const CheckpointStats& rec) EXCLUDES(mu_);
  // The newest globally agreed step (the engine wrote its record); it may go
  // down (a rollback). Releases the committed checkpoints at or below it.
  void Agreed(int64_t step) EXCLUDES(mu_);
  // Blocks until tracked checkpoints are settled and returns them, oldest
  // first; nullopt once stopped with nothing settled left to return.
  std::optional<std::vector<WatchOutcome>> Next() EXCLUDES(mu_);
  // Wakes Next(): it returns what is settled, then nullopt.
  void Stop() EXCLUDES(mu_);
  // Stops, and returns every tracked checkpoint not returned yet: those
  // settled as they are, the others (unfinished, or committed but not agreed
  // on) cancelled with "checkpoint of step N: <why>".
  std::vector<WatchOutcome> Abandon(const std::string& why) EXCLUDES(mu_);

  // The outcome of a finished checkpoint's record (its error line and kind).
  static WatchOutcome Outcome(const CheckpointStats& rec);

 private:
  void Settle(int64_t step, const CheckpointStats& rec) REQUIRES(mu_);

  const bool agreement_;
  Mutex mu_;
  CondVar cv_;
  std::map<uint64_t, int64_t> tracked_ GUARDED_BY(mu_);          // counter -> step, unfinished
  std::map<uint64_t, CheckpointStats> untracked_ GUARDED_BY(mu_);  // finished, not tracked yet
  std::map<uint64_t, std::pair<int64_t, CheckpointStats>> unagreed_ GUARDED_BY(mu_);
  std::vector<WatchOutcome> ready_ GUARDED_BY(mu_);
  std::optional<int64_t> agreed_ GUARDED_BY(mu_);
  bool stopped_ GUARDED_BY(mu_) = false;
};

}  // namespace nonstop
