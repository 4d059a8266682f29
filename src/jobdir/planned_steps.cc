// PlannedSteps (planned_steps.h): the recovery planner's order of one rank's
// checkpoints, as steps, for the ranks' agreement.
#include "jobdir/planned_steps.h"

#include <algorithm>

#include "nonstop/plan.h"

namespace nonstop {

PlanCandidate ListedCandidate(const ListedCheckpoint& c) {
  PlanCandidate pc;
  pc.tier = c.location.keep ? Tier::kKeep : Tier::kDisk;
  pc.where = c.location.where;
  pc.step = c.step;
  pc.counter = c.counter;
  pc.committed = c.state != ListedCheckpoint::State::kDamaged;
  pc.damage = c.reason;
  pc.overwritten = c.rotated;
  return pc;
}

Result<std::vector<int64_t>> PlannedSteps(JobDir& jd, int rank, std::optional<int64_t> step) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<ListedCheckpoint> listed, jd.List(rank));
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, jd.ReadLineage(rank));
  std::vector<PlanCandidate> cands;
  for (const ListedCheckpoint& c : listed) {
    if (c.counter == 0 || (!step && c.location.keep)) continue;
    cands.push_back(ListedCandidate(c));
  }
  PlanRequest req;
  req.step = step;
  req.verify = false;
  NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, lineage, req));
  std::vector<int64_t> out;
  for (size_t i : plan.order) {
    if (std::find(out.begin(), out.end(), cands[i].step) == out.end()) out.push_back(cands[i].step);
  }
  return out;
}

}  // namespace nonstop
