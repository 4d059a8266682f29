#include "engine/chunk_plan.h"

#include <gtest/gtest.h>

namespace nonstop {
namespace {

TensorEntry Entry(const std::string& name, uint64_t nbytes, uint64_t offset) {
  TensorEntry e;
  e.spec.name = name;
  e.spec.nbytes = nbytes;
  e.spec.shape = {static_cast<int64_t>(nbytes)};
  e.data_offset = offset;
  return e;
}

TEST(ChunkPlanTest, SplitsTensorsAtChunkBoundariesAndZeroesPadding) {
  // a: [0, 10000), padding to 12288, b: [12288, 12300), rest padding up to 16384.
  std::vector<TensorEntry> t = {Entry("a", 10000, 0), Entry("b", 12, 12288)};
  ChunkPlan plan = ChunkPlan::Build(t, 16384, 8192);
  ASSERT_EQ(plan.chunks.size(), 2u);
  ASSERT_EQ(plan.chunks[0].pieces.size(), 1u);
  EXPECT_EQ(plan.chunks[0].pieces[0].bytes, 8192u);
  EXPECT_TRUE(plan.chunks[0].gaps.empty());
  ASSERT_EQ(plan.chunks[1].pieces.size(), 2u);
  EXPECT_EQ(plan.chunks[1].pieces[0].tensor_offset, 8192u);
  EXPECT_EQ(plan.chunks[1].pieces[0].bytes, 10000u - 8192u);
  EXPECT_EQ(plan.chunks[1].pieces[1].tensor, 1u);
  EXPECT_EQ(plan.chunks[1].pieces[1].chunk_offset, 12288u - 8192u);
  ASSERT_EQ(plan.chunks[1].gaps.size(), 2u);
  EXPECT_EQ(plan.chunks[1].gaps[0].offset, 10000u - 8192u);
  EXPECT_EQ(plan.chunks[1].gaps[1].offset, 12300u - 8192u);
  EXPECT_EQ(plan.chunks[1].gaps[1].bytes, 16384u - 12300u);
  EXPECT_EQ(plan.tensor_chunks[0], (std::pair<uint32_t, uint32_t>{0, 1}));
  EXPECT_EQ(plan.tensor_chunks[1], (std::pair<uint32_t, uint32_t>{1, 1}));
}

TEST(ChunkPlanTest, EveryByteCoveredExactlyOnce) {
  std::vector<TensorEntry> t = {Entry("x", 4096 * 5, 0), Entry("y", 7, 4096 * 5),
                                Entry("z", 9, 4096 * 5 + 8)};
  const uint64_t data = 4096 * 6;
  ChunkPlan plan = ChunkPlan::Build(t, data, 4096 * 4);
  uint64_t covered = 0;
  for (const auto& c : plan.chunks) {
    for (const auto& p : c.pieces) covered += p.bytes;
    for (const auto& g : c.gaps) covered += g.bytes;
  }
  EXPECT_EQ(covered, data);
  EXPECT_EQ(plan.chunks.back().bytes, 4096u * 2);
}

TEST(ChunkPlanTest, ExcludedTensorsBecomeGaps) {
  std::vector<TensorEntry> t = {Entry("a", 4096, 0), Entry("b", 4096, 4096)};
  ChunkPlan plan = ChunkPlan::Build(t, 8192, 8192, {false, true});
  ASSERT_EQ(plan.chunks[0].pieces.size(), 1u);
  EXPECT_EQ(plan.chunks[0].pieces[0].tensor, 1u);
  EXPECT_GT(plan.tensor_chunks[0].first, plan.tensor_chunks[0].second);
}

}  // namespace
}  // namespace nonstop
