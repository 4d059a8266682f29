// Restore into device tensors (Engine::Restore with tensors whose
// Device is CUDA): chunks are read into staging, verified, and copied to the
// device with CopyToDevice while the next chunks are read. Here the "device"
// is host memory behind a fake copy engine whose host-to-device copies are
// lazy: a copy is in progress from CopyToDevice until its completion is
// waited for, and only then are the bytes moved. So the tests see, without
// timing, whether a read ran while a copy was in progress (the overlap),
// whether a staging buffer was read into while a copy from it was still in
// progress (reuse too early: the device would also get the wrong bytes), and
// whether every copy was waited for before Restore returned.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/damage_step.h"
#include "engine/engine_internal.h"
#include "engine/test_tensor_ref.h"
#include "media/fault_medium.h"
#include "media/medium_wrapper.h"
#include "nonstop/copy_engine.h"
#include "nonstop/crc32c.h"
#include "nonstop/engine.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;

// What the fake device and the observing medium saw, shared between them.
struct Observed {
  std::mutex mu;
  struct Copy {
    const std::byte* src;
    size_t bytes;
  };
  std::vector<Copy> in_progress;  // H2D copies issued and not yet waited for
  uint64_t h2d_copies = 0;
  uint64_t reads_during_copy = 0;  // medium reads that ran while a copy was in progress
  uint64_t max_in_progress = 0;
  std::string violation;  // the first misuse seen

  void Violation(const std::string& what) {
    if (violation.empty()) violation = what;
  }
  bool Overlaps(const void* p, size_t n) {
    auto* b = static_cast<const std::byte*>(p);
    for (const Copy& c : in_progress) {
      if (b < c.src + c.bytes && c.src < b + n) return true;
    }
    return false;
  }
};

// A copy engine whose "device" memory is host memory: device-to-host copies
// (checkpoints) are memcpy; host-to-device copies run when waited for.
class LazyDeviceCopyEngine final : public CopyEngine {
 public:
  explicit LazyDeviceCopyEngine(std::shared_ptr<Observed> seen)
      : host_(MakeHostCopyEngine(0)), seen_(std::move(seen)) {}

  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device&, void* dst,
                                       size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return MakeDoneCopy(Status::OK());
  }
  void* AllocHost(size_t bytes, bool* pinned) override { return host_->AllocHost(bytes, pinned); }
  void FreeHost(void* p, size_t bytes) override { host_->FreeHost(p, bytes); }
  std::string Describe() const override { return "lazy fake device copy engine"; }
  bool CanCopyToDevice(const Device& d) const override { return d.kind == DeviceKind::kCuda; }

  std::unique_ptr<CopyCompletion> CopyToDevice(const void* src, void* dst, const Device& d,
                                               size_t bytes) override {
    std::lock_guard<std::mutex> lock(seen_->mu);
    if (d.kind != DeviceKind::kCuda) seen_->Violation("CopyToDevice into host memory");
    ++seen_->h2d_copies;
    seen_->in_progress.push_back({static_cast<const std::byte*>(src), bytes});
    seen_->max_in_progress = std::max<uint64_t>(seen_->max_in_progress,
                                                seen_->in_progress.size());
    return std::make_unique<Lazy>(seen_, src, dst, bytes,
                                  Crc32c(static_cast<const std::byte*>(src), bytes));
  }

 private:
  class Lazy final : public CopyCompletion {
   public:
    Lazy(std::shared_ptr<Observed> seen, const void* src, void* dst, size_t bytes, uint32_t crc)
        : seen_(std::move(seen)), src_(src), dst_(dst), bytes_(bytes), crc_(crc) {}
    ~Lazy() override {
      if (!done_) {
        std::lock_guard<std::mutex> lock(seen_->mu);
        seen_->Violation("a host-to-device copy was dropped without being waited for");
      }
    }
    Status Wait() override {
      if (done_) return Status::OK();
      std::lock_guard<std::mutex> lock(seen_->mu);
      if (Crc32c(static_cast<const std::byte*>(src_), bytes_) != crc_) {
        seen_->Violation("a staging buffer changed under a host-to-device copy");
      }
      std::memcpy(dst_, src_, bytes_);
      auto& v = seen_->in_progress;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (it->src == src_ && it->bytes == bytes_) {
          v.erase(it);
          break;
        }
      }
      done_ = true;
      return Status::OK();
    }
    bool Ready() override { return done_; }

   private:
    std::shared_ptr<Observed> seen_;
    const void* src_;
    void* dst_;
    size_t bytes_;
    uint32_t crc_;
    bool done_ = false;
  };

  std::unique_ptr<CopyEngine> host_;
  std::shared_ptr<Observed> seen_;
};

