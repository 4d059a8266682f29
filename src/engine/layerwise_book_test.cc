// LayerwiseBook: which engine tensors mode="layerwise" hands over and waits
// for (the Python driver's bookkeeping; _layerwise.py).
#include "engine/layerwise_book.h"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

namespace nonstop {
namespace {

using Ids = std::vector<uint32_t>;
using Waits = std::vector<std::pair<int, std::vector<uint32_t>>>;

// Three host parameters at 100, 200, 300; each with one state tensor at
// 101, 201, 301. Registered: 300, 100, 101, 200, 201, 301 (+ an unrelated 999).
LayerwiseBook Planned(uint64_t group_bytes, std::vector<int> devices = {-1, -1, -1}) {
  LayerwiseBook b(group_bytes, std::move(devices));
  b.Plan({300, 100, 101, 200, 201, 301, 999}, {{100, 101}, {200, 201}, {300, 301}});
  return b;
}

TEST(LayerwiseBookTest, GroupsAreTheRegisteredTensorsOfEachParameterAndItsState) {
  LayerwiseBook b = Planned(1);  // every update hands its group over at once
  b.Open();
  EXPECT_EQ(b.Updated(0, 8), (Ids{1, 2}));
  EXPECT_EQ(b.Updated(1, 8), (Ids{3, 4}));
  EXPECT_EQ(b.Updated(2, 8), (Ids{0, 5}));
}

TEST(LayerwiseBookTest, APointerRegisteredTwiceGivesBothTensors) {
  LayerwiseBook b(1, {-1});
  b.Plan({7, 7, 8}, {{7}});  // e.g. two pieces of one parameter
  b.Open();
  EXPECT_EQ(b.Updated(0, 1), (Ids{0, 1}));
}

TEST(LayerwiseBookTest, UpdatesAreBatchedUntilGroupBytesThenHandedOverInUpdateOrder) {
  LayerwiseBook b = Planned(20);
  b.Open();
  EXPECT_TRUE(b.Updated(2, 8).empty());
  EXPECT_TRUE(b.Updated(0, 8).empty());
  EXPECT_EQ(b.Updated(1, 8), (Ids{0, 5, 1, 2, 3, 4}));  // 24 >= 20
  EXPECT_TRUE(b.Updated(0, 8).empty());                  // a new batch
  EXPECT_EQ(b.Flush(), (Ids{1, 2}));
  EXPECT_TRUE(b.Flush().empty());
}

TEST(LayerwiseBookTest, NothingIsBatchedWhileNoCheckpointIsOpen) {
  LayerwiseBook b = Planned(1);
  EXPECT_TRUE(b.Updated(0, 8).empty());  // planned, not open
  b.Open();
  b.Seal();
  EXPECT_TRUE(b.Updated(0, 8).empty());  // sealed
  LayerwiseBook none(1, {-1});
  none.Plan({5}, {{6}});  // the parameter is not registered: no tensors
  none.Open();
  EXPECT_TRUE(none.Updated(0, 8).empty());
  EXPECT_TRUE(none.Update({0}).waits.empty());
}

TEST(LayerwiseBookTest, AnUpdateWaitsForItsOwnHandedOverCopyOnce) {
  LayerwiseBook b = Planned(1);
  b.Open();
  b.Updated(0, 8);
  b.Updated(1, 8);
  LayerwiseBook::Before w = b.Update({2, 0});  // 2 is not pending
  EXPECT_TRUE(w.copy.empty());
  EXPECT_EQ(w.waits, (Waits{{-1, {1, 2}}}));
  EXPECT_TRUE(b.Update({0}).waits.empty());  // waited for already
  EXPECT_EQ(b.Update({1}).waits, (Waits{{-1, {3, 4}}}));
}

TEST(LayerwiseBookTest, UpdatedTwiceInOneStepHandsTheBatchOverFirstThenWaits) {
  LayerwiseBook b = Planned(100);
  b.Open();
  b.Updated(0, 8);
  b.Updated(1, 8);
  LayerwiseBook::Before w = b.Update({1});
  EXPECT_EQ(w.copy, (Ids{1, 2, 3, 4}));
  EXPECT_EQ(w.waits, (Waits{{-1, {3, 4}}}));
  EXPECT_EQ(b.Update({0}).waits, (Waits{{-1, {1, 2}}}));
}

TEST(LayerwiseBookTest, TheSealMakesEveryGroupPendingAndDropsTheBatch) {
  LayerwiseBook b = Planned(100);
  b.Open();
  b.Updated(0, 8);  // batched: the seal copies it
  b.Seal();
  EXPECT_TRUE(b.Flush().empty());
  EXPECT_EQ(b.Update({0, 1, 2}).waits, (Waits{{-1, {1, 2, 3, 4, 0, 5}}}));
  EXPECT_TRUE(b.Update({0, 1, 2}).waits.empty());
}

TEST(LayerwiseBookTest, CudaParametersWaitPerDeviceAfterTheHost) {
  LayerwiseBook b = Planned(1, {1, -1, 0});
  b.Open();
  b.Seal();
  EXPECT_EQ(b.Update({0, 2, 1}).waits, (Waits{{-1, {3, 4}}, {1, {1, 2}}, {0, {0, 5}}}));
}

TEST(LayerwiseBookTest, ANewPlanTakesEffectAtTheNextOpen) {
  LayerwiseBook b = Planned(1);
  b.Open();
  b.Plan({100, 101}, {{100, 101}, {}, {}});
  EXPECT_EQ(b.Updated(0, 8), (Ids{1, 2}));  // the open checkpoint keeps its groups
  b.Seal();
  b.Open();
  EXPECT_EQ(b.Updated(0, 8), (Ids{0, 1}));
  EXPECT_TRUE(b.Updated(1, 8).empty());
}

TEST(LayerwiseBookTest, ResetForgetsPendingBatchAndPlan) {
  LayerwiseBook b = Planned(100);
  b.Open();
  b.Updated(0, 8);
  b.Seal();
  b.Reset();
  EXPECT_TRUE(b.Update({0, 1, 2}).waits.empty());
  b.Open();  // no plan: no tensors
  EXPECT_TRUE(b.Updated(0, 200).empty());
}

}  // namespace
}  // namespace nonstop
