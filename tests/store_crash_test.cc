// Crash consistency of the store (DESIGN.md invariants 1-3), on the
// fault-injecting disk.
//
// A PCcheck-style pipeline writes checkpoints of random sizes and steps into a
// slot file: up to kInFlight checkpoints at once, their data written by
// kWriters threads in parallel, commits in counter order, and the slot of the
// newest committed checkpoint never reused (kInFlight + 1 slots). The disk
// crashes at a random write or sync, dropping or tearing (512-byte sectors)
// whatever was not synced. Recovery on a fresh medium must then return
//   - at least the newest checkpoint whose Commit had returned OK (else
//     "committed lost"), or a newer one whose commit was under way, and
//   - exactly the bytes, table and metadata written for its step (else
//     "corrupt").
// Writing then resumes on the recovered file, so later crash points also
// exercise commits that follow a recovery.
//
// A second group injects EIO and ENOSPC into each write and sync of one
// commit: that commit fails with a clear error and the previous checkpoint
// stays committed and readable, also after a crash.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "media/fault_medium.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

using testing::CheckContent;
using testing::kTestCrcChunk;
using testing::kTestSlotBytes;
using testing::MakeCheckpoint;
using testing::MakeCommitRequest;
using testing::TestCheckpoint;

constexpr uint32_t kInFlight = 2;              // N checkpoints in flight
constexpr uint32_t kSlots = kInFlight + 1;     // N + 1 slots
constexpr int kWriters = 3;                    // data-writer threads
constexpr uint64_t kWriteBytes = 16 << 10;     // one data write
constexpr int kMaxCheckpointsPerCycle = 5;

// How many crash points the main test runs (NONSTOP_CRASH_POINTS overrides,
// e.g. for the smaller ThreadSanitizer run).
int CrashPoints() {
  const char* env = std::getenv("NONSTOP_CRASH_POINTS");
  int n = env != nullptr ? std::atoi(env) : 0;
  return n > 0 ? n : 1000;
}

bool IsCrashError(const Status& st) {
  return st.message().find("device crashed") != std::string::npos;
}

// Writer threads draining a queue of data writes. Each write belongs to one
// in-flight checkpoint; the checkpoint learns when all of its writes are done
// and whether one failed.
class WriterPool {
 public:
  struct Job {
    std::mutex mu;
    std::condition_variable cv;
    int pending = 0;  // guarded by mu
    Status error;     // guarded by mu; first failure
  };

  explicit WriterPool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
  }
  ~WriterPool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Queues the data region of `c` for `slot`, in kWriteBytes pieces.
  void Submit(SlotFile* f, const TestCheckpoint* c, uint32_t slot, Job* job) {
    std::lock_guard<std::mutex> l(mu_);
    for (uint64_t off = 0; off < c->data.size(); off += kWriteBytes) {
      const uint64_t n = std::min<uint64_t>(kWriteBytes, c->data.size() - off);
      tasks_.push_back({f, slot, off, c->data.data() + off, n, job});
      std::lock_guard<std::mutex> jl(job->mu);
      job->pending++;
    }
    cv_.notify_all();
  }

  static Status Wait(Job* job) {
    std::unique_lock<std::mutex> l(job->mu);
    job->cv.wait(l, [job] { return job->pending == 0; });
    return job->error;
  }

 private:
  struct Task {
    SlotFile* file;
    uint32_t slot;
    uint64_t offset;
    const uint8_t* bytes;
    uint64_t n;
    Job* job;
  };

  void Run() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return closing_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        t = tasks_.front();
        tasks_.pop_front();
      }
      Status st = t.file->WriteData(t.slot, t.offset, t.bytes, t.n);
      std::lock_guard<std::mutex> jl(t.job->mu);
      if (!st.ok() && t.job->error.ok()) t.job->error = st;
      if (--t.job->pending == 0) t.job->cv.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;  // guarded by mu_
  bool closing_ = false;    // guarded by mu_
  std::vector<std::thread> threads_;
};

