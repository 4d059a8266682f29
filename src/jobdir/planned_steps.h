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

}  // namespace nonstop
