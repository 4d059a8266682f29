// The configuration tuner (include/nonstop/tune.h, docs/TUNE.md).
//
// Measurements go through the same code a training job uses: the copy sweep
// through the best copy engine of this build (device-to-host where a GPU is
// usable), the write and in-flight sweeps through Engine itself, so that what
// is measured includes the chunking, checksums, syncs and commit of a real
// checkpoint.
#include "nonstop/tune.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <utility>

#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/simulate.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kAlign = 4096;
constexpr int kCopyWindow = 2;  // chunks in flight in the copy sweep, as the engine's dispatcher

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t RoundDown(uint64_t v, uint64_t a) { return v / a * a; }
uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string Mib(uint64_t b) {
  std::ostringstream os;
  os << static_cast<double>(b) / (1 << 20) << " MiB";
  return os.str();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Page-aligned, pre-faulted host memory standing in for the model state (a
// never-touched page would be faulted in by the first copy, at a tenth of
// the speed: DESIGN.md "This machine").
class HostBuffer {
 public:
  explicit HostBuffer(uint64_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    p_ = static_cast<uint8_t*>(p);
    for (uint64_t i = 0; i < bytes; i += 8) {
      const uint64_t v = i * 0x9E3779B97F4A7C15ull;
      std::memcpy(p_ + i, &v, std::min<uint64_t>(8, bytes - i));
    }
  }
  ~HostBuffer() {
    if (p_) munmap(p_, bytes_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  uint8_t* data() const { return p_; }
  uint64_t bytes() const { return bytes_; }

  // One large tensor and 64 MiB pieces, like a model's parameters.
  std::vector<TensorRef> Refs() const {
    std::vector<TensorRef> refs;
    uint64_t off = 0;
    for (int i = 0; off < bytes_; ++i) {
      const uint64_t n = std::min<uint64_t>(bytes_ - off, i == 0 ? bytes_ / 2 + 1 : (64 << 20));
      TensorRef r;
      r.spec.name = "probe." + std::to_string(i);
      r.spec.dtype = DType::kUInt8;
      r.spec.shape = {static_cast<int64_t>(n)};
      r.spec.nbytes = n;
      r.data = p_ + off;
      refs.push_back(std::move(r));
      off += n;
    }
    return refs;
  }

 private:
  uint8_t* p_ = nullptr;
  uint64_t bytes_ = 0;
};

// Copies `volume` bytes from `src` in chunks of `chunk`, `kCopyWindow` at a
// time, into `dst` (kCopyWindow * chunk bytes of staging). Returns GB/s.
Result<double> CopySweepOnce(CopyEngine& ce, const void* src, const Device& dev, uint8_t* dst,
                             uint64_t volume, uint64_t chunk) {
  std::vector<std::unique_ptr<CopyCompletion>> pending(kCopyWindow);
  const auto t0 = Clock::now();
  uint64_t k = 0;
  for (uint64_t off = 0; off < volume; off += chunk, ++k) {
    auto& slot = pending[k % kCopyWindow];
    if (slot) NONSTOP_RETURN_IF_ERROR(slot->Wait());
    slot = ce.Copy(static_cast<const uint8_t*>(src) + off, dev, dst + (k % kCopyWindow) * chunk,
                   std::min(chunk, volume - off));
  }
  for (auto& slot : pending) {
    if (slot) NONSTOP_RETURN_IF_ERROR(slot->Wait());
  }
  const double s = Since(t0);
  return s > 0 ? volume / s / 1e9 : 0.0;
}

struct CopyResult {
  std::vector<CopyPoint> points;
  std::string describe;
  bool device = false;
};

Result<CopyResult> MeasureCopy(const TuneOptions& o, const HostBuffer& state, uint64_t volume) {
  std::string note;
  std::unique_ptr<CopyEngine> ce = MakeBestCopyEngine(1, &note);
  CopyResult out;
  out.describe = ce->Describe();
  // From GPU memory when the engine is the CUDA one: that is the copy a
  // training job's checkpoint makes.
  void* dev_src = ce->CanSnapshotOnDevice() ? ce->AllocDevice(0, volume) : nullptr;
  Device dev;
  const void* src = state.data();
  if (dev_src != nullptr) {
    dev.kind = DeviceKind::kCuda;
    src = dev_src;
    out.device = true;
  }
  uint64_t max_chunk = 0;
  for (uint64_t b : o.chunk_sizes) max_chunk = std::max(max_chunk, std::min(b, volume));
  bool pinned = false;
  const size_t dst_bytes = kCopyWindow * max_chunk;
  auto* dst = static_cast<uint8_t*>(ce->AllocHost(dst_bytes, &pinned));
  if (dst == nullptr) {
    if (dev_src) ce->FreeDevice(0, dev_src);
    return Status::IOError("cannot allocate " + Mib(dst_bytes) + " of staging memory to measure");
  }
  Status st;
  for (uint64_t b : o.chunk_sizes) {
    if (b > volume) continue;
    double best = 0;
    for (int r = 0; r < 3 && st.ok(); ++r) {
      Result<double> g = CopySweepOnce(*ce, src, dev, dst, volume, b);
      if (!g.ok()) {
        st = g.status();
        break;
      }
      best = std::max(best, g.value());
    }
    if (!st.ok()) break;
    out.points.push_back({b, best});
  }
  ce->FreeHost(dst, dst_bytes);
  if (dev_src) ce->FreeDevice(0, dev_src);
  NONSTOP_RETURN_IF_ERROR(st);
  return out;
}

struct ProbeRun {
  std::vector<double> round_s;  // per round: first Checkpoint() -> all of the round committed
  double read_GBps = 0;
  std::string medium;
};

// Opens an engine with (N, p, b, M) in a scratch directory and runs `rounds`
// rounds of `n` checkpoints of the probe state, started back to back (each
// after the previous one's copy, as a training loop would) so that all n are
// in flight at once, then waits for all of them. The directory is deleted.
Result<ProbeRun> RunProbe(const TuneOptions& o, const HostBuffer& state, int n, int writers,
                          uint64_t chunk, uint64_t staging, int rounds, bool measure_read) {
  const fs::path scratch = fs::path(o.dir) / ".nonstop-tune";
  std::error_code ec;
  fs::remove_all(scratch, ec);
  EngineOptions eo;
  eo.dir = scratch.string();
  eo.max_in_flight = n;
  eo.writers = writers;
  eo.chunk_bytes = chunk;
  eo.staging_bytes = staging;
  eo.medium = o.medium;
  ProbeRun run;
  Status st = [&]() -> Status {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Open(eo));
    Status body = [&]() -> Status {
      NONSTOP_RETURN_IF_ERROR(engine->Register(state.Refs()));
      int64_t step = 0;
      for (int r = 0; r < rounds; ++r) {
        const auto t0 = Clock::now();
        for (int k = 0; k < n; ++k) {
          NONSTOP_RETURN_IF_ERROR(engine->Checkpoint(step++, "{}").status());
          NONSTOP_RETURN_IF_ERROR(engine->WaitCopied());
        }
        NONSTOP_RETURN_IF_ERROR(engine->WaitCommitted());
        run.round_s.push_back(Since(t0));
      }
      run.medium = engine->Stats().medium;
      if (measure_read) {
        const auto r0 = Clock::now();
        NONSTOP_RETURN_IF_ERROR(engine->Restore().status());
        const double s = Since(r0);
        run.read_GBps = s > 0 ? static_cast<double>(state.bytes()) / s / 1e9 : 0;
      }
      return Status::OK();
    }();
    Status closed = engine->Close();
    NONSTOP_RETURN_IF_ERROR(body);
    return closed;
  }();
  fs::remove_all(scratch, ec);
  NONSTOP_RETURN_IF_ERROR(st);
  return run;
}

uint64_t RamBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

Status ValidateOptions(const TuneOptions& o) {
  if (o.dir.empty()) return Status::InvalidArgument("tune: --dir is required");
  if (o.state_bytes == 0) return Status::InvalidArgument("tune: --state-bytes must be > 0");
  if (!(o.step_s > 0)) return Status::InvalidArgument("tune: --step-ms must be > 0");
  if (!(o.max_overhead > 0 && o.max_overhead < 1)) {
    return Status::InvalidArgument("tune: --max-overhead must be in (0, 1), e.g. 0.03 for 3 %");
  }
  if (o.mtbf_s < 0) return Status::InvalidArgument("tune: --mtbf must be >= 0 seconds");
  if (o.max_in_flight_cap < 1) return Status::InvalidArgument("tune: the N cap must be >= 1");
  if (o.probe_cap_bytes < kAlign) {
    return Status::InvalidArgument("tune: the probe size cap must be at least 4096 bytes");
  }
  if (o.chunk_sizes.empty() || o.writer_counts.empty()) {
    return Status::InvalidArgument("tune: need at least one chunk size and one writer count");
  }
  for (uint64_t b : o.chunk_sizes) {
    if (b == 0 || b % kAlign != 0 || b > (1u << 30)) {
      return Status::InvalidArgument("tune: chunk size " + std::to_string(b) +
                                     " is not a multiple of 4096 up to 1 GiB");
    }
  }
  for (int p : o.writer_counts) {
    if (p < 1 || p > 256) return Status::InvalidArgument("tune: writer counts must be 1..256");
  }
  if (o.repeat < 1) return Status::InvalidArgument("tune: repeat must be >= 1");
  return Status::OK();
}

}  // namespace

uint64_t ChooseChunkBytes(const std::vector<CopyPoint>& copy) {
  double best = 0;
  for (const CopyPoint& c : copy) best = std::max(best, c.GBps);
  uint64_t chosen = 0;
  for (const CopyPoint& c : copy) {
    if (c.GBps >= 0.9 * best && (chosen == 0 || c.chunk_bytes < chosen)) chosen = c.chunk_bytes;
  }
  return chosen;
}

int ChooseWriters(const std::vector<WritePoint>& write) {
  double best = 0;
  for (const WritePoint& w : write) best = std::max(best, w.GBps);
  int chosen = 0;
  for (const WritePoint& w : write) {
    if (w.GBps >= 0.95 * best && (chosen == 0 || w.writers < chosen)) chosen = w.writers;
  }
  return chosen;
}

int ChooseMaxInFlight(const std::vector<PersistPoint>& persist) {
  double best = 0;
  for (const PersistPoint& p : persist) {
    const double per = p.tw_s / p.max_in_flight;
    if (best == 0 || per < best) best = per;
  }
  int chosen = 0;
  for (const PersistPoint& p : persist) {
    if (p.tw_s / p.max_in_flight <= 1.05 * best && (chosen == 0 || p.max_in_flight < chosen)) {
      chosen = p.max_in_flight;
    }
  }
  return chosen;
}

int MaxInFlightForStorage(uint64_t storage_bytes, uint64_t state_bytes, int cap) {
  if (state_bytes == 0) return std::max(1, cap);
  const uint64_t slots = storage_bytes / state_bytes;
  const int64_t n = static_cast<int64_t>(std::min<uint64_t>(slots, 1u << 20)) - 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, cap)));
}

