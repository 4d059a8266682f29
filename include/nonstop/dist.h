// The decisions of a distributed restart (docs/DISTRIBUTED.md): recovery's
// agreement on a step and its fallbacks, the reshard's agreement and its
// retries, the memory tier's all-or-none choice, and the byte arithmetic of
// the replicated tensors (which old rank's piece lands where). Pure: every
// function is given, as data, what each rank found (gathered by the Python
// front end over its gloo group: JSON, never pickle) and returns the same
// answer on every rank. None of them chooses a checkpoint: the steps each
// rank offers come from the recovery planner (plan.h MakePlan, through
// JobDir); these only intersect them and decide what the ranks do together.
// Every error and warning line is made here, once.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/plan.h"
#include "nonstop/status.h"

namespace nonstop::dist {

// One rank's failure, gathered: its Status code and one-line message.
struct RankError {
  StatusCode code = StatusCode::kInternal;
  std::string message;
};

// The ranks' failures (index = rank; nullopt: it succeeded) as one Status:
// OK when none failed; else the first failing rank's code with its message
// when one rank failed or all said the same, otherwise "rank R: m; rank S: n".
Status JoinErrors(const std::vector<std::optional<RankError>>& every);

// ---- The agreement thread's rounds (Distributed._loop) ----

// One rank's part of a round, gathered: its engine's offer, whether it is
// closing, and (closing) the newest step it committed (-1: none).
struct RoundOffer {
  AgreeOffer offer;
  bool stopping = false;
  int64_t newest = -1;
};

// What a rank does after each round, and the progress of the agreement
// (Distributed.stats()). Times are the caller's monotonic seconds.
class AgreementRounds {
 public:
  struct Step {
    enum class Kind { kWait, kPin, kAim } kind = Kind::kWait;
    int64_t aim = -1;  // kAim: Engine::Aim(aim); Dropped() when it drops a candidate
    bool close = false;  // every rank is closing: this was the last round
    // close: the newest step every rank committed, newer than the agreed
    // one: pin it (when it is still the candidate) and record it; else -1.
    int64_t close_step = -1;
  };
  // `agreed`: this rank's agreed step of its current lineage (nullopt: none).
  // kPin: pin this rank's candidate (step every[rank].offer.candidate) and
  // record it, then Pinned(). A candidate already agreed is not pinned again:
  // every rank aims past it instead.
  Step OnRound(const std::vector<RoundOffer>& every, std::optional<int64_t> agreed, double now_s);
  void Pinned(double now_s);
  void Dropped();

  // One round driven (Distributed._loop; docs/DISTRIBUTED.md "Agreement"):
  // this rank's offer gathered (closing: with its newest committed
  // checkpoint), then OnRound's step done through the engine's hooks: pin
  // and record, or aim (Dropped() when that drops a candidate); on the last
  // round, pin the newest every rank committed while it is still this
  // rank's candidate, and record it. Returns true after the last round; the
  // first error of a hook, as it is.
  struct Hooks {
    std::function<Result<AgreeOffer>()> offer;  // Engine::Offer
    // The newest committed checkpoint (counter, step), asked only when closing.
    std::function<Result<std::optional<std::pair<uint64_t, int64_t>>>()> latest;
    // Every rank's [candidate, committed, started, stopping, newest] for this rank's.
    std::function<Result<std::vector<std::vector<int64_t>>>(const std::vector<int64_t>&)> gather;
    std::function<Status(uint64_t counter)> pin;
    std::function<Result<bool>(int64_t step)> aim;  // Engine::Aim: true when it dropped one
    std::function<Result<std::optional<uint64_t>>()> candidate;  // the candidate's counter
    std::function<Status(uint64_t counter, int64_t step)> record;  // this rank's agreed record
    std::function<double()> now;                                  // monotonic seconds
  };
  Result<bool> Round(const Hooks& hooks, bool stopping, std::optional<int64_t> agreed);

