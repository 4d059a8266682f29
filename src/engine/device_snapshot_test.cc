// Device snapshots of whole checkpoints (EngineOptions::device_snapshot_bytes)
// on a host-backed "device" whose device-to-host copies are 40x slower than
// its device-to-device copies (fake_device_copy_engine.h): WaitCopied()
// waits for the snapshot, not for the copy to the host; the budget decides
// what is snapshotted; a buffer is never written again before it is
// drained; a failed drain fails only its checkpoint; restored bytes are the
// bytes of the step that was checkpointed, although training overwrote the
// tensors right after WaitCopied().
// What a wait includes is asserted by events, not wall times (the TSan build
// is 5-15x slower): the drains are held at a gate until WaitCopied() has
// returned, and the fake counts the bytes each kind of copy has put in place.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/device_snapshot.h"
#include "engine/engine_internal.h"
#include "engine/fake_device_copy_engine.h"
#include "engine/test_tensor_ref.h"
#include "nonstop/engine.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using engine_detail::SnapshotBytesWanted;
using engine_detail::SnapshotRates;

constexpr uint64_t kMiB = 1 << 20;
constexpr double kD2H = 25e6;  // bytes/s: 4 MiB take 168 ms
constexpr double kD2D = 1e9;   // bytes/s: 4 MiB take 4 ms

// The state: two 2 MiB "device" tensors and a small host one (an
// optimizer's step counter), so chunks mix direct and drained pieces.
struct State {
  std::vector<uint8_t> a = std::vector<uint8_t>(2 * kMiB), b = std::vector<uint8_t>(2 * kMiB);
  std::vector<uint8_t> step = std::vector<uint8_t>(64);
  // A pattern that depends on the position (a chunk in the wrong place
  // shows) with the step stamped into every 4 KiB page (so a page of
  // another step shows); cheap enough for the TSan build.
  void Fill(int s) {
    static const std::vector<uint8_t> base_a = Pattern(2 * kMiB, 7), base_b = Pattern(2 * kMiB, 13);
    std::memcpy(a.data(), base_a.data(), a.size());
    std::memcpy(b.data(), base_b.data(), b.size());
    for (size_t page = 0; page < a.size(); page += 4096) {
      std::memset(a.data() + page, s, 8);
      std::memset(b.data() + page + 100, 3 * s, 8);
    }
    std::memset(step.data(), s, step.size());
  }
  static std::vector<uint8_t> Pattern(size_t n, unsigned mul) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * mul) ^ (i >> 12));
    return v;
  }
  static TensorRef Ref(const std::string& name, std::vector<uint8_t>& v, bool device) {
    TensorRef r = ByteTensorRef(name, v);
    if (device) r.device = Device{DeviceKind::kCuda, 0, 0};
    return r;
  }
  std::vector<TensorRef> Refs(bool device) {
    return {Ref("a", a, device), Ref("b", b, device), Ref("step", step, false)};
  }
};

class DeviceSnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nonstop_dsnap_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    log_ = std::make_shared<FakeDeviceLog>();
  }
  void TearDown() override { fs::remove_all(dir_); }
  EngineOptions Options(int64_t budget, int max_in_flight = 1) const {
    EngineOptions o;
    o.dir = dir_.string();
    o.chunk_bytes = 256 << 10;
    o.max_in_flight = max_in_flight;
    o.memory_tier = "disk";
    o.device_snapshot_bytes = budget;
    return o;
  }
  std::unique_ptr<Engine> Open(const EngineOptions& o, double d2h = kD2H) {
    EngineMedia media;
    auto log = log_;
    media.copy = [log, d2h](int) -> std::unique_ptr<CopyEngine> {
      return std::make_unique<FakeDeviceCopyEngine>(d2h, kD2D, uint64_t{1} << 30, log);
    };
    auto e = OpenEngine(o, media);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(e).value() : nullptr;
  }
  // Reads the newest checkpoint through a host engine into `out`.
  void RestoreInto(State& out, int64_t want_step) {
    EngineOptions o = Options(0);
    auto e = Engine::Open(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    ASSERT_TRUE((*e)->Register(out.Refs(false)).ok());
    auto info = (*e)->Restore();
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(info->step, want_step);
    ASSERT_TRUE((*e)->Close().ok());
  }
  struct AtWait {  // when WaitCopied() returned
    double waited = 0;     // seconds it blocked
    uint64_t direct = 0;   // bytes the direct copies had put on the host
    uint64_t drained = 0;  // bytes the drains had put on the host
  };
  // One checkpoint of `s` filled for `step`, then training overwrites the
  // tensors at once. With `hold_drains`, no drain starts before WaitCopied()
  // returned and the tensors were overwritten (FakeDrainGate).
  AtWait CheckpointThenOverwrite(Engine& e, State& s, int step, bool hold_drains = false) {
    s.Fill(step);
    if (hold_drains) log_->drain_gate.Close();
    const uint64_t direct0 = log_->direct_copied.load(), drained0 = log_->drain_copied.load();
    auto c = e.Checkpoint(step, "{}");
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(e.WaitCopied().ok());
    AtWait r;
    r.waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.direct = log_->direct_copied.load() - direct0;
    r.drained = log_->drain_copied.load() - drained0;
    s.Fill(step + 100);  // the next update
    log_->drain_gate.Open();
    return r;
  }
  static void ExpectFilled(const State& got, int step) {
    State want;
    want.Fill(step);
    EXPECT_TRUE(got.a == want.a) << "tensor a differs from step " << step;
    EXPECT_TRUE(got.b == want.b) << "tensor b differs from step " << step;
    EXPECT_TRUE(got.step == want.step) << "tensor step differs from step " << step;
  }
  struct OneRun {
    AtWait at;          // when WaitCopied() returned (the drains held until then)
    CheckpointStats c;  // the checkpoint's
    EngineStats st;
  };
  // One engine with `budget`: checks what Register() holds (`capacity`,
  // the note's start), takes one checkpoint of `step` (training overwrites
  // the tensors at once), closes, and checks what a restore reads.
  OneRun RunOne(int64_t budget, int step, uint64_t capacity, const std::string& note) {
    OneRun r;
    State s;
    auto e = Open(Options(budget));
    if (e == nullptr) return r;
    EXPECT_TRUE(e->Register(s.Refs(true)).ok());
    EXPECT_EQ(e->Stats().device_snapshot_capacity, capacity);
    EXPECT_EQ(e->Stats().device_snapshot_note.rfind(note, 0), 0u) << e->Stats().device_snapshot_note;
    r.at = CheckpointThenOverwrite(*e, s, step, /*hold_drains=*/true);
    EXPECT_EQ(log_->drain_gate.timeouts.load(), 0) << "WaitCopied() waited for a held drain";
    EXPECT_TRUE(e->WaitCommitted().ok());
    r.st = e->Stats();
    EXPECT_EQ(r.st.recent.size(), 1u);
    if (!r.st.recent.empty()) r.c = r.st.recent[0];
    EXPECT_TRUE(e->Close().ok());
    State got;
    RestoreInto(got, step);
    ExpectFilled(got, step);
    return r;
  }
  fs::path dir_;
  std::shared_ptr<FakeDeviceLog> log_;
};

const double kAllDirectS = 4.0 * kMiB / kD2H;  // 168 ms

TEST_F(DeviceSnapshotTest, StallIsTheDeviceCopyNotTheCopyToTheHost) {
  // A quarter of the 1 GiB free: everything fits.
  const OneRun r = RunOne(-1, 1, 4 * kMiB, "on: all");
  EXPECT_TRUE(r.c.committed);
  EXPECT_EQ(r.c.snapshot_bytes, 4 * kMiB);
  EXPECT_EQ(r.c.direct_bytes, 0u);
  // The wait is the snapshot: WaitCopied() returned before the drain put
  // one byte on the host (it was held until then); the drain ran after.
  EXPECT_EQ(r.at.drained, 0u);
  EXPECT_EQ(r.at.direct, 0u);
  EXPECT_GE(r.c.drain_s, kAllDirectS * 0.9);
  EXPECT_EQ(r.st.snapshot_bytes_total, 4 * kMiB);
  EXPECT_EQ(log_->drain_bytes.load(), 4 * kMiB);
  EXPECT_EQ(log_->direct_bytes.load(), 0u);
}

