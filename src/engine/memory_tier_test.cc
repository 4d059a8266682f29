// The memory tier (memory_tier.h): the newest committed checkpoint is kept in
// a shared-memory segment, and recovery reads it only when it verifies and
// holds exactly the disk's newest committed checkpoint of this job; anything
// else (stale, garbage, foreign, another job's, a full tmpfs, a kill at any
// point) falls back to the disk, which the tier never affects.
#include "engine/memory_tier.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "nonstop/engine.h"
#include "nonstop/jobdir.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;

class MemoryTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("nonstop-memtier-" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    shm_ = (root_ / "shm").string();
  }
  void TearDown() override {
    if (mounted_) ::umount2(mount_.c_str(), MNT_DETACH);
    fs::remove_all(root_);
  }

  EngineOptions Options(const std::string& job, const std::string& tier = "memory") {
    EngineOptions o;
    o.dir = (root_ / job).string();
    o.medium = MediumKind::kBuffered;
    o.chunk_bytes = 64 << 10;
    o.staging_bytes = 1 << 20;
    o.memory_tier = tier;
    o.shm_dir = shm_;
    return o;
  }

  TensorRef Ref(std::vector<float>& w) {
    TensorRef r;
    r.spec.name = "w";
    r.spec.dtype = DType::kFloat32;
    r.spec.shape = {static_cast<int64_t>(w.size())};
    r.spec.nbytes = w.size() * sizeof(float);
    r.data = w.data();
    return r;
  }

  static void Fill(std::vector<float>& w, int step) {
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(step * 1000003 + i);
  }

  // Checkpoints steps [from, to] and waits until the segment holds the last.
  void Run(Engine& e, std::vector<float>& w, int from, int to, bool wait_memory = true) {
    uint64_t last = 0;
    for (int step = from; step <= to; ++step) {
      ASSERT_TRUE(e.WaitCopied().ok());
      Fill(w, step);
      auto c = e.Checkpoint(step, "{}");
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      ASSERT_TRUE(e.WaitCommitted(*c).ok());
      last = *c;
    }
    if (!wait_memory) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (e.Stats().memory_counter != last && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_EQ(e.Stats().memory_counter, last) << e.Stats().memory_error;
  }

  // The segment file of engine `e` (its stats say where).
  static fs::path Segment(Engine& e) { return fs::path(e.Stats().memory_segment); }

  // Restores job `job` in a fresh engine; returns whether it read the segment.
  bool RestoreFresh(const std::string& job, std::vector<float>& w, int64_t want_step,
                    const std::string& tier = "memory") {
    auto e = Engine::Open(Options(job, tier));
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return false;
    std::fill(w.begin(), w.end(), -1.f);
    EXPECT_TRUE((*e)->Register({Ref(w)}).ok());
    auto info = (*e)->Restore();
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    if (info.ok()) {
      EXPECT_EQ(info->step, want_step);
      std::vector<float> want(w.size());
      Fill(want, static_cast<int>(want_step));
      EXPECT_TRUE(want == w);
    }
    const bool mem = (*e)->Stats().restored_from_memory;
    EXPECT_TRUE((*e)->Close().ok());
    return mem;
  }

  fs::path root_;
  std::string shm_;
  std::string mount_;
  bool mounted_ = false;
};

// A crash leaves the segment behind; Close() removes it. Simulated here by
// saving the segment's bytes before Close and putting them back after.
fs::path SaveAside(const fs::path& seg) {
  fs::path aside = seg;
  aside += ".aside";
  fs::copy_file(seg, aside, fs::copy_options::overwrite_existing);
  return aside;
}
void PutBack(const fs::path& aside, const fs::path& seg) {
  fs::copy_file(aside, seg, fs::copy_options::overwrite_existing);
  fs::remove(aside);
}

