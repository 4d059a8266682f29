// Goodput simulation: how many useful training steps per second a checkpoint
// scheme delivers on a cluster that fails.
//
// The simulator replays each scheme's real timeline: every checkpoint is
// requested at a step boundary, may wait for a free in-flight slot, stalls the
// training thread for its visible copy, and becomes durable some time later. A
// failure rolls the job back to the newest checkpoint that was durable *at
// that instant* (not a closed-form average), pays the restart cost and goes on.
// docs/SIMULATE.md describes the model, its assumptions and its defaults.
//
// Also here: the closed forms the simulator is checked against (an exact
// renewal-reward expectation for exponential failures, a first-order model,
// PCcheck's artifact formula) and the Young/Daly interval for the tuner.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/status.h"

namespace nonstop {

// How a scheme checkpoints. The kind fixes what the parameters mean:
//   kNone        never checkpoints; a failure loses everything since the start.
//   kSync        blocks training until the checkpoint is durable (torch.save-like):
//                the stall is the whole persist time.
//   kSingle      one checkpoint in flight (CheckFreq-like): a new one waits,
//                stalled, until the previous one is durable.
//   kConcurrent  up to max_in_flight in flight (PCcheck).
//   kLayerwise   as kConcurrent, with the smaller stall of a per-layer copy (LightCheck).
//   kMultistep   as kConcurrent, with the copy spread over steps (GoCkpt).
//   kIdeal       zero overhead and zero loss: every completed step is durable at
//                once; only the restart cost is paid. Ignores the interval.
enum class SchemeKind { kNone, kSync, kSingle, kConcurrent, kLayerwise, kMultistep, kIdeal };

std::string_view SchemeKindName(SchemeKind kind);
// Accepts the names above ("none", "sync", ...); also a name that starts with one
// of them followed by a non-letter ("concurrent-n4", "single_cf"). False if unknown.
bool ParseSchemeKind(std::string_view name, SchemeKind* kind);

// One scheme as the simulator sees it. Times in seconds.
struct SchemeSpec {
  std::string name;                       // shown in tables; unique per run
  SchemeKind kind = SchemeKind::kConcurrent;
  double step_s = 0.0;                    // T: one training step with no checkpoint
  double stall_s = 0.0;                   // visible stall per checkpoint (copy to staging)
  double persist_s = 0.0;                 // admission to durable, for one checkpoint
  int max_in_flight = 1;                  // N
  double restart_s = 0.0;                 // after a failure: reload and resume
  // Intervals (steps) this description holds for. Empty: any interval of the
  // sweep. Bench rows are measured at one interval each and set it.
  std::vector<int> intervals;
};

// Checks ranges (positive step, non-negative times, N >= 1) and the kind's rules.
Status ValidateScheme(const SchemeSpec& spec);

// Failure instants within [0, horizon_s), ascending, seconds from the start.
struct FailureTrace {
  std::vector<double> times_s;
  double horizon_s = 0.0;
  std::string source;  // "trace FILE" or "exponential mtbf=... seed=..."
};

struct TraceOptions {
  // 0: every change in the GPU count is one failure, at the sample's time.
  // G > 0: floor(|change| / G) failures (PCcheck's artifact uses G = 4, one VM),
  // spread evenly over the sampling interval that ends at the sample, since the
  // trace only says that they happened somewhere in it. A change smaller than G
  // then counts no failure, as in the artifact.
  int gpus_per_failure = 0;
};

// Parses an availability trace: CSV with the header ",Time,GPUs" (row index,
// Unix time in seconds, GPUs available). Times must increase. The horizon is
// last time - first time. The first row is the starting allocation, not a failure.
Result<FailureTrace> ParseAvailabilityTrace(std::istream& in, const TraceOptions& options,
                                            const std::string& name = "trace");
Result<FailureTrace> LoadAvailabilityTrace(const std::string& path, const TraceOptions& options);

// Poisson failures with mean time between failures mtbf_s over horizon_s. The
// same seed gives the same failures on every platform (mt19937_64 + inversion).
Result<FailureTrace> ExponentialFailures(double mtbf_s, double horizon_s, uint64_t seed);

// What one scheme at one interval achieved over the horizon.
struct SimResult {
  std::string scheme;
  SchemeKind kind = SchemeKind::kNone;
  int interval = 0;
  double goodput_steps_per_s = 0.0;  // useful_steps / horizon
  int64_t useful_steps = 0;          // progress when the horizon ends
  int64_t lost_steps = 0;            // completed steps thrown away by rollbacks
  int64_t failures = 0;
  int64_t checkpoints = 0;           // admitted (started)
  int64_t durable_checkpoints = 0;   // became durable before a failure or the end
  double stall_s = 0.0;              // training blocked: slot waits + visible stalls
  double restart_s = 0.0;            // time spent restarting
  double horizon_s = 0.0;
};

// Replays one scheme at interval f (steps) against the failures.
Result<SimResult> SimulateScheme(const SchemeSpec& spec, int interval, const FailureTrace& trace);

// Every scheme at every interval it applies to (spec.intervals, or else
// `intervals`). kIdeal and kNone run once per interval too so that tables line up.
Result<std::vector<SimResult>> Simulate(const std::vector<SchemeSpec>& specs,
                                        const std::vector<int>& intervals,
                                        const FailureTrace& trace);

// Defaults modelled on PCcheck's VGG16 / A100 setup (its artifact's Fig. 8
// throughputs and logs, Fig. 9 load time); docs/SIMULATE.md derives each number.
std::vector<SchemeSpec> PccheckLikeSchemes();

// One row of `nonstop bench ... --json` as far as the simulator needs it.
// Fields that were absent are 0, or -1 for persist_ms.
struct BenchRow {
  std::string scheme;
  int interval = 0;
  int max_in_flight = 1;
  double steps_per_s = 0.0;
  double stall_ms_mean = 0.0;
  double persist_ms = -1.0;  // < 0: not measured
};

// Turns bench rows into scheme descriptions, one per (scheme, interval). The step
// time T comes from the "none" row (or step_s_fallback > 0). When a row has no
// persist time it is inferred as N x (measured time per checkpoint period), the
// largest persist time consistent with the measured throughput: pessimistic.
// Adds an "ideal" scheme if none is present.
Result<std::vector<SchemeSpec>> SchemesFromBench(const std::vector<BenchRow>& rows,
                                                 double restart_s, double step_s_fallback);

// ---- Closed forms -------------------------------------------------------

// Exact long-run goodput of SimulateScheme under Poisson failures (renewal-
// reward): E[durable progress gained per cycle] / E[cycle length], where a cycle
// is one restart (repeated if a failure hits it) plus the run until the next
// failure. Uses the failure-free schedule of durable times d_j, so it is exact
// in the limit of a long horizon, queueing included.
double ExpectedGoodputExponential(const SchemeSpec& spec, int interval, double mtbf_s);

// The failure-free period between checkpoints: max(f*T + stall, W/N) with W =
// max(stall, persist) (sync: f*T + persist).
double CheckpointPeriod(const SchemeSpec& spec, int interval);

// First-order (rare failures) model, PCcheck §5.2.3 style but with the lost wall
// time a durable-at-the-instant rollback really costs: R + W + queue wait + P/2.
// goodput = (f/P) * (1 - rate * lost_wall_time).
double FirstOrderGoodput(const SchemeSpec& spec, int interval, double failures_per_s);

// PCcheck's artifact formula (run_goodput_model.py): redo time per failure =
// R + f*T/2 (+ min(Tw, f*N*T)/2 for concurrent), goodput = (H - n*redo)/(P/f)/H.
// It counts half the persist time where a rollback loses all of it.
double PccheckArtifactGoodput(const SchemeSpec& spec, int interval, int64_t failures,
                              double horizon_s);

// Young/Daly optimal interval in steps, N* = sqrt(2*C / (p * T^2)) (GoCkpt §3.1),
// with C the checkpoint cost in seconds (the visible stall for an asynchronous
// scheme), p the failure rate per second and T the step time. +inf when p == 0.
double YoungDalyIntervalSteps(double checkpoint_cost_s, double step_s, double failures_per_s);

}  // namespace nonstop
