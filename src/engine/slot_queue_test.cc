#include "engine/slot_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "base/task_pool.h"

namespace nonstop {
namespace {

TEST(SlotQueueTest, FifoAndBounds) {
  SlotQueue q(3);  // rounds up to 4
  EXPECT_FALSE(q.Pop().has_value());
  for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE(q.Push(i));
  EXPECT_FALSE(q.Push(9));
  for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(q.Pop(), i);
  EXPECT_FALSE(q.Pop().has_value());
}

// Slots circulate between threads the way the engine moves them (training
// thread pops, committer pushes): each id is owned by at most one thread at a
// time and none is lost or duplicated.
TEST(SlotQueueTest, ConcurrentCirculationConservesIds) {
  constexpr uint32_t kSlots = 5;
  SlotQueue q(kSlots);
  for (uint32_t i = 0; i < kSlots; ++i) ASSERT_TRUE(q.Push(i));
  std::vector<std::atomic<int>> owner(kSlots);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        auto s = q.Pop();
        if (!s) continue;
        if (owner[*s].fetch_add(1) != 0) ++errors;
        owner[*s].fetch_sub(1);
        if (!q.Push(*s)) ++errors;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  std::vector<bool> seen(kSlots);
  for (uint32_t i = 0; i < kSlots; ++i) {
    auto s = q.Pop();
    ASSERT_TRUE(s.has_value());
    EXPECT_FALSE(seen[*s]);
    seen[*s] = true;
  }
  EXPECT_FALSE(q.Pop().has_value());
}

TEST(TaskPoolTest, RunsEverySubmittedTaskBeforeDestruction) {
  std::atomic<int> ran{0};
  {
    TaskPool pool(3);
    for (int i = 0; i < 1000; ++i) pool.Submit([&] { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 1000);
}

}  // namespace
}  // namespace nonstop
