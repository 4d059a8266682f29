// The remote tier's uploader (docs/TIERS.md): one rank's background thread
// that copies committed checkpoints to a RemoteTier. Everything that decides
// is here: which checkpoint goes next (the newest whenever it is free, or
// with `every` = n each n-th in order, none skipped), the follower's pick of
// rank 0's step, the staging copy and when the ring slot may be reused, the
// backoff between failed tries (doubling up to retry_max_s), retention after
// each commit, how long close waits, the counters, and the thread's CPU and
// I/O priority. The bytes go through the tier's Transport; what is the
// newest committed checkpoint comes from `newest` (the engine's, or the
// ranks' agreed one), both handed in.
//
// Thread safety: every public method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "jobdir/remote_layout.h"
#include "nonstop/env.h"
#include "nonstop/status.h"
#include "tier/remote_tier.h"

namespace nonstop::tier {

// One committed checkpoint: the engine's counter and its step.
struct UploadTarget {
  uint64_t counter = 0;
  int64_t step = 0;
};

struct UploaderOptions {
  std::string job_dir;            // the rank's job directory (its slot file; staging under it)
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t every = 0;             // 0: the newest whenever free; n: each counter % n == 0, in order
  remote::Retention retention;    // rank 0, after each commit
  double bps = 0;                 // > 0: a part's upload at most that many bytes a second
  double poll_s = 0.05;           // how often `newest` is asked while idle
  double commit_timeout_s = 120;  // rank 0's wait for the other ranks; BeforeSave's bound
  double retry_max_s = 10;        // the backoff's ceiling (it starts at 0.2 s and doubles)
  double close_timeout_s = 600;   // Close(wait=true): how long the last upload may take
  double abort_grace_s = 10;      // Close: how long an aborted transfer is waited for
  int nice = 10;                  // the thread's CPU nice increment (and idle-class I/O); 0: none
  // The job manifest (jobdir/manifest.h): after each publish the thread
  // notes in job_dir's manifest which committed steps the remote holds of
  // this rank (a listing after retention), off the commit path. `job`: the
  // job's identity (the prefix's JOB name). note_manifest=false: none.
  bool note_manifest = true;
  std::string job;
};

// The counters (stats()["remote"]).
struct UploaderStats {
  uint64_t uploads = 0, committed = 0, retries = 0, failures = 0, bytes = 0;
  uint64_t skipped_existing = 0, deleted_steps = 0, skipped_gone = 0, given_up = 0;
  uint64_t manifest_notes = 0;          // notes written into the job manifest
  std::string manifest_error;           // the last failed note (one line); empty: none
  double upload_s = 0, last_GBps = 0, stage_s = 0, crc_s = 0, put_s = 0;
  std::string last_error;               // empty: none
  std::optional<int64_t> uploaded_step;  // newest step uploaded (rank 0: and committed)
  std::optional<int64_t> uploading_step;
};

class RemoteUploader {
 public:
  // The newest checkpoint to upload, nullopt while there is none: the newest
  // committed one (one process) or the newest one every rank agreed on in
  // this run. Called on the uploader's thread; an error is counted in
  // last_error and asked again later.
  using Newest = std::function<Result<std::optional<UploadTarget>>()>;

  // Starts the thread. `tier` and `env` are not owned and outlive the
  // uploader. InvalidArgument for options out of range (max_to_keep 0).
  static Result<std::unique_ptr<RemoteUploader>> Start(RemoteTier* tier, Env* env,
                                                      UploaderOptions o, Newest newest);
  // Close(false), then waits for the thread.
  ~RemoteUploader();
  RemoteUploader(const RemoteUploader&) = delete;
  RemoteUploader& operator=(const RemoteUploader&) = delete;

  // After each checkpoint started (its counter and step): with `every`, a
  // selected one is queued; the thread looks for work now.
  void Started(uint64_t counter, int64_t step) EXCLUDES(mu_);
  // With `every`: returns once every queued checkpoint has been copied out
  // of the slot ring (staged), so a new checkpoint may reuse its slot. One
  // not staged within commit_timeout_s (it never committed) is given up.
  void BeforeSave() EXCLUDES(mu_);

  UploaderStats Stats() const EXCLUDES(mu_);

  // Stops the thread. wait=true: the newest checkpoint still to upload is
  // uploaded first, within close_timeout_s; past it a transfer under way is
  // aborted (Transport::Abort) and given abort_grace_s more. wait=false: now. OK, or
  // one line: a transfer still running (left to finish in the background;
  // the uploader must then outlive it: see Running), or with wait=true the
  // last failure when an upload failed.
  Status Close(bool wait) EXCLUDES(mu_);
  // Whether the thread still runs (after a Close that timed out).
  bool Running() const EXCLUDES(mu_);

 private:
  RemoteUploader(RemoteTier* tier, Env* env, UploaderOptions o, Newest newest);

  void Loop() EXCLUDES(mu_);
  // What to upload now; nullopt: nothing.
  std::optional<UploadTarget> Target() EXCLUDES(mu_);
  // Rank > 0: the step rank 0 leads to upload for target `t` (nullopt: none yet).
  Result<std::optional<UploadTarget>> Pick(const UploadTarget& t) EXCLUDES(mu_);
  Status Upload(const UploadTarget& t) EXCLUDES(mu_);
  // Notes in the job manifest the committed steps the remote holds of this rank.
  void NoteManifest() EXCLUDES(mu_);
  // Sleeps `s` seconds or until Close is called (stopping: the full `s`).
  void Pause(double s) EXCLUDES(mu_);
  bool DeadlinePassed(double extra_s) const REQUIRES(mu_);

  RemoteTier* const tier_;
  Env* const env_;
  const UploaderOptions o_;
  const Newest newest_;

  mutable Mutex mu_;
  CondVar cv_;  // wake_, stop_, the queue, done_
  UploaderStats stats_ GUARDED_BY(mu_);
  std::deque<UploadTarget> queue_ GUARDED_BY(mu_);   // `every`: selected, not staged yet
  std::optional<UploadTarget> retry_ GUARDED_BY(mu_);  // `every`: staged, its upload failed
  bool wake_ GUARDED_BY(mu_) = false;
  bool stop_ GUARDED_BY(mu_) = false;
  bool done_ GUARDED_BY(mu_) = false;  // the loop returned
  // Close's deadlines (steady clock seconds).
  double stop_at_ GUARDED_BY(mu_) = 0;
  double deadline_ GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

// Lowers the calling thread's CPU priority by `nice` (at most to 19) and
// puts its I/O in the lowest best-effort level (Linux: both per thread).
// `nice` kIdleNice (or more) also puts the thread in the SCHED_IDLE class
// (it runs only on a core nothing else of normal class wants; threads it
// starts inherit that). Best effort: what is refused stays as it is.
inline constexpr int kIdleNice = 20;
void LowerThreadPriority(int nice);

}  // namespace nonstop::tier
