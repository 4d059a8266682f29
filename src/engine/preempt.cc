#include "engine/preempt.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>

#include "jobdir/records.h"

namespace nonstop {

namespace {

using jobdir_internal::Json;

// The signals a process may be sent by name (Linux; Python's signal module).
constexpr struct {
  const char* name;
  int number;
} kSignals[] = {
    {"HUP", SIGHUP},   {"INT", SIGINT},       {"QUIT", SIGQUIT},     {"ILL", SIGILL},
    {"TRAP", SIGTRAP}, {"ABRT", SIGABRT},     {"IOT", SIGIOT},       {"BUS", SIGBUS},
    {"FPE", SIGFPE},   {"KILL", SIGKILL},     {"USR1", SIGUSR1},     {"SEGV", SIGSEGV},
    {"USR2", SIGUSR2}, {"PIPE", SIGPIPE},     {"ALRM", SIGALRM},     {"TERM", SIGTERM},
    {"CHLD", SIGCHLD}, {"CONT", SIGCONT},     {"STOP", SIGSTOP},     {"TSTP", SIGTSTP},
    {"TTIN", SIGTTIN}, {"TTOU", SIGTTOU},     {"URG", SIGURG},       {"XCPU", SIGXCPU},
    {"XFSZ", SIGXFSZ}, {"VTALRM", SIGVTALRM}, {"PROF", SIGPROF},     {"WINCH", SIGWINCH},
    {"IO", SIGIO},     {"SYS", SIGSYS},
#ifdef SIGPWR
    {"PWR", SIGPWR},
#endif
};

// A value as Python would write it in an error line: 'text', 3, True, None.
std::string Shown(const Json& v) {
  switch (v.type) {
    case Json::Type::kNull: return "None";
    case Json::Type::kBool: return v.b ? "True" : "False";
    case Json::Type::kNumber: return v.text;
    case Json::Type::kString: return "'" + v.text + "'";
    case Json::Type::kArray: return "a list";
    case Json::Type::kObject: return "a dict";
  }
  return "?";
}

Result<int> SignalNumber(const Json& v) {
  int64_t n = 0;
  if (v.AsInt64(&n)) {
    if (n < 1 || n > 64) return Status::InvalidArgument("on_preempt: no signal number " + v.text);
    return static_cast<int>(n);
  }
  if (v.type != Json::Type::kString) {
    return Status::InvalidArgument("on_preempt: signals must be names or numbers, got " +
                                   Shown(v));
  }
  std::string name;
  for (char c : v.text) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (name.rfind("SIG", 0) == 0) name.erase(0, 3);
  for (const auto& s : kSignals) {
    if (name == s.name) return s.number;
  }
  return Status::InvalidArgument("on_preempt: unknown signal " + Shown(v));
}

bool PositiveSeconds(const Json& v, double* out) {
  return v.AsDouble(out) && *out > 0;
}

std::string Fmt(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

}  // namespace

Result<PreemptOptions> ParsePreemptOptions(std::string_view json) {
  Result<Json> parsed = jobdir_internal::ParseJson(json, "on_preempt");
  if (!parsed.ok()) return Status::InvalidArgument(parsed.status().message());  // "on_preempt: ..."
  const Json& j = parsed.value();
  if (j.type != Json::Type::kObject) {
    return Status::InvalidArgument(
        "on_preempt: True, False or a dict (signals, exit_code, grace_s, ...), got " + Shown(j));
  }
  static const std::set<std::string> kKeys = {"chain",  "exit_code", "grace_s",
                                              "group",  "signals",   "timeout_s"};
  std::set<std::string> unknown;
  for (const std::string& k : j.keys) {
    if (!kKeys.count(k)) unknown.insert(k);
  }
  if (!unknown.empty()) {
    return Status::InvalidArgument("on_preempt: unknown key '" + *unknown.begin() +
                                   "'; use chain, exit_code, grace_s, group, signals, timeout_s");
  }
  PreemptOptions o;
  if (const Json* v = j.Get("signals")) {
    std::set<int> sigs;
    for (const Json& s : v->type == Json::Type::kArray ? v->items : std::vector<Json>{*v}) {
      NONSTOP_ASSIGN_OR_RETURN(int n, SignalNumber(s));
      if (n == SIGKILL || n == SIGSTOP) {
        return Status::InvalidArgument("on_preempt: SIGKILL and SIGSTOP cannot be caught");
      }
      sigs.insert(n);
    }
    o.signals.assign(sigs.begin(), sigs.end());
  }
  if (const Json* v = j.Get("exit_code")) {
    int64_t code = -1;
    if (!v->AsInt64(&code) || code < 0 || code > 255) {
      return Status::InvalidArgument("on_preempt: exit_code must be an int in 0..255, got " +
                                     Shown(*v));
    }
    o.exit_code = static_cast<int>(code);
  }
  if (const Json* v = j.Get("grace_s"); v != nullptr && v->type != Json::Type::kNull) {
    double g = 0;
    if (!PositiveSeconds(*v, &g)) {
      return Status::InvalidArgument(
          "on_preempt: grace_s must be a positive number of seconds, got " + Shown(*v));
    }
    o.grace_s = g;
  }
  if (const Json* v = j.Get("chain")) {
    if (v->type != Json::Type::kBool) {
      return Status::InvalidArgument("on_preempt: chain must be True or False, got " + Shown(*v));
    }
    o.chain = v->b;
  }
  if (const Json* v = j.Get("timeout_s"); v != nullptr && !PositiveSeconds(*v, &o.timeout_s)) {
    return Status::InvalidArgument(
        "on_preempt: timeout_s must be a positive number of seconds, got " + Shown(*v));
  }
  return o;
}

Result<EmergencyOutcome> AwaitEmergency(Engine& engine, uint64_t counter, int64_t step) {
  const Status waited = engine.WaitCommitted(counter);  // this one's error, or an older one's
  const std::optional<CommittedCheckpoint> latest = engine.Latest();
  EmergencyOutcome o;
  o.committed = latest.has_value() && latest->step == step;
  if (!waited.ok() && !o.committed) return waited;
  o.older = waited.message();
  for (const CheckpointStats& c : engine.Stats().recent) {
    if (c.counter == counter) o.record = c;
  }
  return o;
}

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

std::string PreemptExitLine(const PreemptOutcome& o) {
  const std::string head = "nonstop: emergency checkpoint of step " + std::to_string(o.step);
  const std::string latest = o.latest ? std::to_string(*o.latest) : std::string("None");
  if (!o.error.empty()) {
    return head + " failed: " + o.error + "; the newest committed checkpoint is step " + latest;
  }
  return head + (o.committed ? " committed " : " NOT committed on every rank ") +
         Fmt("%.2f", o.notice_to_safe_s) + " s after the notice (checkpoint " +
         Fmt("%.2f", o.checkpoint_s) + " s); exiting with status " + std::to_string(o.exit_code);
}

std::string PreemptedMessage(const PreemptOutcome& o) {
  return "preempted (" + o.reason + "): checkpoint of step " + std::to_string(o.step) +
         (o.committed ? " committed" : " NOT committed") + ", newest committed step " +
         (o.latest ? std::to_string(*o.latest) : std::string("None")) + ", " +
         Fmt("%.2f", o.notice_to_safe_s) + " s after the notice; exit status " +
         std::to_string(o.exit_code);
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
