// The restore of a rank that has a remote tier (docs/TIERS.md "Restoring"):
// which checkpoint it reads first, from which tier. Everything that orders,
// filters or verifies is here, and every order comes from the recovery
// planner (nonstop/plan.h MakePlan): this file gathers its candidates (the
// rank's job directory: slot file and keep copies, with its lineage; the
// remote's committed steps as listed; a local copy handed in, e.g. the peer
// tier's prefetched replica) and refuses a local copy that fails to verify
// when the remote holds the same checkpoint. Python only fetches and reads
// what the plan names (python/nonstop/_remote.py), and across ranks only
// gathers the plans (CommonRestoreSteps decides).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/plan.h"
#include "nonstop/status.h"

namespace nonstop::tier {

// One step of a restore plan and where it is read first.
struct RestoreSource {
  int64_t step = 0;
  uint64_t counter = 0;
  bool remote = false;  // the remote copy (fetched); false: the local path reads it
};

struct RestorePlanRequest {
  std::string job_dir;  // the rank's job directory; empty (or unreadable): no local candidates
  uint32_t rank = 0;
  std::optional<int64_t> step;  // only this step (restore(step=s))
  // Local copies besides the job directory's (Tier::kMemory: the peer tier's
  // replica fetched for this rank), read by the local path.
  std::vector<PlanCandidate> extra_local;
  // The remote's committed steps as (step, COMMITTED marker's counter);
  // nullopt: not listed (the store is down), the plan is the local one.
  std::optional<std::vector<std::pair<int64_t, uint64_t>>> remote;
  std::string remote_where;  // the remote's URL, for messages
  // Counters whose remote copy failed while it was fetched or read.
  std::vector<uint64_t> exclude;
};

struct RestorePlan {
  // The planner's order, each step once, with its first source. A local
  // newest whose checkpoint the remote also holds has been verified first:
  // when it fails, the remote copy comes before an older local one.
  std::vector<RestoreSource> order;
  // Newest step the local candidates alone would restore (any step asked
  // or not): nullopt when there is none. For the messages of a remote that
  // cannot be listed.
  std::optional<int64_t> local_newest;
  // request.step is held locally (the local path reads it, the remote is
  // not needed).
  bool local_has_step = false;
};

// The plan (above). Only the remote's listing is handed in: nothing here
// speaks to the store. Errors of the job directory (missing, unreadable)
// leave it out: the local path reports them.
Result<RestorePlan> PlanRemoteRestore(Env* env, const RestorePlanRequest& request);

// The distributed remote restore's agreement. `every[r]`: rank r's plan
// (PlanRemoteRestore's order), gathered from every rank. Returns the steps
// of rank 0's order that every rank's plan holds, in that order, each with
// whether every rank reads it locally (then the local collective restore
// reads it, not the remote).
struct AgreedStep {
  int64_t step = 0;
  bool all_local = false;
};
std::vector<AgreedStep> CommonRestoreSteps(const std::vector<std::vector<RestoreSource>>& every);

}  // namespace nonstop::tier
