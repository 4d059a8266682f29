// The peer tier's start on every rank (python: _peer.Peers): what the ranks
// decide together over the Comm's gathers of texts (JSON over the process
// group, never pickle): whether the tier runs at all, the job's secret, the
// partners, this rank's server and replicator, and what every server held
// at the start (its replicas of this rank, the checkpoints of another world
// size a reshard may gather). docs/TIERS.md "The peer tier from Python".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "nonstop/status.h"
#include "tier/peer.h"
#include "tier/peer_gather.h"

namespace nonstop::peer {

// Every rank's text for this rank's `mine`, rank 0 first (collective).
using SetupGather = std::function<Result<std::vector<std::string>>(const std::string& mine)>;

struct SetupRequest {
  uint32_t rank = 0;
  uint32_t world = 1;
  int replicas = 1;                  // replicas= (0: this rank wants no tier)
  std::string segment;               // this rank's memory segment ("": tier="disk")
  std::vector<std::string> segments; // this host's own segments of the job (any world size)
  std::string job_dir;               // this rank's job directory (absolute)
  std::string addr;                  // where this rank's server listens (LocalAddress)
  std::string host;                  // this rank's failure domain (HostId)
  std::string env_secret;            // $NONSTOP_PEER_SECRET's bytes ("": unset)
  std::optional<uint64_t> budget_bytes;  // peer_budget_bytes; none: a share of free space
  uint32_t every = 1;                // peer_every
  int nice = 10;                     // peer_nice
  uint64_t bps = 0;                  // peer_bps (0: see spread_s)
  double spread_s = 0;               // peer_bps="spread": kSpreadS
  std::string mem_dir;               // the memory directory ("": PeerMemoryDir)
  Env* env = nullptr;                // nullptr: DefaultEnv()
};

struct PeerStart {
  std::string note;                   // why the tier does not run here ("": it does)
  int replicas = 0;                   // replicas kept of each rank (0: the tier is off)
  std::vector<std::string> hosts;     // every rank's failure domain
  std::string job;                    // rank 0's job directory: the job's name on every rank
  std::string secret;                 // the agreed secret ("" without servers)
  std::vector<std::string> endpoints; // every rank's server ("" without servers)
  std::vector<uint32_t> partners;     // the ranks that hold this rank's replicas
  // This rank's replicas the servers held: (step, counter, holder rank), newest first.
  std::vector<std::tuple<int64_t, uint64_t, uint32_t>> held;
  // Checkpoints of another world size the servers held (replicas, own
  // segments, rank files; holder: the rank whose server holds it).
  std::vector<GatherCopy> other;
  // The same of this host's memory directory, read without a server (holder -1, path).
  std::vector<GatherCopy> local;
  bool reshard_any = false;           // any rank's server or host holds another world's checkpoint
  std::unique_ptr<PeerServer> server;
  std::unique_ptr<Replicator> replicator;
};

// Collective: every rank calls it with its own request and the same gather.
// Decided together in the first exchange: the tier is off (a note) when a
// rank has replicas=0 or no memory segment; without a partner in another
// failure domain no server starts (a second exchange says whether a host
// holds another world's checkpoint). Else the secret (AgreeSecret; its
// error is returned), a server on every rank (one that cannot start, or
// list, is every rank's note: the job runs on without the tier) and a
// replicator to this rank's partners (one that cannot start is a note).
// Errors: the gather's, AgreeSecret's, a gathered text that does not parse.
Result<PeerStart> StartPeers(const SetupRequest& r, const SetupGather& gather);

// This rank's own directory in the memory directory PeerMemoryDir(mem_dir),
// absolute: "<JobKey(job)>-<what>-rank-RRRRR" (what: "fetched", its
// replica fetched for its restore; "reshard", the copies it fetched alone
// for a reshard). With `fresh`, what a run before this one left there is
// removed first.
std::string RankDir(const std::string& job, const std::string& what, uint32_t rank,
                    bool fresh = false, const std::string& mem_dir = "", Env* env = nullptr);
// Removes RankDir(job, what, rank) through the seam (each subdirectory
// opened relative to its parent, links removed, never followed). Best
// effort: false when it was not there or could not be removed.
bool RemoveRankDir(const std::string& job, const std::string& what, uint32_t rank,
                   const std::string& mem_dir = "", Env* env = nullptr);

// The restart's prefetch of rank `rank` (of `world`), before the collective
// restore (not collective): the newest replica of its checkpoint a
// partner's server held at the start (held[0] of PeerStart::held, at
// endpoints[holder]), fetched and verified into RankDir(job, "fetched",
// rank, fresh) unless this rank's own tiers hold a checkpoint of that step
// (`own_steps`). Nothing fetched: `dir` empty, and `why` says why when a
// fetch failed (the restore goes on without it).
struct Prefetched {
  int64_t step = 0;
  uint64_t counter = 0;
  uint32_t holder = 0;
  std::string dir;  // the one-slot job directory fetched ("": none)
  std::string why;  // why the replica is not used ("": none was wanted)
};
Prefetched PrefetchOwnReplica(const std::vector<std::tuple<int64_t, uint64_t, uint32_t>>& held,
                              const std::vector<std::string>& endpoints, const std::string& job,
                              const std::string& secret, uint32_t rank, uint32_t world,
                              const std::vector<int64_t>& own_steps,
                              const std::string& mem_dir = "", Env* env = nullptr);

}  // namespace nonstop::peer
