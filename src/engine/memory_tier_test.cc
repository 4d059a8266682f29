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

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "engine/engine_internal.h"
#include "media/medium_wrapper.h"
#include "nonstop/engine.h"
#include "nonstop/env.h"
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

// An Env that counts the bytes read from segment files (".nsck" files
// opened in the directory `counted`); everything else goes to DefaultEnv().
class SegmentReadCounter final : public Env {
 public:
  explicit SegmentReadCounter(std::string counted) : counted_(std::move(counted)) {}
  uint64_t bytes() const { return bytes_.load(); }
  Result<std::unique_ptr<Directory>> OpenDirectory(const std::string& path, bool create) override {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d,
                             DefaultEnv()->OpenDirectory(path, create));
    return std::unique_ptr<Directory>(new Dir(this, std::move(d)));
  }

 private:
  class Counted final : public media::MediumWrapper {
   public:
    Counted(std::unique_ptr<Medium> m, std::atomic<uint64_t>* n)
        : MediumWrapper(std::move(m)), n_(n) {}
    Status Read(uint64_t offset, void* buf, size_t n) override {
      *n_ += n;
      return inner().Read(offset, buf, n);
    }

   private:
    std::atomic<uint64_t>* n_;
  };
  class Dir final : public Directory {
   public:
    Dir(SegmentReadCounter* env, std::unique_ptr<Directory> d) : env_(env), d_(std::move(d)) {}
    const std::string& path() const override { return d_->path(); }
    Result<std::unique_ptr<Medium>> OpenFile(std::string_view name, MediumKind kind,
                                             const MediumOptions& opts) override {
      NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m, d_->OpenFile(name, kind, opts));
      const bool segment = fs::path(d_->path()) == fs::path(env_->counted_) &&
                           name.size() > 5 && name.substr(name.size() - 5) == ".nsck";
      if (!segment) return m;
      return std::unique_ptr<Medium>(new Counted(std::move(m), &env_->bytes_));
    }
    Result<std::unique_ptr<Medium>> CreateFile(std::string_view name, MediumKind kind,
                                               const MediumOptions& opts) override {
      return d_->CreateFile(name, kind, opts);
    }
    Result<std::unique_ptr<Directory>> OpenDir(std::string_view name, bool create) override {
      NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, d_->OpenDir(name, create));
      return std::unique_ptr<Directory>(new Dir(env_, std::move(d)));
    }
    Status Rename(std::string_view from, std::string_view to, Directory* to_dir) override {
      Dir* other = dynamic_cast<Dir*>(to_dir);
      return d_->Rename(from, to, other != nullptr ? other->d_.get() : to_dir);
    }
    Status Unlink(std::string_view name) override { return d_->Unlink(name); }
    Status RemoveDir(std::string_view name) override { return d_->RemoveDir(name); }
    Status SyncDir() override { return d_->SyncDir(); }
    Result<std::vector<DirEntry>> List() override { return d_->List(); }
    Result<FileStat> Stat(std::string_view name) override { return d_->Stat(name); }
    Result<uint64_t> FreeBytes() override { return d_->FreeBytes(); }
    Result<std::unique_ptr<FileLock>> Lock(std::string_view name,
                                           const std::string& holder) override {
      return d_->Lock(name, holder);
    }

   private:
    SegmentReadCounter* env_;
    std::unique_ptr<Directory> d_;
  };

  std::string counted_;
  std::atomic<uint64_t> bytes_{0};
};