uint64_t DefaultMemoryBytes(uint64_t state_bytes, uint64_t ram_bytes) {
  uint64_t m = std::min<uint64_t>(RoundUp(state_bytes, kAlign), 1ull << 30);
  if (ram_bytes > 0) m = std::min(m, ram_bytes / 4);
  return m;
}

int OverheadInterval(double tw_s, int max_in_flight, double max_overhead, double step_s) {
  if (!(tw_s > 0) || max_in_flight < 1 || !(max_overhead > 0) || !(step_s > 0)) return 1;
  const double f = std::ceil(tw_s / (max_in_flight * max_overhead * step_s) - 1e-9);
  return static_cast<int>(std::clamp(f, 1.0, 1e9));
}

Result<TuneMeasurements> MeasureForTune(const TuneOptions& o,
                                        const std::function<void(const std::string&)>& progress) {
  NONSTOP_RETURN_IF_ERROR(ValidateOptions(o));
  auto say = [&](const std::string& line) {
    if (progress) progress(line);
  };
  const auto t_begin = Clock::now();
  std::error_code ec;
  fs::create_directories(o.dir, ec);
  if (ec) return Status::IOError("tune: cannot create " + o.dir + ": " + ec.message());
  TuneMeasurements m;
  const fs::space_info space = fs::space(o.dir, ec);
  if (ec) return Status::IOError("tune: cannot stat " + o.dir + ": " + ec.message());
  m.free_bytes = space.available;
  m.ram_bytes = RamBytes();
  const uint64_t storage = o.storage_bytes ? o.storage_bytes : m.free_bytes;
  if (storage / o.state_bytes < 2) {
    return Status::FailedPrecondition(
        "tune: " + o.dir + " has room for fewer than 2 checkpoints of " + Mib(o.state_bytes) +
        " (" + Mib(storage) + " available); free space, pick another --dir or raise --storage");
  }
  m.probe_bytes = std::max<uint64_t>(
      kAlign, RoundDown(std::min<uint64_t>(o.state_bytes, o.probe_cap_bytes), kAlign));
  int n_max = MaxInFlightForStorage(storage, o.state_bytes, o.max_in_flight_cap);
  // The probes themselves need N+1 slots of probe size (and a margin).
  const uint64_t probe_room = m.free_bytes > (64u << 20) ? m.free_bytes - (64u << 20) : 0;
  n_max = std::min(n_max, MaxInFlightForStorage(probe_room, m.probe_bytes, o.max_in_flight_cap));
  if (probe_room / m.probe_bytes < 2) {
    return Status::FailedPrecondition("tune: " + o.dir +
                                      " has no room for two probe checkpoints of " +
                                      Mib(m.probe_bytes) + "; pass a smaller --probe-bytes");
  }

  HostBuffer state(m.probe_bytes);
  if (state.data() == nullptr) {
    return Status::IOError("tune: cannot allocate " + Mib(m.probe_bytes) + " for the probe state");
  }

  // 1. Copy bandwidth per chunk size.
  const uint64_t volume = std::min<uint64_t>(m.probe_bytes, 256ull << 20);
  say("copy bandwidth, " + Mib(volume) + " per chunk size");
  NONSTOP_ASSIGN_OR_RETURN(CopyResult copy, MeasureCopy(o, state, volume));
  m.copy = copy.points;
  m.copy_engine = copy.describe;
  m.device_to_host = copy.device;
  if (m.copy.empty()) {
    // Every candidate chunk is larger than the probe: use one probe-sized chunk.
    m.copy.push_back({m.probe_bytes, 0});
  }
  const uint64_t chunk = ChooseChunkBytes(m.copy);

  // 2. Write bandwidth per writer count (one checkpoint in flight, committed).
  const uint64_t probe_staging = std::max<uint64_t>(
      RoundUp(m.probe_bytes, chunk),
      (static_cast<uint64_t>(*std::max_element(o.writer_counts.begin(), o.writer_counts.end())) +
       2) * chunk);
  for (int p : o.writer_counts) {
    say("write bandwidth, " + std::to_string(p) + " writer(s), chunk " + Mib(chunk));
    NONSTOP_ASSIGN_OR_RETURN(ProbeRun run, RunProbe(o, state, 1, p, chunk, probe_staging,
                                                    o.repeat, /*measure_read=*/false));
    const double best = *std::min_element(run.round_s.begin(), run.round_s.end());
    m.write.push_back({p, best > 0 ? m.probe_bytes / best / 1e9 : 0});
    m.medium = run.medium;
  }
  const int writers = ChooseWriters(m.write);

  // 3. T_w with N = 1 .. n_max in flight.
  for (int n = 1; n <= n_max; ++n) {
    const int rounds = std::max(2, o.repeat);
    say("time to persist, N = " + std::to_string(n) + " in flight, " + std::to_string(rounds) +
        " rounds");
    NONSTOP_ASSIGN_OR_RETURN(ProbeRun run, RunProbe(o, state, n, writers, chunk, probe_staging,
                                                    rounds, /*measure_read=*/n == 1));
    const double tw = Median(run.round_s);
    m.persist.push_back({n, rounds * n, tw, tw / n});
    if (n == 1) m.read_GBps = run.read_GBps;
  }
  m.seconds = Since(t_begin);
  return m;
}

