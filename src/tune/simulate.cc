// The goodput simulator: see include/nonstop/simulate.h and docs/SIMULATE.md.
#include "nonstop/simulate.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>

namespace nonstop {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Steps that complete in `dt` seconds of running. The epsilon keeps a step that
// ends exactly at a failure (dt an exact multiple of T up to rounding) counted.
int64_t StepsIn(double dt, double step_s) {
  if (dt <= 0) return 0;
  return static_cast<int64_t>(std::floor(dt / step_s + 1e-9));
}

// The kind's rules applied: what the timeline actually uses.
struct Effective {
  double step_s;
  double stall_s;
  double durable_after_s;  // admission to durable: max(stall, persist)
  int max_in_flight;
  double restart_s;
  bool checkpoints;        // false for kNone
  bool every_step_durable;  // kIdeal
};

Effective EffectiveOf(const SchemeSpec& spec) {
  Effective e{spec.step_s, spec.stall_s, std::max(spec.stall_s, spec.persist_s),
              spec.max_in_flight, spec.restart_s, true, false};
  switch (spec.kind) {
    case SchemeKind::kNone:
      e.checkpoints = false;
      e.stall_s = 0;
      break;
    case SchemeKind::kSync:
      // Training waits until the checkpoint is durable.
      e.stall_s = e.durable_after_s;
      e.max_in_flight = 1;
      break;
    case SchemeKind::kSingle:
      e.max_in_flight = 1;
      break;
    case SchemeKind::kIdeal:
      e.checkpoints = false;
      e.every_step_durable = true;
      e.stall_s = 0;
      e.durable_after_s = 0;
      break;
    default:
      break;
  }
  return e;
}

bool IsLetter(char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; }

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool ParseDouble(const std::string& text, double* out) {
  std::string t = Trim(text);
  if (t.empty()) return false;
  char* end = nullptr;
  *out = std::strtod(t.c_str(), &end);
  return end == t.c_str() + t.size() && std::isfinite(*out);
}

}  // namespace

std::string_view SchemeKindName(SchemeKind kind) {
  switch (kind) {
    case SchemeKind::kNone: return "none";
    case SchemeKind::kSync: return "sync";
    case SchemeKind::kSingle: return "single";
    case SchemeKind::kConcurrent: return "concurrent";
    case SchemeKind::kLayerwise: return "layerwise";
    case SchemeKind::kMultistep: return "multistep";
    case SchemeKind::kIdeal: return "ideal";
  }
  return "?";
}

bool ParseSchemeKind(std::string_view name, SchemeKind* kind) {
  static constexpr SchemeKind kAll[] = {SchemeKind::kNone,       SchemeKind::kSync,
                                        SchemeKind::kSingle,     SchemeKind::kConcurrent,
                                        SchemeKind::kLayerwise,  SchemeKind::kMultistep,
                                        SchemeKind::kIdeal};
  for (SchemeKind k : kAll) {
    std::string_view n = SchemeKindName(k);
    if (name.size() >= n.size() && name.substr(0, n.size()) == n &&
        (name.size() == n.size() || !IsLetter(name[n.size()]))) {
      *kind = k;
      return true;
    }
  }
  return false;
}

Status ValidateScheme(const SchemeSpec& s) {
  const std::string who = "scheme '" + s.name + "'";
  if (s.name.empty()) return Status::InvalidArgument("a scheme has no name");
  if (!(s.step_s > 0) || !std::isfinite(s.step_s)) {
    return Status::InvalidArgument(who + ": step_s must be > 0 (seconds per training step)");
  }
  if (!(s.stall_s >= 0) || !(s.persist_s >= 0) || !(s.restart_s >= 0) ||
      !std::isfinite(s.stall_s) || !std::isfinite(s.persist_s) || !std::isfinite(s.restart_s)) {
    return Status::InvalidArgument(who + ": stall_s, persist_s and restart_s must be >= 0");
  }
  if (s.max_in_flight < 1) return Status::InvalidArgument(who + ": max_in_flight must be >= 1");
  for (int f : s.intervals) {
    if (f < 1) return Status::InvalidArgument(who + ": intervals must be >= 1 step");
  }
  return Status::OK();
}

// ---- Failure sources ------------------------------------------------------