struct Tally {
  int crash_points = 0;
  int recovered = 0;
  int corrupt = 0;
  int committed_lost = 0;
  int unexpected_errors = 0;
  // Records newer than the recovered checkpoint whose table or data did not
  // verify. The commit order (data and table synced before the record is
  // written) makes this impossible; a torn ring entry is not counted.
  int record_before_data = 0;
  std::vector<std::string> failures;  // the first few, for the log
  void Fail(std::string why) {
    if (failures.size() < 10) failures.push_back(std::move(why));
  }
};

// One disk, one slot file, many crash cycles.
class CrashHarness {
 public:
  explicit CrashHarness(uint64_t seed) : rng_(seed), pool_(kWriters) {
    disk_ = FaultDisk::Create();
    StoreGeometry g;
    g.slots = kSlots;
    g.slot_bytes = kTestSlotBytes;
    file_ = SlotFile::Create(disk_->Open(), g).value();
    // A first checkpoint, so that every crash has something committed to lose.
    TestCheckpoint c = NextCheckpoint();
    step_of_[next_counter_] = c.step;
    EXPECT_TRUE(testing::WriteAndCommit(*file_, c, 0, next_counter_).ok());
    committed_counter_ = next_counter_++;
    committed_slot_ = 0;
  }

  // Writes checkpoints until a crash at a random write or sync, then recovers.
  void Cycle(Tally* tally) {
    const int n = 1 + static_cast<int>(rng_() % kMaxCheckpointsPerCycle);
    std::vector<TestCheckpoint> cks;
    uint64_t writes = 0;
    for (int i = 0; i < n; ++i) {
      cks.push_back(NextCheckpoint());
      writes += (cks.back().data.size() + kWriteBytes - 1) / kWriteBytes + 2;  // data, table, record
    }
    const uint64_t syncs = 2 * static_cast<uint64_t>(n);
    const CrashMode mode = rng_() % 2 ? CrashMode::kTornUnsynced : CrashMode::kDropUnsynced;
    const uint64_t crash_seed = rng_();
    const int where = static_cast<int>(rng_() % 20);
    if (where < 12) {
      disk_->CrashOnCall(FaultOp::kWrite, 1 + rng_() % writes, mode, crash_seed);
    } else if (where < 19) {
      disk_->CrashOnCall(FaultOp::kSync, 1 + rng_() % syncs, mode, crash_seed);
    }  // else: crash after the whole cycle, when everything is synced

    RunPipeline(cks, tally);
    if (disk_->crashes() == crashes_before_) disk_->Crash(mode, crash_seed);
    disk_->ClearErrors();
    crashes_before_ = disk_->crashes();
    tally->crash_points++;
    Recover(tally);
  }

 private:
  TestCheckpoint NextCheckpoint() {
    step_ += 1 + static_cast<int64_t>(rng_() % 100);
    return MakeCheckpoint(step_);
  }

  uint32_t FreeSlot(const std::vector<uint32_t>& busy) const {
    for (uint32_t s = 0; s < kSlots; ++s) {
      if (s != committed_slot_ && std::find(busy.begin(), busy.end(), s) == busy.end()) return s;
    }
    return kSlots;  // cannot happen with kInFlight + 1 slots
  }

