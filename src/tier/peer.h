// The peer tier (issue #27; docs/TIERS.md "Peer tier"): each rank's newest
// committed memory checkpoint is copied, in the background, into the host
// memory of a partner rank on another host, so that a job that loses a node
// restarts from a neighbour's memory instead of the object store.
//
// Three parts, over the engine's own small TCP protocol (peer_wire.h;
// docs/FORMAT.md "Peer wire format"):
//   - PeerServer (one per rank): listens, receives partners' checkpoints and
//     keeps the newest complete one per source rank and world size as a
//     *replica*, a one-slot slot file in the host's memory directory, beside
//     the rank's own segment; serves lists and fetches of what it holds, and
//     read-only its host's own segments and job-directory rank files.
//   - Replicator (one per rank): a background thread that sends the newest
//     committed checkpoint of this rank's memory segment to its partners,
//     newest-wins.
//   - ListReplicas / FetchReplica: what a partner holds; a replica fetched
//     back into a local one-slot job directory, every checksum verified.
// ChoosePartners picks who holds whose replica (never the same host).
//
// Trust (docs/TIERS.md "Trust"): every connection proves the job's peer
// secret both ways (a challenge-response, peer_wire.h) before anything else
// is accepted, and every frame after it carries a MAC; a server and a client
// without the same secret exchange nothing but the handshake.
//
// Replica files (in the memory directory; docs/FORMAT.md):
//   "<job key>-replica-world-WWWWW-rank-RRRRR.nsck"      a complete, verified
//        replica of source rank RRRRR of a world of WWWWW ranks (one-slot
//        slot file, committed record inside; its header says the same)
//   "<job key>-replica-world-WWWWW-rank-RRRRR.nsck.tmp"  one being received:
//        never listed
// where <job key> is JobKey(job), 16 lowercase hex digits. A replica becomes
// visible only by the rename of its complete, verified temp file over the
// name, so a kill at any point leaves the previous replica or the new one.
// Rank r of world 4 and rank r of world 2 are two replicas: a restart with
// another world size never takes one for the other, and a push of the new
// world never overwrites the old world's replica a reshard reads. Names
// without the world ("<job key>-replica-rank-RRRRR.nsck", builds before wire
// version 4) are refused: never listed nor served, removed at Start (a
// PeerServerStats::last_error line says how many).
//
// Thread safety: every public method may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop::peer {

// The most bytes of a job name.
inline constexpr size_t kMaxJobBytes = 256;
// The job's peer secret: random bytes every rank of one incarnation shares
// (Python: rank 0 makes 32 at construction, docs/TIERS.md "Trust").
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 64;

// "host:port" ("[v6 addr]:port" too); InvalidArgument otherwise.
struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const;
};
Result<Endpoint> ParseEndpoint(const std::string& text);

// 16 lowercase hex digits naming `job` in file names (a hash of it).
std::string JobKey(const std::string& job);
// "<JobKey(job)>-replica-world-WWWWW-rank-RRRRR.nsck".
std::string ReplicaName(const std::string& job, uint32_t world_size, uint32_t source_rank);
// The memory directory: `configured` when not empty, else $NONSTOP_SHM_DIR,
// else /dev/shm/nonstop (the memory tier's rule, engine/memory_tier.h).
std::string PeerMemoryDir(const std::string& configured);

// One replica a server holds.
struct HeldReplica {
  uint32_t source_rank = 0;
  uint32_t world_size = 0;
  int64_t step = 0;
  uint64_t counter = 0;
  uint64_t bytes = 0;  // the replica file's size
};

// The default budget's part of the memory directory's free space (the rest
// is left to the ranks' own memory segments; docs/TIERS.md "Peer tier").
inline constexpr double kDefaultBudgetFraction = 0.5;

