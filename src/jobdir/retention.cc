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

constexpr size_t kMaxMetrics = 256;

// Scans the top-level object of `text` without recursion and returns the
// text of the value of `key` (empty when absent, or when `text` is not an
// object this scan understands).
std::string_view TopLevelValue(std::string_view text, std::string_view key) {
  size_t i = 0;
  const size_t n = text.size();
  auto ws = [&] {
    while (i < n && (text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r')) ++i;
  };
  // Skips a string starting at text[i] == '"'; false when unterminated.
  auto skip_string = [&]() -> bool {
    for (++i; i < n; ++i) {
      if (text[i] == '\\') {
        ++i;
      } else if (text[i] == '"') {
        ++i;
        return true;
      }
    }
    return false;
  };
  ws();
  if (i >= n || text[i] != '{') return {};
  ++i;
  while (true) {
    ws();
    if (i >= n || text[i] != '"') return {};
    const size_t k0 = i + 1;
    if (!skip_string()) return {};
    const std::string_view k = text.substr(k0, i - 1 - k0);
    ws();
    if (i >= n || text[i] != ':') return {};
    ++i;
    ws();
    const size_t v0 = i;
    size_t depth = 0;
    while (i < n) {
      const char c = text[i];
      if (c == '"') {
        if (!skip_string()) return {};
        if (depth == 0) break;
        continue;
      }
      if (c == '{' || c == '[') {
        ++depth;
      } else if (c == '}' || c == ']') {
        if (depth == 0) break;  // the end of the top-level object
        if (--depth == 0) {
          ++i;
          break;
        }
      } else if (c == ',' && depth == 0) {
        break;
      }
      ++i;
    }
    if (i > n) return {};
    if (k == key) return text.substr(v0, i - v0);
    ws();
    if (i >= n) return {};
    if (text[i] == '}') return {};
    if (text[i] != ',') return {};
    ++i;
  }
}

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
  std::string_view v = TopLevelValue(meta_json, "metrics");
  while (!v.empty() && (v.back() == ' ' || v.back() == '\n' || v.back() == '\t' || v.back() == '\r')) {
    v.remove_suffix(1);
  }
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
