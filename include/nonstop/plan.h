// The recovery planner: the one answer to "which checkpoint?" (docs/
// ARCHITECTURE.md "The recovery planner"). Pure: it is given, as data, what
// every tier holds (the disk slot file's records, its keep copies, the
// memory segment, a remote listing), the lineage (the rollback records) and
// the request (a step, or the newest), and returns an ordered plan: the
// checkpoint to read first, verified, then the older fallbacks in order, and
// for every newer candidate not chosen one line saying why (abandoned by a
// rollback, never durable, damaged: which check, overwritten, failed while it
// was read). Every selection of nonstop asks it: JobDir::Select and the
// all-ranks selections, List, the engine's Restore, the CLI, and Python
// (nonstop._core.plan) for the remote tier and the exports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/status.h"

namespace nonstop {

// Where a candidate lives. At one counter the lower tier is read first: the
// memory segment, then the slot file, a kept copy, the remote object store.
enum class Tier { kMemory = 0, kDisk = 1, kKeep = 2, kRemote = 3 };
const char* TierName(Tier t);                    // "memory", "disk", "keep", "remote"
std::optional<Tier> ParseTier(const std::string& name);

// Rank R's lineage (its record lineage-rank-R.json, docs/FORMAT.md).
struct LineageRecord {
  // Closed ranges [lo, hi] of abandoned counters, sorted, disjoint: rolled
  // back from by a restore, or noted by RecordNotDurable.
  std::vector<std::pair<uint64_t, uint64_t>> abandoned;
  uint64_t restored_counter = 0;       // counter of the last RecordRestore (0 = none)
  uint64_t abandoned_through = 0;      // highest abandoned counter (0 = none)
  // Counters RecordNotDurable noted (sorted; the newest 1024, for reasons:
  // each is also an abandoned range).
  std::vector<uint64_t> not_durable;
  bool IsAbandoned(uint64_t counter) const;
  bool NotDurable(uint64_t counter) const;
};

// The reason a never-durable counter is never chosen.
inline constexpr const char* kNotDurableReason =
    "its commit failed (a sync of its slot file failed): never durable, never chosen";

// One checkpoint record a tier holds.
struct PlanCandidate {
  Tier tier = Tier::kDisk;
  std::string where;         // for messages: "rank-00000.nsck", "s3://b/job/step-..."
  int64_t step = 0;
  uint64_t counter = 0;
  bool committed = true;     // false: its record is there, its bytes are damaged
  std::string damage;        // why damaged (one line)
  bool overwritten = false;  // damaged only because a newer checkpoint reused its slot
  size_t handle = 0;         // the caller's index, returned untouched
};

struct PlanRequest {
  std::optional<int64_t> step;      // only this step (restore(step=s))
  std::optional<int64_t> max_step;  // only steps at most this
  std::vector<uint64_t> exclude;    // counters found damaged while they were read
  // Verify the first usable candidate (the verifier below) and fall back past
  // the ones that fail. Without it the plan lists the usable ones in order
  // and the caller verifies them as it reads (asking again with `exclude`).
  bool verify = true;
};

// What a candidate is as a listing shows it.
struct CandidateState {
  enum class State { kCommitted, kDamaged, kAbandoned, kOverwritten } state = State::kCommitted;
  std::string reason;  // empty when committed
};
CandidateState Classify(const PlanCandidate& c, const LineageRecord& lineage);

struct Plan {
  // Indices into the candidates, in the order to read them: when `verified`,
  // order[0] passed the verifier; the rest are the older usable ones, not yet
  // verified (the fallbacks of a read that fails midway).
  std::vector<size_t> order;
  bool verified = false;
  // One line per candidate newer than order[0] (or every candidate when
  // order is empty) that was not chosen, newest counter first.
  std::vector<std::string> skipped;
  bool saw_damage = false;          // a damaged or failing candidate was seen
  bool fallback = false;            // order[0] is not the newest live committed candidate
  uint64_t newest_counter = 0;      // newest counter of any candidate
  std::optional<size_t> chosen() const {
    return order.empty() ? std::nullopt : std::optional<size_t>(order.front());
  }
};

// Verifies one candidate's bytes (its checksums): OK; Corruption (or
// IOError from a damaged medium) to fall back past it with the message as
// the reason; Aborted to ask the caller to plan again (a live writer reused
// the slot meanwhile); anything else is returned by MakePlan as it is.
using PlanVerifier = std::function<Status(const PlanCandidate&)>;

// The plan (above). Candidates are ordered newest counter first, at one
// counter by tier. Skipped: abandoned counters (a rollback is final), steps
// not asked for, excluded counters, and candidates the verifier refuses.
// Damaged records newer than the choice are named in `skipped`.
Result<Plan> MakePlan(const std::vector<PlanCandidate>& candidates, const LineageRecord& lineage,
                      const PlanRequest& request, const PlanVerifier& verify = nullptr);

// "checkpoint #7 (step 70)", the name every plan line uses.
std::string DescribeCheckpoint(uint64_t counter, int64_t step);

// ---- The distributed agreement (docs/DISTRIBUTED.md "Global agreement") ----
//
// Which step the ranks agree on is a choice of checkpoint, so it is made
// here, on data alone. In each round every rank reports an AgreeOffer (its
// engine's Engine::Offer) and every rank decides the same thing from the
// same list.
struct AgreeOffer {
  int64_t candidate = -1;  // step of the candidate it holds (-1: none)
  int64_t committed = -1;  // newest step it committed (-1: none)
  int64_t started = -1;    // newest step it started (-1: none)
  uint64_t counter = 0;    // the candidate's counter on this rank (not compared)
};

struct AgreeDecision {
  enum class Kind {
    kWait,  // no rank holds a candidate yet
    kPin,   // every rank holds `step`: pin it
    kAim,   // every rank keeps, as its candidate, the first checkpoint it
            // commits at or above `step` (Engine::Aim), dropping a lower one
  };
  Kind kind = Kind::kWait;
  int64_t step = -1;
};

// kPin when every rank's candidate is the same step. Otherwise the newest
// candidate M is aimed at when every rank can still keep it (it holds M, or
// has committed nothing at or above M yet: its commit of M is still to
// come). Otherwise a rank went past M without keeping it (released while it
// held an older candidate, or skipped) and M can never be agreed: aim at the
// step after the newest any rank started, which no rank has committed, so
// every rank keeps the same step next. A rank never drops a candidate for
// another step it cannot have (that let the ranks leapfrog each other
// forever when checkpoints come faster than rounds).
AgreeDecision DecideAgreement(const std::vector<AgreeOffer>& ranks);

}  // namespace nonstop