struct PeerServerOptions {
  std::string job;                  // the job's name, the same on every rank (required)
  std::string secret;               // the job's peer secret (required, kMinSecretBytes..kMaxSecretBytes)
  std::string bind_host = "0.0.0.0";
  uint16_t port = 0;                // 0: an ephemeral port (port() says which)
  std::string dir;                  // the memory directory (PeerMemoryDir)
  uint64_t budget_bytes = 0;        // replicas of this job here at most (0: see budget_share)
  // With budget_bytes 0: a share > 0 makes the budget kDefaultBudgetFraction
  // of the memory directory's free bytes at Start, divided by budget_share
  // (the servers of this job on this host, which share that directory);
  // 0: no budget (the free-space check of each push still applies).
  uint32_t budget_share = 0;
  double io_timeout_s = 30;         // every blocking send/receive
  int max_connections = 32;         // more at once are closed at accept
  // The handshake (docs/TIERS.md "Trust"), bounded without failing a client
  // that a loaded host makes slow: a new connection has io_timeout_s to send
  // the first byte of its HELLO; from that byte on, the whole handshake
  // (HELLO complete, the proof back) must be done within
  // handshake_timeout_s (0: io_timeout_s) in total, however slowly its bytes
  // trickle in. At most max_pending_handshakes connections are in their
  // handshake at once; more are closed at accept (handshakes_refused). So a
  // stranger holds a connection for at most io_timeout_s +
  // handshake_timeout_s, and never more than that many at once.
  double handshake_timeout_s = 0;
  int max_pending_handshakes = 8;
  // The CPU nice increment (and idle-class I/O) of a connection's thread
  // once it receives a push (tier::LowerThreadPriority): the partner's
  // training threads win the CPU over writing a replica. 0: none. Fetches
  // (a restart) are served at the caller's priority.
  int nice = 10;
  Env* env = nullptr;               // nullptr: DefaultEnv()
  // This host's own memory segments of the job (entry names in `dir`, as
  // the job directory's memory records name them), served read-only by
  // LIST_OWN and FETCH_OWN (each chunk verified as it is sent), so that a
  // restart of another world size gathers an old rank's shard from
  // whichever surviving host holds it (its segment or a replica).
  std::vector<std::string> segments;
  // This host's job directory (absolute; "": none): its rank files
  // ("rank-RRRRR.nsck" and the set-aside "world-W/rank-RRRRR.nsck"), served
  // read-only by LIST_DISK and FETCH_DISK (each chunk verified as it is
  // sent), so that a new rank on a replacement host reshards after a
  // graceful close removed the segments. Only those names, built by the
  // server from the numbers asked for, are ever opened, relative to this
  // directory, never following a link: nothing outside it is served.
  std::string job_dir;
  // The world size of this incarnation of the job (0: not said). With a
  // job_dir, Start removes the replicas of every other world size once
  // AgreedInWorld(job_dir, world_size) (see DropOtherWorlds below).
  uint32_t world_size = 0;
};

// Whether job directory `job_dir` (through `env`) records an agreed
// checkpoint that world size `world_size` committed itself: an agreed record
// ("agreed-rank-RRRRR.json" at its top level, where only the current world's
// records are; SetAside moves the others into world-W/) of that world size
// with a counter (not -1: a resharded restore is the old world's
// checkpoint, not yet one of this world). False without a job directory or
// a record; a damaged record is not one.
Result<bool> AgreedInWorld(Env* env, const std::string& job_dir, uint32_t world_size);

// What a server serves of a source rank: the replica it holds, its host's
// own memory segment, or its host's job directory's rank file.
enum class Source : uint8_t { kReplica = 0, kSegment = 1, kDisk = 2 };

