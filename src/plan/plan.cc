// The recovery planner (include/nonstop/plan.h): pure, no I/O of its own.
#include "nonstop/plan.h"

#include <algorithm>

namespace nonstop {

const char* TierName(Tier t) {
  switch (t) {
    case Tier::kMemory: return "memory";
    case Tier::kDisk: return "disk";
    case Tier::kKeep: return "keep";
    case Tier::kRemote: return "remote";
  }
  return "?";
}

std::optional<Tier> ParseTier(const std::string& name) {
  for (Tier t : {Tier::kMemory, Tier::kDisk, Tier::kKeep, Tier::kRemote}) {
    if (name == TierName(t)) return t;
  }
  return std::nullopt;
}

bool LineageRecord::NotDurable(uint64_t counter) const {
  return std::binary_search(not_durable.begin(), not_durable.end(), counter);
}

bool LineageRecord::IsAbandoned(uint64_t counter) const {
  for (const auto& [lo, hi] : abandoned) {
    if (counter >= lo && counter <= hi) return true;
  }
  return false;
}

std::string DescribeCheckpoint(uint64_t counter, int64_t step) {
  return "checkpoint #" + std::to_string(counter) + " (step " + std::to_string(step) + ")";
}

namespace {

// The one place the lineage is consulted: why `counter` may never be chosen
// (a rollback abandoned it, or its commit was never durable), or nullopt.
std::optional<std::string> Abandoned(const LineageRecord& lineage, uint64_t counter) {
  if (!lineage.IsAbandoned(counter)) return std::nullopt;
  if (lineage.NotDurable(counter)) return std::string(kNotDurableReason);
  return "abandoned (a restore of #" + std::to_string(lineage.restored_counter) +
         " rolled back past it; a rollback is final)";
}

}  // namespace

CandidateState Classify(const PlanCandidate& c, const LineageRecord& lineage) {
  using S = CandidateState::State;
  if (!c.committed) return {c.overwritten ? S::kOverwritten : S::kDamaged, c.damage};
  if (auto why = Abandoned(lineage, c.counter)) return {S::kAbandoned, *why};
  return {S::kCommitted, ""};
}

Result<Plan> MakePlan(const std::vector<PlanCandidate>& candidates, const LineageRecord& lineage,
                      const PlanRequest& request, const PlanVerifier& verify) {
  Plan plan;
  std::vector<size_t> committed;
  std::vector<std::pair<uint64_t, std::string>> damaged;  // (counter, line)
  for (size_t i = 0; i < candidates.size(); ++i) {
    const PlanCandidate& c = candidates[i];
    plan.newest_counter = std::max(plan.newest_counter, c.counter);
    if (c.committed) {
      committed.push_back(i);
    } else if (!Abandoned(lineage, c.counter) && !c.overwritten &&
               (!request.step || c.step == *request.step)) {
      damaged.emplace_back(c.counter, c.where + ": " + DescribeCheckpoint(c.counter, c.step) +
                                          ": " + c.damage);
    }
  }
  plan.saw_damage = !damaged.empty();
  // Newest counter first; at one counter the nearer tier first.
  std::stable_sort(committed.begin(), committed.end(), [&](size_t a, size_t b) {
    const PlanCandidate& x = candidates[a];
    const PlanCandidate& y = candidates[b];
    return x.counter != y.counter ? x.counter > y.counter : x.tier < y.tier;
  });
  std::vector<std::pair<uint64_t, std::string>> passed;  // newer ones not chosen
  std::optional<uint64_t> newest_live;
  for (size_t i : committed) {
    const PlanCandidate& c = candidates[i];
    const std::string what = c.where + ": " + DescribeCheckpoint(c.counter, c.step);
    if (auto why = Abandoned(lineage, c.counter)) {
      if (plan.order.empty()) passed.emplace_back(c.counter, what + ": " + *why);
      continue;
    }
    if (!newest_live) newest_live = c.counter;
    if (request.step && c.step != *request.step) continue;
    if (request.max_step && c.step > *request.max_step) continue;
    if (std::find(request.exclude.begin(), request.exclude.end(), c.counter) !=
        request.exclude.end()) {
      if (plan.order.empty()) passed.emplace_back(c.counter, what + ": failed while it was read");
      plan.saw_damage = true;
      continue;
    }
    if (plan.order.empty() && request.verify && verify) {
      Status st = verify(c);
      if (!st.ok()) {
        if (st.code() != StatusCode::kCorruption) return st;
        passed.emplace_back(c.counter, what + ": " + st.message());
        plan.saw_damage = true;
        continue;
      }
      plan.verified = true;
    }
    plan.order.push_back(i);
  }
  const uint64_t floor = plan.order.empty() ? 0 : candidates[plan.order.front()].counter;
  for (auto& d : damaged) {
    if (d.first > floor) passed.push_back(std::move(d));
  }
  std::stable_sort(passed.begin(), passed.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (auto& p : passed) plan.skipped.push_back(std::move(p.second));
  plan.fallback = !plan.order.empty() && newest_live && *newest_live != floor;
  return plan;
}

AgreeDecision DecideAgreement(const std::vector<AgreeOffer>& ranks) {
  AgreeDecision d;
  if (ranks.empty()) return d;
  int64_t newest = -1, started = -1;
  bool same = true;
  for (const AgreeOffer& r : ranks) {
    newest = std::max(newest, r.candidate);
    started = std::max({started, r.started, r.committed, r.candidate});
    same = same && r.candidate == ranks.front().candidate;
  }
  if (newest < 0) return d;  // nobody holds a candidate yet
  if (same) {
    d.kind = AgreeDecision::Kind::kPin;
    d.step = newest;
    return d;
  }
  bool reachable = true;
  for (const AgreeOffer& r : ranks) {
    if (r.candidate != newest && r.committed >= newest) reachable = false;
  }
  d.kind = AgreeDecision::Kind::kAim;
  d.step = reachable ? newest : started + 1;
  return d;
}

}  // namespace nonstop