TEST_F(MemoryTierTest, NewestCheckpointIsMirroredAndRestoredFromMemory) {
  std::vector<float> w(300000);
  fs::path seg, aside;
  {
    auto e = Engine::Open(Options("job")).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, 1, 3);
    EXPECT_EQ(e->Stats().memory_failures, 0u);
    EXPECT_GE(e->Stats().memory_mirrored, 1u);
    seg = Segment(*e);
    ASSERT_TRUE(fs::is_regular_file(seg)) << seg;
    EXPECT_EQ(seg.parent_path(), fs::path(shm_));
    aside = SaveAside(seg);
    ASSERT_TRUE(e->Close().ok());
  }
  EXPECT_FALSE(fs::exists(seg));  // a clean close gives the memory back
  fs::copy_file(aside, seg);  // as a crash would have left it
  std::string why;
  auto s = OpenMemorySegment((root_ / "job").string(), 0, shm_, nullptr, nullptr, &why);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s.value().has_value()) << why;
  EXPECT_EQ(s.value()->info.step, 3);
  EXPECT_TRUE(RestoreFresh("job", w, 3));
  // tier "disk" never reads it.
  PutBack(aside, seg);
  EXPECT_FALSE(RestoreFresh("job", w, 3, "disk"));
}

TEST_F(MemoryTierTest, StaleSegmentIsNotUsed) {
  std::vector<float> w(100000);
  fs::path seg, aside;
  {
    auto e = Engine::Open(Options("job")).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, 1, 1);
    seg = Segment(*e);
    aside = SaveAside(seg);  // the segment of step 1
    Run(*e, w, 2, 2);
    ASSERT_TRUE(e->Close().ok());
  }
  PutBack(aside, seg);  // older than the disk's newest (step 2)
  std::string why;
  auto s = OpenMemorySegment((root_ / "job").string(), 0, shm_, nullptr, nullptr, &why);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s.value().has_value());
  EXPECT_NE(why.find("holds checkpoint 1, the disk's newest is 2"), std::string::npos) << why;
  EXPECT_FALSE(RestoreFresh("job", w, 2));
}

TEST_F(MemoryTierTest, GarbageForeignAndOtherJobsSegmentsAreRefused) {
  std::vector<float> w(100000);
  fs::path seg_a, seg_b, aside_a, aside_b;
  for (const char* job : {"a", "b"}) {
    auto e = Engine::Open(Options(job)).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, job[0] == 'a' ? 5 : 7, job[0] == 'a' ? 5 : 7);
    (job[0] == 'a' ? seg_a : seg_b) = Segment(*e);
    (job[0] == 'a' ? aside_a : aside_b) = SaveAside(Segment(*e));
    ASSERT_TRUE(e->Close().ok());
  }
  ASSERT_NE(seg_a, seg_b);  // one segment per job directory and rank
  auto refused = [&](const std::string& expect) {
    std::string why;
    auto s = OpenMemorySegment((root_ / "a").string(), 0, shm_, nullptr, nullptr, &why);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_FALSE(s.ok() && s.value().has_value());
    EXPECT_NE(why.find(expect), std::string::npos) << why;
    EXPECT_FALSE(RestoreFresh("a", w, 5));
  };
  // Another job's segment (same rank, same layout) under job a's name.
  fs::copy_file(aside_b, seg_a, fs::copy_options::overwrite_existing);
  refused("differs from the disk's checkpoint");
  // Garbage.
  auto garbage = [&] {
    std::ofstream f(seg_a, std::ios::binary | std::ios::trunc);
    std::mt19937 rng(7);
    for (int i = 0; i < 300000; ++i) f.put(static_cast<char>(rng()));
  };
  garbage();
  refused(seg_a.string());
  // A huge sparse file: refused by its size before anything is read.
  garbage();
  fs::resize_file(seg_a, uint64_t{1} << 40);
  refused("larger than");
  // A symlink to the real segment: never followed.
  fs::remove(seg_a);  // (the engine's clean close removed the file at the name already)
  PutBack(aside_a, fs::path(shm_) / "elsewhere");
  fs::create_symlink(fs::path(shm_) / "elsewhere", seg_a);
  refused("not a regular file");
  // A directory.
  fs::remove(seg_a);
  fs::create_directory(seg_a);
  refused("not a regular file");
  fs::remove(seg_a);
  // The real one (moved back) is used again.
  fs::rename(fs::path(shm_) / "elsewhere", seg_a);
  EXPECT_TRUE(RestoreFresh("a", w, 5));
}