  // Up to kInFlight checkpoints have their data in the writer pool at once;
  // the oldest is committed as soon as its data is written. Stops at the
  // first error (the crash).
  void RunPipeline(const std::vector<TestCheckpoint>& cks, Tally* tally) {
    struct InFlight {
      size_t index;
      uint64_t counter;
      uint32_t slot;
      std::unique_ptr<WriterPool::Job> job;
    };
    std::deque<InFlight> inflight;
    size_t next = 0;
    Status failure;
    while (failure.ok() && (next < cks.size() || !inflight.empty())) {
      while (next < cks.size() && inflight.size() < kInFlight) {
        std::vector<uint32_t> busy;
        for (const auto& f : inflight) busy.push_back(f.slot);
        InFlight f{next, next_counter_++, FreeSlot(busy), std::make_unique<WriterPool::Job>()};
        step_of_[f.counter] = cks[next].step;
        pool_.Submit(file_.get(), &cks[next], f.slot, f.job.get());
        inflight.push_back(std::move(f));
        ++next;
      }
      InFlight& head = inflight.front();
      failure = WriterPool::Wait(head.job.get());
      if (failure.ok()) {
        auto r = file_->Commit(MakeCommitRequest(cks[head.index], head.slot, head.counter));
        failure = r.status();
        if (r.ok()) {
          committed_counter_ = head.counter;
          committed_slot_ = head.slot;
        }
      }
      if (failure.ok()) inflight.pop_front();
    }
    // Every queued write must finish (or fail) before the checkpoints go away.
    for (auto& f : inflight) (void)WriterPool::Wait(f.job.get());
    if (!failure.ok() && !IsCrashError(failure)) {
      tally->unexpected_errors++;
      tally->Fail("unexpected error before the crash: " + failure.ToString());
    }
  }

  void Recover(Tally* tally) {
    const std::string at = "crash point " + std::to_string(tally->crash_points) + ": ";
    auto opened = SlotFile::Open(disk_->Open());
    if (!opened.ok()) {
      tally->corrupt++;
      tally->Fail(at + "open failed: " + opened.status().ToString());
      file_.reset();
      return;
    }
    file_ = std::move(opened).value();
    auto scan = file_->Scan();
    if (!scan.ok() || scan->newest_valid < 0) {
      tally->committed_lost++;
      tally->Fail(at + "nothing recovered (newest committed #" +
                  std::to_string(committed_counter_) + "): " +
                  (scan.ok() ? "no valid checkpoint" : scan.status().ToString()));
      return;
    }
    for (int i = 0; i < scan->newest_valid; ++i) {
      tally->record_before_data++;
      tally->Fail(at + "a record reached the disk before its checkpoint did: " +
                  scan->checkpoints[i].reason);
    }
    const CheckpointInfo& info = scan->checkpoints[scan->newest_valid].info;
    bool ok = true;
    if (info.counter < committed_counter_) {
      tally->committed_lost++;
      tally->Fail(at + "recovered #" + std::to_string(info.counter) + " but #" +
                  std::to_string(committed_counter_) + " had committed");
      ok = false;
    }
    auto it = step_of_.find(info.counter);
    Status content = it == step_of_.end() || it->second != info.step
                         ? Status::Corruption("no checkpoint #" + std::to_string(info.counter) +
                                              " at step " + std::to_string(info.step) +
                                              " was written")
                         : CheckContent(*file_, info);
    if (!content.ok()) {
      tally->corrupt++;
      tally->Fail(at + content.ToString());
      ok = false;
    }
    if (ok) tally->recovered++;
    // The recovered checkpoint is durable: it is the one to protect now.
    committed_counter_ = info.counter;
    committed_slot_ = info.slot;
    next_counter_ = std::max(next_counter_, file_->newest_committed_counter() + 1);
  }

  std::mt19937_64 rng_;
  WriterPool pool_;
  std::shared_ptr<FaultDisk> disk_;
  std::unique_ptr<SlotFile> file_;
  std::map<uint64_t, int64_t> step_of_;  // every checkpoint ever started: counter -> step
  int64_t step_ = 0;
  uint64_t next_counter_ = 1;
  uint64_t committed_counter_ = 0;  // newest whose Commit returned OK (or recovered)
  uint32_t committed_slot_ = 0;
  uint64_t crashes_before_ = 0;
};

