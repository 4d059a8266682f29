// Visible stall of multi-step checkpoints (GoCkpt) against single-step ones,
// on a synthetic training loop whose state takes several step times to copy.
//
//   multistep_bench [--dir D] [--params N] [--grad-dtype bf16|fp32] [--link-gbps G]
//                   [--fwd-ms F --bwd-ms B --update-ms U] [--parts 7] [--intervals 50,200]
//                   [--checkpoints 4] [--mtbf-hours H] [--json PATH]
//
// The "device" is host memory and the device-to-host link is a copy engine
// that moves bytes at `--link-gbps` (memcpy, then a sleep to the link's pace,
// one copy at a time, like a DMA engine). Forward, backward and update are
// sleeps, so the CPU stays free for the copy, replay and writer threads. Each
// step: forward, [on_backward_begin], backward, [on_update_begin], update,
// [on_update_end]. Schemes, all persisted through the same Engine:
//   async     stop after the update, copy the whole state, go on;
//   async-o   the copy overlaps the next step's forward and backward, the
//             update waits for the rest (MultistepCheckpoint with parts = 1);
//   gockpt    parts = K, gradient copies before the update;
//   gockpt-o  parts = K, gradient copies overlap the update and next forward;
//             the next backward waits for them (the paper's rule: a framework
//             that accumulates into the same gradient buffers);
//   gockpt-o+ as gockpt-o, but gradients are reallocated each step (torch's
//             zero_grad(set_to_none=True), nonstop's Python front end holds the
//             old ones until copied), so no hook waits for a gradient copy;
//             a part's state copy still waits behind earlier gradients.
// The visible stall is the time the training thread spends in checkpoint
// calls. Schemes run interleaved, `none` first and last in each round.
// Host memory, per run: the process's resident set added by the run (VmRSS
// at the end of the loop, before anything is closed, minus VmRSS before the
// engine opened), the engine's staging pool and the multi-step host buffers.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/multistep.h"
#include "nonstop/simulate.h"

namespace {

using nonstop::CopyCompletion;
using nonstop::CopyEngine;
using nonstop::Device;
using nonstop::Status;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The process's resident set (VmRSS), bytes; 0 if unreadable.
uint64_t RssBytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) << 10;
  }
  return 0;
}

// A device-to-host link of fixed bandwidth: copies run one at a time, each
// takes bytes / bandwidth (memcpy, then sleep to that pace).
class LinkCopyEngine final : public CopyEngine {
 public:
  explicit LinkCopyEngine(double gbps)
      : bytes_per_s_(gbps * 1e9), host_(nonstop::MakeHostCopyEngine(0)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~LinkCopyEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device&, void* dst,
                                       size_t bytes) override {
    auto job = std::make_shared<Job>();
    job->src = src;
    job->dst = dst;
    job->bytes = bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(job);
    }
    cv_.notify_all();
    return std::make_unique<Completion>(job);
  }
  void* AllocHost(size_t bytes, bool* pinned) override { return host_->AllocHost(bytes, pinned); }
  void FreeHost(void* p, size_t bytes) override { host_->FreeHost(p, bytes); }
  std::string Describe() const override {
    return "link " + std::to_string(bytes_per_s_ / 1e9) + " GB/s";
  }

 private:
  struct Job {
    const void* src = nullptr;
    void* dst = nullptr;
    size_t bytes = 0;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  class Completion final : public CopyCompletion {
   public:
    explicit Completion(std::shared_ptr<Job> j) : j_(std::move(j)) {}
    Status Wait() override {
      std::unique_lock<std::mutex> lock(j_->mu);
      j_->cv.wait(lock, [&] { return j_->done; });
      return Status::OK();
    }
    bool Ready() override {
      std::lock_guard<std::mutex> lock(j_->mu);
      return j_->done;
    }

   private:
    std::shared_ptr<Job> j_;
  };
  void Run() {
    for (;;) {
      std::shared_ptr<Job> j;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        j = queue_.front();
        queue_.pop_front();
      }
      const auto t0 = Clock::now();
      std::memcpy(j->dst, j->src, j->bytes);
      std::this_thread::sleep_until(
          t0 + std::chrono::nanoseconds(static_cast<int64_t>(j->bytes / bytes_per_s_ * 1e9)));
      {
        std::lock_guard<std::mutex> lock(j->mu);
        j->done = true;
      }
      j->cv.notify_all();
    }
  }
  const double bytes_per_s_;
  std::unique_ptr<CopyEngine> host_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

