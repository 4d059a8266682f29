// Layer-wise checkpoints (BeginCheckpoint / CopyTensors / WaitTensorsCopied /
// EndCheckpoint): the unit plan, crc combination, and the consistency rule
// under random concurrency: every tensor in the checkpoint of step s holds
// its step-s value, whatever order tensors are updated and copied in, for
// every copy strategy. Run under TSan by `make test-tsan` (label: concurrency).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "copy/cuda_copy_engine.h"
#include "engine/engine_internal.h"
#include "engine/fake_copy_queue.h"
#include "engine/layerwise_plan.h"
#include "media/fault_medium.h"
#include "nonstop/engine.h"

namespace nonstop {
namespace {

TEST(Crc32cCombineTest, EqualsTheCrcOfTheConcatenation) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<uint8_t> a(rng() % 9000), b(rng() % 9000);
    for (auto& x : a) x = static_cast<uint8_t>(rng());
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    std::vector<uint8_t> ab(a);
    ab.insert(ab.end(), b.begin(), b.end());
    EXPECT_EQ(Crc32cCombine(Crc32c(a.data(), a.size()), Crc32c(b.data(), b.size()), b.size()),
              Crc32c(ab.data(), ab.size()));
  }
}

TensorSpec Spec(const std::string& name, int64_t n) {
  TensorSpec s;
  s.name = name;
  s.dtype = DType::kUInt8;
  s.shape = {n};
  s.nbytes = static_cast<uint64_t>(n);
  return s;
}

TEST(LayerPlanTest, UnitsTileTheRegionAlignedAndOneTensorEach) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 100; ++round) {
    std::vector<TensorSpec> specs;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int t = 0; t < n; ++t) {
      const int64_t bytes = rng() % 2 ? 1 + rng() % 70000 : 65536 + rng() % 400000;
      specs.push_back(Spec("t" + std::to_string(t), bytes));
    }
    auto layout = SlotLayout::Plan(specs);
    ASSERT_TRUE(layout.ok());
    const uint64_t chunk = 4096 * (1 + rng() % 40);
    const LayerPlan plan = LayerPlan::Build(*layout, chunk);
    uint64_t at = 0;
    for (const LayerUnit& u : plan.units) {
      EXPECT_EQ(u.slot_offset, at);
      EXPECT_EQ(u.slot_offset % 4096, 0u);
      EXPECT_EQ(u.bytes % 4096, 0u);
      EXPECT_EQ(u.chunk, u.slot_offset / chunk);
      EXPECT_LE(u.slot_offset + u.bytes, (u.chunk + 1) * chunk);
      if (u.tensor >= 0) {
        const TensorEntry& e = layout->tensors[u.tensor];
        EXPECT_EQ(u.slot_offset, e.data_offset + u.tensor_offset);
        EXPECT_LE(u.tensor_offset + u.tensor_bytes, e.spec.nbytes);
        // Only the last unit of a tensor carries padding.
        if (u.tensor_bytes < u.bytes) {
          EXPECT_EQ(u.tensor_offset + u.tensor_bytes, e.spec.nbytes);
        }
      } else {
        EXPECT_GE(u.slot_offset, plan.small_begin);
      }
      at += u.bytes;
    }
    EXPECT_EQ(at, layout->data_bytes);
    // The combined unit crcs are the chunk crcs of the whole region.
    std::vector<uint8_t> region(layout->data_bytes);
    for (auto& x : region) x = static_cast<uint8_t>(rng());
    std::vector<uint32_t> unit_crcs;
    for (const LayerUnit& u : plan.units) {
      unit_crcs.push_back(Crc32c(region.data() + u.slot_offset, u.bytes));
    }
    const std::vector<uint32_t> crcs = plan.ChunkCrcs(unit_crcs);
    ASSERT_EQ(crcs.size(), (layout->data_bytes + chunk - 1) / chunk);
    for (size_t j = 0; j < crcs.size(); ++j) {
      const uint64_t len = std::min<uint64_t>(chunk, layout->data_bytes - j * chunk);
      EXPECT_EQ(crcs[j], Crc32c(region.data() + j * chunk, len)) << "chunk " << j;
    }
  }
}