Result<FailureTrace> ParseAvailabilityTrace(std::istream& in, const TraceOptions& options,
                                            const std::string& name) {
  if (options.gpus_per_failure < 0) {
    return Status::InvalidArgument("gpus_per_failure must be >= 0");
  }
  std::string line;
  if (!std::getline(in, line)) {
    return Status::InvalidArgument(name + ": empty file; expected a CSV with header ',Time,GPUs'");
  }
  // Columns by header name, so that an extra or reordered column still parses.
  std::vector<std::string> header;
  {
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) header.push_back(Trim(cell));
    if (!line.empty() && line.back() == ',') header.push_back("");
  }
  int time_col = -1, gpus_col = -1;
  for (size_t i = 0; i < header.size(); ++i) {
    if (header[i] == "Time") time_col = static_cast<int>(i);
    if (header[i] == "GPUs") gpus_col = static_cast<int>(i);
  }
  if (time_col < 0 || gpus_col < 0) {
    return Status::InvalidArgument(name + ": line 1: header must name columns 'Time' and 'GPUs' "
                                   "(as ',Time,GPUs'), got '" + Trim(line) + "'");
  }
  std::vector<double> times;
  std::vector<int64_t> gpus;
  int lineno = 1;
  while (std::getline(in, line)) {
    ++lineno;
    if (Trim(line).empty()) continue;
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    const std::string where = name + ": line " + std::to_string(lineno);
    if (static_cast<int>(cells.size()) <= std::max(time_col, gpus_col)) {
      return Status::InvalidArgument(where + ": expected " + std::to_string(header.size()) +
                                     " columns, got " + std::to_string(cells.size()));
    }
    double t = 0, g = 0;
    if (!ParseDouble(cells[time_col], &t)) {
      return Status::InvalidArgument(where + ": Time '" + Trim(cells[time_col]) +
                                     "' is not a number");
    }
    if (!ParseDouble(cells[gpus_col], &g) || g < 0 || g != std::floor(g)) {
      return Status::InvalidArgument(where + ": GPUs '" + Trim(cells[gpus_col]) +
                                     "' is not a non-negative integer");
    }
    if (!times.empty() && !(t > times.back())) {
      return Status::InvalidArgument(where + ": Time does not increase (" + std::to_string(t) +
                                     " after " + std::to_string(times.back()) + ")");
    }
    times.push_back(t);
    gpus.push_back(static_cast<int64_t>(g));
  }
  if (times.size() < 2) {
    return Status::InvalidArgument(name + ": needs at least two samples to span any time");
  }
  FailureTrace trace;
  trace.horizon_s = times.back() - times.front();
  trace.source = name;
  for (size_t i = 1; i < times.size(); ++i) {
    const int64_t change = std::llabs(gpus[i] - gpus[i - 1]);
    if (change == 0) continue;
    const double at = times[i] - times.front();
    if (options.gpus_per_failure == 0) {
      trace.times_s.push_back(at);
      continue;
    }
    const int64_t k = change / options.gpus_per_failure;
    const double prev = times[i - 1] - times.front();
    for (int64_t j = 1; j <= k; ++j) {
      trace.times_s.push_back(prev + (at - prev) * static_cast<double>(j) / static_cast<double>(k));
    }
  }
  return trace;
}

Result<FailureTrace> LoadAvailabilityTrace(const std::string& path, const TraceOptions& options) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open trace " + path + ": " + std::strerror(errno));
  return ParseAvailabilityTrace(in, options, path);
}

Result<FailureTrace> ExponentialFailures(double mtbf_s, double horizon_s, uint64_t seed) {
  if (!(mtbf_s > 0) || !std::isfinite(mtbf_s)) {
    return Status::InvalidArgument("mtbf must be > 0 seconds");
  }
  if (!(horizon_s > 0) || !std::isfinite(horizon_s)) {
    return Status::InvalidArgument("horizon must be > 0 seconds");
  }
  FailureTrace trace;
  trace.horizon_s = horizon_s;
  std::ostringstream src;
  src << "exponential mtbf=" << mtbf_s << "s seed=" << seed;
  trace.source = src.str();
  // mt19937_64's output is fixed by the standard; std::exponential_distribution's
  // is not, so invert the CDF by hand for portable runs.
  std::mt19937_64 rng(seed);
  double t = 0;
  for (;;) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
    t += -mtbf_s * std::log1p(-u);
    if (t >= horizon_s) break;
    trace.times_s.push_back(t);
  }
  return trace;
}

// ---- The simulator --------------------------------------------------------

