// The restore of a rank that has a remote tier (docs/TIERS.md "Restoring"):
// which checkpoint it reads first, from which tier. Everything that orders,
// filters or verifies is here, and every order comes from the recovery
// planner (nonstop/plan.h MakePlan): this file gathers its candidates (the
// rank's job directory: slot file and keep copies, with its lineage; the
// remote's committed steps as listed; a local copy handed in, e.g. the peer
// tier's prefetched replica) and refuses a local copy that fails to verify
// when the remote holds the same checkpoint. Python only reads what C++
// fetched (python/nonstop/_remote.py), and across ranks only carries the
// gathers (RestoreFromRemoteDist decides).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "jobdir/remote_layout.h"
#include "nonstop/env.h"
#include "nonstop/plan.h"
#include "nonstop/status.h"

namespace nonstop::tier {

class RemoteTier;

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

// One rank's restore with a remote tier, the whole loop: the local plan
// (request.step held locally: the local path reads it, nothing is listed);
// the remote's committed steps listed (of `world` only when given; a marker
// that does not parse is a warning); then, in the plan's order, the first
// source: a local one is left to the local path; a remote one is fetched
// into fetch_dir (verified: tier Fetch) and handed to `read`, and when
// either fails the warning "remote step S: ERROR; falling back" is added and
// the plan is made again without that checkpoint.
struct RemoteRestoreRequest {
  RestorePlanRequest plan;  // job_dir, rank, step, extra_local, remote_where (`remote` is listed here)
  std::string fetch_dir;    // where a remote part is fetched (fetch_dir/remote/step-N)
  std::optional<uint32_t> world;  // only remote steps of this world size
  // nonstop.load (no local path): no committed step is NotFound "no
  // committed remote checkpoint [at step S] in URL", and a failed listing
  // is returned as it is.
  bool load = false;
  // Whether waiting can make a failed listing work (a store down, not a
  // missing bucket or refused credentials); decides the error's advice.
  std::function<bool(const Status&)> waiting_helps;
};
// Reads the fetched one-slot directory of `step`; OK or a one-line error
// (the next candidate is tried), or Aborted: the restore stops with it.
using ReadFetched = std::function<Status(int64_t step, const std::string& dir)>;
struct RemoteRestoreResult {
  std::optional<RestoreSource> read;  // the remote checkpoint `read` accepted; nullopt: the local path
  std::vector<std::string> warnings;  // in order, one line each (without "nonstop: ")
};
// Errors: a remote that cannot be listed with nothing local to restore
// instead (IOError, with what to do), every remote candidate failing with
// nothing local left (Corruption "no remote checkpoint in URL verifies:
// FIRST ERROR"), and (load) as above. `out` holds the warnings made before
// an error too.
Status RestoreFromRemote(Env* env, RemoteTier* tier, const RemoteRestoreRequest& request,
                         const ReadFetched& read, RemoteRestoreResult* out);

// One move of the distributed remote restore, made alike on every rank:
// `plans[r]` is rank r's plan (PlanRemoteRestore's order, gathered), `tried`
// the agreed steps tried so far, each with every rank's one-line error
// (empty: that rank read it). Returns the next agreed remote step for every
// rank to fetch and read, or nullopt: the local path restores (an agreed
// step every rank holds locally, or none left). Corruption "no remote
// checkpoint in URL verifies on every rank: ..." when every agreed step
// failed and no rank has a local candidate. `warning` (when not null) gets
// the line of the last step tried when it failed.
struct DistTried {
  int64_t step = 0;
  std::vector<std::string> errors;  // per rank
};
Result<std::optional<int64_t>> NextDistRemoteStep(const std::string& url,
                                                  const std::vector<std::vector<RestoreSource>>& plans,
                                                  const std::vector<DistTried>& tried,
                                                  std::string* warning);

// The distributed remote restore, called alike on every rank: rank 0 lists
// the remote's committed steps (of request.world only, when given), every
// rank plans with that listing (PlanRemoteRestore), and the ranks move
// together through NextDistRemoteStep, each fetching (verified) and reading
// its own part of the agreed step; a step that fails on any rank is a
// warning and the next one is tried. `gather(mine)` returns every rank's
// text, rank 0 first (python: the Comm's gather of JSON over the process
// group, never pickle). A listing that fails is UnlistedRemote's warning
// (with the newest step every rank holds locally) or its error. out->read:
// the agreed remote step every rank read; nullopt: the local path restores.
// Errors: NextDistRemoteStep's, UnlistedRemote's, a gathered text that does
// not parse (Corruption), `read`'s Aborted and the gather's own.
using Gather = std::function<Result<std::vector<std::string>>(const std::string& mine)>;
Status RestoreFromRemoteDist(Env* env, RemoteTier* tier, const RemoteRestoreRequest& request,
                             const Gather& gather, const ReadFetched& read,
                             RemoteRestoreResult* out);

// The remote's committed steps in the planner's order (by counter: a
// checkpoint, not a step number), `step` alone when given, each with its
// marker: what `nonstop verify|export URL` and nonstop.load try. NotFound
// "no committed remote checkpoint [at step S] in URL" when there is none;
// `damaged` gets one line per marker that does not parse.
Result<std::vector<std::pair<int64_t, remote::Doc>>> RemoteCandidates(
    Env* env, RemoteTier* tier, std::optional<int64_t> step, std::vector<std::string>* damaged);

// `nonstop export URL`: each of RemoteCandidates(step) in order, every
// rank's part fetched (FetchAll: verified) under fetch_dir and handed to
// `run` (the export of that directory; its exit code). A download that
// fails its checks, or (no step asked) an export that exits 1 (damaged
// inside), falls back to the next older step with a line on `note`.
// Returns the first other exit code; Corruption "no remote checkpoint in
// URL downloads intact: FIRST" when none is left. Each step's download is
// removed after its try.
Result<int> ExportRemote(Env* env, RemoteTier* tier, std::optional<int64_t> step,
                         const std::string& fetch_dir,
                         const std::function<int(int64_t, const std::string&)>& run,
                         const std::function<void(const std::string&)>& note);

// A remote that cannot be listed at restore (`why`: the store's one line).
// With a local step to resume (`local_newest`), the warning to give before
// the local path restores it; with none (or a step asked), the IOError
// rather than a silent start from scratch, its advice by `waiting_helps`.
Result<std::string> UnlistedRemote(const std::string& url, const std::string& why,
                                   const std::string& job_dir, std::optional<int64_t> local_newest,
                                   bool step_asked, bool waiting_helps);

}  // namespace nonstop::tier