// A restart from the segment reads and checksums its data once: the open
// checks the header, record and table (and that they are the disk's newest
// checkpoint), the restore's read verifies every chunk. It was read twice
// (a full verifying scan at open, then the read).
TEST_F(MemoryTierTest, ARestartReadsTheSegmentsDataOnce) {
  std::vector<float> w(1 << 20);  // 4 MiB of data, 64 KiB crc chunks
  fs::path seg, aside;
  {
    auto e = Engine::Open(Options("job")).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, 1, 2);
    seg = Segment(*e);
    aside = SaveAside(seg);
    ASSERT_TRUE(e->Close().ok());
  }
  PutBack(aside, seg);
  SegmentReadCounter env(shm_);
  EngineOptions o = Options("job");
  o.env = &env;
  auto e = Engine::Open(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  std::fill(w.begin(), w.end(), -1.f);
  ASSERT_TRUE((*e)->Register({Ref(w)}).ok());
  auto info = (*e)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 2);
  EXPECT_TRUE((*e)->Stats().restored_from_memory);
  std::vector<float> want(w.size());
  Fill(want, 2);
  EXPECT_TRUE(want == w);
  const uint64_t data = w.size() * sizeof(float);
  EXPECT_GE(env.bytes(), data);
  EXPECT_LT(env.bytes(), data + data / 2) << "the segment's data was read more than once";
  ASSERT_TRUE((*e)->Close().ok());
}

// A segment whose table is intact but one of whose data chunks is damaged
// passes the open (which no longer reads the data); the restore's read finds
// the mismatch and reads the disk into the same tensors.
TEST_F(MemoryTierTest, ADamagedDataChunkInTheSegmentFallsBackToTheDisk) {
  std::vector<float> w(1 << 18);
  fs::path seg, aside;
  {
    auto e = Engine::Open(Options("job")).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, 1, 4);
    seg = Segment(*e);
    aside = SaveAside(seg);
    ASSERT_TRUE(e->Close().ok());
  }
  PutBack(aside, seg);
  // Flip one byte inside the checkpoint's data (found by its value).
  std::string bytes;
  {
    std::ifstream in(seg, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::vector<float> want(w.size());
  Fill(want, 4);
  const std::string needle(reinterpret_cast<const char*>(&want[1000]), 64);
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  {
    std::fstream f(seg, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(static_cast<char>(bytes[at] ^ 0x5a));
  }
  std::string why;
  auto s = OpenMemorySegment((root_ / "job").string(), 0, shm_, nullptr, nullptr, &why);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_TRUE(s.value().has_value()) << why;  // the data is checked by the read
  EXPECT_FALSE(RestoreFresh("job", w, 4));    // read from the disk, values checked there
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

// The newest committed step on disk of `job` (-1: none).
int64_t NewestOnDisk(const fs::path& job) {
  auto jd = JobDir::OpenForRead(job.string());
  EXPECT_TRUE(jd.ok());
  if (!jd.ok()) return -2;
  auto sel = (*jd)->Select(0);
  EXPECT_TRUE(sel.ok()) << sel.status().ToString();
  if (!sel.ok() || !sel->chosen) return -1;
  return sel->chosen->info.step;
}

// A SIGKILL once the segment is known to hold the newest committed
// checkpoint (the child says so through a pipe and then only waits): the
// restart reads the segment, in both modes. Nothing here depends on timing.
TEST_F(MemoryTierTest, KillAfterTheSegmentIsCompleteRestoresFromMemory) {
  for (const char* tier : {"memory", "auto"}) {
    const std::string job = std::string("killed-") + tier;
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      alarm(60);  // hard limit for the child
      std::vector<float> w(400000);
      EngineOptions o = Options(job, tier);
      o.memory_tier_share = 1;  // "auto" then skips only while a copy runs
      auto e = Engine::Open(o);
      if (!e.ok()) _exit(3);
      if (!(*e)->Register({Ref(w)}).ok()) _exit(4);
      auto wait_segment = [&](uint64_t counter) {
        while ((*e)->Stats().memory_counter != counter) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));  // polls; alarm bounds it
        }
      };
      uint64_t last = 0;
      for (int step = 1; step <= 3; ++step) {
        if (!(*e)->WaitCopied().ok()) _exit(5);
        Fill(w, step);
        auto c = (*e)->Checkpoint(step, "{}");
        if (!c.ok() || !(*e)->WaitCommitted(*c).ok()) _exit(6);
        last = *c;
        // "auto" skips a commit that arrives during a copy: wait for each.
        if (std::string(tier) == "auto") wait_segment(*c);
      }
      wait_segment(last);
      const char one = 1;
      if (::write(fds[1], &one, 1) != 1) _exit(8);
      for (;;) ::pause();
    }
    ::close(fds[1]);
    char got = 0;
    const ssize_t n = ::read(fds[0], &got, 1);  // the child's alarm bounds this
    ::close(fds[0]);
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_EQ(n, 1) << tier << ": the child exited with " << WEXITSTATUS(status)
                    << " or signal " << WTERMSIG(status) << " before its segment was complete";
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    ASSERT_EQ(NewestOnDisk(root_ / job), 3);
    std::vector<float> w(400000);
    EXPECT_TRUE(RestoreFresh(job, w, 3, tier)) << tier << ": the restart did not read the segment";
  }
}

