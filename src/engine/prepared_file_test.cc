// The slot file PrepareStaging creates in the background when the rank has
// none (no first-checkpoint spike): the first Register adopts it when it
// fits, replaces it when not; a kill while or after it is created recovers
// as with no file; a failure of its creation is the first Register's error.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine_internal.h"
#include "engine/test_tensor_ref.h"
#include "media/medium_wrapper.h"
#include "nonstop/engine.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kSlotsOffset = 73728;  // header, its copy, 16 ring records (docs/FORMAT.md)

class PreparedFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nonstop_prepared_file_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  EngineOptions Options() const {
    EngineOptions o;
    o.dir = dir_.string();
    o.chunk_bytes = 1 * kMiB;
    o.staging_bytes = 8 * kMiB;  // the file is prepared whatever the staging
    o.memory_tier = "disk";      // nothing in /dev/shm (the kill tests)
    return o;
  }
  fs::path Slot() const { return dir_ / "rank-00000.nsck"; }
  fs::path Temp() const { return dir_ / "rank-00000.nsck.tmp"; }
  // The size of a slot file of `slots` slots of `slot_bytes`.
  static uint64_t FileBytes(uint64_t slots, uint64_t slot_bytes) {
    return kSlotsOffset + slots * slot_bytes;
  }
  fs::path dir_;
};

// The slot size the first Register needs for one tensor of n bytes.
uint64_t NeededSlotBytes(uint64_t n) {
  TensorSpec s;
  s.name = "t";
  s.dtype = DType::kUInt8;
  s.shape = {static_cast<int64_t>(n)};
  s.nbytes = n;
  return StoreGeometry::SlotBytesFor(SlotLayout::Plan({s}).value());
}

void Fill(std::vector<uint8_t>& v, uint8_t seed) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
}

TEST(PreparedSlotBytesTest, TheEstimateOfOneTensorFitsAndIsNotWasteful) {
  for (uint64_t n : {uint64_t{1}, uint64_t{4096}, 5 * kMiB + 17, 1320 * kMiB}) {
    const uint64_t estimate = n + 4096;  // what _state_bytes_estimate counts
    EXPECT_TRUE(PreparedSlotFits(PreparedSlotBytes(estimate), NeededSlotBytes(n))) << n;
    EXPECT_EQ(PreparedSlotBytes(estimate) % kStoreAlign, 0u);
  }
  EXPECT_FALSE(PreparedSlotFits(PreparedSlotBytes(kMiB), NeededSlotBytes(16 * kMiB)));
  EXPECT_FALSE(PreparedSlotFits(PreparedSlotBytes(256 * kMiB), NeededSlotBytes(4 * kMiB)));
}

// Adopted: the file on disk has the prepared size, the first Register did
// not create another, and a checkpoint through it commits and restores.
TEST_F(PreparedFileTest, TheFirstRegisterAdoptsTheSlotFileCreatedInTheBackground) {
  std::vector<uint8_t> t(5 * kMiB + 17);
  const uint64_t prepared = PreparedSlotBytes(t.size() + 4096);
  {
    auto e = Engine::Open(Options());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    ASSERT_TRUE((*e)->PrepareStaging(t.size() + 4096).ok());
    ASSERT_TRUE((*e)->Register({ByteTensorRef("t", t)}).ok());
    const uint64_t slots = Options().max_in_flight + 1;
    EXPECT_EQ(fs::file_size(Slot()), FileBytes(slots, prepared));
    EXPECT_NE(prepared, NeededSlotBytes(t.size()));  // not the size Register would pick
    EXPECT_EQ((*e)->Stats().slot_file_prepared_bytes, FileBytes(slots, prepared));
    Fill(t, 3);
    auto c = (*e)->Checkpoint(1, "{}");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
    ASSERT_TRUE((*e)->Close().ok());
  }
  EXPECT_FALSE(fs::exists(Temp()));
  auto e = Engine::Open(Options());
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE((*e)->Register({ByteTensorRef("t", t)}).ok());
  const std::vector<uint8_t> want = t;
  std::fill(t.begin(), t.end(), 0);
  auto info = (*e)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 1);
  EXPECT_TRUE(t == want);
  ASSERT_TRUE((*e)->Close().ok());
}

// Not adopted: an estimate below the state (the file is too small) or far
// above it (it would waste disk in every slot). Register creates the file
// it needs, as without the preparation, and it commits.
TEST_F(PreparedFileTest, ATooSmallOrFarTooLargePreparedFileIsReplaced) {
  std::vector<uint8_t> t(16 * kMiB);
  for (uint64_t estimate : {kMiB, 128 * kMiB}) {
    fs::remove_all(dir_);
    auto e = Engine::Open(Options());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    ASSERT_TRUE((*e)->PrepareStaging(estimate).ok());
    ASSERT_TRUE((*e)->Register({ByteTensorRef("t", t)}).ok());
    const uint64_t slots = Options().max_in_flight + 1;
    EXPECT_EQ(fs::file_size(Slot()), FileBytes(slots, NeededSlotBytes(t.size()))) << estimate;
    EXPECT_EQ((*e)->Stats().slot_file_prepared_bytes, 0u);
    Fill(t, 5);
    auto c = (*e)->Checkpoint(2, "{}");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
    EXPECT_EQ((*e)->Latest()->step, 2);
    ASSERT_TRUE((*e)->Close().ok());
    EXPECT_FALSE(fs::exists(Temp()));
  }
}

