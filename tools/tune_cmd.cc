// `nonstop tune`: measures this machine and a checkpoint directory, then
// recommends N, p, b, c and the checkpoint interval (docs/TUNE.md). The
// measurements and the rules live in src/tune/tune.cc; this file parses
// options, prints the table or JSON, and writes the config file that
// nonstop.Checkpointer(config=PATH) reads.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "nonstop/tune.h"
#include "tools/commands.h"

namespace nonstop::cli {
namespace {

using nlohmann::json;

struct TuneArgs {
  TuneOptions opts;
  double step_ms = 0;
  std::string medium = "auto";
  bool quick = false;
  bool json_out = false;
  std::string out;
};

json ToJson(const TuneOptions& o, const TuneMeasurements& m, const TuneRecommendation& r,
            const std::string& medium) {
  json copy = json::array(), write = json::array(), persist = json::array();
  for (const CopyPoint& c : m.copy) {
    copy.push_back({{"chunk_bytes", c.chunk_bytes}, {"GBps", c.GBps}});
  }
  for (const WritePoint& w : m.write) write.push_back({{"writers", w.writers}, {"GBps", w.GBps}});
  for (const PersistPoint& p : m.persist) {
    persist.push_back({{"max_in_flight", p.max_in_flight}, {"checkpoints", p.checkpoints},
                       {"tw_s", p.tw_s}, {"tw_per_n_s", p.tw_s / p.max_in_flight},
                       {"period_s", p.period_s}});
  }
  json j = {
      {"max_in_flight", r.max_in_flight},
      {"writers", r.writers},
      {"chunk_bytes", r.chunk_bytes},
      {"chunks", r.chunks},
      {"staging_bytes", r.staging_bytes},
      {"interval", r.interval},
      {"interval_rule", r.interval_rule},
      {"interval_reason", r.interval_reason},
      {"interval_overhead", r.interval_overhead},
      {"interval_no_queue", r.interval_no_queue},
      {"expected_overhead", r.expected_overhead},
      {"medium", medium},
      {"tw_s", r.tw_s},
      {"tw_per_n_s", r.tw_per_n_s},
      {"stall_s", r.stall_s},
      {"copy_GBps", r.copy_GBps},
      {"write_GBps", r.write_GBps},
      {"restart_s", r.restart_s},
      {"tw_scaled_from_probe", r.scaled},
      {"notes", r.notes},
      {"inputs",
       {{"dir", o.dir},
        {"state_bytes", o.state_bytes},
        {"step_s", o.step_s},
        {"max_overhead", o.max_overhead},
        {"mtbf_s", o.mtbf_s},
        {"memory_bytes", o.memory_bytes},
        {"storage_bytes", o.storage_bytes},
        {"max_in_flight_cap", o.max_in_flight_cap}}},
      {"measured",
       {{"copy_engine", m.copy_engine},
        {"device_to_host", m.device_to_host},
        {"medium", m.medium},
        {"probe_bytes", m.probe_bytes},
        {"free_bytes", m.free_bytes},
        {"ram_bytes", m.ram_bytes},
        {"copy", copy},
        {"write", write},
        {"persist", persist},
        {"read_GBps", m.read_GBps},
        {"seconds", m.seconds}}},
  };
  if (o.mtbf_s > 0) {
    j["young_daly_interval"] = r.young_daly_interval;
    j["goodput_at_interval"] = r.goodput_at_interval;
    j["goodput_at_overhead_interval"] = r.goodput_at_overhead_interval;
    j["goodput_at_young_daly"] = r.goodput_at_young_daly;
  } else {
    j["young_daly_interval"] = nullptr;
  }
  return j;
}

void PrintTable(const TuneOptions& o, const TuneMeasurements& m, const TuneRecommendation& r) {
  const double mib = 1 << 20;
  std::printf("measured in %.1f s on %s (probe checkpoints of %.0f MiB)\n", m.seconds,
              o.dir.c_str(), m.probe_bytes / mib);
  std::printf("copy      %s%s\n", m.copy_engine.c_str(),
              m.device_to_host ? " (device to host)" : " (host to host)");
  for (const CopyPoint& c : m.copy) {
    std::printf("          chunk %8.2f MiB  %7.2f GB/s%s\n", c.chunk_bytes / mib, c.GBps,
                c.chunk_bytes == r.chunk_bytes ? "  <- b" : "");
  }
  std::printf("write     %s\n", m.medium.c_str());
  for (const WritePoint& w : m.write) {
    std::printf("          %2d writer(s)       %7.2f GB/s%s\n", w.writers, w.GBps,
                w.writers == r.writers ? "  <- p" : "");
  }
  std::printf("persist   N  T_w (s)  T_w/N (s)   [probe size, N started together]\n");
  for (const PersistPoint& p : m.persist) {
    std::printf("          %d  %7.3f  %9.3f%s\n", p.max_in_flight, p.tw_s,
                p.tw_s / p.max_in_flight, p.max_in_flight == r.max_in_flight ? "  <- N*" : "");
  }
  std::printf("read      %.2f GB/s\n\n", m.read_GBps);
  std::printf("recommendation for %.0f MiB of state, %.1f ms per step, overhead <= %.1f %%\n",
              o.state_bytes / mib, o.step_s * 1e3, o.max_overhead * 100);
  std::printf("  max_in_flight N*  %d\n", r.max_in_flight);
  std::printf("  writers p         %d\n", r.writers);
  std::printf("  chunk_bytes b     %llu (%.2f MiB)\n",
              static_cast<unsigned long long>(r.chunk_bytes), r.chunk_bytes / mib);
  std::printf("  chunks c          %llu (staging %.0f MiB)\n",
              static_cast<unsigned long long>(r.chunks), r.staging_bytes / mib);
  std::printf("  T_w at N*         %.3f s%s; T_w/N* = %.3f s; predicted stall %.3f s\n", r.tw_s,
              r.scaled ? " (scaled from the probe)" : "", r.tw_per_n_s, r.stall_s);
  std::printf("  overhead bound    f* = ceil(T_w / (N* q t)) = %d steps\n", r.interval_overhead);
  std::printf("  no-queue bound    ceil(T_w / (N* t)) = %d steps\n", r.interval_no_queue);
  if (o.mtbf_s > 0) {
    std::printf("  Young/Daly        %.1f steps (MTBF %.0f s, C = %.3f s)\n", r.young_daly_interval,
                o.mtbf_s, std::max(r.tw_per_n_s, r.stall_s));
  }
  std::printf("  interval          %d steps (expected overhead %.2f %%)\n", r.interval,
              r.expected_overhead * 100);
  std::printf("  why               %s\n", r.interval_reason.c_str());
  for (const std::string& n : r.notes) std::printf("  note              %s\n", n.c_str());
}

void Run(TuneArgs& a) {
  a.opts.step_s = a.step_ms / 1e3;
  if (!ParseMediumKind(a.medium, &a.opts.medium)) {
    std::cerr << "nonstop tune: unknown medium '" << a.medium
              << "'; use auto, buffered, direct, uring, mmap or pmem\n";
    throw CLI::RuntimeError(2);
  }
  if (a.quick) {
    a.opts.probe_cap_bytes = std::min<uint64_t>(a.opts.probe_cap_bytes, 32u << 20);
    a.opts.chunk_sizes = {1u << 20, 4u << 20, 16u << 20};
    a.opts.writer_counts = {1, 2, 4};
    a.opts.repeat = 1;
  }
  const bool quiet = a.json_out;
  auto progress = [quiet](const std::string& line) {
    if (!quiet) std::fprintf(stderr, "tune: %s\n", line.c_str());
  };
  Result<TuneMeasurements> m = MeasureForTune(a.opts, progress);
  if (!m.ok()) {
    std::cerr << "nonstop tune: " << m.status().message() << "\n";
    throw CLI::RuntimeError(1);
  }
  Result<TuneRecommendation> r = Recommend(a.opts, m.value());
  if (!r.ok()) {
    std::cerr << "nonstop tune: " << r.status().message() << "\n";
    throw CLI::RuntimeError(1);
  }
  const json j = ToJson(a.opts, m.value(), r.value(), a.medium);
  if (!a.out.empty()) {
    // The file nonstop.Checkpointer(config=PATH) reads: its own argument
    // names, plus everything tune saw, for the record.
    json config = {{"format", "nonstop.config/1"},
                   {"every", r->interval},
                   {"max_in_flight", r->max_in_flight},
                   {"writers", r->writers},
                   {"chunk_bytes", r->chunk_bytes},
                   {"staging_bytes", r->staging_bytes},
                   {"medium", a.medium},
                   {"tune", j}};
    std::ofstream f(a.out);
    f << config.dump(2) << "\n";
    f.close();
    if (!f) {
      std::cerr << "nonstop tune: cannot write " << a.out << "\n";
      throw CLI::RuntimeError(1);
    }
  }
  if (a.json_out) {
    std::cout << j.dump() << "\n";
  } else {
    PrintTable(a.opts, m.value(), r.value());
    if (!a.out.empty()) std::printf("\nwrote %s (nonstop.Checkpointer(..., config=PATH))\n",
                                    a.out.c_str());
  }
}

}  // namespace

void AddTuneCommand(CLI::App& app) {
  auto a = std::make_shared<TuneArgs>();
  CLI::App* tune = app.add_subcommand(
      "tune", "measure copy/write bandwidth and T_w here; recommend N, p, b, c and the interval");
  tune->add_option("--dir", a->opts.dir, "checkpoint directory to measure")->required();
  tune->add_option("--state-bytes", a->opts.state_bytes, "bytes per checkpoint (e.g. 1GiB)")
      ->required()
      ->transform(CLI::AsSizeValue(false));
  tune->add_option("--step-ms", a->step_ms, "one training step without checkpoints, ms")
      ->required();
  tune->add_option("--max-overhead", a->opts.max_overhead,
                   "target overhead q as a fraction (default 0.03)");
  tune->add_option("--mtbf", a->opts.mtbf_s, "mean time between failures, s: adds Young/Daly");
  tune->add_option("--restart-s", a->opts.restart_s,
                   "restart cost for the goodput model (default: state / read bandwidth)");
  tune->add_option("--memory", a->opts.memory_bytes,
                   "staging memory limit M (default min(state, 1 GiB, RAM/4))")
      ->transform(CLI::AsSizeValue(false));
  tune->add_option("--storage", a->opts.storage_bytes,
                   "storage budget S (default: free space in --dir)")
      ->transform(CLI::AsSizeValue(false));
  tune->add_option("--max-in-flight-cap", a->opts.max_in_flight_cap,
                   "largest N to measure (default 4)");
  tune->add_option("--probe-bytes", a->opts.probe_cap_bytes,
                   "largest probe checkpoint (default 256MiB; larger states are scaled)")
      ->transform(CLI::AsSizeValue(false));
  tune->add_option("--medium", a->medium, "auto, buffered, direct, uring, mmap, pmem");
  tune->add_flag("--quick", a->quick, "32 MiB probes, fewer chunk sizes and writer counts");
  tune->add_flag("--json", a->json_out, "print one JSON object");
  tune->add_option("--out", a->out, "write a config file for nonstop.Checkpointer(config=...)");
  tune->callback([a] { Run(*a); });
}

}  // namespace nonstop::cli