// The slot file's medium, noting each read that runs while a host-to-device
// copy is in progress, and any read into memory a copy in progress reads.
class ObservingMedium final : public media::MediumWrapper {
 public:
  ObservingMedium(std::unique_ptr<Medium> inner, std::shared_ptr<Observed> seen)
      : MediumWrapper(std::move(inner)), seen_(std::move(seen)) {}
  Status Read(uint64_t offset, void* buf, size_t n) override {
    {
      std::lock_guard<std::mutex> lock(seen_->mu);
      if (!seen_->in_progress.empty()) ++seen_->reads_during_copy;
      if (seen_->Overlaps(buf, n)) seen_->Violation("a read into a buffer a copy still reads");
    }
    return MediumWrapper::Read(offset, buf, n);
  }

 private:
  std::shared_ptr<Observed> seen_;
};

struct Rig {
  std::shared_ptr<FaultDisk> disk = FaultDisk::Create();
  std::shared_ptr<Observed> seen = std::make_shared<Observed>();
  EngineMedia Media() {
    EngineMedia m;
    auto d = disk;
    auto s = seen;
    m.wrap = [d, s](std::unique_ptr<Medium>, const std::string& name,
                    bool created) -> Result<std::unique_ptr<Medium>> {
      if (!created && d->size() == 0) return Status::NotFound(name + " does not exist");
      return std::unique_ptr<Medium>(std::make_unique<ObservingMedium>(d->Open(), s));
    };
    m.copy = [s](int) -> std::unique_ptr<CopyEngine> {
      return std::make_unique<LazyDeviceCopyEngine>(s);
    };
    return m;
  }
};

// A tensor in "device" memory (host bytes the engine only reaches through the
// copy engine).
struct DeviceTensor {
  std::string name;
  std::vector<uint8_t> data;
  void Fill(int64_t step) {
    for (size_t i = 0; i < data.size(); ++i) {
      data[i] = static_cast<uint8_t>((i * 2654435761u + static_cast<uint64_t>(step) * 40503u) >> 7);
    }
  }
  TensorRef Ref(DeviceKind kind) {
    TensorRef r = ByteTensorRef(name, data);
    r.device = Device{kind, 0, 0};
    return r;
  }
};

class RestoreDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("nonstop_restore_device_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  EngineOptions Options(int writers) const {
    EngineOptions o;
    o.dir = dir_.string();
    o.medium = MediumKind::kBuffered;
    o.chunk_bytes = 64 << 10;
    o.staging_bytes = 1 << 20;
    o.writers = writers;
    o.max_in_flight = 1;  // two slots
    o.memory_tier = "disk";
    return o;
  }
  // Checkpoints `steps` of {a, b, c} (from host memory) into the rig's disk.
  void Write(Rig& rig, std::vector<DeviceTensor>& ts, const std::vector<int64_t>& steps) {
    auto engine = std::move(OpenEngine(Options(2), rig.Media())).value();
    std::vector<TensorRef> refs;
    for (auto& t : ts) refs.push_back(t.Ref(DeviceKind::kHost));
    ASSERT_TRUE(engine->Register(refs).ok());
    for (int64_t step : steps) {
      for (auto& t : ts) t.Fill(step);
      ASSERT_TRUE(engine->Checkpoint(step, "").ok());
      ASSERT_TRUE(engine->WaitCommitted().ok());
    }
    ASSERT_TRUE(engine->Close().ok());
  }
  // An engine (2 writers) with every tensor of `dev` registered on the device.
  void OpenOnDevice(Rig& rig, std::vector<DeviceTensor>& dev, std::unique_ptr<Engine>* engine) {
    *engine = std::move(OpenEngine(Options(2), rig.Media())).value();
    std::vector<TensorRef> refs;
    for (auto& t : dev) refs.push_back(t.Ref(DeviceKind::kCuda));
    ASSERT_TRUE((*engine)->Register(refs).ok());
  }
  fs::path dir_;
};

std::vector<DeviceTensor> Tensors() {
  // A large tensor over many chunks (not a multiple of 4 KiB), a mid-sized
  // one, and a small one packed with others into a chunk.
  return {DeviceTensor{"w", std::vector<uint8_t>(1000003)},
          DeviceTensor{"m", std::vector<uint8_t>(200000)},
          DeviceTensor{"b", std::vector<uint8_t>(100)}};
}

void ExpectAllCopiesWaited(Observed& seen) {
  std::lock_guard<std::mutex> lock(seen.mu);
  EXPECT_TRUE(seen.in_progress.empty())
      << seen.in_progress.size() << " host-to-device copies still in progress after Restore";
  EXPECT_EQ(seen.violation, "");
}

