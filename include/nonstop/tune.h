// Tuning: measures this machine and a checkpoint directory, then picks the
// engine's configuration and a checkpoint interval (PCcheck §3.4, with
// Young/Daly from GoCkpt §3.1 when a failure rate is known). docs/TUNE.md
// explains the measurements, the choices and their limits.
//
// The work is split so that the choices can be tested without a disk:
// MeasureForTune() runs the measurements (seconds, writing probe checkpoints
// of at most `probe_cap_bytes` into the directory and deleting them), and
// Recommend() turns measurements into a configuration. The Choose* helpers are
// the individual rules, also used by MeasureForTune() between its stages
// (the write sweep uses the chosen chunk size, the in-flight sweep the chosen
// writer count).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nonstop/medium.h"
#include "nonstop/status.h"

namespace nonstop {

struct TuneOptions {
  std::string dir;              // checkpoint directory to measure (created if missing)
  uint64_t state_bytes = 0;     // m: bytes of one checkpoint of this rank
  double step_s = 0;            // t: one training step without checkpoints
  double max_overhead = 0.03;   // q: target fraction of training time spent on checkpoints
  double mtbf_s = 0;            // mean time between failures; 0 = unknown
  double restart_s = -1;        // R for the goodput model; < 0: state / measured read bandwidth
  uint64_t memory_bytes = 0;    // M: staging memory limit; 0 = min(m, 1 GiB, RAM / 4)
  uint64_t storage_bytes = 0;   // S: storage budget; 0 = free space of the directory
  int max_in_flight_cap = 4;    // N is measured for 1 .. min(cap, S/m - 1)
  uint64_t probe_cap_bytes = 256ull << 20;  // largest probe checkpoint written
  std::vector<uint64_t> chunk_sizes = {256u << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20};
  std::vector<int> writer_counts = {1, 2, 4, 8};
  int repeat = 2;               // probe checkpoints per writer count (the best one counts)
  MediumKind medium = MediumKind::kAuto;
};

struct CopyPoint {
  uint64_t chunk_bytes = 0;
  double GBps = 0;              // best of the repeats
};

struct WritePoint {
  int writers = 0;
  double GBps = 0;              // probe bytes / (start -> committed), best of the repeats
};

struct PersistPoint {
  int max_in_flight = 0;        // N
  int checkpoints = 0;          // measured: rounds of N started back to back
  // T_w: median over rounds of the time from the first of N checkpoints
  // started together to all N committed (probe size): the time to persist a
  // checkpoint while N are in flight and share the medium.
  double tw_s = 0;
  double period_s = 0;          // T_w / N: time per checkpoint at that concurrency
};

struct TuneMeasurements {
  std::string copy_engine;      // CopyEngine::Describe()
  bool device_to_host = false;  // true when the copy was measured from GPU memory
  std::string medium;           // Medium::Describe() of the probe engine
  uint64_t probe_bytes = 0;     // size of the probe checkpoints (<= state and cap)
  uint64_t free_bytes = 0;      // free space in the directory's file system
  uint64_t ram_bytes = 0;       // physical memory
  std::vector<CopyPoint> copy;        // per chunk size
  std::vector<WritePoint> write;      // per writer count, with the chosen chunk size
  std::vector<PersistPoint> persist;  // per N, with the chosen chunk size and writers
  double read_GBps = 0;         // restore of the probe checkpoint
  double seconds = 0;           // time spent measuring
};

struct TuneRecommendation {
  int max_in_flight = 1;        // N*: minimises T_w / N
  int writers = 1;              // p
  uint64_t chunk_bytes = 0;     // b: smallest that reaches 90 % of the best copy bandwidth
  uint64_t chunks = 0;          // c = M / b
  uint64_t staging_bytes = 0;   // c * b
  double copy_GBps = 0;         // at b
  double write_GBps = 0;        // at p
  double tw_s = 0;              // T_w at N*, scaled to the state size
  double tw_per_n_s = 0;        // T_w / N*
  double stall_s = 0;           // predicted visible stall per checkpoint
  // PCcheck eq. 3: f* = ceil(T_w / (N* q t)), the shortest interval whose
  // persisting keeps within the overhead budget q (at least the interval the
  // predicted stall allows, ceil(stall / (q t))).
  int interval_overhead = 1;
  // ceil(T_w / (N* t)): shorter intervals queue behind the N* in flight.
  int interval_no_queue = 1;
  double young_daly_interval = 0;  // steps, sqrt(2 C / (lambda t^2)) with C = T_w / N*; 0 w/o MTBF
  int interval = 1;             // the one to use
  std::string interval_rule;    // "overhead", "young-daly"
  std::string interval_reason;  // one sentence: which and why
  double expected_overhead = 0; // charged cost / (interval t) at `interval`
  // With an MTBF: expected goodput (fraction of the failure-free step rate)
  // from the exact exponential-failure model of simulate.h.
  double goodput_at_overhead_interval = 0;
  double goodput_at_young_daly = 0;
  double goodput_at_interval = 0;
  double restart_s = 0;         // R used for the model
  bool scaled = false;          // T_w measured at probe size and scaled linearly to m
  std::vector<std::string> notes;
};

// Smallest chunk size whose copy bandwidth is within 10 % of the best one.
uint64_t ChooseChunkBytes(const std::vector<CopyPoint>& copy);
// Fewest writers whose bandwidth is within 5 % of the best one.
int ChooseWriters(const std::vector<WritePoint>& write);
// N minimising T_w / N; an N within 5 % of the minimum with fewer in flight
// wins (fewer slots, and a shorter T_w loses less work per failure).
int ChooseMaxInFlight(const std::vector<PersistPoint>& persist);
// The largest N the storage budget allows: S / m - 1 slots in flight (one
// more slot keeps the newest committed checkpoint), capped; at least 1.
int MaxInFlightForStorage(uint64_t storage_bytes, uint64_t state_bytes, int cap);
// The staging limit used when the caller gives none: min(m, 1 GiB, RAM / 4).
uint64_t DefaultMemoryBytes(uint64_t state_bytes, uint64_t ram_bytes);
// PCcheck eq. 3: ceil(T_w / (N q t)), at least 1.
int OverheadInterval(double tw_s, int max_in_flight, double max_overhead, double step_s);

// Validates the options and runs the measurements. `progress` (may be empty)
// gets one short line per stage.
Result<TuneMeasurements> MeasureForTune(const TuneOptions& opts,
                                        const std::function<void(const std::string&)>& progress);

// Turns measurements into a configuration (no I/O).
Result<TuneRecommendation> Recommend(const TuneOptions& opts, const TuneMeasurements& m);

}  // namespace nonstop