  int64_t rounds = 0;
  int64_t agreements = 0;
  int64_t candidate_drops = 0;
  int64_t max_drops_in_row = 0;
  // The longest time between two pins (from the first round); with `now_s`,
  // the gap still open counts too (and is kept).
  double MaxGap(std::optional<double> now_s);

 private:
  int64_t drops_in_row_ = 0;
  double max_gap_s_ = 0;
  std::optional<double> last_t_;
};

// Distributed's construction: `replicated` is "shard" or "rank0"
// (InvalidArgument); torch.distributed is initialised (`initialized`,
// Unavailable otherwise) and says this process is rank `dist_rank` of
// `dist_world`, the `rank` and `world` given (InvalidArgument).
Status CheckWorld(const std::string& replicated, int rank, int world, bool initialized,
                  int dist_rank, int dist_world);

// ---- Saving (Distributed.shard) ----

// Replicated tensors smaller than this (in elements) are not cut: one rank
// writes each whole.
inline constexpr uint64_t kMinShardNumel = 1024;

// A replicated tensor to cut among the ranks. `rank0`: rank 0 writes it
// whole (replicated="rank0", or a module buffer DDP broadcasts from rank 0).
struct ShardInput {
  std::string name;
  uint64_t numel = 0;
  bool rank0 = false;
  bool contiguous = true;
};

// What rank `rank` writes of one tensor: its flat elements [begin, end), or
// (whole) the tensor as it is (begin 0). Tensors it writes nothing of are
// left out.
struct ShardRange {
  std::string name;
  uint64_t begin = 0;
  uint64_t end = 0;
  bool whole = false;
};

// The cut (docs/DISTRIBUTED.md): a rank0 tensor whole on rank 0; one under
// kMinShardNumel elements or not contiguous whole on rank crc32c(name) mod
// world; any other in `world` equal runs of ceil(numel / world) elements,
// rank r's the r-th (the last ones may be short or empty). In input order.
std::vector<ShardRange> Shard(const std::vector<ShardInput>& tensors, int rank, int world);

// ---- ZeRO-1 optimizer state (_distributed.consolidate) ----

// An old rank's ZeroRedundancyOptimizer shard: `index[i]` is the global index
// (ZeRO's own param_groups order) of its local state_dict's i-th parameter in
// sorted order of the local ids `params`; `state_ids`: the local ids that hold
// state. Returns each state id's global index, in the order given.
// Corruption (naming `where`) when the ids and the index do not match.
Result<std::vector<int64_t>> ZeroGlobalIds(const std::vector<int64_t>& index,
                                           const std::vector<int64_t>& params,
                                           const std::vector<int64_t>& state_ids,
                                           const std::string& where);

// ---- Recovery (Distributed.recover) ----

// The steps every rank holds, in rank 0's order (each rank's list is its
// planner order: newest of its lineage first).
std::vector<int64_t> CommonSteps(const std::vector<std::vector<int64_t>>& every);

// The ranks found no common step and no set-aside checkpoint to reshard:
// OK (a fresh start) when no rank holds any step and none was asked for;
// else NotFound naming `rank`'s own steps.
Status NoCommonStep(const std::string& dir, int rank, std::optional<int64_t> step,
                    const std::vector<std::vector<int64_t>>& every);

// Some rank's job directory holds rank files of another world size that were
// not set aside: FailedPrecondition saying what to do; OK otherwise.
Status CheckForeign(const std::string& dir, int world, const std::vector<bool>& every);

// What one rank found when it selected and read step order[n].
struct StepRead {
  std::optional<std::string> error;  // why it could not select or read it
  uint64_t run_id = 0;               // the checkpoint's run (CheckpointRunId)
};

// Whether the ranks restore order[n] together. OK with an empty warning: yes.
// OK with a warning: every rank falls back to order[n + 1] (some rank failed,
// or the ranks' checkpoints of the step are of different runs: never mixed).
// Corruption when order[n] was the last common step.
Result<std::string> DecideRecoverStep(const std::string& dir, const std::vector<int64_t>& order,
                                      size_t n, const std::vector<StepRead>& every);

// The memory tier on a restart, all or none. `whys[r]`: "" when rank r's
// segment holds the step and reads (or read) cleanly, nullopt when rank r
// takes no part (it restores a partner's replica), else why not.
struct MemoryChoice {
  bool use = false;    // every taking part said "" and at least one takes part
  std::string unused;  // "rank R: why; ..." of those that cannot
};
MemoryChoice DecideMemory(const std::vector<std::optional<std::string>>& whys);

// ---- Resharding (_distributed.reshard) ----

// The checkpoint a rank's JobDir::SelectReshard chose.
struct ReshardKey {
  int old_world = 0;
  int64_t step = 0;
  uint64_t run_id = 0;
  bool operator==(const ReshardKey&) const = default;
};

// The ranks' agreement on the reshard: each rank chooses on its own (with
// max_step()), the ranks gather their choices (OnPicks), each rebuilds its
// state from the agreed one, and they gather the outcomes (OnRebuilt). A rank
// whose copies differ, or that fails to rebuild, makes every rank try again
// below; nothing older qualifying is one error line naming why the newer
// ones failed.
class ReshardAgreement {
 public:
  enum class Next { kNone, kRetry, kProceed, kDone };
  struct Pick {
    std::optional<RankError> error;
    std::optional<ReshardKey> key;  // nullopt: no set-aside checkpoint at all
  };
  struct Rebuilt {
    std::optional<std::string> error;  // damaged bytes: an older step may do
    std::optional<std::string> fatal;  // not damage: no older step helps
  };

