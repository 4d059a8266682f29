#include <gtest/gtest.h>
#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <condition_variable>
#include <mutex>
#include <set>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <thread>
#include <vector>

#include "engine/damage_step.h"
#include "engine/engine_internal.h"
#include "engine/preempt.h"
#include "media/fault_medium.h"
#include "media/medium_wrapper.h"
#include "nonstop/engine.h"
#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;

// A tensor the test owns: host bytes whose contents are a function of the step.
struct HostTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;

  void Fill(int64_t step, int salt) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(step * 1000003 + salt * 7919 + i);
  }
  TensorRef Ref(bool copy_now = false) {
    TensorRef r;
    r.spec.name = name;
    r.spec.dtype = DType::kFloat32;
    r.spec.shape = shape;
    r.spec.nbytes = data.size() * sizeof(float);
    r.data = data.data();
    r.copy_at_checkpoint = copy_now;
    return r;
  }
};

HostTensor MakeTensor(const std::string& name, int64_t n) {
  return HostTensor{name, {n}, std::vector<float>(static_cast<size_t>(n))};
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("nonstop_engine_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  EngineOptions Options() {
    EngineOptions o;
    o.dir = dir_.string();
    o.medium = MediumKind::kBuffered;
    o.chunk_bytes = 64 << 10;
    o.staging_bytes = 1 << 20;
    o.writers = 2;
    return o;
  }

  fs::path dir_;
};

TEST_F(EngineTest, CheckpointThenRestoreRoundTrips) {
  auto big = MakeTensor("w", 300000);  // > 4 chunks, 4 KiB aligned in the slot
  auto small = MakeTensor("b", 10);
  auto bn = MakeTensor("bn.running_mean", 33);
  auto engine = std::move(Engine::Open(Options())).value();
  ASSERT_TRUE(engine->Register({big.Ref(), small.Ref(), bn.Ref(/*copy_now=*/true)}).ok());
  big.Fill(7, 1);
  small.Fill(7, 2);
  bn.Fill(7, 3);
  auto c = engine->Checkpoint(7, R"({"step":7})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  bn.Fill(8, 3);  // allowed right after Checkpoint(): copied synchronously
  ASSERT_TRUE(engine->WaitCopied().ok());
  big.Fill(8, 1);
  small.Fill(8, 2);
  ASSERT_TRUE(engine->WaitCommitted(*c).ok());
  ASSERT_TRUE(engine->Latest().has_value());
  EXPECT_EQ(engine->Latest()->counter, *c);
  EXPECT_EQ(engine->Latest()->step, 7);

  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 7);
  EXPECT_EQ(info->meta_json, R"({"step":7})");
  auto want_big = MakeTensor("w", 300000), want_small = MakeTensor("b", 10),
       want_bn = MakeTensor("bn", 33);
  want_big.Fill(7, 1);
  want_small.Fill(7, 2);
  want_bn.Fill(7, 3);
  EXPECT_EQ(big.data, want_big.data);
  EXPECT_EQ(small.data, want_small.data);
  EXPECT_EQ(bn.data, want_bn.data);

  EngineStats s = engine->Stats();
  EXPECT_EQ(s.started, 1u);
  EXPECT_EQ(s.committed, 1u);
  ASSERT_EQ(s.recent.size(), 1u);
  EXPECT_TRUE(s.recent[0].committed);
  EXPECT_GT(s.recent[0].bytes, 300000u * 4);
  EXPECT_FALSE(s.medium.empty());
  EXPECT_TRUE(engine->Close().ok());
  EXPECT_TRUE(engine->Close().ok());
}

