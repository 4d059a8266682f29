#include "engine/preempt.h"

#include <algorithm>
#include <cstdio>

namespace nonstop {

namespace {

std::string Fmt(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

}  // namespace

std::optional<double> PersistBandwidth(const std::vector<PersistSample>& recent) {
  std::vector<double> rates;
  for (const PersistSample& c : recent) {
    if (c.committed && c.persist_s > 0 && c.bytes > 0) rates.push_back(c.bytes / c.persist_s);
  }
  if (rates.empty()) return std::nullopt;
  if (rates.size() > 5) rates.erase(rates.begin(), rates.end() - 5);
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

std::string HumanBytes(int64_t n) {
  static constexpr struct {
    const char* unit;
    int64_t scale;
  } kUnits[] = {{"GiB", int64_t{1} << 30}, {"MiB", int64_t{1} << 20}, {"KiB", int64_t{1} << 10}};
  for (const auto& u : kUnits) {
    if (n >= u.scale) return Fmt("%.1f ", static_cast<double>(n) / u.scale) + u.unit;
  }
  return std::to_string(n) + " B";
}

PreemptEstimate EstimatePreempt(const PreemptNotice& n) {
  PreemptEstimate out;
  std::string line = "nonstop: preemption notice (" + n.reason + ")";
  if (n.notice_step) line += " during step " + std::to_string(*n.notice_step);
  line += " on rank " + std::to_string(n.rank) + ": ";
  const std::string size =
      n.state_bytes ? HumanBytes(n.state_bytes) : "size unknown (no checkpoint yet)";
  const double finish = n.step_s && *n.step_s ? (n.lag_steps + 1) * *n.step_s : 0.0;
  if (!n.bandwidth || !n.state_bytes) {
    line += "emergency checkpoint of " + size + "; time unknown (no checkpoint measured yet)";
  } else {
    const double write = static_cast<double>(n.state_bytes) / *n.bandwidth;
    out.expected_s = finish + write;
    line += "emergency checkpoint of " + size + " expected in ~" + Fmt("%.1f", *out.expected_s) +
            " s (finish step ~" + Fmt("%.2f", finish) + " s + write ~" + Fmt("%.2f", write) +
            " s at " + Fmt("%.0f", *n.bandwidth / 1e6) + " MB/s measured)";
  }
  if (n.grace_s) {
    const std::string grace = "; grace " + Fmt("%g", *n.grace_s) + " s: ";
    if (!out.expected_s) {
      line += grace + "cannot tell whether it fits";
    } else if (*out.expected_s <= *n.grace_s) {
      line += grace + "fits";
    } else {
      line += grace + "WILL NOT FIT (needs ~" + Fmt("%.1f", *out.expected_s) +
              " s); trying anyway, the previous committed checkpoint (" +
              (n.latest ? "step " + std::to_string(*n.latest) : std::string("none yet")) +
              ") stays intact";
    }
  }
  out.line = std::move(line);
  return out;
}

}  // namespace nonstop