  ReshardAgreement(std::string dir, int world) : dir_(std::move(dir)), world_(world) {}
  std::optional<int64_t> max_step() const { return max_step_; }
  // kNone: no rank sees a set-aside checkpoint (nothing to lose);
  // kRetry: the ranks chose differently, choose again (max_step() lowered);
  // kProceed: every rank chose key(). Errors: a rank failed to choose, or
  // only some ranks see the old files.
  Result<Next> OnPicks(const std::vector<Pick>& every);
  // kDone, or kRetry with warning() set (every rank falls back below the
  // step). FailedPrecondition when a rank's failure was not damage.
  // `archive`: the agreed set-aside directory, for the lines.
  Result<Next> OnRebuilt(const std::vector<Rebuilt>& every, const std::string& archive);
  const ReshardKey& key() const { return key_; }
  const std::string& warning() const { return warning_; }

 private:
  std::string dir_;
  int world_;
  std::optional<int64_t> max_step_;
  std::vector<std::string> failed_;
  ReshardKey key_;
  std::string warning_;
};

// ---- The restart's rounds, driven (Distributed.load, _distributed.reshard) ----

// Every rank's text, rank 0 first, for this rank's `mine`: one collective
// (python: the Comm's gather, JSON over the gloo group, never pickle). The
// drivers below make the same calls in the same order on every rank, and
// encode what they gather themselves (any bytes survive).
using Gather = std::function<Result<std::vector<std::string>>(const std::string& mine)>;

// A driver's gathered text: fields, each a string or null.
using Fields = std::vector<std::optional<std::string>>;
// Every rank's fields (as many as `mine` holds) for this rank's `mine`:
// one gather; Corruption when a rank's text does not parse.
Result<std::vector<Fields>> GatherFields(const Gather& gather, const Fields& mine);
// Steps as a field ("9 5 3") and back (Corruption when it does not parse).
std::string StepsText(const std::vector<int64_t>& steps);
Result<std::vector<int64_t>> StepsOf(const std::string& text);

// What one rank brings to a distributed restore.
struct RecoverRequest {
  std::string dir;  // the job directory (for the lines)
  int rank = 0;
  std::optional<int64_t> step;  // restore(step=s)
  // Its job directory: why it could not be read, or its planned steps
  // (JobDir planned_steps: the planner's order) and whether it holds rank
  // files of another world size not set aside.
  std::optional<std::string> error;
  std::vector<int64_t> mine;
  bool foreign = false;
  // The step of a partner's replica of this rank's checkpoint, fetched and
  // verified (the peer tier): it counts as this rank's own unless a step
  // was asked for that it is not, or the job directory holds it too.
  std::optional<int64_t> peer_step;
  // The step of this rank's agreed record (a warning when an older one is
  // restored).
  std::optional<int64_t> agreed;
};

// The rank's side of the rounds. Each returns quickly but for gather; an
// error Status is a one-line failure of this rank the ranks decide on
// together, except Aborted (and any error of gather, check, reshard):
// Recover stops and returns it as it is.
struct RecoverHooks {
  Gather gather;
  // The job directory's own checks, once the ranks found it theirs.
  std::function<Status()> check;
  // No step every rank holds: reshard a set-aside checkpoint of another
  // world size (collective); true when it restored one.
  std::function<Result<bool>()> reshard;
  // Selects this rank's checkpoint of `step` (from the peer replica when
  // `peer`) and reads its metadata: its run id (CheckpointRunId).
  std::function<Result<uint64_t>(int64_t step, bool peer)> open;
  // The memory tier's segment of this rank: "" when it holds `step`
  // (the job directory's choice of it), else why not.
  std::function<Result<std::string>(int64_t step)> probe_memory;
  // Reads the opened step's tensors (crcs checked as they are read), from
  // the memory segment probed when `memory`.
  std::function<Status(int64_t step, bool memory)> read;
};

struct RecoverOutcome {
  enum class Kind { kFresh, kResharded, kRestored };
  Kind kind = Kind::kFresh;
  int64_t step = -1;                 // kRestored: the step every rank read
  std::string source;                // kRestored: "memory", "disk" or "peer" (this rank)
  std::vector<std::string> sources;  // kRestored: every rank's source
  std::string memory_unused;         // "rank R: why; ..." of ranks whose memory tier was not used
  std::vector<std::string> warnings;  // in order, each a whole line ("nonstop: ...")
};

// Recover's first round, also the Hugging Face integration's agreement
// (planned_steps.h AgreeOnStep): every rank's planned steps (RecoverRequest's
// mine), gathered with this rank's `error` and `foreign`; one Corruption line
// for all when any rank could not read its job directory (JoinErrors), then
// CheckForeign.
Result<std::vector<std::vector<int64_t>>> GatherPlannedSteps(
    const Gather& gather, const std::string& dir, const std::optional<std::string>& error,
    bool foreign, const std::vector<int64_t>& mine);

// The recovery of a distributed restore, one rank's part, alike on every
// rank (docs/DISTRIBUTED.md "Recovery"): gather what each rank's job
// directory holds (GatherPlannedSteps; then hooks.check); no common step: hooks.reshard, else
// NoCommonStep. Then the common steps in rank 0's order: each rank opens
// and reads step S (the newest, with no step asked: from the memory tier
// when every rank's segment holds it and reads cleanly, DecideMemory, twice:
// before and after the reads), gathers its outcome, and all restore S or
// all fall back to the next (DecideRecoverStep's warning), or all fail with
// its one line. `out` holds the warnings made before an error too.
Status Recover(const RecoverRequest& request, const RecoverHooks& hooks, RecoverOutcome* out);

// What a rank's JobDir::SelectReshard chose, and the set-aside directory
// that holds it (for the lines).
struct ReshardPick {
  ReshardKey key;
  std::string archive;
};

// The reshard's rounds (_distributed.reshard), alike on every rank: each
// rank picks under ReshardAgreement::max_step() (`pick`: nullopt when no
// set-aside rank file holds any checkpoint; an error: its code and line),
// the choices are gathered (OnPicks: choose again, or proceed), each rank
// rebuilds its state from the agreed key (`rebuild`: Corruption is damage,
// an older step may do; any other error is fatal for all, one
// FailedPrecondition line; Aborted returns at once), and the outcomes are gathered (OnRebuilt).
// Returns the key every rank rebuilt, or nullopt: nothing to reshard.
// `warnings` gets each fallback's line. With `missing` (a reshard from
// peers' memory, on every rank or none: this rank's line of the old ranks'
// files no peer held), the lines are gathered first, a rank's own is a
// warning, and any error (but Aborted) ends in "; not on any surviving
// peer either: rank R: ...".
struct ReshardHooks {
  Gather gather;
  std::optional<std::string> missing;
  std::function<Result<std::optional<ReshardPick>>(std::optional<int64_t> max_step)> pick;
  std::function<Status(const ReshardPick& pick)> rebuild;
};
Result<std::optional<ReshardKey>> ReshardTogether(const std::string& dir, int world,
                                                  const ReshardHooks& hooks,
                                                  std::vector<std::string>* warnings);

// The message of a reshard that cannot keep state: a rank-local state key
// (local=...), or a ZeroRedundancyOptimizer key saved without its layout.
// `zero_keys`: the saved ZeRO layouts; `live_zero`: the live state's ZeRO
// keys. OK when the worlds are equal.
Status CheckReshardable(const std::string& archive, int old_world, int world,
                        const std::vector<std::string>& local,
                        const std::vector<std::string>& zero_keys,
                        const std::vector<std::string>& live_zero);

// ---- The replicated tensors' bytes ----

// A replicated tensor as the "shared" table of meta["dist"] records it.
struct SharedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // DTypeName spelling ("float32", ...)
};