// ---- routing: host memory never takes a CUDA-only path -----------------------

TEST(LayerRouteTest, HostMemoryNeverTakesACudaRoute) {
  for (LayerCopy c : {LayerCopy::kHost, LayerCopy::kDirect, LayerCopy::kDevice}) {
    for (bool aligned : {false, true}) {
      for (bool buffer : {false, true}) {
        const LayerRoute host = ChooseLayerRoute(c, DeviceKind::kHost, aligned, buffer);
        EXPECT_NE(host, LayerRoute::kDeviceSnapshot) << LayerCopyName(c);
        const LayerRoute cuda = ChooseLayerRoute(c, DeviceKind::kCuda, aligned, buffer);
        EXPECT_NE(cuda, LayerRoute::kDirect) << "device memory cannot be written by the writers";
        EXPECT_NE(cuda, LayerRoute::kHostSnapshot) << "device memory cannot be memcpy'd";
      }
    }
  }
  // The table itself.
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kHost, DeviceKind::kHost, false, false), LayerRoute::kStage);
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kHost, DeviceKind::kCuda, false, true), LayerRoute::kStage);
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kDirect, DeviceKind::kHost, false, false),
            LayerRoute::kDirect);
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kDirect, DeviceKind::kHost, true, false),
            LayerRoute::kStage);  // O_DIRECT needs aligned buffers
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kDirect, DeviceKind::kCuda, false, false),
            LayerRoute::kStage);
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kDevice, DeviceKind::kHost, false, false),
            LayerRoute::kHostSnapshot);
  // A host snapshot of a CUDA tensor (copy_at_checkpoint) is host memory even
  // though the registration gave the tensor a device buffer.
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kDevice, DeviceKind::kHost, false, true),
            LayerRoute::kHostSnapshot);
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kDevice, DeviceKind::kCuda, false, true),
            LayerRoute::kDeviceSnapshot);
  EXPECT_EQ(ChooseLayerRoute(LayerCopy::kDevice, DeviceKind::kCuda, true, false),
            LayerRoute::kStage);
}

// ---- a CUDA copy engine without a GPU -------------------------------------------
//
// "Device memory" is host memory here; copies from it run later, on a thread,
// after a random delay, as DMA on a copy stream would, and complete through
// their completion only. So the engine's CUDA paths (device snapshots, drains,
// staged copies of device memory, copy_at_checkpoint of device tensors) are
// checked for consistency on a machine with no GPU, and every CUDA-only call
// made with host memory is counted as a violation.
// A device stream without a GPU: its work runs on its own thread, in order,
// sometimes late, so work enqueued on it lands after the enqueuing call
// returned. Its address is the Device::stream handle.
class FakeStream {
 public:
  FakeStream() : thread_([this] { Run(); }) {}
  ~FakeStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Returns the position of `work` (1, 2, ...).
  uint64_t Enqueue(std::function<void()> work) {
    uint64_t pos;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(work));
      pos = ++enqueued_;
    }
    cv_.notify_all();
    return pos;
  }
  uint64_t Enqueued() {
    std::lock_guard<std::mutex> lock(mu_);
    return enqueued_;
  }
  void WaitExecuted(uint64_t pos) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return executed_ >= pos; });
  }
  void Synchronize() { WaitExecuted(Enqueued()); }
  uintptr_t handle() { return reinterpret_cast<uintptr_t>(this); }
  static FakeStream* From(uintptr_t handle) { return reinterpret_cast<FakeStream*>(handle); }

 private:
  void Run() {
    std::mt19937_64 rng(17);
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
      work();
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++executed_;
      }
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // GUARDED_BY(mu_)
  uint64_t enqueued_ = 0;                    // GUARDED_BY(mu_)
  uint64_t executed_ = 0;                    // GUARDED_BY(mu_)
  bool stop_ = false;                        // GUARDED_BY(mu_)
  std::thread thread_;
};