TEST(StoreCrashTest, RandomCrashPointsNeverLoseOrCorruptACommittedCheckpoint) {
  const int points = CrashPoints();
  const uint64_t seed = 20250917;
  Tally tally;
  // A few independent disks, so a damaged file cannot hide later crash points.
  constexpr int kDisks = 4;
  for (int d = 0; d < kDisks; ++d) {
    CrashHarness h(seed + d);
    const int here = points / kDisks + (d < points % kDisks ? 1 : 0);
    for (int i = 0; i < here; ++i) h.Cycle(&tally);
  }
  std::printf("crash points: %d, recovered: %d, corrupt: %d, committed lost: %d\n",
              tally.crash_points, tally.recovered, tally.corrupt, tally.committed_lost);
  for (const auto& f : tally.failures) std::printf("  %s\n", f.c_str());
  EXPECT_EQ(tally.crash_points, points);
  EXPECT_EQ(tally.corrupt, 0);
  EXPECT_EQ(tally.committed_lost, 0);
  EXPECT_EQ(tally.unexpected_errors, 0);
  EXPECT_EQ(tally.record_before_data, 0);
  EXPECT_EQ(tally.recovered, points);
}

// ---------------------------------------------------------------------------
// EIO / ENOSPC during one commit.

struct ErrorCase {
  FaultOp op;
  uint64_t nth;         // counted from the start of checkpoint B's writes
  const char* where;    // what the error message must mention ("" = the write itself)
};

// Checkpoint A committed in slot 0; B is written to slot 1 with one write
// or sync failing. Returns the disk for the caller's further checks.
struct ErrorFixture {
  std::shared_ptr<FaultDisk> disk = FaultDisk::Create();
  std::unique_ptr<SlotFile> file;
  TestCheckpoint a = MakeCheckpoint(1000);
  TestCheckpoint b = MakeCheckpoint(2000);
  TestCheckpoint c = MakeCheckpoint(3000);

  ErrorFixture() {
    StoreGeometry g;
    g.slots = kSlots;
    g.slot_bytes = kTestSlotBytes;
    file = SlotFile::Create(disk->Open(), g).value();
    EXPECT_TRUE(testing::WriteAndCommit(*file, a, 0, 1).ok());
  }
  // B's data goes in kWriteBytes pieces, so a data write can fail midway.
  Status SaveB() {
    for (uint64_t off = 0; off < b.data.size(); off += kWriteBytes) {
      const uint64_t n = std::min<uint64_t>(kWriteBytes, b.data.size() - off);
      NONSTOP_RETURN_IF_ERROR(file->WriteData(1, off, b.data.data() + off, n));
    }
    return file->Commit(MakeCommitRequest(b, 1, 2)).status();
  }
  uint64_t DataWritesOfB() const { return (b.data.size() + kWriteBytes - 1) / kWriteBytes; }
};

// Newest valid must be A, or B with exactly B's bytes (its record reached the
// medium before the failure); A itself must still be committed and readable.
void ExpectAIntactAfter(SlotFile& f, const std::string& when) {
  ScanOptions opts;
  opts.verify_all = true;
  auto scan = f.Scan(opts);
  ASSERT_TRUE(scan.ok()) << when << ": " << scan.status().ToString();
  ASSERT_GE(scan->newest_valid, 0) << when << ": nothing valid";
  const CheckpointInfo& newest = scan->checkpoints[scan->newest_valid].info;
  EXPECT_TRUE(newest.counter == 1 || newest.counter == 2) << when << ": #" << newest.counter;
  EXPECT_TRUE(CheckContent(f, newest).ok()) << when;
  bool a_ok = false;
  for (const auto& sc : scan->checkpoints) {
    if (sc.info.counter == 1 && sc.state == CheckpointState::kCommitted) {
      a_ok = CheckContent(f, sc.info).ok();
    }
  }
  EXPECT_TRUE(a_ok) << when << ": checkpoint A is no longer committed and readable";
}