Result<SimResult> SimulateScheme(const SchemeSpec& spec, int interval, const FailureTrace& trace) {
  NONSTOP_RETURN_IF_ERROR(ValidateScheme(spec));
  if (interval < 1) return Status::InvalidArgument("interval must be >= 1 step");
  if (!(trace.horizon_s > 0)) return Status::InvalidArgument("failure trace has no horizon");
  const Effective e = EffectiveOf(spec);
  const double H = trace.horizon_s;
  const double T = e.step_s;
  const std::vector<double>& fails = trace.times_s;

  SimResult r;
  r.scheme = spec.name;
  r.kind = spec.kind;
  r.interval = interval;
  r.horizon_s = H;

  struct Pending {
    int64_t step;
    double durable_s;
  };
  // Admitted checkpoints not yet known durable, oldest first. Admissions are in
  // order and take the same time, so durable times ascend too.
  std::deque<Pending> pending;
  int64_t base = 0;  // step of the newest checkpoint known durable (0 = the start)
  int64_t step = 0;  // completed steps of the current timeline
  double t = 0;
  size_t next_fail = 0;
  while (next_fail < fails.size() && fails[next_fail] < 0) ++next_fail;
  auto next_failure = [&]() { return next_fail < fails.size() ? fails[next_fail] : kInf; };

  // Retires the pending checkpoints that are durable at `now`.
  auto retire = [&](double now) {
    while (!pending.empty() && pending.front().durable_s <= now) {
      base = pending.front().step;
      ++r.durable_checkpoints;
      pending.pop_front();
    }
  };

  // A failure at time t: roll back to what is durable now, then restart; a
  // failure during the restart starts it over. Returns false at the horizon.
  auto fail = [&]() -> bool {
    retire(t);
    pending.clear();
    ++r.failures;
    ++next_fail;
    if (e.every_step_durable) base = step;
    r.lost_steps += step - base;
    step = base;
    double resume = t + e.restart_s;
    while (next_failure() < resume && next_failure() < H) {
      ++r.failures;
      resume = next_failure() + e.restart_s;
      ++next_fail;
    }
    r.restart_s += std::min(resume, H) - t;
    t = resume;
    return t < H;
  };

  const int64_t f = interval;
  for (;;) {
    // Run until the next checkpoint request, failure or the horizon.
    const int64_t want = e.checkpoints ? (step / f + 1) * f : std::numeric_limits<int64_t>::max();
    const double t_req = e.checkpoints ? t + static_cast<double>(want - step) * T : kInf;
    const double tf = next_failure();
    if (t_req <= tf && t_req <= H) {
      step = want;
      t = t_req;
    } else if (tf <= H) {
      // The failure comes first; a step ending exactly at it counts as done.
      int64_t done = StepsIn(tf - t, T);
      if (e.checkpoints) done = std::min(done, want - step - 1);
      step += done;
      t = tf;
      if (!fail()) break;
      continue;
    } else {
      step += StepsIn(H - t, T);
      if (e.checkpoints) step = std::min(step, want - 1);
      t = H;
      break;
    }

    // A checkpoint of `step` is requested at t.
    retire(t);
    double admit = t;
    if (static_cast<int>(pending.size()) >= e.max_in_flight) {
      admit = pending[pending.size() - e.max_in_flight].durable_s;
    }
    const double tf2 = next_failure();
    if (tf2 < admit || H < admit) {
      // Failed (or ended) while waiting for a free slot: never admitted.
      const double until = std::min(tf2, H);
      r.stall_s += until - t;
      t = until;
      if (H <= tf2) break;
      if (!fail()) break;
      continue;
    }
    pending.push_back({step, admit + e.durable_after_s});
    ++r.checkpoints;
    const double resume = admit + e.stall_s;
    if (tf2 < resume || H < resume) {
      const double until = std::min(tf2, H);
      r.stall_s += until - t;
      t = until;
      if (H <= tf2) break;
      if (!fail()) break;
      continue;
    }
    r.stall_s += resume - t;
    t = resume;
  }
  retire(H);
  if (e.every_step_durable) base = step;
  r.useful_steps = step;
  r.goodput_steps_per_s = static_cast<double>(step) / H;
  return r;
}

Result<std::vector<SimResult>> Simulate(const std::vector<SchemeSpec>& specs,
                                        const std::vector<int>& intervals,
                                        const FailureTrace& trace) {
  std::vector<SimResult> out;
  std::map<std::pair<std::string, int>, bool> seen;
  for (const SchemeSpec& spec : specs) {
    const std::vector<int>& use = spec.intervals.empty() ? intervals : spec.intervals;
    for (int f : use) {
      if (!seen.emplace(std::make_pair(spec.name, f), true).second) {
        return Status::InvalidArgument("scheme '" + spec.name +
                                       "' is described twice for interval " + std::to_string(f));
      }
      NONSTOP_ASSIGN_OR_RETURN(SimResult r, SimulateScheme(spec, f, trace));
      out.push_back(std::move(r));
    }
  }
  return out;
}

// ---- Defaults -------------------------------------------------------------