struct FakeCudaCounters {
  std::atomic<int> device_copies{0}, host_copies{0}, snapshots{0}, drains{0}, device_allocs{0};
  std::atomic<int> stream_waits{0};
  std::atomic<int> violations{0};
  std::mutex mu;
  std::string first_violation;  // GUARDED_BY(mu)
  void Violation(const std::string& what) {
    ++violations;
    std::lock_guard<std::mutex> lock(mu);
    if (first_violation.empty()) first_violation = what;
  }
};

class FakeCudaCopyEngine final : public CudaCopyEngine {
 public:
  // DMA starts late: the training thread must not touch the source before
  // the completion says so.
  explicit FakeCudaCopyEngine(std::shared_ptr<FakeCudaCounters> counters)
      : counters_(std::move(counters)), queue_([rng = std::mt19937_64(5)]() mutable {
          if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400));
        }) {}

  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device& dev, void* dst,
                                       size_t bytes) override {
    if (dev.kind == DeviceKind::kHost) {
      ++counters_->host_copies;
      if (bytes > 0) std::memcpy(dst, src, bytes);
      return Async(nullptr, nullptr, 0);
    }
    ++counters_->device_copies;
    return Async(src, dst, bytes, Status::OK(), After(dev));
  }
  void* AllocHost(size_t bytes, bool* pinned) override {
    if (pinned != nullptr) *pinned = true;
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (p != nullptr) std::memset(p, 0, bytes);
    return p;
  }
  void FreeHost(void* p, size_t) override { std::free(p); }
  std::string Describe() const override { return "fake cuda copy engine (no GPU)"; }
  void* AllocDevice(int, size_t bytes) override {
    ++counters_->device_allocs;
    return std::calloc(1, bytes);
  }
  void FreeDevice(int, void* p) override { std::free(p); }
  std::unique_ptr<CopyCompletion> SnapshotToDevice(const void* src, const Device& dev, void* dst,
                                                   size_t bytes) override {
    ++counters_->snapshots;
    if (dev.kind != DeviceKind::kCuda) {
      counters_->Violation("SnapshotToDevice of host memory");
      return Async(nullptr, nullptr, 0, Status::InvalidArgument("SnapshotToDevice of host memory"));
    }
    return Async(src, dst, bytes, Status::OK(), After(dev));
  }
  std::unique_ptr<CopyCompletion> DrainToHost(const void* src, int, void* dst,
                                              size_t bytes) override {
    ++counters_->drains;
    return Async(src, dst, bytes);
  }
  Status RegisterHostRegion(void*, size_t) override {
    counters_->Violation("RegisterHostRegion");
    return Status::Unavailable("fake");
  }
  Status UnregisterHostRegion(void*) override { return Status::Unavailable("fake"); }
  bool CanOrderStreams(const Device& dev) const override { return dev.kind == DeviceKind::kCuda; }
  // The stream's later work waits for the copy on the stream's thread; the
  // caller does not wait.
  Status StreamWaitFor(CopyCompletion* c, const Device& dev) override {
    auto* completion = dynamic_cast<FakeCopyQueue::Completion*>(c);
    if (dev.kind != DeviceKind::kCuda || dev.stream == 0 || completion == nullptr) {
      counters_->Violation("StreamWaitFor without a device stream or a completion of this engine");
      return Status::InvalidArgument("fake StreamWaitFor");
    }
    ++counters_->stream_waits;
    std::shared_ptr<FakeCopyQueue::State> state = completion->state();
    FakeStream::From(dev.stream)->Enqueue([state] {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->done; });
    });
    return Status::OK();
  }
  uintptr_t CopyStream(int) override { return 0; }
  PinStats pin_stats() const override { return {}; }

 private:
  // A copy from device memory is ordered after the work already enqueued on
  // the caller's stream, like the CUDA engine's event.
  static std::pair<FakeStream*, uint64_t> After(const Device& dev) {
    if (dev.kind != DeviceKind::kCuda || dev.stream == 0) return {nullptr, 0};
    FakeStream* s = FakeStream::From(dev.stream);
    return {s, s->Enqueued()};
  }

  std::unique_ptr<CopyCompletion> Async(const void* src, void* dst, size_t bytes,
                                        Status status = Status::OK(),
                                        std::pair<FakeStream*, uint64_t> after = {nullptr, 0}) {
    FakeCopyQueue::Task t{src, dst, bytes, std::move(status), {}, {}};
    if (after.first != nullptr) {
      t.before = [stream = after.first, pos = after.second] { stream->WaitExecuted(pos); };
    }
    return queue_.Enqueue(std::move(t));
  }

  std::shared_ptr<FakeCudaCounters> counters_;
  FakeCopyQueue queue_;
};