TEST_F(RestoreDeviceTest, RestoresDeviceTensorsBitwiseWithReadsOverlappingTheCopies) {
  for (int writers : {1, 3}) {
    SCOPED_TRACE("writers " + std::to_string(writers));
    fs::remove_all(dir_);
    Rig rig;
    std::vector<DeviceTensor> src = Tensors();
    Write(rig, src, {4});
    std::vector<DeviceTensor> expect = Tensors();
    for (auto& t : expect) t.Fill(4);

    std::vector<DeviceTensor> dev = Tensors();  // zeros: the restore must fill them
    auto engine = std::move(OpenEngine(Options(writers), rig.Media())).value();
    std::vector<TensorRef> refs;
    for (auto& t : dev) refs.push_back(t.Ref(DeviceKind::kCuda));
    ASSERT_TRUE(engine->Register(refs).ok());
    {
      std::lock_guard<std::mutex> lock(rig.seen->mu);
      rig.seen->reads_during_copy = 0;
    }
    auto info = engine->Restore();
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(info->step, 4);
    for (size_t i = 0; i < dev.size(); ++i) {
      EXPECT_TRUE(dev[i].data == expect[i].data) << dev[i].name << " differs after the restore";
    }
    ExpectAllCopiesWaited(*rig.seen);
    {
      std::lock_guard<std::mutex> lock(rig.seen->mu);
      // Every chunk's bytes went to the device through CopyToDevice, and the
      // slot file was read while earlier chunks' copies were in progress.
      EXPECT_GT(rig.seen->h2d_copies, 15u);
      EXPECT_GT(rig.seen->reads_during_copy, 5u);
      EXPECT_GT(rig.seen->max_in_progress, 1u);
    }
    const EngineStats st = engine->Stats();
    EXPECT_EQ(st.restore_h2d_bytes, 1000003u + 200000u + 100u);
    EXPECT_GT(st.restore_read_s, 0.0);
    EXPECT_GE(st.restore_h2d_wait_s, 0.0);
    ASSERT_TRUE(engine->Close().ok());
  }
}

TEST_F(RestoreDeviceTest, HostAndDeviceTensorsTogether) {
  Rig rig;
  std::vector<DeviceTensor> src = Tensors();
  Write(rig, src, {6});
  std::vector<DeviceTensor> expect = Tensors();
  for (auto& t : expect) t.Fill(6);
  std::vector<DeviceTensor> dev = Tensors();
  auto engine = std::move(OpenEngine(Options(2), rig.Media())).value();
  ASSERT_TRUE(engine->Register({dev[0].Ref(DeviceKind::kCuda), dev[1].Ref(DeviceKind::kHost),
                                dev[2].Ref(DeviceKind::kCuda)})
                  .ok());
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  for (size_t i = 0; i < dev.size(); ++i) EXPECT_TRUE(dev[i].data == expect[i].data) << i;
  EXPECT_EQ(engine->Stats().restore_h2d_bytes, 1000003u + 100u);
  ExpectAllCopiesWaited(*rig.seen);
}

TEST_F(RestoreDeviceTest, AChecksumMismatchMidRestoreFallsBackWithEveryCopyDone) {
  Rig rig;
  std::vector<DeviceTensor> src = Tensors();
  Write(rig, src, {7, 9});
  DamageStep(*rig.disk, 9, 0.5);  // chunks before it go to the device first
  std::vector<DeviceTensor> expect = Tensors();
  for (auto& t : expect) t.Fill(7);

  std::vector<DeviceTensor> dev = Tensors();
  std::unique_ptr<Engine> engine;
  ASSERT_NO_FATAL_FAILURE(OpenOnDevice(rig, dev, &engine));
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 7) << "the damaged step 9 must not be restored";
  for (size_t i = 0; i < dev.size(); ++i) {
    EXPECT_TRUE(dev[i].data == expect[i].data)
        << dev[i].name << " holds bytes of the damaged checkpoint after the fallback";
  }
  ExpectAllCopiesWaited(*rig.seen);
}

TEST_F(RestoreDeviceTest, AChecksumMismatchWithNothingOlderIsNotReportedRestored) {
  Rig rig;
  std::vector<DeviceTensor> src = Tensors();
  Write(rig, src, {9});
  DamageStep(*rig.disk, 9, 0.5);  // chunks before it go to the device first
  std::vector<DeviceTensor> dev = Tensors();
  std::unique_ptr<Engine> engine;
  ASSERT_NO_FATAL_FAILURE(OpenOnDevice(rig, dev, &engine));
  auto info = engine->Restore();
  ASSERT_FALSE(info.ok()) << "a damaged checkpoint was reported restored";
  EXPECT_NE(info.status().message().find("no valid checkpoint"), std::string::npos)
      << info.status().ToString();
  ExpectAllCopiesWaited(*rig.seen);
}

TEST_F(RestoreDeviceTest, AnEngineThatCannotCopyToTheDeviceRefuses) {
  Rig rig;
  std::vector<DeviceTensor> src = Tensors();
  Write(rig, src, {3});
  std::vector<DeviceTensor> dev = Tensors();
  EngineMedia m = rig.Media();
  m.copy = [](int threads) { return MakeHostCopyEngine(threads); };
  auto engine = std::move(OpenEngine(Options(2), m)).value();
  ASSERT_TRUE(engine->Register({dev[0].Ref(DeviceKind::kCuda), dev[1].Ref(DeviceKind::kHost),
                                dev[2].Ref(DeviceKind::kHost)})
                  .ok());
  auto info = engine->Restore();
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kUnavailable) << info.status().ToString();
  EXPECT_NE(info.status().message().find("'w' is in device memory"), std::string::npos)
      << info.status().ToString();
}

}  // namespace
}  // namespace nonstop