struct PeerServerStats {
  uint64_t replicas_received = 0;       // replicas stored complete and verified
  uint64_t bytes_received = 0;          // their data bytes
  uint64_t replica_skipped_budget = 0;  // pushes refused: over budget_bytes
  uint64_t replicas_already_held = 0;  // pushes of the checkpoint already held (not sent again)
  uint64_t old_world_removed = 0;       // replicas of another world size removed: a world of
                                        // the job committed an agreed checkpoint of its own
  uint64_t push_failures = 0;           // pushes that ended without a replica (cut, damage, I/O)
  uint64_t refused_frames = 0;          // hostile or malformed frames (connection closed)
  uint64_t auth_failures = 0;           // connections that did not complete the handshake
                                        // (wrong secret or job, the client left on the server's
                                        // proof, a frame not the handshake's) or whose frame MAC
                                        // did not hold: closed, nothing big allocated
  uint64_t handshake_timeouts = 0;      // connections dropped for not completing the handshake in
                                        // time (no HELLO within io_timeout_s, or not done within
                                        // handshake_timeout_s of its first byte): not counted above
  uint64_t handshakes_refused = 0;      // connections closed at accept: max_pending_handshakes
                                        // were in their handshake
  uint64_t fetches_served = 0;         // replicas and own segments
  uint64_t bytes_served = 0;
  uint64_t held = 0;                    // replicas held now
  uint64_t held_bytes = 0;              // their file bytes
  uint64_t budget_bytes = 0;            // the budget in force (0: none)
  std::string last_error;               // one line
};

class PeerServer {
 public:
  // Opens (creating) the memory directory, removes this job's temp files
  // older than a minute (transfers that died) and the replicas of old worlds
  // (DropOtherWorlds with options.world_size), and listens.
  //
  // Old worlds (docs/TIERS.md "Old worlds"): a replica of another world size
  // than the job's current one is what a reshard reads, and what a restart
  // that fails back to the old world needs, until the current world has
  // committed an agreed checkpoint of its own; from then on it only takes
  // the budget. So when the server starts with world_size W, and before it
  // takes each push of world W (before the budget is counted), it removes
  // this job's replicas of every world size W' != W (complete and temp, not
  // one being received) once AgreedInWorld(job_dir, W); without a job_dir
  // it never removes one.
  static Result<std::unique_ptr<PeerServer>> Start(const PeerServerOptions& o);
  ~PeerServer();
  uint16_t port() const;
  // "bind_host:port" ("0.0.0.0" as given: the caller says which address
  // its partners reach it at).
  std::string endpoint() const;
  // The complete replicas of this job in the directory, by source rank.
  Result<std::vector<HeldReplica>> List();
  // The newest committed checkpoint of each own segment served
  // (PeerServerOptions::segments), by source rank; a segment that is gone
  // or holds none is left out.
  Result<std::vector<HeldReplica>> ListOwn();
  // The newest committed checkpoint of each rank file of the job directory
  // served (PeerServerOptions::job_dir), by world size then source rank;
  // none without one.
  Result<std::vector<HeldReplica>> ListDisk();
  PeerServerStats stats() const;
  // Stops listening and ends every connection (a transfer in progress
  // leaves only its temp file). The replicas stay. Idempotent.
  void Close();