TEST_F(DeviceSnapshotTest, OffTheStallIsTheWholeCopyToTheHost) {
  const OneRun r = RunOne(0, 2, 0, "off (device_snapshot_bytes=0)");
  EXPECT_EQ(r.c.snapshot_bytes, 0u);
  EXPECT_EQ(r.c.direct_bytes, 4 * kMiB);
  // The wait is the whole copy to the host.
  EXPECT_EQ(r.at.direct, 4 * kMiB);
  EXPECT_GE(r.at.waited, kAllDirectS * 0.9);
  EXPECT_EQ(log_->device_allocated.load(), 0u);
}

TEST_F(DeviceSnapshotTest, PartOfTheStateFitsTheRestGoesStraight) {
  const OneRun r = RunOne(static_cast<int64_t>(2 * kMiB + 4096), 3, 2 * kMiB, "partial:");
  EXPECT_EQ(r.c.snapshot_bytes, 2 * kMiB);
  EXPECT_EQ(r.c.direct_bytes, 2 * kMiB);
  // The direct half is waited for, the drained half is not: WaitCopied()
  // returned with the direct copies in place and not one byte drained.
  EXPECT_EQ(r.at.direct, 2 * kMiB);
  EXPECT_EQ(r.at.drained, 0u);
  EXPECT_GE(r.at.waited, kAllDirectS / 2 * 0.9);
  EXPECT_EQ(log_->direct_bytes.load(), 2 * kMiB);
  EXPECT_EQ(log_->drain_bytes.load(), 2 * kMiB);
}

TEST_F(DeviceSnapshotTest, NothingFitsEverythingGoesStraight) {
  const OneRun r = RunOne(static_cast<int64_t>(kMiB), 4, 0, "off: no device tensor fits");
  EXPECT_EQ(r.c.direct_bytes, 4 * kMiB);
  EXPECT_EQ(r.at.direct, 4 * kMiB);
  EXPECT_GE(r.at.waited, kAllDirectS * 0.9);
  EXPECT_EQ(log_->device_allocated.load(), 0u);
}

TEST_F(DeviceSnapshotTest, ABufferIsNotWrittenAgainBeforeItIsDrained) {
  // Two in flight: the second checkpoint comes while the first still drains
  // (420 ms at 10 MB/s): it must not take the snapshot set, and goes
  // straight instead.
  State s;
  auto e = Open(Options(-1, /*max_in_flight=*/2), /*d2h=*/10e6);
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(e->Register(s.Refs(true)).ok());
  for (int step = 10; step < 16; ++step) CheckpointThenOverwrite(*e, s, step);
  ASSERT_TRUE(e->WaitCommitted().ok());
  const EngineStats st = e->Stats();
  EXPECT_EQ(log_->overwrites.load(), 0);
  EXPECT_GT(st.snapshot_busy, 0u);
  EXPECT_GT(st.snapshot_bytes_total, 0u);
  EXPECT_EQ(st.committed + st.superseded, 6u);
  EXPECT_EQ(st.failed, 0u);
  EXPECT_EQ(st.snapshot_bytes_total + st.direct_bytes_total, 6 * 4 * kMiB);
  EXPECT_EQ(log_->drain_bytes.load(), st.snapshot_bytes_total);
  ASSERT_TRUE(e->Close().ok());
  State got;
  RestoreInto(got, 15);
  ExpectFilled(got, 15);
}