// PrepareStaging on a rank that has a slot file never touches it (the
// committed checkpoint stays, the file keeps its size).
TEST_F(PreparedFileTest, AnExistingSlotFileIsNeverReplaced) {
  std::vector<uint8_t> t(2 * kMiB);
  Fill(t, 9);
  {
    auto e = Engine::Open(Options());
    ASSERT_TRUE(e.ok());
    ASSERT_TRUE((*e)->Register({ByteTensorRef("t", t)}).ok());
    auto c = (*e)->Checkpoint(4, "{}");
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
    ASSERT_TRUE((*e)->Close().ok());
  }
  const uint64_t size = fs::file_size(Slot());
  {
    auto e = Engine::Open(Options());
    ASSERT_TRUE(e.ok());
    ASSERT_TRUE((*e)->PrepareStaging(64 * kMiB).ok());
    ASSERT_TRUE((*e)->Close().ok());  // joins any background work
  }
  EXPECT_EQ(fs::file_size(Slot()), size);
  auto e = Engine::Open(Options());
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE((*e)->Latest().has_value());
  EXPECT_EQ((*e)->Latest()->step, 4);
}

// Kills itself (SIGKILL) at the first Sync of a file it creates once armed.
class KillAtSync final : public media::MediumWrapper {
 public:
  using media::MediumWrapper::MediumWrapper;
  Status Sync() override {
    ::raise(SIGKILL);
    return MediumWrapper::Sync();
  }
};

// A fault in the background creation: every Sync of a created file fails.
class SyncFails final : public media::MediumWrapper {
 public:
  SyncFails(std::unique_ptr<Medium> m, std::shared_ptr<std::atomic<int>> left)
      : MediumWrapper(std::move(m)), left_(std::move(left)) {}
  Status Sync() override {
    if (left_->fetch_sub(1) > 0) return Status::IOError("fsync: injected EIO");
    return MediumWrapper::Sync();
  }

 private:
  std::shared_ptr<std::atomic<int>> left_;
};

// Runs `child` in a forked process with a hard time limit; returns its wait status.
template <typename F>
int InChild(F child) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(60);  // hard limit for the child
    child();
    ::_exit(0);
  }
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);  // the child's alarm bounds this
  return status;
}

// A process killed while the slot file is being created in the background
// (at its fsync), or after it was created and adopted but before the first
// commit, leaves no checkpoint and nothing that blocks the next start.
TEST_F(PreparedFileTest, AKillDuringOrAfterTheBackgroundCreationRecoversWithNoCheckpoint) {
  std::vector<uint8_t> t(3 * kMiB);
  for (bool during : {true, false}) {
    fs::remove_all(dir_);
    const int status = InChild([&] {
      EngineMedia media;
      if (during) {
        media.wrap = [](std::unique_ptr<Medium> m, const std::string&,
                        bool created) -> Result<std::unique_ptr<Medium>> {
          if (!created) return m;
          return std::unique_ptr<Medium>(std::make_unique<KillAtSync>(std::move(m)));
        };
      }
      auto e = OpenEngine(Options(), media);
      if (!e.ok()) ::_exit(2);
      if (!(*e)->PrepareStaging(t.size() + 4096).ok()) ::_exit(3);
      if (!(*e)->Register({ByteTensorRef("t", t)}).ok()) ::_exit(4);  // waits for the file
      if ((*e)->Stats().slot_file_prepared_bytes == 0) ::_exit(5);  // not adopted
      ::raise(SIGKILL);
    });
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << during << " " << status;
    EXPECT_EQ(fs::exists(Slot()), !during) << during;  // published only when complete
    auto e = Engine::Open(Options());
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    EXPECT_FALSE((*e)->Latest().has_value());
    EXPECT_FALSE(fs::exists(Temp()));
    ASSERT_TRUE((*e)->Register({ByteTensorRef("t", t)}).ok());
    Fill(t, 11);
    auto c = (*e)->Checkpoint(6, "{}");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
    EXPECT_EQ((*e)->Latest()->step, 6);
    ASSERT_TRUE((*e)->Close().ok());
  }
}

// A failed fsync in the background creation is the first Register's error
// (nothing registered, nothing committed, no file left); the next Register
// creates the file on the training thread as without the preparation.
TEST_F(PreparedFileTest, AFailedBackgroundFsyncIsTheFirstRegistersError) {
  std::vector<uint8_t> t(3 * kMiB);
  auto left = std::make_shared<std::atomic<int>>(1);
  EngineMedia media;
  media.wrap = [left](std::unique_ptr<Medium> m, const std::string&,
                      bool created) -> Result<std::unique_ptr<Medium>> {
    if (!created) return m;
    return std::unique_ptr<Medium>(std::make_unique<SyncFails>(std::move(m), left));
  };
  auto e = OpenEngine(Options(), media);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE((*e)->PrepareStaging(t.size() + 4096).ok());
  Status s = (*e)->Register({ByteTensorRef("t", t)});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.ToString().find("creating the slot file in the background"), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.ToString().find("injected EIO"), std::string::npos) << s.ToString();
  EXPECT_EQ(left->load(), 0);  // the fault was hit
  EXPECT_FALSE((*e)->Checkpoint(1, "{}").ok());  // nothing registered
  EXPECT_EQ((*e)->Stats().committed, 0u);
  EXPECT_FALSE((*e)->Latest().has_value());
  EXPECT_FALSE(fs::exists(Slot()));
  EXPECT_FALSE(fs::exists(Temp()));
  ASSERT_TRUE((*e)->Register({ByteTensorRef("t", t)}).ok());
  EXPECT_EQ((*e)->Stats().slot_file_prepared_bytes, 0u);
  auto c = (*e)->Checkpoint(2, "{}");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
  EXPECT_EQ((*e)->Latest()->step, 2);
  ASSERT_TRUE((*e)->Close().ok());
}

}  // namespace
}  // namespace nonstop