Result<TuneRecommendation> Recommend(const TuneOptions& o, const TuneMeasurements& m) {
  NONSTOP_RETURN_IF_ERROR(ValidateOptions(o));
  if (m.copy.empty() || m.write.empty() || m.persist.empty() || m.probe_bytes == 0) {
    return Status::InvalidArgument("tune: measurements are incomplete");
  }
  TuneRecommendation r;
  const uint64_t storage = o.storage_bytes ? o.storage_bytes : m.free_bytes;
  const int n_cap = MaxInFlightForStorage(storage, o.state_bytes, o.max_in_flight_cap);
  std::vector<PersistPoint> allowed;
  for (const PersistPoint& p : m.persist) {
    if (p.max_in_flight <= n_cap && p.tw_s > 0) allowed.push_back(p);
  }
  if (allowed.empty()) return Status::InvalidArgument("tune: no valid T_w measurement");
  r.max_in_flight = ChooseMaxInFlight(allowed);
  r.writers = ChooseWriters(m.write);
  r.chunk_bytes = ChooseChunkBytes(m.copy);
  for (const CopyPoint& c : m.copy) {
    if (c.chunk_bytes == r.chunk_bytes) r.copy_GBps = c.GBps;
  }
  for (const WritePoint& w : m.write) {
    if (w.writers == r.writers) r.write_GBps = w.GBps;
  }

  // Staging: the memory limit, at least what the pipeline needs (p writing
  // and 2 copying), in whole chunks.
  const uint64_t limit = o.memory_bytes ? o.memory_bytes : DefaultMemoryBytes(o.state_bytes,
                                                                                m.ram_bytes);
  const uint64_t floor_bytes = static_cast<uint64_t>(r.writers + 2) * r.chunk_bytes;
  if (limit < floor_bytes) {
    // Smaller chunks keep the pipeline inside the limit.
    uint64_t b = RoundDown(limit / (r.writers + 2), kAlign);
    if (b < kAlign) {
      return Status::InvalidArgument("tune: memory limit " + Mib(limit) + " is below " +
                                     std::to_string(r.writers + 2) + " chunks of 4 KiB");
    }
    r.notes.push_back("chunk reduced from " + Mib(r.chunk_bytes) + " to " + Mib(b) +
                      " to fit " + std::to_string(r.writers + 2) + " chunks in the memory limit");
    r.chunk_bytes = b;
  }
  r.chunks = std::max<uint64_t>(limit / r.chunk_bytes, r.writers + 2);
  r.staging_bytes = r.chunks * r.chunk_bytes;

  // T_w at the state size: the probe's, scaled linearly when the state is
  // larger (persisting is bandwidth-bound once it is more than a few chunks).
  const PersistPoint* chosen = nullptr;
  for (const PersistPoint& p : allowed) {
    if (p.max_in_flight == r.max_in_flight) chosen = &p;
  }
  const double scale = static_cast<double>(o.state_bytes) / m.probe_bytes;
  r.scaled = scale > 1.0 + 1e-9;
  r.tw_s = chosen->tw_s * std::max(1.0, scale);
  r.tw_per_n_s = r.tw_s / r.max_in_flight;

  // Visible stall: the copy overlaps the next step's compute (the engine waits
  // only before the next update), so the training thread sees what is left
  // of it. With the state larger than staging, the rest is paced by writes.
  const double copy_bw = r.copy_GBps > 0 ? r.copy_GBps * 1e9 : 1e12;
  const double write_bw = r.write_GBps > 0 ? r.write_GBps * 1e9 : 1e12;
  const double m_bytes = static_cast<double>(o.state_bytes);
  const double staged = std::min<double>(m_bytes, static_cast<double>(r.staging_bytes));
  const double copy_s = staged / copy_bw + (m_bytes - staged) / write_bw;
  r.stall_s = std::max(0.0, copy_s - o.step_s);
  if (m_bytes > staged) {
    r.notes.push_back("state is larger than staging: the copy is paced by the medium; a larger "
                      "--memory shortens the stall");
  }

  const double t = o.step_s, q = o.max_overhead;
  const double cost = std::max(r.tw_per_n_s, r.stall_s);  // charged per checkpoint
  r.interval_no_queue = std::max(1, static_cast<int>(std::ceil(r.tw_per_n_s / t - 1e-9)));
  r.interval_overhead = std::max(OverheadInterval(r.tw_s, r.max_in_flight, q, t),
                                 OverheadInterval(r.stall_s, 1, q, t));
  r.restart_s = o.restart_s >= 0 ? o.restart_s
                                 : m_bytes / ((m.read_GBps > 0 ? m.read_GBps : r.write_GBps) * 1e9);
  std::ostringstream why;
  if (o.mtbf_s > 0) {
    const double rate = 1.0 / o.mtbf_s;
    r.young_daly_interval = YoungDalyIntervalSteps(cost, t, rate);
    const int yd = std::max(1, static_cast<int>(std::lround(r.young_daly_interval)));
    SchemeSpec spec;
    spec.name = "tuned";
    spec.kind = SchemeKind::kConcurrent;
    spec.step_s = t;
    spec.stall_s = cost;
    spec.persist_s = r.tw_s;
    spec.max_in_flight = r.max_in_flight;
    spec.restart_s = r.restart_s;
    auto goodput = [&](int f) { return ExpectedGoodputExponential(spec, f, o.mtbf_s) * t; };
    r.goodput_at_overhead_interval = goodput(r.interval_overhead);
    r.goodput_at_young_daly = goodput(yd);
    if (yd > r.interval_overhead && r.goodput_at_young_daly > r.goodput_at_overhead_interval) {
      r.interval = yd;
      r.interval_rule = "young-daly";
      why << "use Young/Daly's " << yd << ": at MTBF " << o.mtbf_s
          << " s failures are rare enough that checkpointing less often than the overhead bound "
          << r.interval_overhead << " loses less to overhead than it adds in lost work (expected "
          << "goodput " << r.goodput_at_young_daly << " vs " << r.goodput_at_overhead_interval
          << " of the failure-free rate)";
    } else {
      r.interval = r.interval_overhead;
      r.interval_rule = "overhead";
      if (yd < r.interval_overhead) {
        why << "use the overhead bound " << r.interval_overhead << ": Young/Daly's " << yd
            << " would checkpoint more often than q = " << q << " allows (and ignores that "
            << "persisting takes T_w = " << r.tw_s << " s); expected goodput "
            << r.goodput_at_overhead_interval << " of the failure-free rate";
      } else {
        why << "use the overhead bound " << r.interval_overhead << ": it is within q = " << q
            << " and its expected goodput " << r.goodput_at_overhead_interval
            << " is at least Young/Daly's " << r.goodput_at_young_daly << " (f = " << yd << ")";
      }
    }
    r.goodput_at_interval = goodput(r.interval);
  } else {
    r.interval = r.interval_overhead;
    r.interval_rule = "overhead";
    why << "f* = ceil(T_w / (N* q t)) = " << r.interval_overhead
        << " is the shortest interval whose persisting stays within q = " << q
        << " of training time; pass --mtbf to weigh it against the work lost per failure";
  }
  r.interval_reason = why.str();
  r.expected_overhead = cost / (r.interval * t);
  if (r.interval < r.interval_no_queue) {
    r.notes.push_back("the interval is shorter than T_w/(N t): checkpoints will queue");
  }
  if (r.scaled) {
    std::ostringstream os;
    os << "T_w measured on a " << Mib(m.probe_bytes) << " probe and scaled by " << scale
       << " to the state size";
    r.notes.push_back(os.str());
  }
  return r;
}

}  // namespace nonstop