// SIGKILL at random points while checkpoints commit and the segment is
// rewritten: recovery always gets the newest checkpoint committed on disk,
// from the segment or from the disk, never anything else. (Where the kill
// lands is luck, so this asserts only that the result is right; the test
// above proves the segment is read after a kill.)
TEST_F(MemoryTierTest, KillAtRandomPoints) {
  std::mt19937 rng(12345);
  for (int round = 0; round < 6; ++round) {
    const std::string job = "kill" + std::to_string(round);
    const char* tier = round % 2 == 0 ? "memory" : "auto";
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      alarm(20);  // hard limit for the child
      std::vector<float> w(400000);
      EngineOptions o = Options(job, tier);
      o.memory_tier_share = 0.5;
      auto e = Engine::Open(o);
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
    const int64_t newest = NewestOnDisk(root_ / job);
    if (newest < 0) continue;  // killed before the first commit
    std::vector<float> w(400000);
    (void)RestoreFresh(job, w, newest, tier);  // checks the step and every value
  }
}

// A child that checkpoints steps 1..3 of `job` (tier "memory"), waits until
// the segment holds step 3, says so on a pipe and is SIGKILLed: a crash that
// leaves its segment and lock file behind. Returns the segment's path.
fs::path CrashWithSegment(const EngineOptions& o) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    ::close(fds[0]);
    alarm(60);
    std::vector<float> w(100000, 1.f);
    auto e = Engine::Open(o);
    if (!e.ok()) _exit(3);
    TensorRef r;
    r.spec.name = "w";
    r.spec.dtype = DType::kFloat32;
    r.spec.shape = {static_cast<int64_t>(w.size())};
    r.spec.nbytes = w.size() * sizeof(float);
    r.data = w.data();
    if (!(*e)->Register({r}).ok()) _exit(4);
    uint64_t last = 0;
    for (int step = 1; step <= 3; ++step) {
      for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(step * 1000003 + i);
      auto c = (*e)->Checkpoint(step, "{}");
      if (!c.ok() || !(*e)->WaitCommitted(*c).ok()) _exit(6);
      last = *c;
    }
    while ((*e)->Stats().memory_counter != last) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // polls; alarm bounds it
    }
    const std::string seg = (*e)->Stats().memory_segment;
    if (::write(fds[1], seg.data(), seg.size()) != static_cast<ssize_t>(seg.size())) _exit(8);
    ::close(fds[1]);
    for (;;) ::pause();
  }
  ::close(fds[1]);
  std::string seg;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) seg.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  ::kill(pid, SIGKILL);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child exited with "
                                                                  << WEXITSTATUS(status);
  return fs::path(seg);
}

fs::path LockOf(const fs::path& seg) {
  fs::path l = seg;
  l.replace_extension(".lock");
  return l;
}