std::vector<SchemeSpec> PccheckLikeSchemes() {
  // VGG16 on one A100 as in PCcheck's artifact; docs/SIMULATE.md shows the fits.
  const double T = 1.0 / 15.77;  // Fig. 8, no checkpoint: 15.77 it/s
  const double R = 0.837;        // artifact's measured VGG16 load time
  const double tw = 6.3;         // PCcheck: 4 in flight, 10 steps per 1.575 s => Tw = 4 x 1.575
  std::vector<SchemeSpec> s;
  s.push_back({"none", SchemeKind::kNone, T, 0, 0, 1, R, {}});
  // torch.save-like: CheckFreq's snapshot + persist path, done inline.
  s.push_back({"sync", SchemeKind::kSync, T, 3.4, 3.4, 1, R, {}});
  // CheckFreq fit: f=50 gives the stall (0.9 s), f=10 the persist (3.4 s).
  s.push_back({"single", SchemeKind::kSingle, T, 0.9, 3.4, 1, R, {}});
  s.push_back({"concurrent", SchemeKind::kConcurrent, T, 0.1, tw, 4, R, {}});
  // Estimates, not measurements: a per-layer copy hides ~3/4 of the copy behind
  // backward (LightCheck); GoCkpt-O hides nearly all of it but the checkpoint is
  // durable K=4 steps later.
  s.push_back({"layerwise", SchemeKind::kLayerwise, T, 0.025, tw, 4, R, {}});
  s.push_back({"multistep", SchemeKind::kMultistep, T, 0.01, tw + 4 * T, 4, R, {}});
  s.push_back({"ideal", SchemeKind::kIdeal, T, 0, 0, 1, R, {}});
  return s;
}

Result<std::vector<SchemeSpec>> SchemesFromBench(const std::vector<BenchRow>& rows,
                                                 double restart_s, double step_s_fallback) {
  if (rows.empty()) return Status::InvalidArgument("bench JSON has no rows");
  double step_s = step_s_fallback;
  for (const BenchRow& row : rows) {
    SchemeKind k;
    if (ParseSchemeKind(row.scheme, &k) && k == SchemeKind::kNone && row.steps_per_s > 0) {
      step_s = 1.0 / row.steps_per_s;
      break;
    }
  }
  if (!(step_s > 0)) {
    return Status::InvalidArgument(
        "bench JSON has no 'none' row with steps_per_s; pass --step-s to give the step time");
  }
  std::vector<SchemeSpec> out;
  bool have_ideal = false;
  std::map<std::string, size_t> by_name;
  for (const BenchRow& row : rows) {
    SchemeSpec s;
    s.name = row.scheme;
    if (!ParseSchemeKind(row.scheme, &s.kind)) s.kind = SchemeKind::kConcurrent;
    s.step_s = step_s;
    s.restart_s = restart_s;
    s.max_in_flight = std::max(1, row.max_in_flight);
    s.stall_s = std::max(0.0, row.stall_ms_mean / 1e3);
    if (s.kind == SchemeKind::kIdeal) have_ideal = true;
    if (s.kind == SchemeKind::kNone || s.kind == SchemeKind::kIdeal) {
      if (by_name.count(s.name)) continue;  // one description serves every interval
    } else {
      if (row.interval < 1) {
        return Status::InvalidArgument("bench row '" + row.scheme + "' has no interval >= 1");
      }
      if (!(row.steps_per_s > 0)) {
        return Status::InvalidArgument("bench row '" + row.scheme + "' interval " +
                                       std::to_string(row.interval) + " has no steps_per_s");
      }
      s.intervals = {row.interval};
      if (s.kind == SchemeKind::kSync || s.kind == SchemeKind::kSingle) s.max_in_flight = 1;
      if (row.persist_ms >= 0) {
        s.persist_s = row.persist_ms / 1e3;
      } else if (s.kind == SchemeKind::kSync) {
        s.persist_s = s.stall_s;
      } else {
        // Measured time per checkpoint period bounds the persist time from above:
        // with N in flight the pipeline sustains one checkpoint per W / N.
        const double period = row.interval / row.steps_per_s;
        s.persist_s = std::max(s.stall_s, s.max_in_flight * period);
      }
      // A scheme measured at several intervals keeps one name: tables group by it.
    }
    by_name[s.name] = out.size();
    out.push_back(std::move(s));
  }
  if (!have_ideal) {
    out.push_back({"ideal", SchemeKind::kIdeal, step_s, 0, 0, 1, restart_s, {}});
  }
  return out;
}

// ---- Closed forms ---------------------------------------------------------