struct Args {
  std::string dir = "/dev/shm/nonstop_multistep_bench";
  size_t params = 16u << 20;  // 16 Mi fp32 master parameters: 192 MiB of AdamW state
  std::string grad_dtype = "bf16";
  double link_gbps = 1.0;
  double fwd_ms = 15, bwd_ms = 30, update_ms = 5;
  int parts = 7;
  std::vector<int> intervals = {50, 200};
  int checkpoints = 4;  // per run
  int repeat = 1;
  double mtbf_hours = 4;
  std::string json = "multistep_bench.json";
};

// The "device" state: tensors of a model, AdamW states and gradients.
struct DeviceState {
  std::vector<size_t> numels;
  std::vector<std::vector<float>> param, m, v;
  std::vector<std::vector<uint16_t>> g16;
  std::vector<std::vector<float>> g32;
  bool bf16 = true;
  explicit DeviceState(const Args& a) : bf16(a.grad_dtype == "bf16") {
    // A transformer-like mix: a few big matrices and small vectors.
    size_t left = a.params;
    const size_t big = std::max<size_t>(1, a.params / 12);
    while (left > 0) {
      const size_t n = std::min(left, numels.size() % 3 == 2 ? size_t{4096} : big);
      numels.push_back(n);
      left -= n;
    }
    for (size_t n : numels) {
      param.emplace_back(n, 0.01f);
      m.emplace_back(n, 0.001f);
      v.emplace_back(n, 1e-6f);
      if (bf16) {
        g16.emplace_back(n, 0x3c00);
      } else {
        g32.emplace_back(n, 0.001f);
      }
    }
  }
  std::vector<nonstop::OptimizerTensor> Tensors() {
    std::vector<nonstop::OptimizerTensor> out;
    for (size_t t = 0; t < numels.size(); ++t) {
      nonstop::OptimizerTensor o;
      o.name = "w" + std::to_string(t);
      o.numel = numels[t];
      o.param = param[t].data();
      o.exp_avg = m[t].data();
      o.exp_avg_sq = v[t].data();
      o.step = 100;
      out.push_back(o);
    }
    return out;
  }
  std::vector<nonstop::GradRef> Grads() {
    std::vector<nonstop::GradRef> g(numels.size());
    for (size_t t = 0; t < numels.size(); ++t) {
      g[t].data = bf16 ? static_cast<const void*>(g16[t].data()) : g32[t].data();
      g[t].dtype = bf16 ? nonstop::DType::kBFloat16 : nonstop::DType::kFloat32;
    }
    return g;
  }
  uint64_t StateBytes() const {
    uint64_t n = 0;
    for (size_t x : numels) n += x;
    return n * 12;
  }
  uint64_t GradBytes() const {
    uint64_t n = 0;
    for (size_t x : numels) n += x;
    return n * (bf16 ? 2 : 4);
  }
};

struct RunResult {
  double steps_per_s = 0;
  double stall_ms_mean = 0;  // per checkpoint
  double stall_ms_max = 0;
  double replay_ms_mean = 0;
  double replay_GBps = 0;  // bytes the replay reads and writes / replay time
  int checkpoints = 0;
  double rss_mib = 0;       // resident set added by the run
  double staging_mib = 0;   // the engine's staging pool
  double ms_host_mib = 0;   // multi-step host buffers (state, gradients, extras)
};

void Sleep(double ms) {
  std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(ms * 1000)));
}