// A piece of a replicated tensor that some rank's checkpoint holds.
struct Piece {
  int rank = 0;
  size_t handle = 0;          // the caller's index (its tensor table), returned untouched
  std::string name;
  uint64_t global_offset = 0;  // in elements
  uint64_t nbytes = 0;
};

// Where one piece's bytes go in the flat buffer of every shared tensor.
struct PieceCopy {
  int rank = 0;
  size_t handle = 0;
  uint64_t offset = 0;  // in bytes, into the flat buffer
  uint64_t nbytes = 0;
};

// The flat buffer: every shared tensor by name order, each at `offset` (a
// multiple of 64 bytes, so a view of the buffer at it fits any dtype).
struct SharedLayout {
  struct Tensor {
    std::string name;
    uint64_t offset = 0;
    uint64_t nbytes = 0;
  };
  std::vector<Tensor> tensors;
  uint64_t total = 0;
  std::vector<PieceCopy> copies;  // the pieces, in the order given
};

// The layout and each piece's place. Pieces of names not shared are left
// out. Refused with one line: an unknown dtype (FailedPrecondition); a
// negative dimension or a size past 2^62 bytes, a piece outside its tensor,
// not of whole elements or overlapping another, and, with `complete`, a
// tensor whose pieces do not cover all of its bytes (every old rank file's
// pieces gathered) (Corruption, naming the tensor, `where` and `step`).
Result<SharedLayout> LayOutShared(const std::vector<SharedTensor>& shared,
                                  const std::vector<Piece>& pieces, bool complete,
                                  const std::string& where, int64_t step);

