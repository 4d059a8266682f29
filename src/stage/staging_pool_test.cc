#include "stage/staging_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

namespace nonstop {
namespace {

TEST(StagingPoolTest, AllocatesWithinBoundOnce) {
  auto copy = MakeHostCopyEngine(0);
  auto pool = StagingPool::Create(copy.get(), (10 << 20) + 123, 1 << 20, 2);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->chunks(), 10u);
  EXPECT_LE((*pool)->total_bytes(), (10u << 20) + 123);
  std::set<std::byte*> seen;
  std::vector<StagingPool::Chunk> held;
  for (int i = 0; i < 10; ++i) {
    auto c = (*pool)->Acquire();
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(c->data) % 4096, 0u);
    seen.insert(c->data);
    held.push_back(*c);
  }
  EXPECT_EQ(seen.size(), 10u);
  EXPECT_EQ((*pool)->in_use(), 10u);
  for (auto& c : held) (*pool)->Release(c);
  EXPECT_EQ((*pool)->in_use(), 0u);
  EXPECT_EQ((*pool)->high_water(), 10u);
}

TEST(StagingPoolTest, RejectsBadSizes) {
  auto copy = MakeHostCopyEngine(0);
  EXPECT_FALSE(StagingPool::Create(copy.get(), 1 << 20, 1000, 1).ok());
  EXPECT_FALSE(StagingPool::Create(copy.get(), 1 << 20, 1 << 20, 4).ok());
}

TEST(StagingPoolTest, AcquireWaitsAndCountsTheWait) {
  auto copy = MakeHostCopyEngine(0);
  auto pool = std::move(StagingPool::Create(copy.get(), 1 << 20, 1 << 20, 1)).value();
  auto first = pool->Acquire();
  ASSERT_TRUE(first.ok());
  std::thread releaser([&] {
    // Released 50 ms after the second Acquire blocks, not 50 ms after this
    // thread starts: on a loaded host the main thread can reach Acquire
    // later than that (it then waited not at all).
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (pool->waiting() == 0 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(pool->waiting(), 1u);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pool->Release(*first);
  });
  auto second = pool->Acquire();
  releaser.join();
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(pool->waits(), 1u);
  EXPECT_EQ(pool->waiting(), 0u);
  EXPECT_GE(pool->wait_s_total(), 0.03);
  pool->Release(*second);
}

TEST(StagingPoolTest, ShutdownWakesWaiters) {
  auto copy = MakeHostCopyEngine(0);
  auto pool = std::move(StagingPool::Create(copy.get(), 1 << 20, 1 << 20, 1)).value();
  auto held = pool->Acquire();
  ASSERT_TRUE(held.ok());
  std::thread waiter([&] { EXPECT_EQ(pool->Acquire().status().code(), StatusCode::kAborted); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  pool->Shutdown();
  waiter.join();
}

// Many threads hammer a small pool; no chunk is ever held twice.
TEST(StagingPoolTest, ConcurrentAcquireReleaseNeverSharesAChunk) {
  auto copy = MakeHostCopyEngine(0);
  auto pool = std::move(StagingPool::Create(copy.get(), 4 << 12, 4096, 1)).value();
  std::vector<std::atomic<int>> owners(pool->chunks());
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        auto c = pool->Acquire();
        if (!c.ok()) { ++errors; return; }
        if (owners[c->index].fetch_add(1) != 0) ++errors;
        c->data[0] = std::byte{1};
        owners[c->index].fetch_sub(1);
        pool->Release(*c);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(pool->in_use(), 0u);
}

}  // namespace
}  // namespace nonstop
