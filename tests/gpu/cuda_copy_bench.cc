// Copy-bandwidth benchmark for the CUDA copy engine: device-to-host GB/s for
// 256 MiB - 2 GiB transfers in 4 - 64 MiB chunks, as a fraction of a plain
// cudaMemcpy into pinned memory measured in the same run; plus pageable and
// registered (/dev/shm mapping, LightCheck-D) destinations, device snapshots
// (LightCheck-G), the host time one Copy() call costs, and pinning times.
// Prints a table and writes JSON.
//
//   cuda_copy_bench [--out FILE.json] [--reps N] [--pin-gib N]
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "copy/cuda_copy_engine.h"
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Stat {
  double median = 0, min = 0, max = 0;
};

Stat Summarise(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

double GBps(size_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e9; }

#define BENCH_CUDA(expr)                                                                \
  do {                                                                                  \
    cudaError_t _e = (expr);                                                            \
    if (_e != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(_e));                 \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

struct Json {
  std::string s = "{";
  bool first = true;
  void Key(const std::string& k) {
    s += first ? "\n  " : ",\n  ";
    first = false;
    s += "\"" + k + "\": ";
  }
  void Raw(const std::string& k, const std::string& v) {
    Key(k);
    s += v;
  }
  void Num(const std::string& k, double v) {
    char b[64];
    std::snprintf(b, sizeof(b), "%.6g", v);
    Raw(k, b);
  }
  void Str(const std::string& k, const std::string& v) { Raw(k, "\"" + v + "\""); }
};

std::string StatJson(const Stat& s) {
  char b[160];
  std::snprintf(b, sizeof(b), "{\"median\": %.4g, \"min\": %.4g, \"max\": %.4g}", s.median, s.min,
                s.max);
  return b;
}

// Engine D2H of `total` bytes in `chunk` pieces into `dst`; returns GB/s per
// repetition, and the host microseconds spent inside each Copy() call.
std::vector<double> EngineRun(CudaCopyEngine* engine, const uint8_t* dev, uint8_t* dst,
                              size_t total, size_t chunk, int reps, cudaStream_t train,
                              std::vector<double>* issue_us) {
  std::vector<double> out;
  Device d{DeviceKind::kCuda, 0, reinterpret_cast<uintptr_t>(train)};
  for (int r = 0; r < reps; ++r) {
    BENCH_CUDA(cudaDeviceSynchronize());  // benchmark setup only
    std::vector<std::unique_ptr<CopyCompletion>> pending;
    pending.reserve(total / chunk + 1);
    auto t0 = Clock::now();
    for (size_t off = 0; off < total; off += chunk) {
      size_t n = std::min(chunk, total - off);
      auto c0 = Clock::now();
      pending.push_back(engine->Copy(dev + off, d, dst + off, n));
      if (issue_us != nullptr) issue_us->push_back(Seconds(c0) * 1e6);
    }
    for (auto& c : pending) {
      Status st = c->Wait();
      if (!st.ok()) {
        std::fprintf(stderr, "copy failed: %s\n", st.message().c_str());
        std::exit(1);
      }
    }
    out.push_back(GBps(total, Seconds(t0)));
  }
  return out;
}

int Main(int argc, char** argv) {
  std::string out_path = "cuda_copy_bench.json";
  int reps = 5;
  int pin_gib = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--out") out_path = argv[i + 1];
    if (a == "--reps") reps = std::atoi(argv[i + 1]);
    if (a == "--pin-gib") pin_gib = std::atoi(argv[i + 1]);
  }
  std::string why;
  if (CudaDeviceCount(&why) == 0) {
    std::printf("SKIP: no usable CUDA device (%s)\n", why.c_str());
    return 77;
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("device: %s, driver %d, runtime %d, reps %d (median [min-max])\n", prop.name,
              driver, runtime, reps);
  Json json;
  json.Str("device", prop.name);
  json.Num("driver_version", driver);
  json.Num("runtime_version", runtime);
  json.Num("reps", reps);

  auto made = MakeCudaCopyEngine(CudaCopyOptions{}, nullptr);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.status().message().c_str());
    return 1;
  }
  std::unique_ptr<CudaCopyEngine> engine = std::move(made).value();
  CudaCopyOptions blocking_options;
  blocking_options.wait_mode = CudaCopyOptions::WaitMode::kBlockingSync;
  std::unique_ptr<CudaCopyEngine> blocking =
      MakeCudaCopyEngine(blocking_options, nullptr).value();

  const size_t kMax = 2 * kGiB;
  uint8_t* dev = nullptr;
  BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&dev), kMax));
  BENCH_CUDA(cudaMemset(dev, 0x3C, kMax));
  bool pinned = false;
  auto t_pin = Clock::now();
  auto* host = static_cast<uint8_t*>(engine->AllocHost(kMax, &pinned));
  double pin_s = Seconds(t_pin);
  if (host == nullptr || !pinned) {
    std::fprintf(stderr, "AllocHost(2 GiB) did not pin\n");
    return 1;
  }
  cudaStream_t train;
  BENCH_CUDA(cudaStreamCreateWithFlags(&train, cudaStreamNonBlocking));
  // The peak is measured into memory from cudaHostAlloc, the textbook pinned
  // buffer; the engine copies into its own AllocHost memory.
  uint8_t* peak_host = nullptr;
  BENCH_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&peak_host), kMax, cudaHostAllocPortable));

  // Peak: one plain cudaMemcpy of the whole transfer into pinned memory.
  const std::vector<size_t> totals = {256 * kMiB, 1 * kGiB, 2 * kGiB};
  const std::vector<size_t> chunks = {4 * kMiB, 16 * kMiB, 64 * kMiB};
  std::string peaks = "[";
  std::vector<double> peak_of(totals.size());
  std::printf("\n%-28s %10s %26s\n", "peak (cudaMemcpy, pinned)", "MiB", "GB/s");
  for (size_t t = 0; t < totals.size(); ++t) {
    BENCH_CUDA(cudaMemcpy(peak_host, dev, totals[t], cudaMemcpyDeviceToHost));  // warm-up
    std::vector<double> v;
    for (int r = 0; r < reps; ++r) {
      auto t0 = Clock::now();
      BENCH_CUDA(cudaMemcpy(peak_host, dev, totals[t], cudaMemcpyDeviceToHost));
      v.push_back(GBps(totals[t], Seconds(t0)));
    }
    Stat s = Summarise(v);
    peak_of[t] = s.median;
    std::printf("%-28s %10zu %10.2f [%.2f-%.2f]\n", "", totals[t] / kMiB, s.median, s.min, s.max);
    peaks += std::string(t ? ", " : "") + "{\"total_mib\": " + std::to_string(totals[t] / kMiB) +
             ", \"gbps\": " + StatJson(s) + "}";
  }
  peaks += "]";
  json.Raw("peak_cudamemcpy_pinned_d2h", peaks);
  double peak = *std::max_element(peak_of.begin(), peak_of.end());
  json.Num("peak_gbps", peak);

  // The engine, both wait modes, every total x chunk.
  std::string rows = "[";
  std::printf("\n%-14s %8s %8s %26s %9s %14s\n", "engine wait", "MiB", "chunk", "GB/s",
              "of peak", "Copy() us");
  bool first = true;
  for (int mode = 0; mode < 2; ++mode) {
    CudaCopyEngine* e = mode == 0 ? engine.get() : blocking.get();
    const char* name = mode == 0 ? "poll" : "blocking-sync";
    for (size_t t = 0; t < totals.size(); ++t) {
      for (size_t chunk : chunks) {
        EngineRun(e, dev, host, chunk, chunk, 1, train, nullptr);  // warm-up
        std::vector<double> issue;
        Stat s = Summarise(EngineRun(e, dev, host, totals[t], chunk, reps, train, &issue));
        Stat us = Summarise(issue);
        double frac = s.median / peak_of[t];
        std::printf("%-14s %8zu %8zu %10.2f [%.2f-%.2f] %8.1f%% %8.1f [%.1f]\n", name,
                    totals[t] / kMiB, chunk / kMiB, s.median, s.min, s.max, 100 * frac,
                    us.median, us.max);
        char b[512];
        std::snprintf(b, sizeof(b),
                      "%s{\"wait\": \"%s\", \"total_mib\": %zu, \"chunk_mib\": %zu, "
                      "\"gbps\": %s, \"fraction_of_peak\": %.4f, \"copy_call_us\": %s}",
                      first ? "" : ", ", name, totals[t] / kMiB, chunk / kMiB,
                      StatJson(s).c_str(), frac, StatJson(us).c_str());
        rows += b;
        first = false;
      }
    }
  }
  rows += "]";
  json.Raw("engine_d2h", rows);
  BENCH_CUDA(cudaFreeHost(peak_host));

  // Does a checkpoint copy slow the training stream? "Training" here is
  // device-to-device traffic on the caller's stream (HBM-bound, like an
  // optimizer step), timed with events, alone and while the engine copies
  // 2 GiB to the host in 16 MiB chunks ordered after it.
  {
    void* a = nullptr;
    void* b = nullptr;
    BENCH_CUDA(cudaMalloc(&a, 512 * kMiB));
    BENCH_CUDA(cudaMalloc(&b, 512 * kMiB));
    cudaEvent_t e0, e1;
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    auto train_ms = [&](bool with_copy) {
      BENCH_CUDA(cudaDeviceSynchronize());
      std::vector<std::unique_ptr<CopyCompletion>> pending;
      Device d{DeviceKind::kCuda, 0, reinterpret_cast<uintptr_t>(train)};
      if (with_copy) {
        for (size_t off = 0; off < kMax; off += 16 * kMiB) {
          pending.push_back(engine->Copy(dev + off, d, host + off, 16 * kMiB));
        }
      }
      BENCH_CUDA(cudaEventRecord(e0, train));
      for (int i = 0; i < 40; ++i) {
        BENCH_CUDA(cudaMemcpyAsync(b, a, 512 * kMiB, cudaMemcpyDeviceToDevice, train));
        BENCH_CUDA(cudaMemcpyAsync(a, b, 512 * kMiB, cudaMemcpyDeviceToDevice, train));
      }
      BENCH_CUDA(cudaEventRecord(e1, train));
      BENCH_CUDA(cudaEventSynchronize(e1));
      for (auto& c : pending) (void)c->Wait();
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    train_ms(false);
    std::vector<double> alone, with;
    for (int r = 0; r < reps; ++r) {
      alone.push_back(train_ms(false));
      with.push_back(train_ms(true));
    }
    Stat sa = Summarise(alone), sw = Summarise(with);
    std::printf("\ntraining stream (40 GiB of D2D traffic): alone %.2f ms, with a concurrent "
                "2 GiB checkpoint copy %.2f ms (%+.1f%%)\n",
                sa.median, sw.median, 100 * (sw.median / sa.median - 1));
    json.Raw("train_stream_alone_ms", StatJson(sa));
    json.Raw("train_stream_with_copy_ms", StatJson(sw));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
  }

  // Other destinations, 1 GiB in 64 MiB chunks.
  const size_t kOne = 1 * kGiB, kChunk = 64 * kMiB;
  std::printf("\n%-44s %26s %9s\n", "destination (1 GiB, 64 MiB chunks)", "GB/s", "of peak");
  auto report = [&](const std::string& key, const std::string& label, const Stat& s) {
    std::printf("%-44s %10.2f [%.2f-%.2f] %8.1f%%\n", label.c_str(), s.median, s.min, s.max,
                100 * s.median / peak_of[1]);
    json.Raw(key, StatJson(s));
  };
  {
    auto* pageable = static_cast<uint8_t*>(std::aligned_alloc(4096, kOne));
    std::memset(pageable, 0, kOne);  // pre-faulted
    report("pageable_prefaulted_gbps", "pageable, pre-faulted",
           Summarise(EngineRun(engine.get(), dev, pageable, kOne, kChunk, reps, train, nullptr)));
    auto t0 = Clock::now();
    Status st = engine->RegisterHostRegion(pageable, kOne);
    double reg_s = Seconds(t0);
    if (st.ok()) {
      json.Num("register_1gib_seconds", reg_s);
      report("registered_malloc_gbps", "malloc + RegisterHostRegion",
             Summarise(EngineRun(engine.get(), dev, pageable, kOne, kChunk, reps, train, nullptr)));
      (void)engine->UnregisterHostRegion(pageable);
    }
    std::free(pageable);
  }
  for (const char* dir : {"/dev/shm", "/tmp"}) {
    std::string path = std::string(dir) + "/nonstop-bench-" + std::to_string(getpid());
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, kOne) != 0) continue;
    auto* map = static_cast<uint8_t*>(
        mmap(nullptr, kOne, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0));
    std::string tag = std::string(dir) == "/dev/shm" ? "shm" : "tmpfile";
    if (map != MAP_FAILED) {
      report(tag + "_mmap_unregistered_gbps", std::string("mmap ") + dir + ", unregistered",
             Summarise(EngineRun(engine.get(), dev, map, kOne, kChunk, reps, train, nullptr)));
      auto t0 = Clock::now();
      Status st = engine->RegisterHostRegion(map, kOne);
      double reg_s = Seconds(t0);
      if (st.ok()) {
        json.Num(tag + "_register_1gib_seconds", reg_s);
        report(tag + "_mmap_registered_gbps",
               std::string("mmap ") + dir + ", registered (LightCheck-D)",
               Summarise(EngineRun(engine.get(), dev, map, kOne, kChunk, reps, train, nullptr)));
        (void)engine->UnregisterHostRegion(map);
      } else {
        std::printf("%-44s %s\n", (std::string("mmap ") + dir + ", registered").c_str(),
                    st.message().c_str());
        json.Str(tag + "_register_error", st.message());
      }
      munmap(map, kOne);
    }
    close(fd);
    unlink(path.c_str());
  }

  // LightCheck-G: device snapshot; the source is free once it completes.
  {
    void* snap = engine->AllocDevice(0, kOne);
    std::vector<double> v;
    Device d{DeviceKind::kCuda, 0, reinterpret_cast<uintptr_t>(train)};
    for (int r = 0; r <= reps; ++r) {
      BENCH_CUDA(cudaDeviceSynchronize());
      std::vector<std::unique_ptr<CopyCompletion>> pending;
      auto t0 = Clock::now();
      for (size_t off = 0; off < kOne; off += kChunk) {
        pending.push_back(engine->SnapshotToDevice(dev + off, d, static_cast<uint8_t*>(snap) + off,
                                                   kChunk));
      }
      for (auto& c : pending) (void)c->Wait();
      if (r > 0) v.push_back(GBps(kOne, Seconds(t0)));
    }
    Stat s = Summarise(v);
    std::printf("%-44s %10.2f [%.2f-%.2f]  (device to device; source held %.2f ms)\n",
                "device snapshot (LightCheck-G)", s.median, s.min, s.max,
                1e3 * static_cast<double>(kOne) / (s.median * 1e9));
    json.Raw("device_snapshot_gbps", StatJson(s));
    std::vector<double> drain;
    for (int r = 0; r < reps; ++r) {
      auto t0 = Clock::now();
      std::vector<std::unique_ptr<CopyCompletion>> pending;
      for (size_t off = 0; off < kOne; off += kChunk) {
        pending.push_back(
            engine->DrainToHost(static_cast<uint8_t*>(snap) + off, 0, host + off, kChunk));
      }
      for (auto& c : pending) (void)c->Wait();
      drain.push_back(GBps(kOne, Seconds(t0)));
    }
    report("drain_to_host_gbps", "drain snapshot to pinned host", Summarise(drain));
    engine->FreeDevice(0, snap);
  }

  // Pinning: what a staging pool of this size costs at start-up, through
  // AllocHost (map + parallel prefault + cudaHostRegister) and through a
  // plain cudaHostAlloc.
  std::printf("\n%-34s %6s %10s %10s %12s\n", "pinning", "GiB", "seconds", "GB/s", "free s");
  std::printf("%-34s %6d %10.3f %10.2f\n", "AllocHost (first, 2 GiB)", 2, pin_s,
              GBps(kMax, pin_s));
  std::string pins = "[{\"how\": \"AllocHost\", \"gib\": 2, \"seconds\": " +
                     std::to_string(pin_s) + "}";
  engine->FreeHost(host, kMax);
  for (int gib : {2, 4, pin_gib}) {
    size_t n = static_cast<size_t>(gib) * kGiB;
    for (int how = 0; how < 2; ++how) {
      auto t0 = Clock::now();
      void* p = nullptr;
      bool ok;
      if (how == 0) {
        p = engine->AllocHost(n, &pinned);
        ok = p != nullptr && pinned;
      } else {
        ok = cudaHostAlloc(&p, n, cudaHostAllocPortable) == cudaSuccess;
      }
      double s = Seconds(t0);
      const char* name = how == 0 ? "AllocHost (prefault + register)" : "cudaHostAlloc";
      if (!ok) {
        std::printf("%-34s %6d  failed to pin\n", name, gib);
        continue;
      }
      auto f0 = Clock::now();
      if (how == 0) {
        engine->FreeHost(p, n);
      } else {
        cudaFreeHost(p);
      }
      double fs = Seconds(f0);
      std::printf("%-34s %6d %10.3f %10.2f %12.3f\n", name, gib, s, GBps(n, s), fs);
      pins += std::string(", {\"how\": \"") + (how == 0 ? "AllocHost" : "cudaHostAlloc") +
              "\", \"gib\": " + std::to_string(gib) + ", \"seconds\": " + std::to_string(s) +
              ", \"free_seconds\": " + std::to_string(fs) + "}";
    }
  }
  pins += "]";
  json.Raw("pin_times", pins);

  BENCH_CUDA(cudaStreamDestroy(train));
  BENCH_CUDA(cudaFree(dev));
  json.s += "\n}\n";
  FILE* f = std::fopen(out_path.c_str(), "w");
  if (f != nullptr) {
    std::fputs(json.s.c_str(), f);
    std::fclose(f);
    std::printf("\nwrote %s\n", out_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace nonstop

int main(int argc, char** argv) { return nonstop::Main(argc, argv); }
