// The rules of kept-copy retention (include/nonstop/jobdir.h, "Retention of
// kept copies"): which committed checkpoint is copied to keep/, and which
// kept copies are deleted. Pure functions; JobDir::Retain applies them.
#include <algorithm>
#include <cmath>
#include <set>

#include "jobdir/records.h"
#include "nonstop/jobdir.h"

namespace nonstop {
namespace {

using jobdir_internal::Json;
using jobdir_internal::ParseJson;
using jobdir_internal::TopLevelValue;

constexpr size_t kMaxMetrics = 256;

bool Better(const KeptCopy& a, const KeptCopy& b, bool higher) {
  // a ranks before b: a better metric, or the same metric and newer.
  if (*a.metric != *b.metric) return higher ? *a.metric > *b.metric : *a.metric < *b.metric;
  return a.counter > b.counter;
}

bool BestRule(const RetentionPolicy& p) { return p.best_k > 0 && !p.best_metric.empty(); }
bool Periodic(uint64_t counter, const RetentionPolicy& p) {
  return p.keep_every > 0 && counter % p.keep_every == 0;
}

}  // namespace

std::vector<std::pair<std::string, double>> CheckpointMetrics(std::string_view meta_json) {
  std::vector<std::pair<std::string, double>> out;
  const std::string_view v = TopLevelValue(meta_json, "metrics");
  if (v.empty() || v.front() != '{' || v.size() > jobdir_internal::kMaxRecordBytes) return out;
  Result<Json> j = ParseJson(v, "metrics");
  if (!j.ok() || j.value().type != Json::Type::kObject) return out;
  const Json& o = j.value();
  for (size_t i = 0; i < o.keys.size() && out.size() < kMaxMetrics; ++i) {
    double d = 0;
    if (o.items[i].type == Json::Type::kNumber && o.items[i].AsDouble(&d) && std::isfinite(d)) {
      out.emplace_back(o.keys[i], d);
    }
  }
  return out;
}

std::optional<double> CheckpointMetric(std::string_view meta_json, std::string_view name) {
  for (const auto& [k, v] : CheckpointMetrics(meta_json)) {
    if (k == name) return v;
  }
  return std::nullopt;
}

bool WantsKeepCopy(uint64_t counter, std::optional<double> metric, const RetentionPolicy& policy,
                   const std::vector<KeptCopy>& copies) {
  if (Periodic(counter, policy)) return true;
  if (!BestRule(policy) || !metric) return false;
  std::vector<KeptCopy> ranked;
  for (const KeptCopy& c : copies) {
    if (c.metric && c.counter != counter) ranked.push_back(c);
  }
  if (ranked.size() < policy.best_k) return true;
  std::sort(ranked.begin(), ranked.end(),
            [&](const KeptCopy& a, const KeptCopy& b) { return Better(a, b, policy.best_higher); });
  const KeptCopy mine{0, counter, metric};
  return Better(mine, ranked[policy.best_k - 1], policy.best_higher);
}

std::vector<int64_t> RetentionVictims(const std::vector<KeptCopy>& copies,
                                      const RetentionPolicy& policy,
                                      const std::vector<uint64_t>& keep_counters) {
  std::set<int64_t> held;
  std::vector<KeptCopy> others;  // not eligible as best only: periodic, or without the metric
  std::vector<KeptCopy> ranked;
  const bool best = BestRule(policy);
  for (const KeptCopy& c : copies) {
    if (best && c.metric) ranked.push_back(c);
    if (!best || !c.metric || Periodic(c.counter, policy)) others.push_back(c);
  }
  if (best) {
    std::sort(ranked.begin(), ranked.end(),
              [&](const KeptCopy& a, const KeptCopy& b) { return Better(a, b, policy.best_higher); });
    for (size_t i = 0; i < ranked.size() && i < policy.best_k; ++i) held.insert(ranked[i].step);
  }
  std::sort(others.begin(), others.end(),
            [](const KeptCopy& a, const KeptCopy& b) { return a.counter > b.counter; });
  for (size_t i = 0; i < others.size(); ++i) {
    if (policy.max_to_keep == 0 || i < policy.max_to_keep) held.insert(others[i].step);
  }
  std::vector<int64_t> out;
  for (const KeptCopy& c : copies) {
    if (held.count(c.step)) continue;
    if (std::find(keep_counters.begin(), keep_counters.end(), c.counter) != keep_counters.end()) {
      continue;
    }
    out.push_back(c.step);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace nonstop