TEST_F(DeviceSnapshotTest, AFailedDrainFailsOnlyItsCheckpoint) {
  State s;
  auto e = Open(Options(-1));
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(e->Register(s.Refs(true)).ok());
  CheckpointThenOverwrite(*e, s, 20);
  ASSERT_TRUE(e->WaitCommitted().ok());
  const uint64_t good = e->Latest()->counter;
  log_->fail_drain_at = log_->drain_calls.load() + 3;  // inside the next checkpoint's drain
  s.Fill(21);
  auto bad = e->Checkpoint(21, "{}");
  ASSERT_TRUE(bad.ok());
  EXPECT_TRUE(e->WaitCopied().ok());
  s.Fill(121);
  const Status st = e->WaitCommitted(*bad);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find("injected drain failure"), std::string::npos) << st.ToString();
  ASSERT_TRUE(e->Latest().has_value());
  EXPECT_EQ(e->Latest()->counter, good);
  const EngineStats stats = e->Stats();
  ASSERT_EQ(stats.recent.size(), 2u);
  EXPECT_FALSE(stats.recent[1].committed);
  EXPECT_EQ(stats.failed, 1u);
  // The previous checkpoint is what a restore finds now.
  ASSERT_TRUE(e->Close().ok());
  {
    State got;
    RestoreInto(got, 20);
    ExpectFilled(got, 20);
  }
  // And the snapshot set is free again: the next checkpoint snapshots and commits.
  auto e2 = Open(Options(-1));
  ASSERT_NE(e2, nullptr);
  ASSERT_TRUE(e2->Register(s.Refs(true)).ok());
  CheckpointThenOverwrite(*e2, s, 22);
  ASSERT_TRUE(e2->WaitCommitted().ok());
  EXPECT_EQ(e2->Stats().recent.at(0).snapshot_bytes, 4 * kMiB);
  ASSERT_TRUE(e2->Close().ok());
  State got;
  RestoreInto(got, 22);
  ExpectFilled(got, 22);
}

TEST_F(DeviceSnapshotTest, WhatReachesTheHostBeforeTheNextUpdateGoesStraight) {
  // The next step's forward and backward (between Checkpoint() and
  // WaitCopied()) last twice as long as the checkpoint's copy to the host
  // and commit, however slow this build is: the test waits for the commit,
  // then as long again. Once the engine has measured that (the first
  // checkpoint snapshots all it can), it snapshots nothing.
  State s;
  auto e = Open(Options(-1));
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(e->Register(s.Refs(true)).ok());
  for (int step = 30; step < 34; ++step) {
    s.Fill(step);
    ASSERT_TRUE(e->Checkpoint(step, "{}").ok());
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(e->WaitCommitted().ok());
    std::this_thread::sleep_for(std::chrono::steady_clock::now() - t0);  // forward, backward
    ASSERT_TRUE(e->WaitCopied().ok());
    s.Fill(step + 100);
  }
  const EngineStats st = e->Stats();
  ASSERT_EQ(st.recent.size(), 4u);
  EXPECT_EQ(st.recent[0].snapshot_bytes, 4 * kMiB);  // nothing measured yet
  EXPECT_EQ(st.recent[3].snapshot_bytes, 0u);
  EXPECT_EQ(st.recent[3].direct_bytes, 4 * kMiB);
  ASSERT_TRUE(e->Close().ok());
  State got;
  RestoreInto(got, 33);
  ExpectFilled(got, 33);
}

TEST(DeviceSnapshotPlan, SnapshotsWhatCannotReachTheHostInTheWindow) {
  // Not measured: all the buffers hold.
  EXPECT_EQ(SnapshotBytesWanted(1000, 600, SnapshotRates{}), 600u);
  EXPECT_EQ(SnapshotBytesWanted(1000, 0, SnapshotRates{}), 0u);
  EXPECT_EQ(SnapshotBytesWanted(0, 600, SnapshotRates{}), 0u);
  // 1000 bytes at 100 B/s = 10 s; a 10 s window: nothing to snapshot.
  EXPECT_EQ(SnapshotBytesWanted(1000, 1000, SnapshotRates{100, 1e9, 10}), 0u);
  // A 6 s window: 400 bytes must leave the direct copies (d2d ~free).
  const uint64_t s = SnapshotBytesWanted(1000, 1000, SnapshotRates{100, 1e9, 6});
  EXPECT_GE(s, 400u);
  EXPECT_LE(s, 401u);
  // d2d at 1000 B/s: each snapshotted byte saves 0.009 s: 4 / 0.009 = 445.
  EXPECT_EQ(SnapshotBytesWanted(1000, 1000, SnapshotRates{100, 1000, 6}), 445u);
  // More than the capacity: the capacity.
  EXPECT_EQ(SnapshotBytesWanted(1000, 300, SnapshotRates{100, 1e9, 6}), 300u);
  // A snapshot no faster than the copy to the host saves nothing.
  EXPECT_EQ(SnapshotBytesWanted(1000, 1000, SnapshotRates{100, 100, 6}), 0u);
}

}  // namespace
}  // namespace nonstop