// ---- FSDP2 DTensors (_fsdp.py) ----

// A DTensor's placement as nonstop saves it (_fsdp.take): "S0" (Shard(0)
// of a tensor with a dimension) or "R" (Replicate()), as `placement` names
// it (any other: how torch prints it). InvalidArgument naming tensor `name`
// when its device mesh (`mesh_ndim` dimensions, `mesh_ranks` flattened,
// `mesh_text` as printed) is not 1-D over all `world` ranks (HSDP, 2-D
// meshes), or for another placement.
Result<std::string> DTensorPlacement(const std::string& name, int mesh_ndim,
                                     const std::vector<int64_t>& mesh_ranks,
                                     const std::string& mesh_text, const std::string& placement,
                                     int world);

// Rows [begin, end) of dim 0 that `rank` holds under Shard(0): torch.chunk's
// split, which FSDP2 and DTensor use (ceil(d0 / world) rows each; the last
// ranks may hold fewer, or none).
std::pair<int64_t, int64_t> ShardRows(int64_t d0, int rank, int world);

// This rank's Shard(0) piece of a DTensor of global shape `shape` (saving,
// _fsdp.take; restoring, _fsdp.wrap): its shape (the rows ShardRows gives,
// the other dimensions whole) and the global offset of its first element,
// its TensorSpec.global_offset. With `local` (the live piece's shape):
// InvalidArgument naming tensor `name` when it is not that shape (nonstop
// expects torch.chunk's split), or when `shape` has no dimension.
struct ShardPiece {
  std::vector<int64_t> shape;
  uint64_t offset = 0;
};
Result<ShardPiece> ShardPieceOf(const std::string& name, const std::vector<int64_t>& shape,
                                int rank, int world,
                                const std::optional<std::vector<int64_t>>& local = std::nullopt);