// A tmpfs too small for the segment: "memory" reports the failure once and
// every checkpoint still commits on disk; "auto" does not even try.
TEST_F(MemoryTierTest, FullShmNeverAffectsTheDisk) {
  mount_ = (root_ / "small").string();
  fs::create_directories(mount_);
  if (::mount("tmpfs", mount_.c_str(), "tmpfs", 0, "size=256k") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(errno) << ")";
  }
  mounted_ = true;
  shm_ = mount_ + "/nonstop";
  std::vector<float> w(200000);  // 800 KB: does not fit 256 KiB
  for (const char* tier : {"memory", "auto"}) {
    const std::string job = std::string("job-") + tier;
    testing::internal::CaptureStderr();
    auto e = Engine::Open(Options(job, tier)).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, 1, 4, /*wait_memory=*/false);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((e->Stats().memory_failures == 0 && e->Stats().memory_error.empty()) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    EngineStats st = e->Stats();
    EXPECT_EQ(st.committed, 4u);
    EXPECT_EQ(st.memory_counter, 0u);
    ASSERT_TRUE(e->Close().ok());
    const std::string err = testing::internal::GetCapturedStderr();
    size_t lines = 0;
    for (size_t p = err.find("memory tier"); p != std::string::npos;
         p = err.find("memory tier", p + 1)) {
      ++lines;
    }
    if (std::string(tier) == "memory") {
      EXPECT_GE(st.memory_failures, 1u);
      EXPECT_EQ(lines, 1u) << err;  // reported once
    } else {
      EXPECT_EQ(st.memory_failures, 0u);
      EXPECT_NE(st.memory_error.find("does not fit"), std::string::npos) << st.memory_error;
      EXPECT_EQ(lines, 0u) << err;
    }
    EXPECT_TRUE(fs::is_empty(shm_)) << "no segment or temp file left";
    EXPECT_FALSE(RestoreFresh(job, w, 4, tier));
  }
}

// SIGKILL at random points while checkpoints commit and the segment is
// rewritten: recovery always gets the newest checkpoint committed on disk,
// from the segment or from the disk, never anything else.
TEST_F(MemoryTierTest, KillAtRandomPoints) {
  std::mt19937 rng(12345);
  int from_memory = 0;
  for (int round = 0; round < 6; ++round) {
    const std::string job = "kill" + std::to_string(round);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      alarm(20);  // hard limit for the child
      std::vector<float> w(400000);
      auto e = Engine::Open(Options(job));
      if (!e.ok()) _exit(3);
      if (!(*e)->Register({Ref(w)}).ok()) _exit(4);
      for (int step = 1;; ++step) {
        if (!(*e)->WaitCopied().ok()) _exit(5);
        Fill(w, step);
        auto c = (*e)->Checkpoint(step, "{}");
        if (!c.ok()) _exit(6);
        // Training between checkpoints: every other one is followed by a
        // pause, so kills land during writes, commits, segment copies and
        // between them.
        if (step % 2 == 0) {
          if (!(*e)->WaitCommitted(*c).ok()) _exit(7);
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 600));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited with " << WEXITSTATUS(status);
    // The newest committed checkpoint on disk.
    auto jd = JobDir::OpenForRead((root_ / job).string());
    ASSERT_TRUE(jd.ok());
    auto sel = (*jd)->Select(0);
    ASSERT_TRUE(sel.ok()) << sel.status().ToString();
    if (!sel->chosen) continue;  // killed before the first commit
    const int64_t newest = sel->chosen->info.step;
    std::vector<float> w(400000);
    from_memory += RestoreFresh(job, w, newest) ? 1 : 0;
  }
  // Most kills land between two commits, with the segment already holding the newest.
  EXPECT_GE(from_memory, 1);
}

}  // namespace
}  // namespace nonstop
