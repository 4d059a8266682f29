// The reshard's gather of old ranks' checkpoints (docs/TIERS.md "Peer tier",
// "Resharding from memory"): before a set-aside checkpoint of another world
// size W is resharded, every old rank whose rank file the job directory's
// world-W/ lacks (a lost or new host never held it) needs a copy that
// verifies. GatherOldShards decides where each comes from and gets it:
//   - this host's memory directory, read in place (its own segment of that
//     old rank, or the replica it holds), verified (VerifyLocal);
//   - a server of another host that held it (a replica, its own segment or
//     its job directory's rank file), fetched, verified, once per host
//     (FetchOncePerHost);
//   - the job's remote tier where it holds a committed step of world size W:
//     that old rank's part, fetched once per host too (OncePerHost; the
//     caller's `remote_fetch` verifies size and part crcs, the reshard every
//     chunk as it reads).
// Only steps of which every missing old rank has a copy are tried, newest
// first in the recovery planner's order (MakePlan: newest counter first, at
// one counter memory before disk before the object store; the remote part
// of a step takes the counter of the memory copies of that step); at a step
// every old rank's copies are tried in the planner's order, the first that
// verifies kept; done at the first step every old rank got. The copies are
// for JobDir::SelectReshard (the reshard's own choice), which reads them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/status.h"
#include "tier/peer.h"

namespace nonstop::peer {

// One copy of an old rank's checkpoint that this host or a server holds.
struct GatherCopy {
  HeldReplica held;
  Source kind = Source::kReplica;  // a replica, an own segment or a rank file
  int holder = -1;                 // -1: this host's memory directory (`path`); else the
                                   // rank whose server holds it (`endpoints[holder]`)
  std::string path;
};

// A committed step of the remote tier: its world size, step and counter.
struct RemoteStep {
  uint32_t world_size = 0;
  int64_t step = 0;
  uint64_t counter = 0;
};

struct GatherRequest {
  std::string job_dir;                 // world-W/rank-RRRRR.nsck there need no copy
  std::string job;
  std::string secret;
  std::vector<std::string> endpoints;  // by rank
  std::vector<GatherCopy> copies;
  std::vector<RemoteStep> remote_steps;
  std::string remote_url;              // names the remote tier ("": none)
  std::string remote_error;            // why the remote could not be listed ("": it could)
  // The remote part of old rank `rank` of `step` written into `local_dir`
  // (as local_dir/remote/step-N/rank-RRRRR.nsck); returns that directory.
  std::function<Result<std::string>(int64_t step, uint32_t rank, const std::string& local_dir)>
      remote_fetch;
  std::string mem_dir;                 // this host's memory directory
  std::string fallback_dir;            // this rank's own directory of copies
  std::string holder;                  // "rank 3 pid 77": names this rank in lock files
  Env* env = nullptr;
  double timeout_s = 60;
  double wait_s = 120;
};

// A rank's hold on this host's copies fetched once per host
// (SharedReshardDir in the memory directory): taken before the rank's gather
// fetches or takes a copy there, released once its reshard has read them
// (or failed, or was never run). Every holder keeps a lock file
// "readers/reader-N.lock" in that directory (Directory::Lock: released when
// its process dies, so a killed rank holds nothing); Release removes the
// directory only when no other holder's lock is held. No rank removes a
// copy another rank of its host may still be reading, whichever path its
// reshard took (an error raised on that rank alone included), and the last
// one to finish leaves nothing (copies a dead job left there go with it).
// Take and Release serialize on "<job key>-reshard-host.lock" beside the
// directory (left there: one small file a job).
class ReshardLease {
 public:
  static Result<std::unique_ptr<ReshardLease>> Take(const std::string& mem_dir,
                                                    const std::string& job,
                                                    const std::string& holder,
                                                    Env* env = nullptr, double wait_s = 60);
  ~ReshardLease();  // the hold goes (as at a death); the directory stays
  ReshardLease(const ReshardLease&) = delete;
  ReshardLease& operator=(const ReshardLease&) = delete;
  // Gives the hold up; removes the directory when no other holder is left.
  // Returns whether it removed it. A second call does nothing (false).
  Result<bool> Release();

 private:
  ReshardLease() = default;
  Env* env_ = nullptr;
  std::string mem_dir_, job_, holder_;
  double wait_s_ = 60;
  std::unique_ptr<FileLock> mine_;
};

struct GatherResult {
  std::vector<std::tuple<uint32_t, uint32_t, std::string>> files;  // (old world, old rank, path)
  std::map<std::string, std::string> from;  // "W/r" -> where it came from (one line)
  std::string missing;    // "; "-joined lines naming every old rank without a copy, and why
  uint64_t bytes = 0;     // fetched by this rank
  uint64_t shared = 0;    // copies another rank of this host fetched
  std::string dir;        // where the fetched copies are ("": none fetched)
  // This rank's hold on the host's shared copies (taken as the gather
  // starts; null when there was nothing to gather or it could not be taken,
  // and then no copy there was used): Release it once the reshard has read
  // them.
  std::shared_ptr<ReshardLease> lease;
};

// Not collective; never fails: what cannot be found is in `missing` (the
// reshard then reads what the disk holds, and fails in one line when an old
// rank is on neither). Copies of the caller's own world are not asked for.
GatherResult GatherOldShards(const GatherRequest& r);

}  // namespace nonstop::peer