// One run of `steps` steps with a checkpoint due every `interval` steps.
nonstop::Result<RunResult> RunLoop(const Args& a, const std::string& scheme, int interval,
                                   DeviceState& st) {
  const int steps = scheme == "none" ? std::min(interval, 100) : interval * a.checkpoints;
  const fs::path dir = fs::path(a.dir) / scheme;
  fs::remove_all(dir);
  const uint64_t rss0 = RssBytes();
  std::unique_ptr<nonstop::Engine> engine;
  std::unique_ptr<nonstop::MultistepCheckpoint> ms;
  std::unique_ptr<CopyEngine> link;
  // async: host buffers of the whole state, copied while training stops.
  std::vector<std::vector<float>> host;
  bool registered = false;
  if (scheme != "none") {
    nonstop::EngineOptions eo;
    eo.dir = dir.string();
    eo.max_in_flight = 1;
    NONSTOP_ASSIGN_OR_RETURN(engine, nonstop::Engine::Open(eo));
  }
  const bool realloc_grads = scheme == "gockpt-o+";
  if (scheme == "async-o" || scheme == "gockpt" || scheme == "gockpt-o" || realloc_grads) {
    nonstop::MultistepOptions mo;
    mo.parts = scheme == "async-o" ? 1 : a.parts;
    mo.overlap_gradients = scheme == "gockpt-o" || realloc_grads;
    NONSTOP_ASSIGN_OR_RETURN(
        ms, nonstop::MultistepCheckpoint::Create(engine.get(), mo,
                                                 std::make_unique<LinkCopyEngine>(a.link_gbps)));
  } else if (scheme == "async") {
    link = std::make_unique<LinkCopyEngine>(a.link_gbps);
    for (size_t t = 0; t < st.numels.size(); ++t) {
      for (int r = 0; r < 3; ++r) host.emplace_back(st.numels[t], 0.f);
    }
  }
  nonstop::optim::OptimizerConfig config;  // AdamW
  std::vector<nonstop::optim::StepHyperparameters> groups(1);
  double stall = 0;
  int ckpts = 0;
  // The first checkpoint of a run allocates and pre-faults host buffers and
  // creates the slot file: a warm-up window, not counted.
  const int warmup = scheme == "none" ? 0 : a.parts + 3;
  auto t0 = Clock::now();
  for (int s = -warmup; s < steps; ++s) {
    if (s == 0) {
      if (ms) NONSTOP_RETURN_IF_ERROR(ms->Wait());
      stall = 0;
      ckpts = 0;
      t0 = Clock::now();
    }
    Sleep(a.fwd_ms);
    auto h0 = Clock::now();
    if (ms && !realloc_grads) NONSTOP_RETURN_IF_ERROR(ms->OnBackwardBegin());
    stall += Seconds(h0, Clock::now());
    Sleep(a.bwd_ms);
    h0 = Clock::now();
    if (ms) NONSTOP_RETURN_IF_ERROR(ms->OnUpdateBegin(s, groups, false, st.Grads()));
    stall += Seconds(h0, Clock::now());
    Sleep(a.update_ms);
    h0 = Clock::now();
    if (ms) NONSTOP_RETURN_IF_ERROR(ms->OnUpdateEnd(s));
    if ((s >= 0 && (s + 1) % interval == 0 && s + 1 < steps) || s == -warmup) {
      if (ms) {
        NONSTOP_RETURN_IF_ERROR(ms->Begin(s, config, st.Tensors()));
        ++ckpts;
      } else if (link) {
        // Async: stop, copy everything, go on; the engine persists the copy.
        if (registered) NONSTOP_RETURN_IF_ERROR(engine->WaitCopied());
        std::vector<std::unique_ptr<CopyCompletion>> pending;
        std::vector<nonstop::TensorRef> refs;
        for (size_t t = 0; t < st.numels.size(); ++t) {
          const float* src[3] = {st.param[t].data(), st.m[t].data(), st.v[t].data()};
          for (int r = 0; r < 3; ++r) {
            auto& dst = host[t * 3 + r];
            pending.push_back(link->Copy(src[r], {}, dst.data(), dst.size() * 4));
            nonstop::TensorRef ref;
            ref.spec.name = "w" + std::to_string(t) + "/" + std::to_string(r);
            ref.spec.dtype = nonstop::DType::kFloat32;
            ref.spec.shape = {static_cast<int64_t>(dst.size())};
            ref.spec.nbytes = dst.size() * 4;
            ref.data = dst.data();
            refs.push_back(ref);
          }
        }
        for (auto& p : pending) NONSTOP_RETURN_IF_ERROR(p->Wait());
        if (!registered) {
          NONSTOP_RETURN_IF_ERROR(engine->Register(refs));
          registered = true;
        }
        NONSTOP_RETURN_IF_ERROR(engine->Checkpoint(s, "{}").status());
        ++ckpts;
      }
    }
    stall += Seconds(h0, Clock::now());
  }
  const double secs = Seconds(t0, Clock::now());
  RunResult r;
  if (ms) NONSTOP_RETURN_IF_ERROR(ms->Wait());
  r.rss_mib = (static_cast<double>(RssBytes()) - static_cast<double>(rss0)) / 1048576.0;
  if (engine) r.staging_mib = engine->Stats().staging_bytes / 1048576.0;
  if (ms) {
    auto stats = ms->Stats();
    r.ms_host_mib = stats.host_bytes / 1048576.0;
    double replay = 0, worst = 0, replay_bytes = 0;
    int n = 0;
    for (size_t i = 1; i < stats.recent.size(); ++i) {  // [0] is the warm-up
      const auto& w = stats.recent[i];
      if (getenv("MULTISTEP_BENCH_VERBOSE") != nullptr) {
        std::fprintf(stderr, "    %s window %lld: stall %.1f ms (state %.1f, grad %.1f), "
                     "%.1f MiB state, %.1f MiB grads, replay %.1f ms, window %.0f ms\n",
                     scheme.c_str(), static_cast<long long>(w.begin_step), w.stall_s * 1e3,
                     w.state_wait_s * 1e3, w.grad_wait_s * 1e3, w.state_bytes / 1048576.0,
                     w.grad_bytes / 1048576.0, w.replay_s * 1e3, w.window_s * 1e3);
      }
      replay += w.replay_s;
      // Parts 1..K-1 are replayed: their state read and written once
      // (blocked replay), every logged gradient read once.
      const double k = std::max(1, a.parts);
      if (scheme != "async-o") replay_bytes += 2.0 * w.state_bytes * (k - 1) / k + w.grad_bytes;
      worst = std::max(worst, w.stall_s);
      ++n;
    }
    r.replay_ms_mean = n ? replay * 1e3 / n : 0;
    r.replay_GBps = replay > 0 ? replay_bytes / replay / 1e9 : 0;
    r.stall_ms_max = worst * 1e3;
    NONSTOP_RETURN_IF_ERROR(ms->Close());
  }
  if (engine) {
    NONSTOP_RETURN_IF_ERROR(engine->WaitCommitted());
    NONSTOP_RETURN_IF_ERROR(engine->Close());
  }
  fs::remove_all(dir);
  r.steps_per_s = steps / secs;
  r.checkpoints = ckpts;
  r.stall_ms_mean = ckpts ? stall * 1e3 / ckpts : 0;
  return r;
}