// Leftovers of crashed jobs are removed by the next writer of any job when
// their job directory is gone or names another segment; a crashed job whose
// directory still names its segment keeps it (it may restart) until it is
// older than memory_tier_orphan_s; a live job's segment is never touched.
TEST_F(MemoryTierTest, LeftoversOfCrashedJobsAreSweptLiveOnesNever) {
  std::vector<float> w(100000);
  // Crashed jobs: "gone" (directory deleted), "renamed" (its record now names
  // another segment), "waiting" (directory intact: may restart). Forked
  // before this process starts any thread of its own (TSan refuses threads
  // in a child forked from a multi-threaded parent).
  const fs::path gone = CrashWithSegment(Options("gone"));
  const fs::path renamed = CrashWithSegment(Options("renamed"));
  const fs::path waiting = CrashWithSegment(Options("waiting"));
  const fs::path old = CrashWithSegment(Options("old"));  // intact too, left to age
  // A live job with a segment (its directory is deleted under it below).
  auto live = Engine::Open(Options("live")).value();
  ASSERT_TRUE(live->Register({Ref(w)}).ok());
  Run(*live, w, 1, 1);
  const fs::path live_seg = Segment(*live);
  for (const fs::path& p : {gone, renamed, waiting, old}) {
    ASSERT_TRUE(fs::is_regular_file(p)) << p;
    ASSERT_TRUE(fs::is_regular_file(LockOf(p))) << p;
  }
  std::ofstream(fs::path(gone).concat(".tmp")) << "a copy the kill interrupted";
  fs::remove_all(root_ / "gone");
  {
    std::ofstream rec(root_ / "renamed" / JobDirNames::MemoryRecord(0), std::ios::trunc);
    rec << "nonstop memory segment v1\n0123456789abcdef-rank-00000.nsck\n";
  }
  fs::remove_all(root_ / "live");

  // The next writer, in another job, with the default age limit.
  {
    auto e = Engine::Open(Options("next")).value();
    EXPECT_EQ(e->Stats().memory_swept, 2u);
    ASSERT_TRUE(e->Close().ok());
  }
  EXPECT_FALSE(fs::exists(gone));
  EXPECT_FALSE(fs::exists(fs::path(gone).concat(".tmp")));
  EXPECT_FALSE(fs::exists(LockOf(gone)));
  EXPECT_FALSE(fs::exists(renamed));
  EXPECT_FALSE(fs::exists(LockOf(renamed)));
  EXPECT_TRUE(fs::is_regular_file(waiting));  // its job may restart
  EXPECT_TRUE(fs::is_regular_file(old));
  EXPECT_TRUE(fs::is_regular_file(live_seg));  // alive
  // The crashed job restarts within the age limit: it reads its segment.
  EXPECT_TRUE(RestoreFresh("waiting", w, 3));  // (its clean close removes it)
  EXPECT_FALSE(fs::exists(waiting));
  // A writer with an age limit of 0 removes the other crashed job's, still
  // not the live one.
  ASSERT_TRUE(fs::is_regular_file(old));
  {
    EngineOptions o = Options("next");
    o.memory_tier_orphan_s = 0;
    auto e = Engine::Open(o).value();
    EXPECT_EQ(e->Stats().memory_swept, 1u);
    ASSERT_TRUE(e->Close().ok());
  }
  EXPECT_FALSE(fs::exists(old));
  EXPECT_FALSE(fs::exists(LockOf(old)));
  EXPECT_TRUE(fs::is_regular_file(live_seg));
  EXPECT_TRUE(fs::is_regular_file(LockOf(live_seg)));
  EXPECT_TRUE(live->Close().ok());
  EXPECT_FALSE(fs::exists(live_seg));
  EXPECT_FALSE(fs::exists(LockOf(live_seg)));
}