 private:
  PeerServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct PushOptions {
  double connect_timeout_s = 5;
  double io_timeout_s = 30;
};

// What one push did.
enum class PushOutcome {
  kStored,         // the partner holds it now
  kAlreadyHeld,    // the partner holds this checkpoint or a newer one
  kSkippedBudget,  // refused: over the partner's budget
};

// Sends committed checkpoint `info` of `file` (every chunk verified as read)
// to the server at `endpoint`, after the handshake over `secret`. Errors:
// IOError (unreachable, cut, timeout), Corruption (the source's data),
// FailedPrecondition (the server does not prove the secret, or refuses
// ours), the server's refusal otherwise.
Result<PushOutcome> PushCheckpoint(const std::string& endpoint, const std::string& job,
                                   const std::string& secret, SlotFile& file,
                                   const CheckpointInfo& info, const PushOptions& o = {});

// The newest committed checkpoint of the slot file at `slot_path` (a memory
// segment, a one-slot copy or a rank's slot file; opened read-only through
// `env`) pushed as PushCheckpoint does; `pushed` (optional) receives it.
// NotFound when the file holds no committed checkpoint.
Result<PushOutcome> PushNewest(const std::string& endpoint, const std::string& job,
                               const std::string& secret, const std::string& slot_path,
                               const PushOptions& o = {},
                               Env* env = nullptr, CheckpointInfo* pushed = nullptr);

struct ReplicatorOptions {
  std::string job;                    // as the servers' job
  std::string secret;                 // as the servers' secret
  uint32_t rank = 0;                  // this rank
  std::string segment;                // this rank's memory segment (Engine stats memory_segment)
  std::vector<std::string> partners;  // endpoints that hold this rank's replicas
  double poll_s = 0.2;                // how often the segment is looked at without Notify
  double retry_s = 1;                 // after a failed push, the next try at the earliest
  // The replicator thread's CPU nice increment (and idle-class I/O;
  // tier::LowerThreadPriority), so that training threads win the CPU over
  // replication: a push only takes what training leaves. 0: none;
  // tier::kIdleNice: the SCHED_IDLE class.
  int nice = 10;
  // The pace of a push: at most `bps` data bytes a second to each partner
  // (whole DATA frames at the link's speed, then a wait until their bytes at
  // `bps` took their time; the kernel's own TCP pacing would cut the stream
  // into many small packets, each one more softirq), so that the work a
  // push makes, also what runs outside the thread's priority (the network
  // stack's softirq on both ends of a veth or NIC), is spread out: its share
  // of the CPU is at most bps times the CPU time a byte costs. A checkpoint
  // of B bytes then reaches a partner about B / bps after it is taken up
  // at the earliest (stats lag_s_*). 0: see spread_s.
  uint64_t bps = 0;
  // Without `bps`: each push is spread over max(spread_s, the interval
  // between this rank's commits times `every`) -- the pace B / that time --
  // so replication takes a bounded share of the CPU however often
  // checkpoints come, and a partner holds a checkpoint at most about two
  // such times old (one waiting for the push before it, one sending).
  // Never slower than spread_min_bps (small states: no lag worth the
  // name). 0 (with bps 0): unpaced, the default.
  double spread_s = 0;
  uint64_t spread_min_bps = 4 << 20;
  // The peer cadence: a checkpoint is pushed only when its counter is at
  // least `every` above the last one every partner holds (the first always);
  // the newest one at that moment, the ones between skipped. 1: every
  // checkpoint the replicator sees (newest-wins: one committed during a push
  // is sent next, the ones it superseded never).
  uint32_t every = 1;
  PushOptions push;
  Env* env = nullptr;
  // This rank's job directory: after each push a partner holds, its
  // endpoint and the checkpoint are noted in the job manifest
  // (jobdir/manifest.h). Empty: none.
  std::string job_dir;
};

struct ReplicatorStats {
  uint64_t replicated = 0;      // pushes stored (per partner)
  uint64_t bytes = 0;           // their data bytes
  uint64_t failures = 0;        // pushes that failed (retried with the newest later)
  uint64_t skipped = 0;         // checkpoints never sent: a newer one came first
  uint64_t skipped_cadence = 0; // checkpoints seen and not sent: within `every` of the last sent
  uint64_t skipped_budget = 0;  // pushes a partner refused for its budget
  int64_t last_step = -1;       // newest step every partner holds (-1: none)
  uint64_t last_counter = 0;
  double send_s_total = 0;
  // The age of a checkpoint (seconds since its commit, commit_unix_ns) when
  // its push to every partner ended: the newest (last) and the most (max)
  // over the pushes stored. -1: none yet.
  double lag_s_last = -1;
  double lag_s_max = -1;
  std::string last_error;       // one line
};

class Replicator {
 public:
  static Result<std::unique_ptr<Replicator>> Start(const ReplicatorOptions& o);
  ~Replicator();
  // A checkpoint may have been committed to the segment: look now.
  void Notify();
  // Waits until the segment's newest committed checkpoint has been pushed
  // to every partner (or refused, failed, or left out by the cadence
  // `every`) and nothing is in flight; false
  // when `timeout_s` passed first.
  bool Drain(double timeout_s);
  ReplicatorStats stats() const;
  // Stops the thread (a push in progress is cut). Idempotent.
  void Close();