namespace {

// Failure-free durable times d_j (from the end of a restart, progress at a
// checkpoint step) of checkpoints j = 1, 2, ... calling visit(d_j) until it
// returns false.
template <typename Visit>
void ForEachDurableTime(const Effective& e, int interval, Visit visit) {
  const double work = interval * e.step_s;
  std::deque<double> inflight;  // durable times of the last N admissions
  double resume = 0;            // when training resumes after the previous checkpoint
  for (;;) {
    const double request = resume + work;
    double admit = request;
    if (static_cast<int>(inflight.size()) >= e.max_in_flight) {
      admit = std::max(admit, inflight[inflight.size() - e.max_in_flight]);
    }
    const double durable = admit + e.durable_after_s;
    inflight.push_back(durable);
    if (static_cast<int>(inflight.size()) > e.max_in_flight) inflight.pop_front();
    resume = admit + e.stall_s;
    if (!visit(durable)) return;
  }
}

}  // namespace

double CheckpointPeriod(const SchemeSpec& spec, int interval) {
  const Effective e = EffectiveOf(spec);
  if (!e.checkpoints) return interval * e.step_s;
  return std::max(interval * e.step_s + e.stall_s, e.durable_after_s / e.max_in_flight);
}

double ExpectedGoodputExponential(const SchemeSpec& spec, int interval, double mtbf_s) {
  const Effective e = EffectiveOf(spec);
  const double lambda = 1.0 / mtbf_s;
  // A restart of length R completes only if no failure hits it; each failure
  // starts it over. Memorylessness gives E[time to get through] = (e^{lR} - 1)/l.
  const double restart = std::expm1(lambda * e.restart_s) / lambda;
  const double cycle = restart + mtbf_s;
  double gain = 0;  // E[durable steps gained before the run's failure]
  if (e.every_step_durable) {
    // Step k counts iff the failure comes after k*T: sum_k e^{-l k T}.
    const double q = std::exp(-lambda * e.step_s);
    gain = q / (1 - q);
  } else if (e.checkpoints) {
    ForEachDurableTime(e, interval, [&](double d) {
      const double p = std::exp(-lambda * d);
      gain += interval * p;
      return lambda * d < 60;  // the rest of the series is below e^-60 of its head
    });
  }
  return gain / cycle;
}

double FirstOrderGoodput(const SchemeSpec& spec, int interval, double failures_per_s) {
  const Effective e = EffectiveOf(spec);
  if (e.every_step_durable) {
    // Lost: the restart and on average half a step.
    return (1 / e.step_s) * (1 - failures_per_s * (e.restart_s + e.step_s / 2));
  }
  if (!e.checkpoints) return 0;  // every failure loses everything: no first-order form
  const double period = CheckpointPeriod(spec, interval);
  // In steady state each request waits period - (f*T + stall) for a slot; the
  // progress point of the newest durable checkpoint is then wait + W + U(0, P) old.
  const double wait = period - (interval * e.step_s + e.stall_s);
  const double lost = e.restart_s + wait + e.durable_after_s + period / 2;
  return (interval / period) * (1 - failures_per_s * lost);
}

double PccheckArtifactGoodput(const SchemeSpec& spec, int interval, int64_t failures,
                              double horizon_s) {
  const Effective e = EffectiveOf(spec);
  const double T = e.step_s;
  if (!e.checkpoints && !e.every_step_durable) return 0;
  // The artifact's redo time per failure, by scheme: CheckFreq loses a whole
  // interval, GPM (sync) half of one, PCcheck half of one plus half of the
  // persist time; its "Ideal" loses half an interval (ours checkpoints every step).
  double redo = e.restart_s;
  double iter_time = T;  // the measured time per iteration with checkpoints
  if (e.every_step_durable) {
    redo += T / 2;
  } else {
    iter_time = CheckpointPeriod(spec, interval) / interval;
    if (spec.kind == SchemeKind::kSingle) {
      redo += interval * T;
    } else if (spec.kind == SchemeKind::kSync) {
      redo += interval * T / 2;
    } else {
      const double in_flight_steps = static_cast<double>(interval) * e.max_in_flight;
      redo += interval * T / 2 + T * std::min(e.durable_after_s / T, in_flight_steps) / 2;
    }
  }
  const double seen = (horizon_s - static_cast<double>(failures) * redo) / iter_time;
  return std::max(0.0, seen / horizon_s);
}

double YoungDalyIntervalSteps(double checkpoint_cost_s, double step_s, double failures_per_s) {
  if (!(failures_per_s > 0)) return kInf;
  return std::sqrt(2 * checkpoint_cost_s / (failures_per_s * step_s * step_s));
}

}  // namespace nonstop