// A writer whose lock a sweeper holds right now takes a fresh name; the
// sweeper never removes a segment whose lock it cannot take.
TEST_F(MemoryTierTest, AWriterWhoseLockIsHeldTakesAFreshName) {
  std::vector<float> w(100000);
  const fs::path seg = CrashWithSegment(Options("job"));
  auto dir = DefaultEnv()->OpenDirectory(shm_, false).value();
  std::string line;
  std::getline(std::ifstream(LockOf(seg)), line);  // as a sweeper keeps the owner's line
  auto held = dir->Lock(LockOf(seg).filename().string(), line).value();
  EngineOptions o = Options("job");
  o.memory_tier_orphan_s = 0;
  auto e = Engine::Open(o).value();
  EXPECT_NE(Segment(*e), seg);
  EXPECT_EQ(e->Stats().memory_swept, 0u);
  EXPECT_TRUE(fs::is_regular_file(seg));  // locked: not touched
  ASSERT_TRUE(e->Register({Ref(w)}).ok());
  Run(*e, w, 4, 4);
  ASSERT_TRUE(e->Close().ok());
  held.reset();
  // Its job directory names the new segment now: the old one is swept.
  auto e2 = Engine::Open(Options("other")).value();
  EXPECT_EQ(e2->Stats().memory_swept, 1u);
  EXPECT_FALSE(fs::exists(seg));
  ASSERT_TRUE(e2->Close().ok());
}

// The rule of "auto" (MirrorPacer): never while a copy runs, and at most
// `share` of the time.
TEST(MirrorPacerTest, SkipsWhileCopyingAndBoundsTheShare) {
  MirrorPacer p(0.1);
  EXPECT_TRUE(p.Admit(0.0, false));   // the first commit
  EXPECT_FALSE(p.Admit(0.0, true));   // never while a copy runs
  p.Done(10.0, 11.0);                 // a copy of 1 s: the next one 9 s after it
  EXPECT_FALSE(p.Admit(11.0, false));
  EXPECT_FALSE(p.Admit(19.99, false));
  EXPECT_TRUE(p.Admit(20.0, false));
  EXPECT_FALSE(p.Admit(25.0, true));
  // Over any run of copies, copying takes at most `share` of the time.
  MirrorPacer q(0.25);
  double t = 0, busy = 0;
  for (int i = 0; i < 1000; ++i) {
    t += 0.001 * (i % 7);  // commits at irregular intervals
    if (!q.Admit(t, false)) continue;
    const double d = 0.01 + 0.001 * (i % 5);
    q.Done(t, t + d);
    busy += d;
    t += d;
  }
  EXPECT_LE(busy, 0.25 * t + 0.015);
  EXPECT_GT(busy, 0.2 * t);  // and uses it when commits keep coming
  // share 1 (and anything out of range) = whenever no copy runs.
  for (double share : {1.0, 0.0, -1.0, 2.0}) {
    MirrorPacer r(share);
    r.Done(0, 5);
    EXPECT_TRUE(r.Admit(5, false)) << share;
  }
}

// "auto" at a tiny share: after the first copy every commit is skipped, the
// segment goes stale, and recovery reads the disk's newest checkpoint.
TEST_F(MemoryTierTest, AutoSkipsCommitsBeyondItsShareAndRecoveryReadsTheDisk) {
  std::vector<float> w(100000);
  fs::path seg, aside;
  {
    EngineOptions o = Options("job", "auto");
    o.memory_tier_share = 1e-9;  // a copy of >= 1 us forbids copies for >= 1000 s
    auto e = Engine::Open(o).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, 1, 1);  // the first commit is copied
    Run(*e, w, 2, 5, /*wait_memory=*/false);
    const EngineStats st = e->Stats();
    EXPECT_EQ(st.memory_mirrored, 1u);
    EXPECT_EQ(st.memory_skipped, 4u);
    EXPECT_EQ(st.memory_failures, 0u) << st.memory_error;
    seg = Segment(*e);
    aside = SaveAside(seg);  // as a crash would leave it: step 1
    ASSERT_TRUE(e->Close().ok());
  }
  PutBack(aside, seg);
  std::string why;
  auto s = OpenMemorySegment((root_ / "job").string(), 0, shm_, nullptr, nullptr, &why);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s.value().has_value());
  EXPECT_NE(why.find("holds checkpoint 1, the disk's newest is 5"), std::string::npos) << why;
  EXPECT_FALSE(RestoreFresh("job", w, 5, "auto"));
  // Out of range is refused.
  EngineOptions bad = Options("bad", "auto");
  bad.memory_tier_share = 0;
  auto e = Engine::Open(bad);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("memory_tier_share"), std::string::npos);
}

