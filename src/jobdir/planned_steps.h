// The recovery planner's order of one rank's checkpoints, as steps: what a
// rank offers in a distributed restart's agreement (docs/DISTRIBUTED.md).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "nonstop/status.h"

namespace nonstop {

// The steps of rank R's checkpoints in `jd` in the recovery planner's order
// (MakePlan over JobDir::List and the lineage: newest counter of the lineage
// first; abandoned, damaged and overwritten ones left out), each step once;
// with `step`, only it, keep copies included. The ranks gather these and
// restore the first step every rank holds (nonstop/dist.h CommonSteps).
// A listed disk or keep checkpoint as the planner's candidate (tier disk or
// keep; an abandoned one counts as committed: the planner reads the lineage).
PlanCandidate ListedCandidate(const ListedCheckpoint& c);

Result<std::vector<int64_t>> PlannedSteps(JobDir& jd, int rank,
                                          std::optional<int64_t> step = std::nullopt);

// max_to_keep/best with world size > 1, before the engine opens: deletes
// this writer's (rank `rank`'s) file of each of its kept steps that is not in
// `common` (the steps every rank keeps: a step kept on some ranks only is
// never restored, since recovery needs it on every rank), so that every rank
// ranks the same kept steps. A copy already gone, one a restore protects and
// the newest committed checkpoint stay (DeleteKeptShare's NotFound and
// FailedPrecondition). Returns the steps deleted, oldest first.
Result<std::vector<int64_t>> TidyKeptShares(JobDir& jd, int rank,
                                            const std::vector<int64_t>& common);

// Restoring with world size 1 where set-aside checkpoints of another world
// size exist: kOwn when rank 0's own file holds a committed checkpoint (of
// `step`, when given), or when its listing fails (the ordinary read reports
// it); else the newest set-aside one resharded, falling back to the own file
// when it lists any checkpoint (kReshardElseOwn: its error is the one to see).
enum class SingleSource { kOwn, kReshard, kReshardElseOwn };
SingleSource ChooseSingleSource(JobDir& jd, std::optional<int64_t> step);

}  // namespace nonstop