TEST_F(EngineTest, ReopenFindsNewestAndContinuesTheCounter) {
  auto t = MakeTensor("x", 5000);
  uint64_t last = 0;
  {
    auto engine = std::move(Engine::Open(Options())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    for (int step = 1; step <= 5; ++step) {
      t.Fill(step, 0);
      auto c = engine->Checkpoint(step, "");
      ASSERT_TRUE(c.ok());
      ASSERT_TRUE(engine->WaitCopied().ok());
      last = *c;
    }
    ASSERT_TRUE(engine->Close().ok());
  }
  auto engine = std::move(Engine::Open(Options())).value();
  ASSERT_TRUE(engine->Latest().has_value());
  EXPECT_EQ(engine->Latest()->counter, last);
  EXPECT_EQ(engine->Latest()->step, 5);
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  t.Fill(0, 0);
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  auto want = MakeTensor("x", 5000);
  want.Fill(5, 0);
  EXPECT_EQ(t.data, want.data);
  // An older step that is still in a slot can be restored by step.
  auto older = engine->Restore(4);
  ASSERT_TRUE(older.ok()) << older.status().ToString();
  want.Fill(4, 0);
  EXPECT_EQ(t.data, want.data);
  auto c = engine->Checkpoint(6, "");
  ASSERT_TRUE(c.ok());
  EXPECT_GT(*c, last);
  ASSERT_TRUE(engine->WaitCommitted().ok());
}

TEST_F(EngineTest, RestoreNamesTheMismatchedTensor) {
  auto t = MakeTensor("layer.weight", 100);
  auto engine = std::move(Engine::Open(Options())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  ASSERT_TRUE(engine->Checkpoint(1, "").ok());
  ASSERT_TRUE(engine->WaitCommitted().ok());
  auto other = MakeTensor("layer.weight", 50);
  other.shape = {5, 10};
  ASSERT_TRUE(engine->Register({other.Ref()}).ok());
  auto r = engine->Restore();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layer.weight"), std::string::npos);
  auto missing = MakeTensor("nope", 100);
  ASSERT_TRUE(engine->Register({missing.Ref()}).ok());
  r = engine->Restore();
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("nope"), std::string::npos);
}

TEST_F(EngineTest, BiggerRegistrationSwapsFilesWithoutLosingTheCommittedOne) {
  auto a = MakeTensor("a", 1000);
  auto engine = std::move(Engine::Open(Options())).value();
  ASSERT_TRUE(engine->Register({a.Ref()}).ok());
  a.Fill(1, 0);
  ASSERT_TRUE(engine->Checkpoint(1, "").ok());
  ASSERT_TRUE(engine->WaitCommitted().ok());
  // Needs bigger slots: a new file under a temp name until its first commit.
  auto big = MakeTensor("a", 200000);
  ASSERT_TRUE(engine->Register({big.Ref()}).ok());
  EXPECT_TRUE(fs::exists(dir_ / (SlotFileName(0) + ".tmp")));
  EXPECT_TRUE(fs::exists(dir_ / SlotFileName(0)));
  EXPECT_EQ(engine->Latest()->step, 1);
  // Until the new file has a commit, Restore still reads the old one.
  auto small_again = MakeTensor("a", 1000);
  ASSERT_TRUE(engine->Register({small_again.Ref()}).ok());
  ASSERT_TRUE(engine->Restore().ok());
  a.Fill(1, 0);
  EXPECT_EQ(small_again.data, a.data);
  ASSERT_TRUE(engine->Register({big.Ref()}).ok());
  big.Fill(2, 0);
  ASSERT_TRUE(engine->Checkpoint(2, "").ok());
  ASSERT_TRUE(engine->WaitCommitted().ok());
  EXPECT_FALSE(fs::exists(dir_ / (SlotFileName(0) + ".tmp")));
  ASSERT_TRUE(engine->Close().ok());
  auto reopened = std::move(Engine::Open(Options())).value();
  EXPECT_EQ(reopened->Latest()->step, 2);
  ASSERT_TRUE(reopened->Register({big.Ref()}).ok());
  big.Fill(0, 0);
  ASSERT_TRUE(reopened->Restore().ok());
  auto want = MakeTensor("a", 200000);
  want.Fill(2, 0);
  EXPECT_EQ(big.data, want.data);
}

uint64_t RssBytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// N checkpoints in flight on a state 8x larger than M: host memory grows by
// at most M plus a small constant (no per-checkpoint copy of the state).
TEST_F(EngineTest, HostMemoryStaysWithinTheStagingBound) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "sanitizer shadow memory makes RSS meaningless";
#endif
  // RSS counts what malloc keeps after a free: glibc raises its mmap
  // threshold after freeing a large block, and each writer thread's arena
  // then keeps its 1 MiB I/O buffers resident (peaks of M + 15 MiB in one
  // run in three, against M + 1.5 MiB otherwise). A fixed threshold makes
  // every large buffer an mmap returned on free, so the peak measures what
  // is live.
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 256 << 10), 1);
  const uint64_t kM = 8 << 20;
  auto state = MakeTensor("state", (64 << 20) / 4);
  state.Fill(1, 0);
  const uint64_t before = RssBytes();
  EngineOptions o = Options();
  o.staging_bytes = kM;
  o.chunk_bytes = 1 << 20;
  o.max_in_flight = 3;
  o.medium = MediumKind::kDirect;
  auto engine = std::move(Engine::Open(o)).value();
  ASSERT_TRUE(engine->Register({state.Ref()}).ok());
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> peak{0};
  std::thread sampler([&] {
    while (!stop.load()) {
      peak.store(std::max(peak.load(), RssBytes()));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  for (int step = 1; step <= 6; ++step) {
    ASSERT_TRUE(engine->Checkpoint(step, "").ok());
  }
  EXPECT_GE(engine->Stats().in_flight, 1);
  ASSERT_TRUE(engine->WaitCommitted().ok());
  stop.store(true);
  sampler.join();
  const uint64_t growth = peak.load() > before ? peak.load() - before : 0;
  EXPECT_LE(growth, kM + (16u << 20)) << "peak RSS grew by " << growth << " bytes";
  EngineStats s = engine->Stats();
  EXPECT_LE(s.staging_bytes, kM);
  EXPECT_EQ(s.committed + s.superseded, 6u);
}

// ---- failures through the fault-injecting disk ----------------------------

struct FaultRig {
  std::shared_ptr<FaultDisk> disk = FaultDisk::Create();
  // The slot file's bytes go to the disk; its name, lock, temp file and
  // rename are real (the job directory).
  EngineMedia Media() {
    EngineMedia m;
    auto d = disk;
    m.wrap = [d](std::unique_ptr<Medium>, const std::string& name,
                 bool created) -> Result<std::unique_ptr<Medium>> {
      if (!created && d->size() == 0) return Status::NotFound(name + " does not exist");
      return d->Open();
    };
    return m;
  }
};

TEST_F(EngineTest, FailedWriteKeepsThePreviousCheckpointAndTheEngineUsable) {
  for (int err : {EIO, ENOSPC}) {
    FaultRig rig;
    auto t = MakeTensor("t", 100000);
    auto engine = std::move(OpenEngine(Options(), rig.Media())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    t.Fill(1, 0);
    ASSERT_TRUE(engine->Checkpoint(1, "").ok());
    ASSERT_TRUE(engine->WaitCommitted().ok());

    rig.disk->InjectError(FaultOp::kWrite, 2, err);
    t.Fill(2, 0);
    auto c2 = engine->Checkpoint(2, "");
    ASSERT_TRUE(c2.ok());
    Status st = engine->WaitCommitted(*c2);
    EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
    EXPECT_NE(st.message().find(std::strerror(err)), std::string::npos) << st.message();
    EXPECT_EQ(engine->Latest()->step, 1);
    EXPECT_EQ(engine->Stats().failed, 1u);

    t.Fill(3, 0);
    auto c3 = engine->Checkpoint(3, "");
    ASSERT_TRUE(c3.ok()) << c3.status().ToString();
    ASSERT_TRUE(engine->WaitCommitted(*c3).ok());
    EXPECT_EQ(engine->Latest()->step, 3);
    t.Fill(0, 0);
    auto info = engine->Restore();
    ASSERT_TRUE(info.ok());
    auto want = MakeTensor("t", 100000);
    want.Fill(3, 0);
    EXPECT_EQ(t.data, want.data);
  }
}

// A preemption's emergency checkpoint (engine/preempt.h AwaitEmergency):
// committed, with its record; an older checkpoint's failure said beside it;
// its own failure returned.
TEST_F(EngineTest, AwaitEmergencySaysWhetherTheEmergencyCheckpointCommitted) {
  FaultRig rig;
  auto t = MakeTensor("t", 100000);
  auto engine = std::move(OpenEngine(Options(), rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  auto c1 = engine->Checkpoint(1, "");
  ASSERT_TRUE(c1.ok());
  Result<EmergencyOutcome> o = AwaitEmergency(*engine, *c1, 1);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->committed);
  ASSERT_TRUE(o->record.has_value());
  EXPECT_EQ(o->record->counter, *c1);
  EXPECT_TRUE(o->record->committed);
  EXPECT_EQ(o->older, "");
  o = AwaitEmergency(*engine, *c1, 2);  // step 2 is not this rank's newest committed
  ASSERT_TRUE(o.ok());
  EXPECT_FALSE(o->committed);

  // an older checkpoint failed in the background; the emergency one commits
  rig.disk->InjectError(FaultOp::kWrite, 2, EIO);
  ASSERT_TRUE(engine->Checkpoint(2, "").ok());
  while (engine->Stats().in_flight > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto c3 = engine->Checkpoint(3, "");
  ASSERT_TRUE(c3.ok());
  o = AwaitEmergency(*engine, *c3, 3);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->committed);
  EXPECT_NE(o->older.find(std::strerror(EIO)), std::string::npos) << o->older;

  // its own write fails: its error; the previous checkpoint stays the newest
  rig.disk->InjectError(FaultOp::kWrite, 2, EIO);
  auto c4 = engine->Checkpoint(4, "");
  ASSERT_TRUE(c4.ok());
  o = AwaitEmergency(*engine, *c4, 4);
  EXPECT_EQ(o.status().code(), StatusCode::kIOError) << o.status().ToString();
  EXPECT_EQ(engine->Latest()->step, 3);
}

TEST_F(EngineTest, BackgroundErrorReachesTheNextCall) {
  FaultRig rig;
  auto t = MakeTensor("t", 100000);
  auto engine = std::move(OpenEngine(Options(), rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  ASSERT_TRUE(engine->Checkpoint(1, "").ok());
  ASSERT_TRUE(engine->WaitCommitted().ok());
  rig.disk->InjectError(FaultOp::kSync, 1, EIO);  // the commit's first sync
  ASSERT_TRUE(engine->Checkpoint(2, "").ok());
  // Let it fail in the background, then make an unrelated call.
  while (engine->Stats().in_flight > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Status st = engine->WaitCopied();
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_NE(st.message().find("step 2"), std::string::npos) << st.message();
  EXPECT_TRUE(engine->WaitCopied().ok());  // delivered once
  EXPECT_EQ(engine->Latest()->step, 1);
}

// ---- fsync failures with Linux semantics (DESIGN.md invariant 8) ----------

// The page cache of one file over a FaultDisk, as Linux keeps it: writes stay
// dirty in memory (readable at once) until a sync writes them to the disk. A
// failed sync drops the dirty pages it could not write (they stay readable,
// clean, but never reach the disk) and consumes the error, so the next sync
// returns 0. Shared by every descriptor of the file, as the page cache is (a
// reopened descriptor does not hear of the error either).
//
// And the extent map, as ext4 (6.x) keeps it (issue 24): the bytes a Resize
// adds are an unwritten (fallocated) extent until a sync writes them. A page
// whose failed writeback fell in an unwritten extent stays cached with its
// block mapped ("stale"): a later write of it reaches the disk, but the
// extent is never marked written, so after the page leaves the cache it
// reads as zeros, while every sync returned 0. A power cut empties the
// cache (the page is plain unwritten again). In a written extent a rewrite
// after a failed writeback is durable.
struct LinuxPageCache {
  static constexpr uint64_t kPage = 4096;
  std::shared_ptr<FaultDisk> disk = FaultDisk::Create();
  std::mutex mu;
  std::condition_variable cv;
  struct Piece {
    uint64_t offset;
    std::vector<uint8_t> bytes;
  };
  std::vector<Piece> dropped;  // GUARDED_BY(mu): readable, never durable
  std::vector<Piece> dirty;    // GUARDED_BY(mu)
  uint64_t writes = 0;         // GUARDED_BY(mu)
  // The sync that fails (1-based count from arming) and how many writes it
  // waits for first, so that other checkpoints' bytes are dirty when it fails.
  uint64_t syncs = 0, fail_sync = 0, wait_writes = 0;  // GUARDED_BY(mu)
  int failed_syncs = 0;                                // GUARDED_BY(mu)
  std::set<uint64_t> written;  // GUARDED_BY(mu): pages whose extent is written
  std::set<uint64_t> stale;    // GUARDED_BY(mu): failed writeback in an unwritten extent
  uint64_t lost_writes = 0;    // GUARDED_BY(mu): synced writes that never became durable

  void Arm(uint64_t nth_sync, uint64_t writes_first) {
    std::lock_guard<std::mutex> l(mu);
    syncs = 0;
    fail_sync = nth_sync;
    wait_writes = writes + writes_first;
  }
};

class LinuxCachedMedium final : public Medium {
 public:
  explicit LinuxCachedMedium(std::shared_ptr<LinuxPageCache> c) : c_(std::move(c)), disk_(c_->disk->Open()) {}
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    std::lock_guard<std::mutex> l(c_->mu);
    const auto* p = static_cast<const uint8_t*>(buf);
    if (offset + n > disk_->Size()) return Status::IOError("write past the end");
    c_->dirty.push_back({offset, std::vector<uint8_t>(p, p + n)});
    ++c_->writes;
    c_->cv.notify_all();
    return Status::OK();
  }
  Status Read(uint64_t offset, void* buf, size_t n) override {
    std::lock_guard<std::mutex> l(c_->mu);
    NONSTOP_RETURN_IF_ERROR(disk_->Read(offset, buf, n));
    auto* out = static_cast<uint8_t*>(buf);
    for (const auto* list : {&c_->dropped, &c_->dirty}) {
      for (const LinuxPageCache::Piece& piece : *list) {
        const uint64_t lo = std::max<uint64_t>(offset, piece.offset);
        const uint64_t hi = std::min<uint64_t>(offset + n, piece.offset + piece.bytes.size());
        if (lo < hi) std::memcpy(out + (lo - offset), piece.bytes.data() + (lo - piece.offset), hi - lo);
      }
    }
    return Status::OK();
  }
  Status Sync() override {
    std::unique_lock<std::mutex> l(c_->mu);
    if (++c_->syncs == c_->fail_sync) {
      c_->cv.wait_for(l, std::chrono::seconds(10), [&] { return c_->writes >= c_->wait_writes; });
      for (auto& piece : c_->dirty) {
        ForPages(piece, [&](uint64_t page, uint64_t, uint64_t) {
          if (c_->written.count(page) == 0) c_->stale.insert(page);
        });
        c_->dropped.push_back(std::move(piece));
      }
      c_->dirty.clear();
      ++c_->failed_syncs;
      return Status::FromErrno("fdatasync (injected)", EIO);
    }
    std::vector<uint64_t> now_written;
    for (auto& piece : c_->dirty) {
      bool lost = false;
      Status st;
      ForPages(piece, [&](uint64_t page, uint64_t lo, uint64_t hi) {
        if (c_->stale.count(page) != 0) {
          lost = true;  // written to the disk, but its extent still reads as zeros
          return;
        }
        if (st.ok()) st = disk_->Write(lo, piece.bytes.data() + (lo - piece.offset), hi - lo);
        now_written.push_back(page);
      });
      NONSTOP_RETURN_IF_ERROR(st);
      if (lost) {
        ++c_->lost_writes;
        c_->dropped.push_back(std::move(piece));  // readable until the cache drops it
      }
    }
    c_->dirty.clear();
    NONSTOP_RETURN_IF_ERROR(disk_->Sync());
    c_->written.insert(now_written.begin(), now_written.end());
    return Status::OK();
  }
  Status Resize(uint64_t size) override {
    std::lock_guard<std::mutex> l(c_->mu);
    return disk_->Resize(size);
  }
  uint64_t Size() const override { return disk_->Size(); }
  size_t Alignment() const override { return 1; }
  MediumKind kind() const override { return MediumKind::kBuffered; }
  std::string Describe() const override { return "linux page cache over a fault disk"; }

 private:
  // Calls f(page, lo, hi) for each page `piece` touches, [lo, hi) its bytes there.
  template <typename F>
  static void ForPages(const LinuxPageCache::Piece& piece, F f) {
    const uint64_t end = piece.offset + piece.bytes.size();
    for (uint64_t lo = piece.offset; lo < end;) {
      const uint64_t page = lo / LinuxPageCache::kPage;
      const uint64_t hi = std::min(end, (page + 1) * LinuxPageCache::kPage);
      f(page, lo, hi);
      lo = hi;
    }
  }

  std::shared_ptr<LinuxPageCache> c_;
  std::unique_ptr<Medium> disk_;
};

struct LinuxRig {
  std::shared_ptr<LinuxPageCache> cache = std::make_shared<LinuxPageCache>();
  EngineMedia Media() {
    EngineMedia m;
    auto c = cache;
    m.wrap = [c](std::unique_ptr<Medium>, const std::string& name,
                 bool created) -> Result<std::unique_ptr<Medium>> {
      if (!created && c->disk->size() == 0) return Status::NotFound(name + " does not exist");
      return std::unique_ptr<Medium>(std::make_unique<LinuxCachedMedium>(c));
    };
    return m;
  }
  // Power cut: the page cache is gone; the disk keeps what was synced.
  void PowerCut() {
    std::lock_guard<std::mutex> l(cache->mu);
    cache->dropped.clear();
    cache->dirty.clear();
    cache->stale.clear();
    cache->disk->Crash(CrashMode::kDropUnsynced, 1);
  }
};

TEST_F(EngineTest, AFailedFsyncNeverLetsACheckpointWrittenBeforeItCommit) {
  // Regression (issue 14, defect 1): after one failed fdatasync the engine
  // kept writing on the file and the next checkpoint's fsync returned 0, so
  // Latest() advanced to a checkpoint whose data the kernel had dropped.
  LinuxRig rig;
  EngineOptions o = Options();
  o.max_in_flight = 2;
  auto t = MakeTensor("t", 100000);  // 7 chunks of 64 KiB
  auto want = MakeTensor("t", 100000);
  auto engine = std::move(OpenEngine(o, rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  t.Fill(1, 0);
  ASSERT_TRUE(engine->Checkpoint(1, "").ok());
  ASSERT_TRUE(engine->WaitCommitted().ok());

  // Checkpoint 2's commit sync fails once both 2 and 3 have written their
  // data (7 + 1 table + 7 writes): the kernel drops 3's pages too.
  rig.cache->Arm(1, 15);
  t.Fill(2, 0);
  auto c2 = engine->Checkpoint(2, "");
  ASSERT_TRUE(c2.ok());
  ASSERT_TRUE(engine->WaitCopied().ok());
  t.Fill(3, 0);
  auto c3 = engine->Checkpoint(3, "");
  ASSERT_TRUE(c3.ok());
  EXPECT_EQ(engine->WaitCommitted(*c2).code(), StatusCode::kIOError);
  Status st3 = engine->WaitCommitted(*c3);
  EXPECT_FALSE(st3.ok()) << "checkpoint 3 was written before the failed fsync";
  // Its error is the failed sync: the sticky one of checkpoint 2's
  // ("fsync"), or the injected failure itself ("fdatasync") when 3's commit
  // sync came first (the two commits' syncs race; seen in a CI rehearsal).
  EXPECT_TRUE(st3.message().find("fsync") != std::string::npos ||
              st3.message().find("fdatasync (injected)") != std::string::npos)
      << st3.ToString();
  {
    std::lock_guard<std::mutex> l(rig.cache->mu);
    EXPECT_EQ(rig.cache->failed_syncs, 1);
  }
  ASSERT_TRUE(engine->Latest().has_value());
  EXPECT_EQ(engine->Latest()->step, 1);

  // The file was reopened: the next checkpoint commits, and is durable. It
  // reuses the slot of 2 or 3, whose pages were never written before
  // (issue 24: on ext4 the failed pages stay stale, and without the slot
  // file's zero-filled slots this commit's bytes were lost at the power cut
  // below: 8 synced writes lost, the restart resumed step 1).
  t.Fill(4, 0);
  auto c4 = engine->Checkpoint(4, "");
  ASSERT_TRUE(c4.ok()) << c4.status().ToString();
  ASSERT_TRUE(engine->WaitCommitted(*c4).ok());
  EXPECT_EQ(engine->Latest()->step, 4);
  const CommittedCheckpoint latest = *engine->Latest();
  engine.reset();
  {
    std::lock_guard<std::mutex> l(rig.cache->mu);
    EXPECT_EQ(rig.cache->lost_writes, 0u) << "a synced write went into a stale page";
  }

  // After a power cut every checkpoint reported committed reads back.
  rig.PowerCut();
  auto again = std::move(OpenEngine(o, rig.Media())).value();
  ASSERT_TRUE(again->Register({t.Ref()}).ok());
  ASSERT_TRUE(again->Latest().has_value());
  EXPECT_EQ(again->Latest()->counter, latest.counter);
  t.Fill(0, 0);
  auto info = again->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, latest.step);
  want.Fill(latest.step, 0);
  EXPECT_EQ(t.data, want.data);
}

TEST_F(EngineTest, ACommitWhoseRecordSyncFailedIsNeverChosenAfterARestart) {
  // Regression (issue 14): the commit record was written, its fsync failed and
  // the engine reported the failure, but the record stayed readable (from the
  // page cache: no power cut) and the next start resumed that checkpoint,
  // whose bytes never reached the disk.
  LinuxRig rig;
  EngineOptions o = Options();
  auto t = MakeTensor("t", 100000);
  {
    auto engine = std::move(OpenEngine(o, rig.Media())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    t.Fill(1, 0);
    ASSERT_TRUE(engine->Checkpoint(1, "").ok());
    ASSERT_TRUE(engine->WaitCommitted().ok());
    rig.cache->Arm(2, 0);  // checkpoint 2: the data sync passes, the record's sync fails
    t.Fill(2, 0);
    auto c2 = engine->Checkpoint(2, "");
    ASSERT_TRUE(c2.ok());
    Status st = engine->WaitCommitted(*c2);
    EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
    {
      std::lock_guard<std::mutex> l(rig.cache->mu);
      ASSERT_EQ(rig.cache->failed_syncs, 1);
    }
    EXPECT_EQ(engine->Latest()->step, 1);
    ASSERT_TRUE(engine->Close().ok());
  }
  // The record of step 2 is still readable (the precondition of the defect).
  {
    auto sf = SlotFile::Open(std::make_unique<LinuxCachedMedium>(rig.cache));
    ASSERT_TRUE(sf.ok()) << sf.status().ToString();
    ScanOptions so;
    so.verify_data = false;
    auto rep = (*sf)->Scan(so);
    ASSERT_TRUE(rep.ok());
    bool seen = false;
    for (const ScannedCheckpoint& c : rep->checkpoints) {
      seen = seen || (c.info.step == 2 && c.state == CheckpointState::kCommitted);
    }
    ASSERT_TRUE(seen) << "the test no longer leaves step 2's record readable";
  }
  // A restart without a power cut never resumes step 2 ...
  {
    auto engine = std::move(OpenEngine(o, rig.Media())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    ASSERT_TRUE(engine->Latest().has_value());
    EXPECT_EQ(engine->Latest()->step, 1) << "resumed a checkpoint whose commit failed";
    t.Fill(0, 0);
    auto info = engine->Restore();
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(info->step, 1);
    auto want = MakeTensor("t", 100000);
    want.Fill(1, 0);
    EXPECT_EQ(t.data, want.data);
    // ... the job directory lists it as never durable ...
    auto jd = JobDir::OpenForRead(o.dir);
    ASSERT_TRUE(jd.ok());
    auto lineage = (*jd)->ReadLineage(0);
    ASSERT_TRUE(lineage.ok()) << lineage.status().ToString();
    EXPECT_EQ(lineage->not_durable.size(), 1u);
    // ... and the next checkpoint commits above it.
    t.Fill(3, 0);
    auto c3 = engine->Checkpoint(3, "");
    ASSERT_TRUE(c3.ok());
    ASSERT_TRUE(engine->WaitCommitted(*c3).ok());
    EXPECT_EQ(engine->Latest()->step, 3);
  }
  // After a power cut too, only committed checkpoints come back.
  rig.PowerCut();
  auto engine = std::move(OpenEngine(o, rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  t.Fill(0, 0);
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 3);
}

TEST_F(EngineTest, AQueuedFailureDoesNotCostTheNextCheckpoint) {
  // Regression (issue 14): Checkpoint() returned a queued failure and started
  // nothing, so one transient error cost two checkpoints.
  FaultRig rig;
  auto t = MakeTensor("t", 100000);
  auto engine = std::move(OpenEngine(Options(), rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  rig.disk->InjectError(FaultOp::kWrite, 1, EIO);
  t.Fill(1, 0);
  ASSERT_TRUE(engine->Checkpoint(1, "").ok());
  while (engine->Stats().in_flight > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  t.Fill(2, 0);
  auto c2 = engine->Checkpoint(2, "");
  ASSERT_TRUE(c2.ok()) << "the earlier failure must not stop this checkpoint: "
                       << c2.status().ToString();
  Status old = engine->TakeError();  // reported separately, once
  EXPECT_EQ(old.code(), StatusCode::kIOError) << old.ToString();
  EXPECT_NE(old.message().find("step 1"), std::string::npos) << old.message();
  EXPECT_TRUE(engine->TakeError().ok());
  ASSERT_TRUE(engine->WaitCommitted(*c2).ok());
  EXPECT_EQ(engine->Latest()->step, 2);
  EXPECT_EQ(engine->Stats().failed, 1u);
}

TEST_F(EngineTest, AQueuedFailureDoesNotRefuseTheNextRegister) {
  // Register() used to return a queued failure and register nothing; the
  // Python front end then had to take it and call again.
  FaultRig rig;
  auto t = MakeTensor("t", 100000);
  auto u = MakeTensor("u", 1000);
  auto engine = std::move(OpenEngine(Options(), rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  rig.disk->InjectError(FaultOp::kWrite, 1, EIO);
  ASSERT_TRUE(engine->Checkpoint(1, "").ok());
  while (engine->Stats().in_flight > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Status reg = engine->Register({t.Ref(), u.Ref()});
  ASSERT_TRUE(reg.ok()) << "the earlier failure must not refuse this registration: "
                        << reg.ToString();
  auto c2 = engine->Checkpoint(2, "");
  ASSERT_TRUE(c2.ok()) << c2.status().ToString();
  Status old = engine->TakeError();  // still queued, reported once
  EXPECT_EQ(old.code(), StatusCode::kIOError) << old.ToString();
  EXPECT_NE(old.message().find("step 1"), std::string::npos) << old.message();
  EXPECT_TRUE(engine->TakeError().ok());
  ASSERT_TRUE(engine->WaitCommitted(*c2).ok());
  EXPECT_EQ(engine->Latest()->step, 2);
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->tensors.size(), 2u);  // the second registration's
}

// ---- the restored checkpoint is protected (DESIGN.md invariant 9) ----------

TEST_F(EngineTest, AFallbackRestoreKeepsTheRestoredCheckpointUntilANewerCommits) {
  // Regression (issue 14, defect 4): newest step 9 damaged, restore() falls
  // back to step 7, but the engine kept step 9's slot and wrote the next
  // checkpoint over step 7's; a kill during that commit left nothing valid.
  FaultRig rig;
  EngineOptions o = Options();
  o.max_in_flight = 1;  // two slots: 7 and 9 are the only checkpoints held
  auto t = MakeTensor("t", 100000);
  {
    auto engine = std::move(OpenEngine(o, rig.Media())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    for (int64_t step : {5, 7, 9}) {
      t.Fill(step, 0);
      ASSERT_TRUE(engine->Checkpoint(step, "").ok());
      ASSERT_TRUE(engine->WaitCommitted().ok());
    }
    ASSERT_TRUE(engine->Close().ok());
  }
  DamageStep(*rig.disk, 9);
  {
    auto engine = std::move(OpenEngine(o, rig.Media())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    auto info = engine->Restore();
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    ASSERT_EQ(info->step, 7);
    EXPECT_EQ(engine->Latest()->step, 7);
    // The first new checkpoint's data and table become durable, then the
    // process dies before its commit record does.
    rig.disk->CrashOnCall(FaultOp::kSync, 2, CrashMode::kDropUnsynced, 0);
    t.Fill(10, 0);
    ASSERT_TRUE(engine->Checkpoint(10, "").ok());
    EXPECT_FALSE(engine->WaitCommitted().ok());
  }
  auto engine = std::move(OpenEngine(o, rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  t.Fill(0, 0);
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << "the restored checkpoint was overwritten: " << info.status().ToString();
  EXPECT_EQ(info->step, 7);
  auto want = MakeTensor("t", 100000);
  want.Fill(7, 0);
  EXPECT_EQ(t.data, want.data);
}

TEST_F(EngineTest, AdoptRestoredKeepsTheCallersCheckpointAndMakesTheRollbackFinal) {
  // Engine::AdoptRestored: the caller (the Python front end) restored step 7
  // with its own reader while 9 is newer. The engine must keep 7's slot and
  // record the rollback before it writes anything: a kill during the first
  // new commit then resumes 7, never 9 (DESIGN.md invariant 9).
  FaultRig rig;
  EngineOptions o = Options();
  o.max_in_flight = 1;  // two slots: 7 and 9 are the only checkpoints held
  auto t = MakeTensor("t", 100000);
  uint64_t c7 = 0;
  {
    auto engine = std::move(OpenEngine(o, rig.Media())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    for (int64_t step : {5, 7, 9}) {
      t.Fill(step, 0);
      auto c = engine->Checkpoint(step, "");
      ASSERT_TRUE(c.ok());
      if (step == 7) c7 = *c;
      ASSERT_TRUE(engine->WaitCommitted().ok());
    }
    ASSERT_TRUE(engine->Close().ok());
  }
  {
    auto engine = std::move(OpenEngine(o, rig.Media())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    EXPECT_EQ(engine->Latest()->step, 9);
    ASSERT_TRUE(engine->AdoptRestored(c7).ok());
    EXPECT_EQ(engine->Latest()->step, 7);
    // The first new checkpoint's data and table become durable, then the
    // process dies before its commit record does.
    rig.disk->CrashOnCall(FaultOp::kSync, 2, CrashMode::kDropUnsynced, 0);
    t.Fill(10, 0);
    ASSERT_TRUE(engine->Checkpoint(10, "").ok());
    EXPECT_FALSE(engine->WaitCommitted().ok());
  }
  auto engine = std::move(OpenEngine(o, rig.Media())).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  ASSERT_TRUE(engine->Latest().has_value());
  EXPECT_EQ(engine->Latest()->step, 7) << "resumed a step the caller rolled back from";
  t.Fill(0, 0);
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << "the adopted checkpoint was overwritten: " << info.status().ToString();
  EXPECT_EQ(info->step, 7);
  auto want = MakeTensor("t", 100000);
  want.Fill(7, 0);
  EXPECT_EQ(t.data, want.data);
}

TEST_F(EngineTest, AdoptRestoredRecordsADistributedRollbackInTheLineage) {
  // Distributed mode: Pin keeps the restored checkpoint's slot, and the
  // rollback goes into the rank's lineage record like a single process's.
  EngineOptions o = Options();
  o.max_in_flight = 1;
  o.global_agreement = true;
  o.extra_slots = 1;
  auto t = MakeTensor("t", 5000);
  uint64_t c7 = 0, c9 = 0;
  {
    auto engine = Engine::Open(o);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->Register({t.Ref()}).ok());
    for (int64_t step : {5, 7, 9}) {
      t.Fill(step, 0);
      auto c = (*engine)->Checkpoint(step, "");
      ASSERT_TRUE(c.ok());
      if (step == 7) c7 = *c;
      if (step == 9) c9 = *c;
      ASSERT_TRUE((*engine)->WaitCommitted().ok());
      ASSERT_TRUE((*engine)->Pin(*c).ok());
    }
    ASSERT_TRUE((*engine)->Close().ok());
  }
  auto engine = Engine::Open(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->Register({t.Ref()}).ok());
  ASSERT_TRUE((*engine)->Pin(c7).ok());
  ASSERT_TRUE((*engine)->AdoptRestored(c7).ok());
  t.Fill(10, 0);
  auto c10 = (*engine)->Checkpoint(10, "");
  ASSERT_TRUE(c10.ok());
  ASSERT_TRUE((*engine)->WaitCommitted(*c10).ok());
  auto jd = JobDir::OpenForRead(o.dir);
  ASSERT_TRUE(jd.ok());
  auto lineage = (*jd)->ReadLineage(0);
  ASSERT_TRUE(lineage.ok()) << lineage.status().ToString();
  EXPECT_EQ(lineage->restored_counter, c7);
  EXPECT_TRUE(lineage->IsAbandoned(c9)) << "the rolled-back step 9 could be resumed";
  EXPECT_FALSE(lineage->IsAbandoned(*c10));
  auto sel = (*jd)->Select(0);
  ASSERT_TRUE(sel.ok()) << sel.status().ToString();
  ASSERT_TRUE(sel->chosen.has_value());
  EXPECT_EQ(sel->chosen->info.step, 10);
}

// A process killed inside a commit, after the checkpoint's data and table
// were synced and before its record was written: once armed (1), the first
// sync goes through and every later write fails.
class KilledBeforeTheRecord final : public media::MediumWrapper {
 public:
  KilledBeforeTheRecord(std::unique_ptr<Medium> inner, std::shared_ptr<std::atomic<int>> arm)
      : MediumWrapper(std::move(inner)), arm_(std::move(arm)) {}
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    if (arm_->load() == 2) return Status::IOError("the process was killed");
    return MediumWrapper::Write(offset, buf, n);
  }
  Status Sync() override {
    Status st = MediumWrapper::Sync();
    int armed = 1;
    if (st.ok()) arm_->compare_exchange_strong(armed, 2);
    return st;
  }

 private:
  std::shared_ptr<std::atomic<int>> arm_;
};

TEST_F(EngineTest, ARollbackIsFinalEvenIfTheFirstNewCommitIsKilled) {
  // Regression (issue 14, defect 4): after restore(step=5) with 7 and 9
  // newer, a kill during the first new commit resumed step 9, the future the
  // user rolled back from.
  auto arm = std::make_shared<std::atomic<int>>(0);
  EngineMedia media;
  media.wrap = [arm](std::unique_ptr<Medium> m, const std::string&,
                     bool) -> Result<std::unique_ptr<Medium>> {
    return std::unique_ptr<Medium>(std::make_unique<KilledBeforeTheRecord>(std::move(m), arm));
  };
  EngineOptions o = Options();
  o.max_in_flight = 2;
  auto t = MakeTensor("t", 100000);
  {
    auto engine = std::move(OpenEngine(o, media)).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    for (int64_t step : {5, 7, 9}) {
      t.Fill(step, 0);
      ASSERT_TRUE(engine->Checkpoint(step, "").ok());
      ASSERT_TRUE(engine->WaitCommitted().ok());
    }
  }
  {
    auto engine = std::move(OpenEngine(o, media)).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    auto info = engine->Restore(5);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    EXPECT_EQ(engine->Latest()->step, 5);
    arm->store(1);
    t.Fill(10, 0);
    ASSERT_TRUE(engine->Checkpoint(10, "").ok());
    EXPECT_FALSE(engine->WaitCommitted().ok());
  }
  auto engine = Engine::Open(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->Register({t.Ref()}).ok());
  ASSERT_TRUE((*engine)->Latest().has_value());
  EXPECT_EQ((*engine)->Latest()->step, 5) << "resumed a step the user rolled back from";
  t.Fill(0, 0);
  auto info = (*engine)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 5);
  auto want = MakeTensor("t", 100000);
  want.Fill(5, 0);
  EXPECT_EQ(t.data, want.data);
}

// ---- one writer per job directory; symlinks are refused (DESIGN.md 7) -----

TEST_F(EngineTest, ASecondEngineOnTheSameDirectoryIsRefusedNamingTheHolder) {
  // Regression (issue 14, defect 2): two jobs on one directory both started
  // and overwrote each other's committed checkpoints.
  auto t = MakeTensor("t", 5000);
  auto first = Engine::Open(Options());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE((*first)->Register({t.Ref()}).ok());
  t.Fill(1, 0);
  ASSERT_TRUE((*first)->Checkpoint(1, "").ok());
  ASSERT_TRUE((*first)->WaitCommitted().ok());
  auto second = Engine::Open(Options());
  ASSERT_FALSE(second.ok()) << "a second writer was let in";
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  const std::string& m = second.status().message();
  EXPECT_NE(m.find("pid " + std::to_string(::getpid())), std::string::npos) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  // Once the first is closed, the directory is free again.
  ASSERT_TRUE((*first)->Close().ok());
  auto third = Engine::Open(Options());
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_EQ((*third)->Latest()->step, 1);
}

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST_F(EngineTest, SymlinksPlantedAtTheEnginesNamesAreNeverFollowed) {
  // Regression (issue 14, defect 3): a symlink at rank-00000.nsck.tmp (or the
  // slot file) made the engine overwrite the link's target.
  auto t = MakeTensor("t", 5000);
  const fs::path victim = dir_.string() + "_victim";
  fs::remove_all(victim);
  fs::create_directories(victim);
  std::ofstream(victim / "precious") << "precious bytes";
  fs::create_directories(dir_);
  {
    // At the slot file's name: refused, with the name.
    fs::create_symlink(victim / "precious", dir_ / SlotFileName(0));
    auto e = Engine::Open(Options());
    ASSERT_FALSE(e.ok()) << "the engine opened a symlink as its slot file";
    EXPECT_NE(e.status().message().find("symlink"), std::string::npos) << e.status().ToString();
    fs::remove(dir_ / SlotFileName(0));
  }
  {
    // At the temp name while the engine runs: a resize creates the new slot
    // file there, never through the link.
    auto engine = std::move(Engine::Open(Options())).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    t.Fill(1, 0);
    ASSERT_TRUE(engine->Checkpoint(1, "").ok());
    ASSERT_TRUE(engine->WaitCommitted().ok());
    fs::create_symlink(victim / "precious", dir_ / (SlotFileName(0) + ".tmp"));
    auto big = MakeTensor("big", 2 << 20);  // needs bigger slots: a new slot file
    big.Fill(2, 1);
    ASSERT_TRUE(engine->Register({t.Ref(), big.Ref()}).ok());
    t.Fill(2, 0);
    ASSERT_TRUE(engine->Checkpoint(2, "").ok());
    ASSERT_TRUE(engine->WaitCommitted().ok());
    EXPECT_EQ(engine->Latest()->step, 2);
    EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(dir_ / SlotFileName(0))));
  }
  {
    // In keep/: a symlinked step directory is refused; the target stays empty.
    fs::create_directories(dir_ / "keep");
    fs::create_directories(victim / "stepdir");
    char name[40];
    std::snprintf(name, sizeof(name), "step-%012d", 4);
    fs::create_symlink(victim / "stepdir", dir_ / "keep" / name);
    EngineOptions o = Options();
    o.keep_every = 1;
    auto engine = std::move(Engine::Open(o)).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    t.Fill(4, 0);
    auto c = engine->Checkpoint(4, "");
    ASSERT_TRUE(c.ok());
    Status st = engine->WaitCommitted(*c);
    EXPECT_FALSE(st.ok()) << "keep copy made through a symlink";
    EXPECT_NE(st.message().find("symlink"), std::string::npos) << st.ToString();
    EXPECT_EQ(engine->Latest()->step, 4);  // the checkpoint itself is committed
    EXPECT_TRUE(fs::is_empty(victim / "stepdir"));
  }
  EXPECT_EQ(ReadAll(victim / "precious"), "precious bytes");
  fs::remove_all(victim);
}

// ---- AbandonOlderThan (preemption notices, docs/PREEMPTION.md) -------------

// Sleeps before every write, so checkpoints stay in flight long enough to be
// abandoned, and counts the writes.
// A medium whose header write (offset 0) fails: the process dying while the
// engine creates its slot file, before the header is durable.
class HeaderWriteFails final : public media::MediumWrapper {
 public:
  using MediumWrapper::MediumWrapper;
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    if (offset == 0) return Status::IOError("header write: injected EIO");
    return MediumWrapper::Write(offset, buf, n);
  }
};

TEST_F(EngineTest, ATornSlotFileCreationNeverBlocksTheNextStart) {
  EngineMedia failing;
  failing.wrap = [](std::unique_ptr<Medium> m, const std::string&,
                    bool created) -> Result<std::unique_ptr<Medium>> {
    if (!created) return m;
    return std::unique_ptr<Medium>(std::make_unique<HeaderWriteFails>(std::move(m)));
  };
  auto t = MakeTensor("t", 5000);
  {
    auto engine = std::move(OpenEngine(Options(), failing)).value();
    EXPECT_FALSE(engine->Register({t.Ref()}).ok());
  }
  // Nothing torn at the final name: the file is created under a temp name.
  EXPECT_FALSE(fs::exists(dir_ / SlotFileName(0)));
  EXPECT_FALSE(fs::exists(dir_ / (SlotFileName(0) + ".tmp")));
  // A temp file left by a process killed mid-creation is removed at start.
  std::ofstream(dir_ / (SlotFileName(0) + ".tmp")) << "torn";
  auto engine = Engine::Open(Options());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->Register({t.Ref()}).ok());
  t.Fill(4, 0);
  auto c = (*engine)->Checkpoint(4, "");
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*engine)->WaitCommitted(*c).ok());
  EXPECT_FALSE(fs::exists(dir_ / (SlotFileName(0) + ".tmp")));
  EXPECT_EQ((*engine)->Latest()->step, 4);
}

class SlowMedium final : public Medium {
 public:
  SlowMedium(std::unique_ptr<Medium> inner, std::shared_ptr<std::atomic<int>> writes)
      : inner_(std::move(inner)), writes_(std::move(writes)) {}
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    writes_->fetch_add(1);
    return inner_->Write(offset, buf, n);
  }
  Status Read(uint64_t offset, void* buf, size_t n) override { return inner_->Read(offset, buf, n); }
  Status Sync() override { return inner_->Sync(); }
  Status Resize(uint64_t size) override { return inner_->Resize(size); }
  uint64_t Size() const override { return inner_->Size(); }
  size_t Alignment() const override { return inner_->Alignment(); }
  MediumKind kind() const override { return inner_->kind(); }
  std::string Describe() const override { return "slow " + inner_->Describe(); }

 private:
  std::unique_ptr<Medium> inner_;
  std::shared_ptr<std::atomic<int>> writes_;
};

TEST_F(EngineTest, AbandonOlderThanLetsAnUrgentCheckpointGoFirst) {
  FaultRig rig;
  EngineMedia media = rig.Media();
  auto wrap = media.wrap;
  auto writes = std::make_shared<std::atomic<int>>(0);
  media.wrap = [wrap, writes](std::unique_ptr<Medium> opened, const std::string& name,
                              bool created) -> Result<std::unique_ptr<Medium>> {
    auto m = wrap(std::move(opened), name, created);
    if (!m.ok()) return m.status();
    return std::unique_ptr<Medium>(std::make_unique<SlowMedium>(std::move(*m), writes));
  };
  auto t = MakeTensor("t", 64 * 16384);  // 4 MiB: 64 chunks of 64 KiB, ~100 ms per checkpoint
  auto engine = std::move(OpenEngine(Options(), media)).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  t.Fill(1, 0);
  ASSERT_TRUE(engine->Checkpoint(1, "").ok());
  ASSERT_TRUE(engine->WaitCommitted().ok());
  // Two regular checkpoints in flight (max_in_flight 2), then a notice.
  for (int64_t step : {2, 3}) {
    ASSERT_TRUE(engine->WaitCopied().ok());
    t.Fill(step, 0);
    ASSERT_TRUE(engine->Checkpoint(step, "").ok());
  }
  // Step 3 is copied, so at most a staging pool's worth (16 chunks) of its
  // writes is still queued: abandoned at once, before the writers catch up.
  ASSERT_TRUE(engine->WaitCopied().ok());
  auto n = engine->AbandonOlderThan(std::numeric_limits<uint64_t>::max());
  const int writes_at_notice = writes->load();
  t.Fill(4, 0);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_GE(*n, 1);
  // Whatever committed before the notice stays committed (the staging bound
  // paces copies by the writes, so step 2 may have finished by now).
  EXPECT_LT(engine->Latest()->step, 4);
  auto urgent = engine->Checkpoint(4, "");
  ASSERT_TRUE(urgent.ok()) << urgent.status().ToString();
  ASSERT_TRUE(engine->WaitCommitted(*urgent).ok());
  const int writes_to_commit = writes->load() - writes_at_notice;
  EXPECT_EQ(engine->Latest()->step, 4);
  EngineStats s = engine->Stats();
  EXPECT_EQ(s.failed, 0u);
  EXPECT_EQ(s.abandoned, static_cast<uint64_t>(*n));
  EXPECT_EQ(s.committed + s.abandoned + s.superseded, 4u);
  // Abandoned work is skipped: the urgent checkpoint's 64 chunks and its
  // commit, plus at most the 2 writes already under way; not step 3's rest.
  EXPECT_LE(writes_to_commit, 64 + 2 + 8) << "writes between the notice and the commit";
  ASSERT_TRUE(engine->WaitCommitted().ok());  // abandoned ones report no error
  EXPECT_TRUE(engine->WaitCopied().ok());
  t.Fill(0, 0);
  auto info = engine->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 4);
  auto want = MakeTensor("t", 64 * 16384);
  want.Fill(4, 0);
  EXPECT_EQ(t.data, want.data);
  // Nothing older than the newest is in flight any more: a no-op.
  EXPECT_EQ(engine->AbandonOlderThan(std::numeric_limits<uint64_t>::max()).value(), 0);
}

// Holds the first write that starts with `hold`'s float until Open(), and
// counts the writes that start with one of `count`'s floats.
struct WriteGate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false, held = false;
  float hold = 0;
  std::set<float> count;
  std::atomic<int> counted{0};
  void Open() {
    std::lock_guard<std::mutex> l(mu);
    open = true;
    cv.notify_all();
  }
};

class GateMedium final : public media::MediumWrapper {
 public:
  GateMedium(std::unique_ptr<Medium> inner, std::shared_ptr<WriteGate> gate)
      : MediumWrapper(std::move(inner)), gate_(std::move(gate)) {}
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    float first = 0;
    if (n >= sizeof first) std::memcpy(&first, buf, sizeof first);
    {
      std::unique_lock<std::mutex> l(gate_->mu);
      if (n >= sizeof first && first == gate_->hold && !gate_->held) {
        gate_->held = true;
        gate_->cv.wait(l, [&] { return gate_->open; });
      }
    }
    Status st = inner().Write(offset, buf, n);
    if (n >= sizeof first && gate_->count.count(first) != 0) gate_->counted.fetch_add(1);
    return st;
  }
  std::string Describe() const override { return "gated " + inner().Describe(); }

 private:
  std::shared_ptr<WriteGate> gate_;
};

// `rig`'s media with every medium it opens behind a GateMedium of `gate`.
EngineMedia GatedMedia(FaultRig& rig, std::shared_ptr<WriteGate> gate) {
  EngineMedia media = rig.Media();
  auto wrap = media.wrap;
  media.wrap = [wrap, gate](std::unique_ptr<Medium> opened, const std::string& name,
                            bool created) -> Result<std::unique_ptr<Medium>> {
    auto m = wrap(std::move(opened), name, created);
    if (!m.ok()) return m.status();
    return std::unique_ptr<Medium>(std::make_unique<GateMedium>(std::move(*m), gate));
  };
  return media;
}

// best= (and keep_every): the checkpoint carrying the metric must commit even
// when a newer one finishes writing first (PCcheck's claim would supersede
// it, and its metric with it: Trainer's best step was lost so in CI).
TEST_F(EngineTest, ACheckpointCarryingTheBestMetricIsNeverSuperseded) {
  constexpr int kChunks = 8;  // 64 KiB chunks
  auto t = MakeTensor("t", kChunks * 16384);
  auto gate = std::make_shared<WriteGate>();
  t.Fill(1, 0);
  gate->hold = t.data[0];  // step 1's first chunk waits for the gate
  t.Fill(2, 0);
  for (int j = 0; j < kChunks; ++j) gate->count.insert(t.data[static_cast<size_t>(j) * 16384]);
  FaultRig rig;
  EngineMedia media = GatedMedia(rig, gate);
  auto engine = std::move(OpenEngine(Options(), media)).value();
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  RetentionPolicy policy;
  policy.best_metric = "loss";
  policy.best_k = 1;
  ASSERT_TRUE(engine->SetRetention(policy).ok());
  t.Fill(1, 0);
  ASSERT_TRUE(engine->Checkpoint(1, R"({"metrics": {"loss": 0.5}})").ok());
  ASSERT_TRUE(engine->WaitCopied().ok());
  t.Fill(2, 0);
  ASSERT_TRUE(engine->Checkpoint(2, "").ok());
  // Step 2 is all written while step 1's first chunk is held.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (gate->counted.load() < kChunks && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(gate->counted.load(), kChunks);
  // Without the rule step 2 claims and commits within milliseconds here.
  bool newer_committed_first = false;
  for (int i = 0; i < 300 && !newer_committed_first; ++i) {
    auto latest = engine->Latest();
    newer_committed_first = latest.has_value() && latest->step == 2;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  gate->Open();
  ASSERT_TRUE(engine->WaitCommitted().ok());
  EXPECT_FALSE(newer_committed_first) << "step 2 committed while step 1 (best=) was in flight";
  EngineStats s = engine->Stats();
  EXPECT_EQ(s.superseded, 0u);
  EXPECT_EQ(s.committed, 2u);
  EXPECT_EQ(engine->Latest()->step, 2);
  // Step 1, the best, was copied to keep/ when it committed.
  bool kept = false;
  for (const auto& e : fs::directory_iterator(dir_ / JobDirNames::KeepRoot())) {
    kept = kept || e.path().filename().string().find("step-000000000001") != std::string::npos;
  }
  EXPECT_TRUE(kept);
}

// One writer commits checkpoints in the order they started: the dispatcher
// hands out all of a checkpoint's chunks before the next one's and the one
// writer runs them in that order (TaskPool is FIFO), so none finishes
// writing before an older one and none is superseded, however the writes
// are delayed. Tests that need the checkpoint before the newest rely on it
// (test_fsdp's fallback to step 8, the Lightning DDP jobs: max_in_flight=2,
// writers=1; docs/TESTING.md). Two writers: the same delay supersedes.
TEST_F(EngineTest, OneWriterNeverSupersedesTwoWritersMay) {
  constexpr int kChunks = 8;  // 64 KiB chunks
  for (int writers : {1, 2}) {
    SCOPED_TRACE("writers " + std::to_string(writers));
    fs::remove_all(dir_);
    auto t = MakeTensor("t", kChunks * 16384);
    auto gate = std::make_shared<WriteGate>();
    t.Fill(1, 0);
    gate->hold = t.data[0];  // step 1's first chunk waits for the gate
    FaultRig rig;
    EngineMedia media = GatedMedia(rig, gate);
    EngineOptions o = Options();
    o.writers = writers;
    o.max_in_flight = 2;
    auto engine = std::move(OpenEngine(o, media)).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    t.Fill(1, 0);
    ASSERT_TRUE(engine->Checkpoint(1, "").ok());
    ASSERT_TRUE(engine->WaitCopied().ok());
    t.Fill(2, 0);
    ASSERT_TRUE(engine->Checkpoint(2, "").ok());
    ASSERT_TRUE(engine->WaitCopied().ok());  // step 2's chunks are all queued to the writers
    if (writers > 1) {
      // The other writer writes step 2 while step 1's first chunk is held:
      // step 2 commits first (the event; a hang is ctest's timeout).
      while (!(engine->Latest().has_value() && engine->Latest()->step == 2)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
    gate->Open();
    ASSERT_TRUE(engine->WaitCommitted().ok());
    EngineStats s = engine->Stats();
    EXPECT_EQ(s.superseded, writers == 1 ? 0u : 1u);
    EXPECT_EQ(s.committed, writers == 1 ? 2u : 1u);
    EXPECT_EQ(engine->Latest()->step, 2);
    ASSERT_TRUE(engine->Close().ok());
  }
}

// One tensor in an engine of the distributed agreement (one slot spare, one
// checkpoint in flight); Save checkpoints a step and waits for its commit.
struct AgreeRig {
  explicit AgreeRig(EngineOptions o) : t(MakeTensor("x", 40000)) {
    o.max_in_flight = 1;
    o.extra_slots = 1;
    o.global_agreement = true;
    auto e = Engine::Open(o);
    if (e.ok() && e.value()->Register({t.Ref()}).ok()) engine = std::move(e).value();
  }
  uint64_t Save(int64_t step) {
    t.Fill(step, 0);
    auto c = engine->Checkpoint(step, "");
    EXPECT_TRUE(c.ok());
    EXPECT_TRUE(engine->WaitCommitted(*c).ok());
    return *c;
  }
  HostTensor t;
  std::unique_ptr<Engine> engine;
};

// Pins step 1, aims at 10 (the peers far ahead: candidate 2 dropped),
// rolls back to step 1 with `roll_back`, saves step 2 again: it must become
// the candidate, the aim and the newest started step from before forgotten.
void RollBackPastAnAim(AgreeRig& rig, const std::function<void(Engine&, uint64_t)>& roll_back) {
  ASSERT_TRUE(rig.engine != nullptr);
  Engine* engine = rig.engine.get();
  const uint64_t c1 = rig.Save(1);
  ASSERT_TRUE(engine->Pin(c1).ok());
  rig.Save(2);
  rig.Save(3);
  EXPECT_TRUE(engine->Aim(10).value());
  rig.Save(4);
  EXPECT_FALSE(engine->Candidate().has_value());
  roll_back(*engine, c1);
  rig.Save(2);
  ASSERT_TRUE(engine->Candidate().has_value()) << "the aim from before the rollback kept step 2 out";
  EXPECT_EQ(engine->Candidate()->step, 2);
  AgreeOffer off = engine->Offer();
  EXPECT_EQ(off.candidate, 2);
  EXPECT_EQ(off.started, 2);
  ASSERT_TRUE(engine->Close().ok());
}

TEST_F(EngineTest, ARestoreForgetsTheAgreementsAim) {
  // An aim set before a rollback (restore of an older step) must not keep
  // the new, lower steps out of the candidate: the agreement would stall
  // until training caught up with the old steps.
  AgreeRig rig(Options());
  RollBackPastAnAim(rig, [](Engine& e, uint64_t) {
    auto restored = e.Restore(1);
    ASSERT_TRUE(restored.ok()) << restored.status().ToString();
    EXPECT_EQ(restored->step, 1);
  });
}

TEST_F(EngineTest, AnAdoptedRestoreForgetsTheAgreementsAim) {
  // The same rollback, restored by the caller's own reader (a keep copy, a
  // remote, the memory tier) and handed over with AdoptRestored.
  AgreeRig rig(Options());
  RollBackPastAnAim(rig, [](Engine& e, uint64_t c1) { ASSERT_TRUE(e.AdoptRestored(c1).ok()); });
}

TEST_F(EngineTest, AimKeepsTheFirstCommitAtOrAboveItsStep) {
  // The agreement's aim (DecideAgreement kAim): a lower candidate is
  // dropped, commits below the aim are not kept, the first at or above it
  // is, and Offer reports the candidate, the newest committed and started.
  AgreeRig rig(Options());
  ASSERT_TRUE(rig.engine != nullptr);
  Engine* engine = rig.engine.get();
  auto save = [&](int64_t step) { return rig.Save(step); };
  const uint64_t c1 = save(1);
  save(2);
  AgreeOffer off = engine->Offer();
  EXPECT_EQ(off.candidate, 1);
  EXPECT_EQ(off.counter, c1);
  EXPECT_EQ(off.committed, 2);
  EXPECT_EQ(off.started, 2);
  EXPECT_FALSE(engine->Aim(1).value());  // at the aim: kept
  EXPECT_TRUE(engine->Aim(4).value());   // below it: dropped
  EXPECT_FALSE(engine->Candidate().has_value());
  save(3);  // below the aim: not kept
  EXPECT_FALSE(engine->Candidate().has_value());
  EXPECT_EQ(engine->Offer().candidate, -1);
  const uint64_t c4 = save(4);
  save(5);
  ASSERT_TRUE(engine->Candidate().has_value());
  EXPECT_EQ(engine->Candidate()->counter, c4);
  off = engine->Offer();
  EXPECT_EQ(off.candidate, 4);
  EXPECT_EQ(off.committed, 5);
  EXPECT_EQ(off.started, 5);
  EXPECT_FALSE(engine->Aim(4).value());
  ASSERT_TRUE(engine->Pin(c4).ok());  // forgets the aim: a lower step is kept again
  const uint64_t c3 = save(3);
  ASSERT_TRUE(engine->Candidate().has_value());
  EXPECT_EQ(engine->Candidate()->counter, c3);
  ASSERT_TRUE(engine->Close().ok());
}

TEST_F(EngineTest, PinnedAndCandidateSlotsSurviveNewerCommits) {
  // Distributed mode: the pinned (agreed) checkpoint and the candidate (the
  // oldest committed above it) are never overwritten, however many newer
  // checkpoints commit; later ones are not kept.
  EngineOptions o = Options();
  o.max_in_flight = 1;
  o.extra_slots = 1;
  o.global_agreement = true;
  auto t = MakeTensor("x", 40000);
  uint64_t c1 = 0, c2 = 0, c7 = 0;
  {
    auto engine = std::move(Engine::Open(o)).value();
    ASSERT_TRUE(engine->Register({t.Ref()}).ok());
    auto save = [&](int64_t step) {
      t.Fill(step, 0);
      auto c = engine->Checkpoint(step, "");
      EXPECT_TRUE(c.ok());
      EXPECT_TRUE(engine->WaitCommitted(*c).ok());
      return *c;
    };
    c1 = save(1);
    ASSERT_TRUE(engine->Candidate().has_value());
    EXPECT_EQ(engine->Candidate()->step, 1);
    ASSERT_TRUE(engine->Pin(c1).ok());
    EXPECT_FALSE(engine->Candidate().has_value());
    c2 = save(2);
    for (int64_t step = 3; step <= 6; ++step) save(step);
    ASSERT_TRUE(engine->Candidate().has_value());
    EXPECT_EQ(engine->Candidate()->counter, c2);
    auto want = MakeTensor("x", 40000);
    // Newer first: a restore is a rollback, durable at once (issue 23), so
    // restoring 1 first would abandon 2.
    for (int64_t step : {2, 1}) {
      ASSERT_TRUE(engine->Restore(step).ok()) << step;
      want.Fill(step, 0);
      EXPECT_EQ(t.data, want.data);
    }
    ASSERT_TRUE(engine->DropCandidate(c2).ok());
    c7 = save(7);
    EXPECT_EQ(engine->Candidate()->counter, c7);
    ASSERT_TRUE(engine->Pin(c7).ok());
    EXPECT_EQ(engine->Pin(c7 + 100).code(), StatusCode::kNotFound);
    ASSERT_TRUE(engine->Close().ok());
  }
  // On open the newest is the candidate; an older committed one can be pinned
  // while nothing is in flight (the restore of a globally agreed step).
  auto engine = std::move(Engine::Open(o)).value();
  EXPECT_EQ(engine->Candidate()->counter, c7);
  ASSERT_TRUE(engine->Pin(c7).ok());
  ASSERT_TRUE(engine->Register({t.Ref()}).ok());
  for (int64_t step = 8; step <= 12; ++step) {
    t.Fill(step, 0);
    ASSERT_TRUE(engine->Checkpoint(step, "").ok());
    ASSERT_TRUE(engine->WaitCommitted().ok());
  }
  ASSERT_TRUE(engine->Restore(7).ok());
  auto want = MakeTensor("x", 40000);
  want.Fill(7, 0);
  EXPECT_EQ(t.data, want.data);
}

TEST_F(EngineTest, PinWithoutGlobalAgreementIsRefused) {
  auto engine = std::move(Engine::Open(Options())).value();
  EXPECT_EQ(engine->Pin(1).code(), StatusCode::kFailedPrecondition);
  EngineOptions o = Options();
  o.global_agreement = true;
  EXPECT_FALSE(Engine::Open(o).ok());  // needs extra_slots >= 1
}

}  // namespace
}  // namespace nonstop