TEST(StoreErrorTest, EioAndEnospcFailTheCommitAndKeepThePreviousCheckpoint) {
  const uint64_t data_writes = ErrorFixture().DataWritesOfB();
  const std::vector<ErrorCase> cases = {
      {FaultOp::kWrite, 1, ""},                                   // first data write
      {FaultOp::kWrite, data_writes, ""},                         // last data write
      {FaultOp::kWrite, data_writes + 1, "writing the tensor table"},
      {FaultOp::kSync, 1, "syncing checkpoint data"},
      {FaultOp::kWrite, data_writes + 2, "writing the superblock record"},
      {FaultOp::kSync, 2, "syncing the superblock record"},
  };
  for (int err : {EIO, ENOSPC}) {
    for (const ErrorCase& ec : cases) {
      for (CrashMode mode : {CrashMode::kDropUnsynced, CrashMode::kTornUnsynced}) {
        const std::string name = std::string(ec.op == FaultOp::kWrite ? "write " : "sync ") +
                                 std::to_string(ec.nth) + " " + std::strerror(err);
        SCOPED_TRACE(name);
        ErrorFixture fx;
        fx.disk->InjectError(ec.op, ec.nth, err);
        Status st = fx.SaveB();
        ASSERT_FALSE(st.ok());
        EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
        EXPECT_NE(st.message().find(std::strerror(err)), std::string::npos) << st.ToString();
        EXPECT_NE(st.message().find(ec.where), std::string::npos) << st.ToString();

        // The same file, and a fresh open of the disk, still hold A.
        ExpectAIntactAfter(*fx.file, "after the failed commit");
        ExpectAIntactAfter(*SlotFile::Open(fx.disk->Open()).value(), "reopened");

        // The medium stays usable: the next checkpoint reuses B's slot.
        ASSERT_TRUE(testing::WriteAndCommit(*fx.file, fx.c, 1, 3).ok());
        fx.disk->Crash(mode, 7);
        auto f = SlotFile::Open(fx.disk->Open()).value();
        auto scan = f->Scan();
        ASSERT_TRUE(scan.ok());
        ASSERT_GE(scan->newest_valid, 0);
        const CheckpointInfo& info = scan->checkpoints[scan->newest_valid].info;
        EXPECT_EQ(info.counter, 3u);
        EXPECT_TRUE(CheckContent(*f, info).ok());
      }
    }
  }
}

TEST(StoreErrorTest, CrashRightAfterAFailedCommitRecoversThePreviousCheckpoint) {
  for (int err : {EIO, ENOSPC}) {
    for (uint64_t nth : {1, 2}) {  // the data/table sync or the record sync
      for (CrashMode mode : {CrashMode::kDropUnsynced, CrashMode::kTornUnsynced}) {
        for (uint64_t seed = 0; seed < 8; ++seed) {
          ErrorFixture fx;
          fx.disk->InjectError(FaultOp::kSync, nth, err);
          ASSERT_FALSE(fx.SaveB().ok());
          fx.disk->Crash(mode, seed);
          auto f = SlotFile::Open(fx.disk->Open()).value();
          ExpectAIntactAfter(*f, "after the crash");
        }
      }
    }
  }
}

TEST(StoreErrorTest, FullDiskFailsEveryCommitAndKeepsTheLastGoodOne) {
  ErrorFixture fx;
  fx.disk->InjectErrorFrom(FaultOp::kWrite, 3, ENOSPC);  // the disk fills during B's data
  Status st = fx.SaveB();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("No space left on device"), std::string::npos) << st.ToString();
  EXPECT_FALSE(testing::WriteAndCommit(*fx.file, fx.c, 2, 3).ok());
  ExpectAIntactAfter(*fx.file, "disk full");
  fx.disk->Crash(CrashMode::kTornUnsynced, 3);
  fx.disk->ClearErrors();
  auto f = SlotFile::Open(fx.disk->Open()).value();
  ExpectAIntactAfter(*f, "disk full, then a crash");
}

}  // namespace
}  // namespace nonstop
