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

Result<std::vector<int64_t>> TidyKeptShares(JobDir& jd, int rank,
                                            const std::vector<int64_t>& common) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<KeptCopy> kept, jd.KeptCopies(rank));
  std::vector<int64_t> mine;
  for (const KeptCopy& k : kept) mine.push_back(k.step);
  std::sort(mine.begin(), mine.end());
  mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
  std::vector<int64_t> gone;
  for (int64_t step : mine) {
    if (std::find(common.begin(), common.end(), step) != common.end()) continue;
    const Status s = jd.DeleteKeptShare(step);
    if (s.ok()) {
      gone.push_back(step);
    } else if (s.code() != StatusCode::kNotFound && s.code() != StatusCode::kFailedPrecondition) {
      return s;
    }
  }
  return gone;
}

SingleSource ChooseSingleSource(JobDir& jd, std::optional<int64_t> step) {
  Result<std::vector<ListedCheckpoint>> listed = jd.List(0);
  if (!listed.ok()) return SingleSource::kOwn;
  bool any = false;
  for (const ListedCheckpoint& c : listed.value()) {
    if (c.location.keep) continue;
    any = true;
    if (c.state == ListedCheckpoint::State::kCommitted && (!step || c.step == *step)) {
      return SingleSource::kOwn;
    }
  }
  return any ? SingleSource::kReshardElseOwn : SingleSource::kReshard;
}

}  // namespace nonstop
