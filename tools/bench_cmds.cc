// `nonstop bench storage` and `nonstop bench overhead`: programs that print a
// table (or one JSON object with --json), not timed unit tests.
//
// Both follow DESIGN.md "Measuring on a noisy machine": schemes are
// interleaved and repeated, medians are reported with their spread, and the
// `none` baseline runs at the start and at the end of every round so its
// drift is printed next to the ratios.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nonstop/engine.h"
#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "tools/commands.h"
#include "tools/remote_cli.h"

namespace nonstop::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Spread(const std::vector<double>& v) {
  if (v.empty()) return 0;
  auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return *hi - *lo;
}

// Page-aligned, pre-faulted memory standing in for the model state.
struct StateBuffer {
  explicit StateBuffer(uint64_t n) : bytes(n) {
    p = static_cast<uint8_t*>(mmap(nullptr, n, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (p == MAP_FAILED) {
      p = nullptr;
      return;
    }
    for (uint64_t i = 0; i < n; i += 8) {
      uint64_t v = i * 0x9E3779B97F4A7C15ull;
      std::memcpy(p + i, &v, std::min<uint64_t>(8, n - i));
    }
  }
  ~StateBuffer() {
    if (p) munmap(p, bytes);
  }
  // The "update": touches one word in every 4 KiB page, so every page changes
  // and a checkpoint must have copied it first, at a CPU cost that stays
  // small next to the simulated device compute.
  void Update(uint64_t step) {
    for (uint64_t i = 0; i + 8 <= bytes; i += 4096) std::memcpy(p + i, &step, 8);
  }
  std::vector<TensorRef> Refs() const {
    // A few tensors of mixed sizes, like a model: one big, the rest in pieces.
    std::vector<TensorRef> refs;
    uint64_t off = 0;
    int i = 0;
    while (off < bytes) {
      const uint64_t n = std::min<uint64_t>(bytes - off, i == 0 ? bytes / 2 + 1 : (64 << 20));
      TensorRef r;
      r.spec.name = "param." + std::to_string(i++);
      r.spec.dtype = DType::kUInt8;
      r.spec.shape = {static_cast<int64_t>(n)};
      r.spec.nbytes = n;
      r.data = p + off;
      refs.push_back(r);
      off += n;
    }
    return refs;
  }
  uint8_t* p = nullptr;
  uint64_t bytes = 0;
};

// Prints the error as one line; returns the exit code.
int Fail(const Status& s) {
  std::cerr << "nonstop bench: " << s.ToString() << "\n";
  return 1;
}

// ---- bench storage -----------------------------------------------------------

struct StorageArgs {
  std::string dir;
  uint64_t size = 1ull << 30;
  std::string medium = "auto";
  int writers = 0;
  uint64_t chunk = 0;
  uint64_t staging = 0;
  int repeat = 3;
  bool json = false;
};

int RunStorage(const StorageArgs& a) {
  EngineOptions o;
  o.dir = a.dir;
  o.writers = a.writers;
  o.chunk_bytes = a.chunk;
  o.staging_bytes = a.staging;
  o.max_in_flight = 1;
  if (!ParseMediumKind(a.medium, &o.medium)) {
    std::cerr << "nonstop bench storage: unknown medium '" << a.medium << "'\n";
    return 2;
  }
  StateBuffer state(a.size);
  if (state.p == nullptr) {
    std::cerr << "nonstop bench storage: cannot allocate " << a.size << " bytes\n";
    return 1;
  }
  fs::remove(fs::path(a.dir) / SlotFileName(0));
  auto opened = Engine::Open(o);
  if (!opened.ok()) return Fail(opened.status());
  auto engine = std::move(opened).value();
  if (Status s = engine->Register(state.Refs()); !s.ok()) return Fail(s);
  std::vector<double> w, r;
  for (int i = 0; i < a.repeat; ++i) {
    const auto t0 = Clock::now();
    auto c = engine->Checkpoint(i, "{}");
    if (!c.ok()) return Fail(c.status());
    if (Status s = engine->WaitCommitted(*c); !s.ok()) return Fail(s);
    w.push_back(a.size / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
    const auto t1 = Clock::now();
    auto info = engine->Restore();
    if (!info.ok()) return Fail(info.status());
    r.push_back(a.size / std::chrono::duration<double>(Clock::now() - t1).count() / 1e9);
  }
  EngineStats st = engine->Stats();
  (void)engine->Close();
  fs::remove(fs::path(a.dir) / SlotFileName(0));
  if (a.json) {
    json j = {{"bytes", a.size},         {"write_GBps", Median(w)}, {"read_GBps", Median(r)},
              {"write_GBps_all", w},     {"read_GBps_all", r},      {"medium", st.medium},
              {"writers", st.writers},   {"chunk_bytes", st.chunk_bytes},
              {"staging_bytes", st.staging_bytes}, {"copy_engine", st.copy_engine}};
    std::cout << j.dump() << "\n";
  } else {
    std::printf("medium   %s\n", st.medium.c_str());
    std::printf("size     %llu bytes, %d writers, chunk %llu, staging %llu, %d runs\n",
                static_cast<unsigned long long>(a.size), st.writers,
                static_cast<unsigned long long>(st.chunk_bytes),
                static_cast<unsigned long long>(st.staging_bytes), a.repeat);
    std::printf("write    %.2f GB/s (median; spread %.2f)\n", Median(w), Spread(w));
    std::printf("read     %.2f GB/s (median; spread %.2f)\n", Median(r), Spread(r));
  }
  return 0;
}

// ---- bench overhead ----------------------------------------------------------

struct OverheadArgs {
  std::string dir;
  double step_ms = 50;
  uint64_t state = 256ull << 20;
  std::vector<int> intervals = {1, 2, 5, 10};
  std::vector<int> in_flight = {1, 2, 3, 4};
  int steps = 40;
  int repeat = 3;
  std::string medium = "auto";
  int writers = 0;
  uint64_t staging = 0;
  uint64_t chunk = 0;
  std::vector<std::string> schemes = {"sync", "single", "gpm", "concurrent"};
  bool json = false;
};

struct Scheme {
  std::string name;  // none, sync, single, gpm, concurrent
  int max_in_flight = 0;
};

// GPM-like direct write and stall (GPM, ASPLOS '22, as PCcheck compares with
// it): no staging copy and no pipelining; the training thread stalls while the
// state is written straight from its own memory to the medium by `writers`
// threads, then synced. No checksums and no commit record: a baseline for
// speed, not a crash-consistent checkpoint.
Status WriteDirectAndSync(Medium& medium, const uint8_t* p, uint64_t bytes, int writers) {
  const uint64_t piece = 4u << 20;
  const uint64_t align = medium.Alignment();
  const uint64_t total = (bytes + align - 1) / align * align;  // the state is page-padded
  std::vector<Status> errors(std::max(1, writers));
  std::vector<std::thread> threads;
  for (int w = 0; w < static_cast<int>(errors.size()); ++w) {
    threads.emplace_back([&, w] {
      for (uint64_t off = w * piece; off < total; off += piece * errors.size()) {
        Status st = medium.Write(off, p + off, std::min(piece, total - off));
        if (!st.ok()) {
          errors[w] = st;
          return;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& st : errors) NONSTOP_RETURN_IF_ERROR(st);
  return medium.Sync();
}

struct RunResult {
  double steps_per_s = 0;
  double stall_ms_mean = 0;  // per checkpoint
  int checkpoints = 0;
};

// One synthetic training run: each step is `step_ms` of device compute (a
// sleep: the CPU stays free for the engine), then the update, then a
// checkpoint every `interval` steps.
Result<RunResult> RunLoop(const OverheadArgs& a, const Scheme& s, int interval, StateBuffer& st) {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Medium> direct;  // gpm
  const fs::path dir = fs::path(a.dir) / (s.name + std::to_string(s.max_in_flight));
  if (s.name == "gpm") {
    MediumKind kind;
    if (!ParseMediumKind(a.medium, &kind)) return Status::InvalidArgument("unknown medium");
    std::error_code ec;
    fs::create_directories(dir, ec);
    MediumOptions mo;
    mo.create = true;
    NONSTOP_ASSIGN_OR_RETURN(direct, OpenMedium((dir / "gpm.bin").string(), kind, mo));
    NONSTOP_RETURN_IF_ERROR(direct->Resize((st.bytes + 4095) / 4096 * 4096));
  } else if (s.name != "none") {
    EngineOptions o;
    o.dir = dir.string();
    o.max_in_flight = s.max_in_flight;
    // CheckFreq-like `single`: one checkpoint in flight, persisted by one thread.
    o.writers = s.name == "single" ? 1 : a.writers;
    o.staging_bytes = a.staging;
    o.chunk_bytes = a.chunk;
    if (!ParseMediumKind(a.medium, &o.medium)) return Status::InvalidArgument("unknown medium");
    NONSTOP_ASSIGN_OR_RETURN(engine, Engine::Open(o));
    NONSTOP_RETURN_IF_ERROR(engine->Register(st.Refs()));
  }
  const auto step = std::chrono::microseconds(static_cast<int64_t>(a.step_ms * 1000));
  double stall = 0;
  int ckpts = 0;
  const auto t0 = Clock::now();
  for (int i = 1; i <= a.steps; ++i) {
    std::this_thread::sleep_for(step);  // forward + backward on the device
    if (engine) {
      const auto w0 = Clock::now();
      NONSTOP_RETURN_IF_ERROR(engine->WaitCopied());  // before the update may modify the state
      stall += std::chrono::duration<double>(Clock::now() - w0).count();
    }
    st.Update(i);
    if (direct && i % interval == 0) {
      const auto c0 = Clock::now();
      const int writers = a.writers ? a.writers : 4;
      NONSTOP_RETURN_IF_ERROR(WriteDirectAndSync(*direct, st.p, st.bytes, writers));
      stall += std::chrono::duration<double>(Clock::now() - c0).count();
      ++ckpts;
    }
    if (engine && i % interval == 0) {
      const auto c0 = Clock::now();
      NONSTOP_ASSIGN_OR_RETURN(uint64_t c, engine->Checkpoint(i, "{}"));
      if (s.name == "sync") NONSTOP_RETURN_IF_ERROR(engine->WaitCommitted(c));
      stall += std::chrono::duration<double>(Clock::now() - c0).count();
      ++ckpts;
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  if (engine) {
    NONSTOP_RETURN_IF_ERROR(engine->WaitCommitted());
    NONSTOP_RETURN_IF_ERROR(engine->Close());
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  RunResult r;
  r.steps_per_s = a.steps / secs;
  r.checkpoints = ckpts;
  r.stall_ms_mean = ckpts ? stall * 1e3 / ckpts : 0;
  return r;
}

int RunOverhead(const OverheadArgs& a) {
  StateBuffer st(a.state);
  if (st.p == nullptr) {
    std::cerr << "nonstop bench overhead: cannot allocate " << a.state << " bytes\n";
    return 1;
  }
  std::vector<Scheme> schemes;
  for (const std::string& name : a.schemes) {
    if (name == "concurrent") {
      for (int n : a.in_flight) schemes.push_back({"concurrent", n});
    } else if (name == "sync" || name == "single" || name == "gpm") {
      schemes.push_back({name, 1});
    } else {
      std::cerr << "nonstop bench overhead: unknown scheme '" << name
                << "'; use sync, single, gpm, concurrent\n";
      return 2;
    }
  }
  // results[interval][scheme] over rounds, as ratios to that round's none.
  const size_t ni = a.intervals.size(), ns = schemes.size();
  std::vector<std::vector<std::vector<double>>> rel(ni, std::vector<std::vector<double>>(ns)),
      sps(ni, std::vector<std::vector<double>>(ns)), stall(ni, std::vector<std::vector<double>>(ns));
  std::vector<double> none_sps, drift;
  std::string medium;
  for (int round = 0; round < a.repeat; ++round) {
    auto first = RunLoop(a, {"none", 0}, 1, st);
    if (!first.ok()) return Fail(first.status());
    std::vector<std::vector<RunResult>> got(ni, std::vector<RunResult>(ns));
    for (size_t i = 0; i < ni; ++i) {
      for (size_t k = 0; k < ns; ++k) {
        auto r = RunLoop(a, schemes[k], a.intervals[i], st);
        if (!r.ok()) return Fail(r.status());
        got[i][k] = *r;
      }
    }
    auto last = RunLoop(a, {"none", 0}, 1, st);
    if (!last.ok()) return Fail(last.status());
    const double base = (first->steps_per_s + last->steps_per_s) / 2;
    none_sps.push_back(first->steps_per_s);
    none_sps.push_back(last->steps_per_s);
    drift.push_back((last->steps_per_s - first->steps_per_s) / first->steps_per_s);
    for (size_t i = 0; i < ni; ++i) {
      for (size_t k = 0; k < ns; ++k) {
        rel[i][k].push_back(got[i][k].steps_per_s / base);
        sps[i][k].push_back(got[i][k].steps_per_s);
        stall[i][k].push_back(got[i][k].stall_ms_mean);
      }
    }
    if (!a.json) {
      std::fprintf(stderr, "round %d/%d done (none %.2f -> %.2f steps/s)\n", round + 1, a.repeat,
                   first->steps_per_s, last->steps_per_s);
    }
  }
  {
    // Which medium `auto` picked, for the record.
    EngineOptions o;
    o.dir = (fs::path(a.dir) / "probe").string();
    (void)ParseMediumKind(a.medium, &o.medium);
    if (auto e = Engine::Open(o); e.ok()) {
      StateBuffer tiny(4096);
      if ((*e)->Register(tiny.Refs()).ok()) medium = (*e)->Stats().medium;
      (void)(*e)->Close();
    }
    std::error_code ec;
    fs::remove_all(o.dir, ec);
  }
  json rows = json::array();
  double max_drift = 0;
  for (double d : drift) max_drift = std::max(max_drift, std::abs(d));
  rows.push_back({{"scheme", "none"}, {"interval", 0}, {"max_in_flight", 0},
                  {"steps_per_s", Median(none_sps)}, {"relative", 1.0}, {"relative_spread", 0.0},
                  {"stall_ms_mean", 0.0}});
  for (size_t i = 0; i < ni; ++i) {
    for (size_t k = 0; k < ns; ++k) {
      rows.push_back({{"scheme", schemes[k].name}, {"interval", a.intervals[i]},
                      {"max_in_flight", schemes[k].max_in_flight},
                      {"steps_per_s", Median(sps[i][k])}, {"relative", Median(rel[i][k])},
                      {"relative_spread", Spread(rel[i][k])},
                      {"stall_ms_mean", Median(stall[i][k])}});
    }
  }
  if (a.json) {
    json j = {{"rows", rows},          {"step_ms", a.step_ms},   {"state_bytes", a.state},
              {"steps", a.steps},      {"repeat", a.repeat},     {"medium", medium},
              {"none_drift", drift},   {"none_drift_max", max_drift}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("state %llu bytes, step %.1f ms, %d steps per run, %d rounds, medium %s\n",
              static_cast<unsigned long long>(a.state), a.step_ms, a.steps, a.repeat,
              medium.c_str());
  std::printf("none baseline drift (end vs start of a round), max |drift| = %.1f%%\n",
              max_drift * 100);
  std::printf("%-12s %8s %5s %11s %9s %8s %10s\n", "scheme", "interval", "N", "steps/s",
              "relative", "spread", "stall ms");
  for (const auto& r : rows) {
    std::printf("%-12s %8d %5d %11.3f %9.3f %8.3f %10.2f\n",
                r["scheme"].get<std::string>().c_str(), r["interval"].get<int>(),
                r["max_in_flight"].get<int>(), r["steps_per_s"].get<double>(),
                r["relative"].get<double>(), r["relative_spread"].get<double>(),
                r["stall_ms_mean"].get<double>());
  }
  return 0;
}

// `nonstop bench [--quick] [suite options]` without a subcommand: the whole
// comparison matrix, bench/suite.py (it needs torch and matplotlib).
// Replaces this process with `PY SUITE [--quick] [options...]`: PY is
// $NONSTOP_PYTHON, else the `python` next to this executable (a virtual
// environment's bin/), else python3; SUITE is $NONSTOP_SOURCE/bench/suite.py,
// else ./bench/suite.py. docs/BENCHMARKS.md.
[[noreturn]] void RunSuite(bool quick, const std::vector<std::string>& extra) {
  const std::string python = PackagePython();
  const char* src = std::getenv("NONSTOP_SOURCE");
  const fs::path suite =
      fs::path(src != nullptr && *src != '\0' ? src : ".") / "bench" / "suite.py";
  if (!fs::exists(suite)) {
    std::fprintf(stderr,
                 "nonstop bench: %s not found; run it from the repository root or set "
                 "NONSTOP_SOURCE (or use `nonstop bench storage|overhead`)\n",
                 suite.c_str());
    std::exit(2);
  }
  std::vector<std::string> argv = {python, suite.string()};
  if (quick) argv.emplace_back("--quick");
  argv.insert(argv.end(), extra.begin(), extra.end());
  ExecArgv(argv);
  std::fprintf(stderr, "nonstop bench: cannot run %s: %s (set NONSTOP_PYTHON to a python with "
               "torch)\n", python.c_str(), std::strerror(errno));
  std::exit(2);
}

}  // namespace

void AddBenchCommands(CLI::App& app) {
  CLI::App* bench = app.add_subcommand(
      "bench",
      "measure checkpoint bandwidth and training overhead; without a subcommand: the whole "
      "benchmark suite (bench/suite.py, --quick < 5 min; other options pass through)");
  bench->require_subcommand(0, 1);
  auto quick = std::make_shared<bool>(false);
  bench->add_flag("--quick", *quick, "the suite's < 5 minute plan");
  bench->final_callback([bench, quick] {
    if (bench->get_subcommands().empty()) RunSuite(*quick, bench->remaining());
    if (!bench->remaining().empty()) {
      throw CLI::ExtrasError("bench " + bench->get_subcommands()[0]->get_name(),
                             bench->remaining());
    }
  });

  auto sa = std::make_shared<StorageArgs>();
  CLI::App* storage = bench->add_subcommand(
      "storage", "write one checkpoint of --size bytes and restore it: write/read GB/s");
  storage->add_option("--dir", sa->dir, "directory on the file system to measure")->required();
  storage->add_option("--size", sa->size, "checkpoint bytes, e.g. 64M or 1GiB (default 1 GiB)")
      ->transform(CLI::AsSizeValue(false));
  storage->add_option("--medium", sa->medium, "auto, buffered, direct, uring, mmap, pmem");
  storage->add_option("--writers", sa->writers, "writer threads (0 = engine default)");
  storage->add_option("--chunk", sa->chunk, "chunk bytes, e.g. 64M or 1GiB (0 = engine default)")
      ->transform(CLI::AsSizeValue(false));
  storage->add_option("--staging", sa->staging, "staging bound M in bytes, e.g. 64M or 1GiB (0 = engine default)")
      ->transform(CLI::AsSizeValue(false));
  storage->add_option("--repeat", sa->repeat, "runs; the median is reported (default 3)");
  storage->add_flag("--json", sa->json, "print one JSON object");
  storage->callback([sa] {
    if (int rc = RunStorage(*sa); rc != 0) throw CLI::RuntimeError(rc);
  });

  auto oa = std::make_shared<OverheadArgs>();
  CLI::App* overhead = bench->add_subcommand(
      "overhead", "synthetic training loop: none, sync, single, gpm, concurrent N=1..4");
  overhead->add_option("--dir", oa->dir, "directory for the checkpoints")->required();
  overhead->add_option("--step-ms", oa->step_ms, "device compute per step, ms (default 50)");
  overhead->add_option("--state", oa->state, "state bytes, e.g. 64M or 1GiB (default 256 MiB)")
      ->transform(CLI::AsSizeValue(false));
  overhead->add_option("--interval", oa->intervals, "checkpoint every k steps (default 1 2 5 10)")
      ->delimiter(',');
  overhead->add_option("--max-in-flight", oa->in_flight, "N values for concurrent (default 1,2,3,4)")
      ->delimiter(',');
  overhead->add_option("--steps", oa->steps, "steps per run (default 40)");
  overhead->add_option("--repeat", oa->repeat, "interleaved rounds (default 3)");
  overhead->add_option("--medium", oa->medium, "auto, buffered, direct, uring, mmap, pmem");
  overhead->add_option("--writers", oa->writers, "writer threads (0 = engine default)");
  overhead->add_option("--staging", oa->staging, "staging bound M in bytes, e.g. 64M or 1GiB (0 = engine default)")
      ->transform(CLI::AsSizeValue(false));
  overhead->add_option("--chunk", oa->chunk, "chunk bytes b (0 = engine default)")
      ->transform(CLI::AsSizeValue(false));
  overhead->add_option("--schemes", oa->schemes,
                       "schemes besides none (default sync,single,gpm,concurrent)")
      ->delimiter(',');
  overhead->add_flag("--json", oa->json, "print one JSON object");
  overhead->callback([oa] {
    if (int rc = RunOverhead(*oa); rc != 0) throw CLI::RuntimeError(rc);
  });
  // Only now: subcommands created after allow_extras() would inherit it and
  // take unknown options silently.
  bench->allow_extras();
}

}  // namespace nonstop::cli