// A DTensor as meta["dist"]["dtensor"] records it (a hostile file's words).
struct DTensorDoc {
  std::string name;
  std::vector<int64_t> shape;  // the global shape
  std::string dtype;           // DTypeName spelling
  std::string placement;       // "S0" (Shard(0)) or "R" (Replicate())
};

// Where rank `rank` of a job of world size `world` finds its new piece of
// each DTensor: an "S0" one's rows ShardRows(shape[0], rank, world), an "R"
// one whole, each in one flat buffer at `offset` (a multiple of 64 bytes)
// with its local `shape`; `copies`: bytes [src, src + nbytes) of old piece
// `handle` of old rank `rank` go to byte `dst` of the buffer (pieces that
// hold none of those bytes are left out; at most one copy per piece).
struct DTensorReshard {
  struct Tensor {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;  // this rank's piece
    uint64_t offset = 0;
    uint64_t nbytes = 0;
  };
  struct Copy {
    int rank = 0;
    size_t handle = 0;
    uint64_t src = 0;  // bytes into the old piece
    uint64_t dst = 0;  // bytes into the flat buffer
    uint64_t nbytes = 0;
  };
  std::vector<Tensor> tensors;  // in the order of `doc`
  uint64_t total = 0;
  std::vector<Copy> copies;     // in the order of `pieces`
};

// The plan, or one line (naming the tensor, `where` and `step`) before
// anything is allocated: an unknown dtype or placement, an "S0" tensor of no
// dimension, a negative dimension or a size past 2^62 bytes, a name listed
// twice, a rank or world out of range (Corruption); an old piece outside its
// tensor, not of whole elements or overlapping another (Corruption); some
// element of this rank's range held by no old piece (FailedPrecondition:
// "hold N of elements B..E", a rank file missing or incomplete).
Result<DTensorReshard> PlanDTensorReshard(const std::vector<DTensorDoc>& doc,
                                          const std::vector<Piece>& pieces, int rank, int world,
                                          const std::string& where, int64_t step);

// How rank `rank` of a job of world size `world` makes each saved DTensor
// (`doc`) a DTensor again on the live state (_fsdp.restored). `live`: the
// names whose live tensor is a DTensor (its mesh is used); `any_mesh`:
// whether the live state has DTensor parameters at all; `meshes`: how many
// distinct 1-D meshes over all `world` ranks they use, `same`: whether those
// compare equal (then any of them serves a name without a live DTensor, an
// optimizer's state before its first step). One process without
// fully_shard (a resharded FSDP2 checkpoint in a plain model): `plain`, the
// whole tensor. Refused with one line naming the tensor (InvalidArgument):
// no usable mesh, meshes that differ, a Shard(0) of no dimension; an
// unknown placement (Corruption).
struct DTensorRestore {
  std::string name;
  bool plain = false;      // the whole tensor as it is, reshaped to `shape`
  bool live = false;       // on the live tensor's mesh, else on the parameters' one mesh
  bool shard = false;      // Shard(0), else Replicate()
  std::vector<int64_t> shape;  // the global shape
  std::vector<int64_t> local;  // this rank's piece's shape
};
Result<std::vector<DTensorRestore>> PlanDTensorRestore(const std::vector<DTensorDoc>& doc,
                                                       int rank, int world,
                                                       const std::vector<std::string>& live,
                                                       bool any_mesh, int meshes, bool same);

}  // namespace nonstop::dist
