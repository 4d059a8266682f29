// The remote tier (docs/TIERS.md): committed checkpoints copied to an
// object store, or a plain directory used as one, under the layout and
// commit rules of jobdir/remote_layout.h, and fetched back by a node that
// lost its local directory. Everything but the bytes is decided here: which
// steps are committed, what a fetch verifies (the manifest's size and the
// crc32 of every unit while writing), which steps retention deletes and in
// what order, whose job the prefix is. The bytes go through a Transport.
//
// Thread safety: one RemoteTier may be used from several threads (the
// counters cache of Retain is guarded); its Transport must allow that too.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "jobdir/remote_layout.h"
#include "nonstop/env.h"
#include "nonstop/status.h"
#include "tier/tier.h"
#include "tier/transport.h"

namespace nonstop::tier {

// Local staging and fetch directory under a job directory:
// DIR/remote/step-N/rank-R.nsck.
inline constexpr const char* kLocalDir = "remote";

class RemoteTier final : public Tier {
 public:
  // Neither is owned; both outlive the tier.
  RemoteTier(Transport* transport, Env* env) : t_(transport), env_(env) {}

  std::string where() const override { return t_->url(); }
  Result<std::vector<HeldStep>> List(uint32_t rank) override;
  Result<std::string> Fetch(int64_t step, uint32_t rank, const std::string& local_dir) override;
  Result<int> Retain(const remote::Retention& r) override;
  // The upload of one staged one-slot copy (req.dir/req.name) and, on rank
  // 0, the commit:
  //  - a step already committed by this checkpoint (its marker's lineage,
  //    and with one process its counter) is not uploaded again;
  //  - a marker of another checkpoint of the step (an abandoned future after
  //    a rollback) is deleted first, so that the step is never committed
  //    over a mix of old and new objects;
  //  - world > 1: rank 0 writes LEAD before its part (the others follow it);
  //  - the part's crc32 per unit (remote_layout.h ChecksumUnit), the part,
  //    then its manifest; rank 0 then waits for every rank's manifest of the
  //    step and lineage and writes COMMITTED, gives the step up when a rank
  //    left a skip note, and stops waiting after commit_timeout_s or once
  //    Stop's deadline has passed.
  Result<PublishReport> Publish(const PublishRequest& req, const PublishOptions& o) override;

  // A follower's pick (world > 1, rank > 0): the newest step rank 0 leads
  // (LEAD) that is newer than `done_step`, not newer than `target_step`, and
  // that this rank's slot file in `job_dir` holds committed with the LEAD's
  // lineage: (counter, step); nullopt while there is none. A step rank 0
  // leads in this run (the lineage of this rank's own target) that the slot
  // ring has already reused gets this rank's skip note, once, so that rank
  // 0 gives it up at once; a LEAD of an abandoned run is never followed.
  Result<std::optional<std::pair<uint64_t, int64_t>>> Follow(const std::string& job_dir,
                                                              uint32_t rank, uint32_t world,
                                                              int64_t target_step,
                                                              std::optional<int64_t> done_step);
  // Skip notes written by Follow so far.
  uint64_t skipped_gone() const { return skipped_gone_.load(); }

  // From now on, a commit wait ends `wait_s` seconds from now at the latest
  // (the uploader closing). Any thread.
  void Stop(double wait_s);
  // A transfer under way stops as soon as it can (Transport::Abort). Any thread.
  void Abort() { t_->Abort(); }

  // The committed steps, newest first, with their markers; `damaged`
  // (optional) receives one line per marker that does not parse (skipped).
  Result<std::vector<std::pair<int64_t, remote::Doc>>> CommittedSteps(
      std::vector<std::string>* damaged = nullptr);

  // This job owns the prefix: one without a JOB document is claimed; one
  // of another job is FailedPrecondition unless `adopt`, which takes it.
  Status Claim(const std::string& job, bool adopt, double unix_s);
  // The job that owns the prefix (its JOB document): nullopt when there is
  // none; Corruption when it does not parse.
  Result<std::optional<std::string>> Job();

  // Every rank's part of committed `step` (the ranks of its marker's
  // world), each fetched as Fetch does, into local_dir/remote/step-N;
  // returns that directory. Corruption for a step not committed or a part
  // missing or damaged.
  Result<std::string> FetchAll(int64_t step, const std::string& local_dir);

 private:
  // A marker, LEAD or skip note: nullopt when missing; Corruption when it
  // does not parse.
  Result<std::optional<remote::Doc>> LoadDoc(const std::string& key);

  bool StopPassed() const;

  Transport* const t_;
  Env* const env_;
  Mutex mu_;
  std::map<int64_t, std::optional<uint64_t>> counters_ GUARDED_BY(mu_);  // Retain's cache
  std::set<int64_t> skipped_ GUARDED_BY(mu_);  // steps Follow wrote a skip note for
  std::atomic<uint64_t> skipped_gone_{0};
  // Stop's deadline (steady clock, ns since its epoch); INT64_MAX: none.
  std::atomic<int64_t> stop_ns_{INT64_MAX};
};

// The path of the one-slot job directory a fetch of `step` writes under
// `local_dir` (local_dir/remote/step-N).
std::string LocalStepDir(const std::string& local_dir, int64_t step);

}  // namespace nonstop::tier