// Aborts the test binary with what it was doing when a case runs past its
// limit, so a hang (seen once on a GPU machine, docs/CUDA.md) is reported
// with its place instead of stopping CTest at its timeout.
class Watchdog {
 public:
  Watchdog(std::string name, int seconds) : name_(std::move(name)) {
    thread_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::seconds(seconds), [&] { return done_; })) {
        std::fprintf(stderr, "layerwise_test: %s stuck for %d s at: %s\n", name_.c_str(), seconds,
                     where_.c_str());
        std::fflush(stderr);
        std::abort();
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void At(std::string where) {
    std::lock_guard<std::mutex> lock(mu_);
    where_ = std::move(where);
  }

 private:
  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;      // GUARDED_BY(mu_)
  std::string where_;      // GUARDED_BY(mu_)
  std::thread thread_;
};

// Delays each write by a random time so units and checkpoints finish out of
// order, and copies lag behind the training thread.
class DelayMedium final : public Medium {
 public:
  DelayMedium(std::unique_ptr<Medium> inner, uint64_t seed) : inner_(std::move(inner)), seed_(seed) {}
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    thread_local std::mt19937_64 rng(seed_ ^
                                     std::hash<std::thread::id>()(std::this_thread::get_id()));
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 32 == 0 ? 5000 : rng() % 300));
    return inner_->Write(offset, buf, n);
  }
  Status Read(uint64_t offset, void* buf, size_t n) override { return inner_->Read(offset, buf, n); }
  Status Sync() override { return inner_->Sync(); }
  Status Resize(uint64_t size) override { return inner_->Resize(size); }
  uint64_t Size() const override { return inner_->Size(); }
  size_t Alignment() const override { return inner_->Alignment(); }
  MediumKind kind() const override { return inner_->kind(); }
  std::string Describe() const override { return "delayed " + inner_->Describe(); }

 private:
  std::unique_ptr<Medium> inner_;
  const uint64_t seed_;
};

EngineMedia Media(const std::shared_ptr<FaultDisk>& disk, uint64_t seed,
                  std::shared_ptr<FakeCudaCounters> fake_cuda = nullptr) {
  EngineMedia m;
  if (fake_cuda) {
    m.copy = [fake_cuda](int) -> std::unique_ptr<CopyEngine> {
      return std::make_unique<FakeCudaCopyEngine>(fake_cuda);
    };
  }
  // The slot file's bytes go to the disk; the job directory itself is real.
  m.wrap = [disk, seed](std::unique_ptr<Medium>, const std::string& name,
                        bool created) -> Result<std::unique_ptr<Medium>> {
    if (!created && disk->size() == 0) return Status::NotFound(name + " does not exist");
    return std::unique_ptr<Medium>(std::make_unique<DelayMedium>(disk->Open(), seed));
  };
  return m;
}