// STREAM-like triad on 3 arrays of `n` floats on all hardware threads (as
// the replay runs), best of 5, GB/s (12 bytes/element).
double TriadGBps(size_t n) {
  std::vector<float> a(n, 0.f), b(n, 1.f), c(n, 2.f);
  const size_t threads = std::max(1u, std::thread::hardware_concurrency());
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (size_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        for (size_t i = lo; i < hi; ++i) a[i] = b[i] + 0.5f * c[i];
      });
    }
    for (auto& th : pool) th.join();
    best = std::min(best, Seconds(t0, Clock::now()));
  }
  volatile float sink = a[n / 2];
  (void)sink;
  return 12.0 * n / best / 1e9;
}

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::atoi(item.c_str()));
  return out;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "--dir") a.dir = v;
    else if (f == "--params") a.params = std::strtoull(v.c_str(), nullptr, 10);
    else if (f == "--grad-dtype") a.grad_dtype = v;
    else if (f == "--link-gbps") a.link_gbps = std::atof(v.c_str());
    else if (f == "--fwd-ms") a.fwd_ms = std::atof(v.c_str());
    else if (f == "--bwd-ms") a.bwd_ms = std::atof(v.c_str());
    else if (f == "--update-ms") a.update_ms = std::atof(v.c_str());
    else if (f == "--parts") a.parts = std::atoi(v.c_str());
    else if (f == "--intervals") a.intervals = ParseInts(v);
    else if (f == "--checkpoints") a.checkpoints = std::atoi(v.c_str());
    else if (f == "--repeat") a.repeat = std::atoi(v.c_str());
    else if (f == "--mtbf-hours") a.mtbf_hours = std::atof(v.c_str());
    else if (f == "--json") a.json = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  DeviceState st(a);
  const double step_ms = a.fwd_ms + a.bwd_ms + a.update_ms;
  const double copy_ms = st.StateBytes() / (a.link_gbps * 1e9) * 1e3;
  std::printf("state %.0f MiB (AdamW fp32 master+m+v), grads %s %.0f MiB, link %.2f GB/s: "
              "state copy %.0f ms = %.1f steps of %.0f ms (fwd %.0f, bwd %.0f, update %.0f); "
              "K = %d\n",
              st.StateBytes() / 1048576.0, a.grad_dtype.c_str(), st.GradBytes() / 1048576.0,
              a.link_gbps, copy_ms, copy_ms / step_ms, step_ms, a.fwd_ms, a.bwd_ms, a.update_ms,
              a.parts);
  const std::vector<std::string> schemes = {"async", "async-o", "gockpt", "gockpt-o",
                                            "gockpt-o+"};
  // [interval][scheme] -> per round
  const size_t ni = a.intervals.size(), ns = schemes.size();
  std::vector<std::vector<std::vector<double>>> stall(ni, std::vector<std::vector<double>>(ns)),
      worst = stall, rel = stall, sps = stall, replay = stall, replay_bw = stall, rss = stall,
      staging = stall, ms_host = stall;
  std::vector<double> drift, none_sps;
  for (int round = 0; round < a.repeat; ++round) {
    auto first = RunLoop(a, "none", 100, st);
    if (!first.ok()) {
      std::fprintf(stderr, "%s\n", first.status().ToString().c_str());
      return 1;
    }
    std::vector<std::vector<RunResult>> got(ni, std::vector<RunResult>(ns));
    for (size_t i = 0; i < ni; ++i) {
      for (size_t k = 0; k < ns; ++k) {
        auto r = RunLoop(a, schemes[k], a.intervals[i], st);
        if (!r.ok()) {
          std::fprintf(stderr, "%s: %s\n", schemes[k].c_str(), r.status().ToString().c_str());
          return 1;
        }
        got[i][k] = *r;
        std::fprintf(stderr, "  round %d interval %d %-9s stall %.1f ms/ckpt, %.3f steps/s\n",
                     round + 1, a.intervals[i], schemes[k].c_str(), r->stall_ms_mean,
                     r->steps_per_s);
      }
    }
    auto last = RunLoop(a, "none", 100, st);
    if (!last.ok()) return 1;
    const double base = (first->steps_per_s + last->steps_per_s) / 2;
    none_sps.push_back(base);
    drift.push_back((last->steps_per_s - first->steps_per_s) / first->steps_per_s);
    for (size_t i = 0; i < ni; ++i) {
      for (size_t k = 0; k < ns; ++k) {
        stall[i][k].push_back(got[i][k].stall_ms_mean);
        worst[i][k].push_back(got[i][k].stall_ms_max);
        sps[i][k].push_back(got[i][k].steps_per_s);
        rel[i][k].push_back(got[i][k].steps_per_s / base);
        replay[i][k].push_back(got[i][k].replay_ms_mean);
        replay_bw[i][k].push_back(got[i][k].replay_GBps);
        rss[i][k].push_back(got[i][k].rss_mib);
        staging[i][k].push_back(got[i][k].staging_mib);
        ms_host[i][k].push_back(got[i][k].ms_host_mib);
      }
    }
  }
  const double triad = TriadGBps(std::max<size_t>(a.params, 8u << 20));
  const double p = 1.0 / (a.mtbf_hours * 3600.0);
  std::printf("none: %.3f steps/s (median), max |drift| %.1f%%; triad %.1f GB/s; MTBF %.1f h\n",
              Median(none_sps), 100 * [&] {
                double m = 0;
                for (double d : drift) m = std::max(m, std::abs(d));
                return m;
              }(), triad, a.mtbf_hours);
  std::printf("%-9s %8s %14s %12s %10s %9s %10s %12s %10s %9s %9s %11s %9s\n", "scheme",
              "interval", "stall ms/ckpt", "vs async-o", "steps/s", "relative", "replay ms",
              "replay GB/s", "N* steps", "K*T ms", "RSS MiB", "staging MiB", "host MiB");
  std::ostringstream js;
  js << "{\"state_bytes\":" << st.StateBytes() << ",\"grad_bytes\":" << st.GradBytes()
     << ",\"grad_dtype\":\"" << a.grad_dtype << "\",\"link_gbps\":" << a.link_gbps
     << ",\"step_ms\":" << step_ms << ",\"copy_ms\":" << copy_ms << ",\"parts\":" << a.parts
     << ",\"repeat\":" << a.repeat << ",\"triad_GBps\":" << triad
     << ",\"mtbf_hours\":" << a.mtbf_hours << ",\"rows\":[";
  bool first_row = true;
  for (size_t i = 0; i < ni; ++i) {
    const double base = Median(stall[i][1]);
    for (size_t k = 0; k < ns; ++k) {
      const double s = Median(stall[i][k]);
      const double reduction = base > 0 ? 1 - s / base : 0;
      const double nstar = nonstop::YoungDalyIntervalSteps(s / 1e3, step_ms / 1e3, p);
      std::printf("%-9s %8d %14.1f %11.0f%% %10.3f %9.3f %10.1f %12.1f %10.0f %9.0f %9.0f %11.0f "
                  "%9.0f\n",
                  schemes[k].c_str(), a.intervals[i], s, 100 * reduction, Median(sps[i][k]),
                  Median(rel[i][k]), Median(replay[i][k]), Median(replay_bw[i][k]), nstar,
                  a.parts * step_ms, Median(rss[i][k]), Median(staging[i][k]),
                  Median(ms_host[i][k]));
      js << (first_row ? "" : ",") << "{\"scheme\":\"" << schemes[k]
         << "\",\"interval\":" << a.intervals[i] << ",\"stall_ms_mean\":" << s
         << ",\"stall_ms_max_window\":" << Median(worst[i][k])
         << ",\"reduction_vs_async_o\":" << reduction << ",\"steps_per_s\":" << Median(sps[i][k])
         << ",\"relative\":" << Median(rel[i][k]) << ",\"replay_ms\":" << Median(replay[i][k])
         << ",\"replay_GBps\":" << Median(replay_bw[i][k])
         << ",\"young_daly_steps\":" << nstar << ",\"rss_mib\":" << Median(rss[i][k])
         << ",\"staging_mib\":" << Median(staging[i][k])
         << ",\"ms_host_mib\":" << Median(ms_host[i][k]) << "}";
      first_row = false;
    }
  }
  js << "],\"none_drift\":[";
  for (size_t i = 0; i < drift.size(); ++i) js << (i ? "," : "") << drift[i];
  js << "]}";
  std::ofstream(a.json) << js.str() << "\n";
  std::printf("json: %s\n", a.json.c_str());
  return 0;
}
