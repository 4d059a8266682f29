// The restore plan of a rank with a remote tier (tier/remote_restore.h).
#include "tier/remote_restore.h"

#include <memory>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "jobdir/remote_layout.h"
#include "nonstop/jobdir.h"

namespace nonstop::tier {

namespace {

// The planner's order of `cands` (no verifier: the caller verifies).
Result<std::vector<size_t>> Order(const std::vector<PlanCandidate>& cands,
                                  const LineageRecord& lineage, std::optional<int64_t> step,
                                  const std::vector<uint64_t>& exclude) {
  PlanRequest req;
  req.step = step;
  req.exclude = exclude;
  req.verify = false;
  NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, lineage, req));
  return std::move(plan.order);
}

bool IsLocal(const PlanCandidate& c) { return c.tier == Tier::kDisk || c.tier == Tier::kKeep; }

// Marks damaged the local candidates of the job directory newer than the
// checkpoint of this rank that verifies (JobDir::Select): a damaged local
// newest restores its remote copy, not an older local one.
void RefuseUnverified(JobDir& jd, uint32_t rank, std::optional<int64_t> step,
                      std::vector<PlanCandidate>& cands) {
  SelectOptions o;
  o.step = step;
  std::optional<uint64_t> good;
  Result<Selection> sel = jd.Select(static_cast<int>(rank), o);
  if (sel.ok() && sel.value().chosen) good = sel.value().chosen->info.counter;
  for (PlanCandidate& c : cands) {
    if (IsLocal(c) && c.committed && (!good || c.counter > *good)) {
      c.committed = false;
      c.damage = "fails to verify";
    }
  }
}

}  // namespace

Result<RestorePlan> PlanRemoteRestore(Env* env, const RestorePlanRequest& r) {
  std::vector<PlanCandidate> cands;
  LineageRecord lineage;
  std::unique_ptr<JobDir> jd;
  if (!r.job_dir.empty()) {
    Result<std::unique_ptr<JobDir>> opened = JobDir::OpenForRead(r.job_dir, env);
    if (opened.ok()) {
      Result<std::vector<ListedCheckpoint>> rows = opened.value()->List(static_cast<int>(r.rank));
      Result<LineageRecord> lin = opened.value()->ReadLineage(static_cast<int>(r.rank));
      if (rows.ok() && lin.ok()) {
        jd = std::move(opened).value();
        lineage = std::move(lin).value();
        for (const ListedCheckpoint& c : rows.value()) {
          if (c.counter == 0) continue;
          PlanCandidate p;
          p.tier = c.location.keep ? Tier::kKeep : Tier::kDisk;
          p.where = c.location.where;
          p.step = c.step;
          p.counter = c.counter;
          p.committed = c.state != ListedCheckpoint::State::kDamaged;
          p.damage = c.reason;
          p.overwritten = c.rotated;
          cands.push_back(std::move(p));
        }
      }
    }
  }
  for (const PlanCandidate& c : r.extra_local) cands.push_back(c);
  for (size_t i = 0; i < cands.size(); ++i) cands[i].handle = i;

  RestorePlan out;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<size_t> local, Order(cands, lineage, std::nullopt, {}));
  if (!local.empty()) out.local_newest = cands[local.front()].step;
  if (r.step) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<size_t> at, Order(cands, lineage, r.step, {}));
    out.local_has_step = !at.empty();
  }

  std::set<uint64_t> remote_counters;
  if (r.remote) {
    for (const auto& [step, counter] : *r.remote) {
      PlanCandidate p;
      p.tier = Tier::kRemote;
      p.where = r.remote_where + "/" + remote::StepDir(step);
      p.step = step;
      p.counter = counter;
      p.handle = cands.size();
      cands.push_back(std::move(p));
      remote_counters.insert(counter);
    }
  }
  std::vector<size_t> order;
  for (bool verified = false;;) {
    NONSTOP_ASSIGN_OR_RETURN(order, Order(cands, lineage, r.step, r.exclude));
    if (order.empty() || verified || jd == nullptr) break;
    const PlanCandidate& head = cands[order.front()];
    if (head.tier == Tier::kRemote || remote_counters.count(head.counter) == 0) break;
    // The remote holds this checkpoint too: the local copy must verify to
    // be read first.
    verified = true;
    RefuseUnverified(*jd, r.rank, r.step, cands);
  }
  std::unordered_set<int64_t> seen;
  for (size_t i : order) {
    const PlanCandidate& c = cands[i];
    if (!seen.insert(c.step).second) continue;
    out.order.push_back({c.step, c.counter, c.tier == Tier::kRemote});
  }
  return out;
}

std::vector<AgreedStep> CommonRestoreSteps(const std::vector<std::vector<RestoreSource>>& every) {
  std::vector<AgreedStep> out;
  if (every.empty()) return out;
  std::vector<std::unordered_map<int64_t, bool>> held(every.size());  // step -> remote
  for (size_t r = 0; r < every.size(); ++r) {
    for (const RestoreSource& s : every[r]) held[r].emplace(s.step, s.remote);
  }
  std::unordered_set<int64_t> seen;
  for (const RestoreSource& s : every[0]) {
    if (!seen.insert(s.step).second) continue;  // a step twice in rank 0's plan: once
    bool common = true, all_local = true;
    for (const auto& h : held) {
      auto it = h.find(s.step);
      if (it == h.end()) {
        common = false;
        break;
      }
      all_local = all_local && !it->second;
    }
    if (common) out.push_back({s.step, all_local});
  }
  return out;
}

}  // namespace nonstop::tier