uint64_t Word(int64_t step, size_t tensor, size_t i) {
  uint64_t x = static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull ^ (tensor << 40) ^ i;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

struct Model {
  std::vector<std::vector<uint64_t>> tensors;
  std::vector<bool> at_checkpoint;  // copy_at_checkpoint (changed outside the updates)
  std::vector<bool> on_device;      // registered as CUDA memory (fake CUDA engine only)
  uintptr_t stream = 0;             // their stream (a FakeStream), 0 for none

  void Fill(size_t t, int64_t step) {
    for (size_t i = 0; i < tensors[t].size(); ++i) tensors[t][i] = Word(step, t, i);
  }
  std::vector<TensorRef> Refs() {
    std::vector<TensorRef> refs;
    for (size_t t = 0; t < tensors.size(); ++t) {
      TensorRef r;
      r.spec.name = "t" + std::to_string(t);
      r.spec.dtype = DType::kUInt64;
      r.spec.shape = {static_cast<int64_t>(tensors[t].size())};
      r.spec.nbytes = tensors[t].size() * 8;
      r.data = tensors[t].data();
      r.copy_at_checkpoint = at_checkpoint[t];
      if (t < on_device.size() && on_device[t]) r.device = Device{DeviceKind::kCuda, 0, stream};
      refs.push_back(r);
    }
    return refs;
  }
};

struct Case {
  LayerCopy copy;
  size_t alignment;  // of the medium: 4096 makes kDirect fall back to staging
  // 0: the build's own copy engine (CUDA where a GPU is present); 1: the fake
  // CUDA engine with host tensors; 2: the fake CUDA engine with about half
  // of the tensors (always tensor 0, a copy_at_checkpoint one) on the "device".
  int fake_cuda = 0;
  // The training thread waits with WaitTensorsCopiedOnStream on a FakeStream
  // and enqueues the updates of device tensors on it (fake CUDA engine only).
  bool on_stream = false;
};

class LayerwiseConsistencyTest : public ::testing::TestWithParam<Case> {};

// The training thread updates tensors in a random order each step, waiting
// only for each tensor's own copy; checkpoints are begun at random steps,
// copies requested right after each update (or left to EndCheckpoint), and
// writes are randomly delayed. Every checkpoint still stored must hold, for
// every tensor, exactly its value at the checkpoint's step (the synchronous
// reference: Word(step, t, i)).
TEST_P(LayerwiseConsistencyTest, EveryTensorHoldsItsStepValue) {
  const Case param = GetParam();
  const std::string name = std::string(LayerCopyName(param.copy)) + " align " +
                           std::to_string(param.alignment) + " fake_cuda " +
                           std::to_string(param.fake_cuda) +
                           (param.on_stream ? " on_stream" : "");
  Watchdog watchdog(name, 120);
  auto counters = param.fake_cuda ? std::make_shared<FakeCudaCounters>() : nullptr;
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::mt19937_64 rng(99 + round * 31 + static_cast<int>(param.copy));
    FaultDiskOptions fo;
    fo.alignment = param.alignment;
    auto disk = FaultDisk::Create(fo);
    Model m;
    const int n = 2 + static_cast<int>(rng() % 10);
    for (int t = 0; t < n; ++t) {
      const size_t words = rng() % 3 == 0 ? 1 + rng() % 1000 : 8192 + rng() % 30000;
      m.tensors.emplace_back(words);
      m.at_checkpoint.push_back(t == 0 || rng() % 8 == 0);
      m.on_device.push_back(param.fake_cuda == 2 && (t == 0 || rng() % 2 == 0));
      m.Fill(t, 0);
    }
    // Declared after the model and before the engine: destroyed after the
    // engine's copies (which may wait on it) and before the model it writes.
    std::unique_ptr<FakeStream> stream;
    if (param.on_stream) {
      stream = std::make_unique<FakeStream>();
      m.stream = stream->handle();
    }
    // An update: device tensors on the stream (it lands later), host tensors now.
    auto update = [&](uint32_t t, int64_t step) {
      if (stream && m.on_device[t]) {
        stream->Enqueue([&m, t, step] { m.Fill(t, step); });
      } else {
        m.Fill(t, step);
      }
    };
    EngineOptions o;
    o.dir = (std::filesystem::temp_directory_path() /
             ("nonstop_layerwise_test_" + std::to_string(::getpid())))
                .string();
    o.max_in_flight = 1 + static_cast<int>(rng() % 3);
    o.writers = 1 + static_cast<int>(rng() % 3);
    o.chunk_bytes = 4096 * (4 + rng() % 16);
    o.staging_bytes = (o.writers + 2 + rng() % 6) * o.chunk_bytes;
    o.layer_copy = param.copy;
    watchdog.At("round " + std::to_string(round) + ": open");
    auto opened = OpenEngine(o, Media(disk, rng(), counters));
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    auto engine = std::move(opened).value();
    if (round == 0) std::printf("%s: %s\n", name.c_str(), engine->Stats().copy_engine.c_str());
    ASSERT_TRUE(engine->Register(m.Refs()).ok());

    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    int64_t last_ckpt = -1;
    for (int64_t step = 1; step <= 24; ++step) {
      // Tensors not driven by updates change "in the forward pass".
      for (int t = 0; t < n; ++t) {
        if (m.at_checkpoint[t]) update(t, step);
      }
      watchdog.At("round " + std::to_string(round) + " step " + std::to_string(step));
      const bool ckpt = rng() % 2 == 0;
      uint64_t c = 0;
      if (ckpt) {
        auto begun = engine->BeginCheckpoint(step);
        ASSERT_TRUE(begun.ok()) << begun.status().ToString();
        c = *begun;
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (uint32_t t : order) {
        if (m.at_checkpoint[t]) continue;
        if (stream) {
          // Device tensors: the stream waits for the copies, the host goes on.
          ASSERT_TRUE(
              engine->WaitTensorsCopiedOnStream({t}, Device{DeviceKind::kCuda, 0, m.stream}).ok());
        } else {
          ASSERT_TRUE(engine->WaitTensorsCopied({t}).ok());
        }
        update(t, step);  // the update of step `step`
        if (ckpt && rng() % 10 != 0) {
          ASSERT_TRUE(engine->CopyTensors(c, {t}).ok());
        }
        if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 500));
      }
      if (ckpt) {
        Status st = engine->EndCheckpoint(c, step, "{\"step\":" + std::to_string(step) + "}");
        ASSERT_TRUE(st.ok()) << st.ToString();
        last_ckpt = step;
      }
    }
    if (stream) stream->Synchronize();  // the last updates landed
    watchdog.At("round " + std::to_string(round) + ": WaitCommitted");
    ASSERT_TRUE(engine->WaitCommitted(0).ok());
    if (last_ckpt >= 0) {
      auto latest = engine->Latest();
      ASSERT_TRUE(latest.has_value());
      EXPECT_EQ(latest->step, last_ckpt);
    }
    EngineStats stats = engine->Stats();
    EXPECT_EQ(stats.failed, 0u);
    watchdog.At("round " + std::to_string(round) + ": Close");
    ASSERT_TRUE(engine->Close().ok());
    if (last_ckpt < 0) continue;
    watchdog.At("round " + std::to_string(round) + ": verify and restore");

    // Every checkpoint still stored, read back through the store (crcs checked).
    auto file = SlotFile::Open(disk->Open());
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ScanOptions so;
    so.verify_all = true;
    auto report = (*file)->Scan(so);
    ASSERT_TRUE(report.ok());
    int verified = 0;
    for (const ScannedCheckpoint& sc : report->checkpoints) {
      if (sc.state != CheckpointState::kCommitted) {
        // An older record whose slot a newer (maybe superseded) checkpoint
        // took: not a defect, as long as the newest one is intact.
        ASSERT_GE(report->newest_valid, 0);
        EXPECT_LT(sc.info.counter, report->checkpoints[report->newest_valid].info.counter)
            << sc.reason;
        continue;
      }
      const CheckpointInfo& info = sc.info;
      EXPECT_EQ(info.meta_json, "{\"step\":" + std::to_string(info.step) + "}");
      for (int t = 0; t < n; ++t) {
        std::vector<uint64_t> got(m.tensors[t].size());
        ASSERT_TRUE((*file)->ReadTensor(info, info.FindTensor("t" + std::to_string(t)),
                                        got.data()).ok());
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], Word(info.step, t, i))
              << "tensor " << t << " word " << i << " of the checkpoint of step " << info.step;
        }
      }
      ++verified;
    }
    EXPECT_GE(verified, 1);
    EXPECT_EQ(report->checkpoints.front().info.step, last_ckpt);

    // And Restore through a new engine returns the last one.
    Model back = m;
    back.on_device.clear();  // restores go through host memory
    for (auto& t : back.tensors) std::fill(t.begin(), t.end(), 0);
    auto reopened = OpenEngine(o, Media(disk, 1, counters));
    ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
    ASSERT_TRUE((*reopened)->Register(back.Refs()).ok());
    auto restored = (*reopened)->Restore();
    ASSERT_TRUE(restored.ok()) << restored.status().ToString();
    EXPECT_EQ(restored->step, last_ckpt);
    for (int t = 0; t < n; ++t) {
      for (size_t i = 0; i < back.tensors[t].size(); ++i) {
        ASSERT_EQ(back.tensors[t][i], Word(last_ckpt, t, i));
      }
    }
  }
  if (counters) {
    std::lock_guard<std::mutex> lock(counters->mu);
    EXPECT_EQ(counters->violations.load(), 0) << counters->first_violation;
  }
  if (counters) {
    // Stream waits only for device tensors waited for on a stream.
    if (param.on_stream && param.fake_cuda == 2) {
      EXPECT_GT(counters->stream_waits.load(), 0);
    } else {
      EXPECT_EQ(counters->stream_waits.load(), 0);
    }
  }
  if (param.fake_cuda == 1) {
    // Host tensors: no device buffer, no device snapshot, no drain, no copy
    // of device memory.
    EXPECT_EQ(counters->device_allocs.load(), 0);
    EXPECT_EQ(counters->snapshots.load(), 0);
    EXPECT_EQ(counters->drains.load(), 0);
    EXPECT_EQ(counters->device_copies.load(), 0);
  }
  if (param.fake_cuda == 2) {
    EXPECT_GT(counters->device_copies.load(), 0);  // copy_at_checkpoint, small or staged
    if (param.copy == LayerCopy::kDevice) {
      EXPECT_GT(counters->device_allocs.load(), 0);
      EXPECT_GT(counters->snapshots.load(), 0);
      EXPECT_EQ(counters->drains.load(), counters->snapshots.load());
    } else {
      EXPECT_EQ(counters->snapshots.load(), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, LayerwiseConsistencyTest,
                         ::testing::Values(Case{LayerCopy::kHost, 1}, Case{LayerCopy::kHost, 4096},
                                           Case{LayerCopy::kDirect, 1},
                                           Case{LayerCopy::kDirect, 4096},
                                           Case{LayerCopy::kDevice, 1},
                                           Case{LayerCopy::kDevice, 4096},
                                           Case{LayerCopy::kHost, 1, 1},
                                           Case{LayerCopy::kDirect, 1, 1},
                                           Case{LayerCopy::kDevice, 1, 1},
                                           Case{LayerCopy::kHost, 4096, 2},
                                           Case{LayerCopy::kDirect, 1, 2},
                                           Case{LayerCopy::kDevice, 1, 2},
                                           Case{LayerCopy::kDevice, 4096, 2},
                                           Case{LayerCopy::kHost, 1, 1, true},
                                           Case{LayerCopy::kDevice, 1, 1, true},
                                           Case{LayerCopy::kHost, 1, 2, true},
                                           Case{LayerCopy::kHost, 4096, 2, true},
                                           Case{LayerCopy::kDirect, 1, 2, true},
                                           Case{LayerCopy::kDevice, 1, 2, true},
                                           Case{LayerCopy::kDevice, 4096, 2, true}),
                         [](const auto& info) {
                           std::string n = std::string(LayerCopyName(info.param.copy)) + "_align" +
                                           std::to_string(info.param.alignment);
                           if (info.param.fake_cuda == 1) n += "_fakecuda_hosttensors";
                           if (info.param.fake_cuda == 2) n += "_fakecuda_devicetensors";
                           if (info.param.on_stream) n += "_onstream";
                           return n;
                         });

class LayerwiseEngineTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> Open(const std::shared_ptr<FaultDisk>& disk, int max_in_flight = 2) {
    EngineOptions o;
    o.dir = (std::filesystem::temp_directory_path() /
             ("nonstop_layerwise_test_" + std::to_string(::getpid())))
                .string();
    o.max_in_flight = max_in_flight;
    o.writers = 2;
    o.chunk_bytes = 64 << 10;
    o.staging_bytes = 8 * o.chunk_bytes;
    auto e = OpenEngine(o, Media(disk, 3));
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
  Model TwoTensors() {
    Model m;
    m.tensors = {std::vector<uint64_t>(20000), std::vector<uint64_t>(10)};
    m.at_checkpoint = {false, false};
    m.Fill(0, 1);
    m.Fill(1, 1);
    return m;
  }
};

TEST_F(LayerwiseEngineTest, OpenCheckpointsAreRefusedWhereTheyWouldDeadlock) {
  auto disk = FaultDisk::Create();
  Model m = TwoTensors();
  auto engine = Open(disk, 2);
  ASSERT_TRUE(engine->Register(m.Refs()).ok());
  auto a = engine->BeginCheckpoint(1);
  auto b = engine->BeginCheckpoint(2);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(engine->BeginCheckpoint(3).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->Checkpoint(3, "{}").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->Register(m.Refs()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->WaitCommitted(0).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->CopyTensors(*a, {7}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->CopyTensors(12345, {0}).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine->EndCheckpoint(*a, 1, "{}").ok());
  EXPECT_EQ(engine->EndCheckpoint(*a, 1, "{}").code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine->WaitCommitted(*a).ok());
  // Closing with b still open abandons it quietly; a stays the newest.
  EXPECT_TRUE(engine->Close().ok());
  auto file = SlotFile::Open(disk->Open());
  ASSERT_TRUE(file.ok());
  auto report = (*file)->Scan();
  ASSERT_TRUE(report.ok());
  ASSERT_GE(report->newest_valid, 0);
  EXPECT_EQ(report->checkpoints[report->newest_valid].info.step, 1);
}

TEST_F(LayerwiseEngineTest, WriteErrorsAreReturnedAndTheEngineStaysUsable) {
  auto disk = FaultDisk::Create();
  Model m = TwoTensors();
  auto engine = Open(disk, 1);
  ASSERT_TRUE(engine->Register(m.Refs()).ok());
  auto c1 = engine->BeginCheckpoint(1);
  ASSERT_TRUE(c1.ok());
  ASSERT_TRUE(engine->EndCheckpoint(*c1, 1, "{}").ok());
  ASSERT_TRUE(engine->WaitCommitted(*c1).ok());

  disk->InjectError(FaultOp::kWrite, 1, EIO);
  m.Fill(0, 2);
  auto c2 = engine->BeginCheckpoint(2);
  ASSERT_TRUE(c2.ok());
  ASSERT_TRUE(engine->CopyTensors(*c2, {0}).ok());
  ASSERT_TRUE(engine->EndCheckpoint(*c2, 2, "{}").ok());
  Status st = engine->WaitCommitted(*c2);
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_EQ(engine->Latest()->step, 1);

  auto c3 = engine->BeginCheckpoint(3);
  ASSERT_TRUE(c3.ok()) << c3.status().ToString();
  ASSERT_TRUE(engine->EndCheckpoint(*c3, 3, "{}").ok());
  ASSERT_TRUE(engine->WaitCommitted(*c3).ok());
  EXPECT_EQ(engine->Latest()->step, 3);
  EXPECT_TRUE(engine->Close().ok());
}

}  // namespace
}  // namespace nonstop
