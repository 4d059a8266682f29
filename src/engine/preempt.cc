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

bool PreemptNotices::Notice(const std::string& reason, std::optional<int64_t> step, double now_s) {
  MutexLock lock(&mu_);
  if (notice_s_) return false;
  notice_s_ = now_s;
  reason_ = reason;
  notice_step_ = step ? step : last_step_ ? std::optional<int64_t>(*last_step_ + 1) : std::nullopt;
  return true;
}

void PreemptNotices::Boundary(int64_t step, double now_s) {
  MutexLock lock(&mu_);
  if (last_step_ && step > *last_step_) {
    const double dt = (now_s - last_s_) / static_cast<double>(step - *last_step_);
    step_s_ = step_s_ ? 0.8 * *step_s_ + 0.2 * dt : dt;
  }
  last_step_ = step;
  last_s_ = now_s;
}

int64_t PreemptNotices::Flag() const { return noticed() ? world_ - rank_ : 0; }

std::optional<int> PreemptNotices::FirstRank(int64_t reduced) const {
  if (reduced <= 0) return std::nullopt;
  return world_ - static_cast<int>(reduced);
}

void PreemptNotices::HandledAt(int64_t step) {
  MutexLock lock(&mu_);
  if (!notice_step_) notice_step_ = step;
}

PreemptEstimate PreemptNotices::Estimate(int64_t state_bytes, std::optional<double> bandwidth,
                                         std::optional<double> grace_s,
                                         std::optional<int64_t> latest) const {
  MutexLock lock(&mu_);
  return EstimatePreempt({reason_, rank_, notice_step_, state_bytes, bandwidth, step_s_,
                          world_ > 1 ? 1 : 0, grace_s, latest});
}

bool PreemptNotices::noticed() const {
  MutexLock lock(&mu_);
  return notice_s_.has_value();
}

std::optional<double> PreemptNotices::notice_s() const {
  MutexLock lock(&mu_);
  return notice_s_;
}

std::string PreemptNotices::reason() const {
  MutexLock lock(&mu_);
  return reason_;
}

std::optional<int64_t> PreemptNotices::notice_step() const {
  MutexLock lock(&mu_);
  return notice_step_;
}

std::optional<double> PreemptNotices::step_s() const {
  MutexLock lock(&mu_);
  return step_s_;
}

}  // namespace nonstop
