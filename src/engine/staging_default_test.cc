// The default staging size (EngineOptions::staging_bytes == 0): the rule
// (DefaultStagingSize) and the engine growing its pool to the registered
// state at Register.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>
#include <vector>

#include "engine/engine_internal.h"
#include "engine/test_tensor_ref.h"
#include "nonstop/engine.h"

namespace nonstop {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

TEST(DefaultStagingSizeTest, HoldsTheWholeStateAboveTheFloor) {
  const uint64_t b = 4 * kMiB;
  // Small states get the floor (256 MiB), as before.
  StagingSize s = DefaultStagingSize(0, b, 6, 64 * kGiB, false);
  EXPECT_EQ(s.bytes, 256 * kMiB);
  EXPECT_FALSE(s.capped);
  EXPECT_TRUE(s.note.empty());
  EXPECT_EQ(DefaultStagingSize(10 * kMiB, b, 6, 64 * kGiB, true).bytes, 256 * kMiB);
  // A 1.33 GB state (the H100 benchmark's) gets all of it, in whole chunks.
  const uint64_t state = 1330000000;
  s = DefaultStagingSize(state, b, 6, 128 * kGiB, true);
  EXPECT_GE(s.bytes, state);
  EXPECT_LT(s.bytes, state + b);
  EXPECT_EQ(s.bytes % b, 0u);
  EXPECT_FALSE(s.capped);
  // Never fewer than min_chunks chunks, whatever the floor.
  EXPECT_EQ(DefaultStagingSize(0, 64 * kMiB, 10, 64 * kGiB, false).bytes, 640 * kMiB);
}

TEST(DefaultStagingSizeTest, CappedByMemoryAndSaysSo) {
  const uint64_t b = 4 * kMiB;
  // A quarter of physical memory.
  StagingSize s = DefaultStagingSize(20 * kGiB, b, 6, 16 * kGiB, false);
  EXPECT_EQ(s.bytes, 4 * kGiB);
  EXPECT_TRUE(s.capped);
  EXPECT_NE(s.note.find("a quarter of physical memory"), std::string::npos) << s.note;
  EXPECT_NE(s.note.find("staging_bytes"), std::string::npos) << s.note;
  // Pinned staging: at most 32 GiB even with 1 TiB of RAM.
  s = DefaultStagingSize(100 * kGiB, b, 6, 1024 * kGiB, true);
  EXPECT_EQ(s.bytes, kPinnedStagingCapBytes);
  EXPECT_TRUE(s.capped);
  EXPECT_NE(s.note.find("pinned"), std::string::npos) << s.note;
  // Pageable staging is not held to the pinned cap.
  s = DefaultStagingSize(100 * kGiB, b, 6, 1024 * kGiB, false);
  EXPECT_GE(s.bytes, 100 * kGiB);
  EXPECT_FALSE(s.capped);
  // The cap never goes below the chunks the pipeline needs.
  s = DefaultStagingSize(kGiB, b, 6, 40 * kMiB, false);
  EXPECT_EQ(s.bytes, 6 * b);
  EXPECT_TRUE(s.capped);
  // Unknown RAM (0): no memory cap for pageable staging.
  EXPECT_FALSE(DefaultStagingSize(2 * kGiB, b, 6, 0, false).capped);
}

class StagingGrowthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("nonstop_staging_default_test_" + std::to_string(::getpid())))
               .string();
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(StagingGrowthTest, PoolGrowsToTheRegisteredStateUnlessStagingBytesIsGiven) {
  std::vector<uint8_t> big(264 * kMiB, 7);  // above the 256 MiB floor
  {
    EngineOptions o;
    o.dir = dir_;
    o.chunk_bytes = 4 * kMiB;
    auto e = Engine::Open(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    EXPECT_EQ((*e)->Stats().staging_bytes, 256 * kMiB);
    ASSERT_TRUE((*e)->Register({ByteTensorRef("big", big)}).ok());
    EXPECT_GE((*e)->Stats().staging_bytes, big.size());
    auto c = (*e)->Checkpoint(1, "{}");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
    // The whole copy fit in staging: it never waited for a free chunk.
    EXPECT_EQ((*e)->Stats().staging_wait_s_total, 0.0);
    ASSERT_TRUE((*e)->Close().ok());
  }
  std::filesystem::remove_all(dir_);
  {
    EngineOptions o;
    o.dir = dir_;
    o.chunk_bytes = 4 * kMiB;
    o.staging_bytes = 32 * kMiB;  // explicit: kept
    auto e = Engine::Open(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    ASSERT_TRUE((*e)->Register({ByteTensorRef("big", big)}).ok());
    EXPECT_EQ((*e)->Stats().staging_bytes, 32 * kMiB);
    ASSERT_TRUE((*e)->Close().ok());
  }
}

// small_initial_staging (the Python Checkpointer in one process, which calls
// PrepareStaging right after Open): Open allocates only the smallest pool,
// not the 256 MiB floor; Register still grows it to the default size.
TEST_F(StagingGrowthTest, SmallInitialStagingOpensWithTheSmallestPoolAndStillGrows) {
  std::vector<uint8_t> small(1 * kMiB, 3);
  EngineOptions o;
  o.dir = dir_;
  o.chunk_bytes = 4 * kMiB;
  o.small_initial_staging = true;
  auto e = Engine::Open(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const uint64_t opened = (*e)->Stats().staging_bytes;
  EXPECT_LT(opened, 256 * kMiB);
  EXPECT_GE(opened, 4 * kMiB);
  EXPECT_EQ(opened % (4 * kMiB), 0u);
  ASSERT_TRUE((*e)->Register({ByteTensorRef("small", small)}).ok());
  EXPECT_EQ((*e)->Stats().staging_bytes, 256 * kMiB);  // the default for this state
  auto c = (*e)->Checkpoint(1, "{}");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
  ASSERT_TRUE((*e)->Close().ok());
}

// PrepareStaging (no first-checkpoint spike): a pool allocated in the
// background before the first Register is taken by it without the training
// thread waiting for any allocation.
TEST_F(StagingGrowthTest, PreparedStagingIsTakenWithoutWaiting) {
  std::vector<uint8_t> big(264 * kMiB);
  for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<uint8_t>(i >> 12);
  EngineOptions o;
  o.dir = dir_;
  o.chunk_bytes = 4 * kMiB;
  auto e = Engine::Open(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_TRUE((*e)->PrepareStaging(big.size()).ok());
  ASSERT_TRUE((*e)->PrepareStaging(big.size()).ok());  // a second call while it runs: no-op
  // Give it time: the stats say when the background allocation is done.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while ((*e)->Stats().staging_prepared_bytes == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE((*e)->Stats().staging_prepared_bytes, big.size());
  // Not swapped in before Register; the default pool gave way to the
  // smallest one (its 256 MiB freed in the background, not in the first save).
  EXPECT_LT((*e)->Stats().staging_bytes, 256 * kMiB);
  EXPECT_GE((*e)->Stats().staging_bytes, 4 * kMiB);
  ASSERT_TRUE((*e)->Register({ByteTensorRef("big", big)}).ok());
  EngineStats s = (*e)->Stats();
  EXPECT_GE(s.staging_bytes, big.size());
  EXPECT_EQ(s.staging_alloc_waits, 0u);
  EXPECT_EQ(s.staging_alloc_wait_s, 0.0);
  auto c = (*e)->Checkpoint(1, "{}");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
  EXPECT_EQ((*e)->Stats().staging_wait_s_total, 0.0);  // the whole state fit
  // The checkpoint went through the prepared pool intact.
  std::vector<uint8_t> want = big;
  std::fill(big.begin(), big.end(), 0);
  auto info = (*e)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(big == want);
  ASSERT_TRUE((*e)->Close().ok());
}

// Without PrepareStaging the first Register allocates on the training
// thread, and the stats say so; a preparation still running when Register
// comes is waited for (at most once), never allocated twice.
TEST_F(StagingGrowthTest, AllocationOnTheTrainingThreadIsCounted) {
  std::vector<uint8_t> big(264 * kMiB, 3);
  for (bool prepare : {false, true}) {
    std::filesystem::remove_all(dir_);
    EngineOptions o;
    o.dir = dir_;
    o.chunk_bytes = 4 * kMiB;
    auto e = Engine::Open(o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    if (prepare) {
      ASSERT_TRUE((*e)->PrepareStaging(big.size()).ok());
    }
    ASSERT_TRUE((*e)->Register({ByteTensorRef("big", big)}).ok());
    EngineStats s = (*e)->Stats();
    EXPECT_GE(s.staging_bytes, big.size());
    if (prepare) {
      EXPECT_LE(s.staging_alloc_waits, 1u);
      EXPECT_GE(s.staging_prepared_bytes, big.size());
    } else {
      EXPECT_EQ(s.staging_alloc_waits, 1u);
      EXPECT_GT(s.staging_alloc_wait_s, 0.0);
      EXPECT_EQ(s.staging_prepared_bytes, 0u);
    }
    auto c = (*e)->Checkpoint(1, "{}");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE((*e)->WaitCommitted(*c).ok());
    ASSERT_TRUE((*e)->Close().ok());
  }
  // Close with a preparation nobody took frees it (ASan/TSan watch this).
  std::filesystem::remove_all(dir_);
  EngineOptions o;
  o.dir = dir_;
  o.chunk_bytes = 4 * kMiB;
  auto e = Engine::Open(o);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE((*e)->PrepareStaging(big.size()).ok());
  ASSERT_TRUE((*e)->Close().ok());
}

}  // namespace
}  // namespace nonstop