 private:
  Replicator() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What the server at `endpoint` holds of job `job`. IOError when it cannot
// be reached; FailedPrecondition when it does not share `secret`.
Result<std::vector<HeldReplica>> ListReplicas(const std::string& endpoint, const std::string& job,
                                              const std::string& secret, double timeout_s = 10);

// Where FetchReplica writes: local_dir/peer/step-N (holding rank-RRRRR.nsck).
std::string PeerStepDir(const std::string& local_dir, int64_t step);

// Source rank `source_rank` of world size `world_size`: its replica held at
// `endpoint` (of `step`, or the newest), every chunk verified as it arrives, written to a one-slot job
// directory local_dir/peer/step-N/rank-RRRRR.nsck (temp name, committed
// record, fsync, rename last); returns that directory. NotFound: the server
// holds none (of that step); Corruption: the replica is damaged; IOError:
// unreachable, cut or timed out; FailedPrecondition: the server does not
// prove `secret`. Any of them: fall back to another source.
Result<std::string> FetchReplica(const std::string& endpoint, const std::string& job,
                                 const std::string& secret, uint32_t world_size,
                                 uint32_t source_rank, std::optional<int64_t> step,
                                 const std::string& local_dir, Env* env = nullptr,
                                 double timeout_s = 60);

// What the server at `endpoint` serves of its host's own memory segments of
// job `job` (PeerServerOptions::segments): one entry per segment's newest
// committed checkpoint. IOError when it cannot be reached; FailedPrecondition
// when it does not share `secret`.
Result<std::vector<HeldReplica>> ListOwnSegments(const std::string& endpoint,
                                                 const std::string& job,
                                                 const std::string& secret, double timeout_s = 10);

// What the server at `endpoint` serves of its host's job directory
// (PeerServerOptions::job_dir): one entry per rank file's newest committed
// checkpoint. Errors as ListOwnSegments'.
Result<std::vector<HeldReplica>> ListDiskFiles(const std::string& endpoint, const std::string& job,
                                               const std::string& secret, double timeout_s = 10);

// Source rank `source_rank` of world size `world_size`: its checkpoint (of
// `step`, or the newest) as the server at `endpoint` holds it (`source`: its
// replica, its host's own segment or its host's job directory's rank file),
// every chunk verified as it arrives, written as a one-slot slot file
// local_dir/sub/rank-RRRRR.nsck (sub created when missing; temp name,
// committed record, fsync, rename last; an existing file there replaced).
// Returns the file's path. Errors as FetchReplica's.
Result<std::string> FetchInto(const std::string& endpoint, const std::string& job,
                              const std::string& secret, uint32_t world_size,
                              uint32_t source_rank, std::optional<int64_t> step, Source source,
                              const std::string& local_dir, const std::string& sub,
                              Env* env = nullptr, double timeout_s = 60);

// One fetch per host (a reshard whose new ranks on one host need the same
// old rank's checkpoint): FetchInto's checkpoint of (world_size,
// source_rank, step, counter) written once into this host's memory directory
// `mem_dir` at "<job key>-reshard-host/w<W>-s<step>-c<counter>/rank-RRRRR.nsck",
// whichever rank of the host comes first. That rank holds the lock file
// "rank-RRRRR.lock" beside it (Directory::Lock: released when it dies) while
// it fetches; the others wait for the renamed complete copy and use it. When
// the fetcher fails or dies (the lock free, no copy), the next one fetches;
// past `wait_s` of waiting (or with no lock to take) a rank fetches into its
// own `fallback_dir` (fallback_dir/w<W>-s<step>-c<counter>/) instead.
// `holder` (one line, e.g. "rank 3 pid 77") names the caller in the lock
// file.
struct SharedCopy {
  std::string path;     // the copy (rank-RRRRR.nsck)
  bool fetched = false; // this call fetched it (false: another rank's copy)
  std::string by;       // who fetched it: `holder`, or the lock file's line
};
Result<SharedCopy> FetchOncePerHost(const std::string& endpoint, const std::string& job,
                                    const std::string& secret, uint32_t world_size,
                                    uint32_t source_rank, int64_t step, uint64_t counter,
                                    Source source, const std::string& mem_dir,
                                    const std::string& fallback_dir, const std::string& holder,
                                    Env* env = nullptr, double timeout_s = 60,
                                    double wait_s = 120);

// The once-per-host pattern of FetchOncePerHost for any fetch (the remote
// tier's parts too, peer_gather.h): `fetch(parent, sub)` writes the copy as
// parent/sub/rel.../rank-RRRRR.nsck and returns its path; it is called with
// parent = mem_dir/"<job key>-reshard-host" by the rank that holds the lock
// file "rank-RRRRR.lock" in that sub, or with parent = fallback_dir past
// wait_s. A copy is taken when its newest committed checkpoint is of
// (world_size, source_rank, step) and, when given, `counter`.
struct OncePerHostCopy {
  std::string job;
  std::string sub;               // the copy's directory under the shared one
  std::vector<std::string> rel;  // where in it the fetch writes the file
  uint32_t world_size = 0;
  uint32_t source_rank = 0;
  int64_t step = 0;
  std::optional<uint64_t> counter;
  std::string mem_dir;
  std::string fallback_dir;
  std::string holder;            // names the caller in the lock file
  std::string what;              // names the source in errors ("peer host:port")
  Env* env = nullptr;
  double wait_s = 120;
};
using CopyFetch =
    std::function<Result<std::string>(const std::string& parent, const std::string& sub)>;
Result<SharedCopy> OncePerHost(const OncePerHostCopy& c, const CopyFetch& fetch);
// "<job key>-reshard-host": FetchOncePerHost's directory in the memory
// directory (removed once the reshard read it).
std::string SharedReshardDir(const std::string& job);

// This host's copies, read without a server (a restart of another world size
// whose ranks all sit on one host starts no server, and a rank reads its own
// host's memory directory directly; docs/TIERS.md "Peer tier").
struct LocalCopy {
  HeldReplica held;
  std::string path;  // absolute: the replica or segment in the memory directory
};
// The complete replicas of job `job` (own false) or the newest committed
// checkpoint of each of `segments` (own true: entry names, as
// PeerServerOptions::segments) in the memory directory PeerMemoryDir(dir),
// by source rank; none when that directory does not exist.
Result<std::vector<LocalCopy>> ListLocal(const std::string& job, bool own,
                                         const std::vector<std::string>& segments,
                                         const std::string& dir = "", Env* env = nullptr);
// Whether the newest committed checkpoint of the slot file at `path`
// (absolute, opened read-only, never followed) is of rank `source_rank` and
// step `step` and every chunk of its data verifies: OK, or NotFound (another
// checkpoint, gone), Corruption (the chunk named), IOError.
Status VerifyLocal(const std::string& path, uint32_t source_rank, int64_t step,
                   Env* env = nullptr);

// This process's address on the job's network: $NONSTOP_PEER_ADDR, else the
// source address of a route to $MASTER_ADDR:$MASTER_PORT (29500 when unset;
// the interface the process group uses: a UDP connect, no packet is sent),
// else the host name's IPv4 address, else "127.0.0.1".
std::string LocalAddress();
// The failure domain of a rank at `addr`: $NONSTOP_HOST_ID (a rack, a VM),
// else "<host name>@<addr>" (network namespaces share a host name).
std::string HostId(const std::string& addr);

// Partners: out[r] = the ranks that hold rank r's replicas, given each
// rank's host (any string naming its failure domain). Deterministic, never
// r's own host, at most `replicas` (fewer when fewer other hosts exist:
// none in a one-host world), spread so that each rank holds about as many
// replicas as it sends.
std::vector<std::vector<uint32_t>> ChoosePartners(const std::vector<std::string>& hosts,
                                                  int replicas);

}  // namespace nonstop::peer