// Distributed recovery opens each rank's segment against the checkpoint of
// the step the ranks agreed on, which may be older than this rank's newest
// (a peer had not committed the newer one): exactly that checkpoint, never
// another step's.
TEST_F(MemoryTierTest, ASegmentIsOpenedForTheStepTheRanksAgreedOn) {
  std::vector<float> w(100000);
  fs::path seg, aside;
  {
    auto e = Engine::Open(Options("job")).value();
    ASSERT_TRUE(e->Register({Ref(w)}).ok());
    Run(*e, w, 1, 2);
    seg = Segment(*e);
    aside = SaveAside(seg);  // the segment of step 2
    Run(*e, w, 3, 3);
    ASSERT_TRUE(e->Close().ok());
  }
  PutBack(aside, seg);
  const std::string job = (root_ / "job").string();
  std::string why;
  auto s = OpenMemorySegment(job, 0, shm_, nullptr, nullptr, &why);  // the disk's newest: 3
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE(s.value().has_value());
  s = OpenMemorySegment(job, 0, shm_, nullptr, nullptr, &why, 3);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE(s.value().has_value());
  s = OpenMemorySegment(job, 0, shm_, nullptr, nullptr, &why, 2);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s.value().has_value()) << why;
  EXPECT_EQ(s.value()->info.step, 2);
  s = OpenMemorySegment(job, 0, shm_, nullptr, nullptr, &why, 7);  // no such step on disk
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE(s.value().has_value());
}

// All ranks of a job restart at once: a writer's sweep never takes the lock
// of another rank's segment of its own job that the job directory names
// (that rank would record a fresh name and restart from the disk), even
// with an age limit of 0, which removes any other job's dead segment.
TEST_F(MemoryTierTest, ASweepLeavesAnotherRankOfItsOwnJobAlone) {
  EngineOptions r1 = Options("job");
  r1.rank = 1;
  r1.world_size = 2;
  const fs::path seg1 = CrashWithSegment(r1);  // forked before any thread here
  ASSERT_TRUE(fs::is_regular_file(seg1));
  EngineOptions r0 = Options("job");
  r0.world_size = 2;
  r0.memory_tier_orphan_s = 0;
  auto e = Engine::Open(r0).value();
  EXPECT_EQ(e->Stats().memory_swept, 0u);
  EXPECT_TRUE(fs::is_regular_file(seg1));
  EXPECT_TRUE(fs::is_regular_file(LockOf(seg1)));
  ASSERT_TRUE(e->Close().ok());
  // Rank 1 restarts and finds its segment (step 3) under the recorded name.
  std::vector<float> w(100000);
  auto e1 = Engine::Open(r1).value();
  EXPECT_EQ(Segment(*e1), seg1);
  ASSERT_TRUE(e1->Register({Ref(w)}).ok());
  auto info = e1->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 3);
  EXPECT_TRUE(e1->Stats().restored_from_memory);
  ASSERT_TRUE(e1->Close().ok());
}

