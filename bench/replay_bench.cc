// Replay throughput of the CPU optimizer (AdamW) against a STREAM-like triad
// measured in the same run, on the same buffers' sizes and thread counts.
//
//   replay_bench [--mib-per-array N] [--steps K] [--reps R] [--json PATH]
//
// Bytes counted for one AdamW step: param, grad, exp_avg, exp_avg_sq read and
// param, exp_avg, exp_avg_sq written: 7 * 4 bytes per element. The triad
// a = b + s * c counts 3 * 4 bytes per element, as STREAM does (no
// write-allocate traffic). "blocked" replays K steps one cache block at a
// time, so the state crosses memory once per K steps; its GB/s is the logical
// per-step byte count (7 * 4 * K per element) over the time, i.e. what a
// step-by-step replay would need to reach to be as fast.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "nonstop/optim.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void Triad(float* a, const float* b, const float* c, float s, size_t n, int threads) {
  auto run = [=](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
  };
  const size_t per = (n + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) {
    workers.emplace_back(run, std::min(n, t * per), std::min(n, (t + 1) * per));
  }
  run(0, std::min(n, per));
  for (auto& w : workers) w.join();
}

struct Row {
  std::string name;
  int threads;
  double seconds;  // best of reps
  double bytes;
  double gbps() const { return bytes / seconds / 1e9; }
};

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 64;
  int steps = 7;
  int reps = 7;
  std::string json_path = "replay_bench.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mib-per-array") {
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--steps") {
      steps = std::atoi(argv[i + 1]);
    } else if (flag == "--reps") {
      reps = std::atoi(argv[i + 1]);
    } else if (flag == "--json") {
      json_path = argv[i + 1];
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const size_t n = mib * (1u << 20) / sizeof(float);
  // Touch everything up front: first-touch page faults are not bandwidth.
  std::vector<float> param(n, 0.5f), exp_avg(n, 0.01f), exp_avg_sq(n, 1e-4f);
  std::vector<std::vector<float>> grads(steps, std::vector<float>(n));
  for (int k = 0; k < steps; ++k)
    for (size_t i = 0; i < n; ++i) grads[k][i] = 1e-3f * static_cast<float>((i + k) % 97) - 0.05f;
  std::vector<float> ta(n, 0.0f), tb(n, 1.0f), tc(n, 2.0f);

  nonstop::optim::OptimizerConfig config;  // AdamW, torch 2.13 arithmetic
  std::vector<nonstop::optim::StepRecord> log(steps);
  for (int k = 0; k < steps; ++k) {
    log[k].hyper.lr = 1e-4;
    log[k].hyper.weight_decay = 0.01;
    log[k].grad.data = grads[k].data();
  }
  nonstop::optim::PartState state;
  state.numel = n;
  state.param = param.data();
  state.exp_avg = exp_avg.data();
  state.exp_avg_sq = exp_avg_sq.data();
  state.step = 100;

  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> thread_counts{1};
  if (hw > 1) thread_counts.push_back(hw);

  std::vector<Row> rows;
  for (int threads : thread_counts) {
    // Interleave the three measurements rep by rep (noise hits all alike).
    double triad = 1e30, step1 = 1e30, blocked = 1e30;
    for (int r = 0; r < reps; ++r) {
      auto t0 = Clock::now();
      Triad(ta.data(), tb.data(), tc.data(), 3.0f, n, threads);
      auto t1 = Clock::now();
      triad = std::min(triad, Seconds(t0, t1));

      t0 = Clock::now();
      nonstop::Status st = nonstop::optim::Replay(
          config, std::span(log.data(), 1), &state,
          {.num_threads = threads, .block_elements = 0});
      t1 = Clock::now();
      if (!st.ok()) {
        std::fprintf(stderr, "replay: %s\n", st.ToString().c_str());
        return 1;
      }
      step1 = std::min(step1, Seconds(t0, t1));

      t0 = Clock::now();
      st = nonstop::optim::Replay(config, log, &state,
                                  {.num_threads = threads, .block_elements = 8192});
      t1 = Clock::now();
      if (!st.ok()) return 1;
      blocked = std::min(blocked, Seconds(t0, t1));
    }
    const double e = static_cast<double>(n);
    rows.push_back({"triad", threads, triad, 12.0 * e});
    rows.push_back({"adamw_step", threads, step1, 28.0 * e});
    rows.push_back({"adamw_blocked_x" + std::to_string(steps), threads, blocked,
                    28.0 * e * steps});
  }

  std::printf("AdamW replay vs STREAM triad, %zu MiB per array (%zu elements), kernels: %s,"
              " best of %d\n",
              mib, n, nonstop::optim::KernelIsa().c_str(), reps);
  std::printf("%-20s %8s %12s %10s %12s\n", "kernel", "threads", "time_ms", "GB/s", "vs triad");
  for (const Row& row : rows) {
    double triad_gbps = 0;
    for (const Row& t : rows)
      if (t.name == "triad" && t.threads == row.threads) triad_gbps = t.gbps();
    std::printf("%-20s %8d %12.3f %10.2f %11.2fx\n", row.name.c_str(), row.threads,
                row.seconds * 1e3, row.gbps(), row.gbps() / triad_gbps);
  }

  std::ofstream json(json_path);
  json << "{\n  \"benchmark\": \"replay_bench\",\n  \"isa\": \"" << nonstop::optim::KernelIsa()
       << "\",\n  \"mib_per_array\": " << mib << ",\n  \"elements\": " << n
       << ",\n  \"steps\": " << steps << ",\n  \"reps\": " << reps << ",\n  \"rows\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    json << "    {\"kernel\": \"" << r.name << "\", \"threads\": " << r.threads
         << ", \"seconds\": " << r.seconds << ", \"bytes\": " << r.bytes
         << ", \"gbps\": " << r.gbps() << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
}