// What a peer server serves of its host's own memory (tier/peer.h): every
// segment the job directory's records name that exists, whatever rank or
// world size; a record that names none or is garbage, and a removed
// segment, are left out.
TEST_F(MemoryTierTest, RecordedSegmentsAreEveryRanksExistingSegment) {
  EngineOptions r0 = Options("job"), r1 = Options("job"), r3 = Options("job");
  r0.world_size = r1.world_size = r3.world_size = 4;
  r1.rank = 1;
  r3.rank = 3;
  const fs::path seg0 = CrashWithSegment(r0);  // forked before any thread here
  const fs::path seg1 = CrashWithSegment(r1);
  const fs::path seg3 = CrashWithSegment(r3);
  const std::string job = (root_ / "job").string();
  using Got = std::vector<std::pair<int, std::string>>;
  EXPECT_EQ(RecordedMemorySegments(job, shm_, nullptr),
            (Got{{0, seg0.filename().string()}, {1, seg1.filename().string()},
                 {3, seg3.filename().string()}}));
  fs::remove(seg1);
  {
    std::ofstream bad(root_ / "job" / JobDirNames::MemoryRecord(3), std::ios::trunc);
    bad << "not a record\n";
  }
  EXPECT_EQ(RecordedMemorySegments(job, shm_, nullptr), (Got{{0, seg0.filename().string()}}));
  EXPECT_TRUE(RecordedMemorySegments((root_ / "none").string(), shm_, nullptr).empty());
}

// Each read of a slot file first waits `read_ms` (only the mirror's copy
// reads it while the job runs), and each write returns `write_ms` after it
// landed: a newer checkpoint's first write lands while the copy still reads,
// and its commit comes well after the copy ended.
class SlowMedium final : public media::MediumWrapper {
 public:
  SlowMedium(std::unique_ptr<Medium> inner, int read_ms, int write_ms)
      : MediumWrapper(std::move(inner)), read_ms_(read_ms), write_ms_(write_ms) {}
  Status Read(uint64_t offset, void* buf, size_t n) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(read_ms_));
    return MediumWrapper::Read(offset, buf, n);
  }
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    Status s = MediumWrapper::Write(offset, buf, n);
    std::this_thread::sleep_for(std::chrono::milliseconds(write_ms_));
    return s;
  }

 private:
  const int read_ms_, write_ms_;
};

// Issue 24: in a distributed job, with the agreed checkpoint pinned and a
// candidate held, every newer committed slot went back to the free queue at
// its commit, while the mirror was still copying it: the next checkpoint
// took it and overwrote it during the copy ("Corruption: copying checkpoint
// 7846 to ...: data chunk 0 (tensor ...)"). The slot is held until the copy
// ends now: every copy succeeds.
TEST_F(MemoryTierTest, TheMirrorNeverReadsASlotThatANewerCheckpointReuses) {
  EngineOptions o = Options("dist");
  o.global_agreement = true;
  o.extra_slots = 1;    // the pinned one: 3 slots, so the freed one is taken next
  o.max_in_flight = 1;
  EngineMedia media;
  media.wrap = [](std::unique_ptr<Medium> m, const std::string&,
                  bool) -> Result<std::unique_ptr<Medium>> {
    return std::unique_ptr<Medium>(std::make_unique<SlowMedium>(std::move(m), 20, 40));
  };
  auto e = OpenEngine(o, media);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  std::vector<float> w(64 << 10);  // 256 KiB: 4 crc chunks of 64 KiB
  ASSERT_TRUE((*e)->Register({Ref(w)}).ok());
  Run(**e, w, 0, 0, /*wait_memory=*/false);
  auto cand = (*e)->Candidate();
  ASSERT_TRUE(cand.has_value());
  ASSERT_TRUE((*e)->Pin(cand->counter).ok());  // the agreed one
  Run(**e, w, 1, 1, /*wait_memory=*/false);     // the candidate
  Run(**e, w, 2, 6);                            // each freed at its commit before
  const EngineStats s = (*e)->Stats();
  EXPECT_EQ(s.memory_failures, 0u) << s.memory_error;
  EXPECT_EQ(s.committed, 7u);
  ASSERT_TRUE((*e)->Close().ok());
}

}  // namespace
}  // namespace nonstop
