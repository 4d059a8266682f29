#include "nonstop/tune.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>

namespace nonstop {
namespace {

namespace fs = std::filesystem;

TuneOptions Options(uint64_t state, double step_s, double q) {
  TuneOptions o;
  o.dir = "/unused";
  o.state_bytes = state;
  o.step_s = step_s;
  o.max_overhead = q;
  return o;
}

// Measurements as a machine with 10 GB/s copies, 2 GB/s writes with 4
// writers, and T_w/N best at N = 2, would give for a 64 MiB probe.
TuneMeasurements Machine() {
  TuneMeasurements m;
  m.probe_bytes = 64u << 20;
  m.free_bytes = 100ull << 30;
  m.ram_bytes = 24ull << 30;
  m.copy = {{1u << 20, 6.0}, {4u << 20, 9.5}, {16u << 20, 10.0}};
  m.write = {{1, 0.8}, {2, 1.5}, {4, 2.0}, {8, 2.02}};
  m.persist = {{1, 3, 0.040, 0.04}, {2, 4, 0.060, 0.03}, {3, 6, 0.093, 0.031}};
  m.read_GBps = 4.0;
  return m;
}

TEST(TuneRulesTest, ChunkIsTheSmallestWithinTenPercentOfTheBestCopy) {
  EXPECT_EQ(ChooseChunkBytes({{1u << 20, 6.0}, {4u << 20, 9.5}, {16u << 20, 10.0}}), 4u << 20);
  EXPECT_EQ(ChooseChunkBytes({{1u << 20, 9.1}, {4u << 20, 9.5}, {16u << 20, 10.0}}), 1u << 20);
}

TEST(TuneRulesTest, WritersAreTheFewestWithinFivePercentOfTheBest) {
  EXPECT_EQ(ChooseWriters({{1, 0.8}, {2, 1.5}, {4, 2.0}, {8, 2.02}}), 4);
  EXPECT_EQ(ChooseWriters({{1, 2.0}, {2, 1.5}}), 1);
}

TEST(TuneRulesTest, MaxInFlightMinimisesTwOverN) {
  // T_w/N: 0.04, 0.03, 0.031 -> N = 2 (3 is within 5 % but has more in flight).
  EXPECT_EQ(ChooseMaxInFlight({{1, 3, 0.040, 0}, {2, 4, 0.060, 0}, {3, 6, 0.093, 0}}), 2);
  EXPECT_EQ(ChooseMaxInFlight({{1, 3, 0.040, 0}, {2, 4, 0.080, 0}}), 1);
}

TEST(TuneRulesTest, StorageBoundsInFlight) {
  EXPECT_EQ(MaxInFlightForStorage(10 * 100, 100, 4), 4);  // 10 slots, capped
  EXPECT_EQ(MaxInFlightForStorage(3 * 100 + 50, 100, 4), 2);  // S/m - 1
  EXPECT_EQ(MaxInFlightForStorage(100, 100, 4), 1);  // never below 1
}

TEST(TuneRulesTest, OverheadIntervalIsPccheckEquation3) {
  // T_w = 3 s, N = 2, q = 0.03, t = 0.5 s: 3 / (2 * 0.03 * 0.5) = 100.
  EXPECT_EQ(OverheadInterval(3.0, 2, 0.03, 0.5), 100);
  EXPECT_EQ(OverheadInterval(3.01, 2, 0.03, 0.5), 101);
  EXPECT_EQ(OverheadInterval(0.0001, 4, 0.03, 0.5), 1);
}

TEST(TuneRecommendTest, PicksEachParameterAndTheEquation3Interval) {
  TuneOptions o = Options(64u << 20, 0.05, 0.03);
  Result<TuneRecommendation> r = Recommend(o, Machine());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->max_in_flight, 2);
  EXPECT_EQ(r->writers, 4);
  EXPECT_EQ(r->chunk_bytes, 4u << 20);
  EXPECT_EQ(r->chunks, 16u);  // M = state = 64 MiB
  EXPECT_EQ(r->staging_bytes, 64u << 20);
  EXPECT_FALSE(r->scaled);
  EXPECT_DOUBLE_EQ(r->tw_s, 0.060);
  // f* = ceil(0.06 / (2 * 0.03 * 0.05)) = ceil(20) = 20.
  EXPECT_EQ(r->interval_overhead, 20);
  EXPECT_EQ(r->interval, 20);
  EXPECT_EQ(r->interval_rule, "overhead");
  EXPECT_NEAR(r->expected_overhead, 0.03, 1e-9);
  EXPECT_EQ(r->interval_no_queue, 1);  // 0.03 s per checkpoint < one 50 ms step
  EXPECT_EQ(r->young_daly_interval, 0);
}

TEST(TuneRecommendTest, ScalesTwToALargerStateAndRespectsTheMemoryLimit) {
  TuneOptions o = Options(640u << 20, 0.05, 0.03);
  o.memory_bytes = 32u << 20;
  Result<TuneRecommendation> r = Recommend(o, Machine());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->scaled);
  EXPECT_NEAR(r->tw_s, 0.6, 1e-9);  // 10x the probe
  EXPECT_EQ(r->chunks, 8u);         // 32 MiB / 4 MiB
  EXPECT_LE(r->staging_bytes, o.memory_bytes);
  // The copy of 640 MiB through 32 MiB of staging is paced by the writes.
  EXPECT_GT(r->stall_s, 0.2);
}

TEST(TuneRecommendTest, ShrinksTheChunkWhenMemoryIsTight) {
  TuneOptions o = Options(64u << 20, 0.05, 0.03);
  o.memory_bytes = 12u << 20;  // < (4 writers + 2) * 4 MiB
  Result<TuneRecommendation> r = Recommend(o, Machine());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->chunk_bytes, 2u << 20);
  EXPECT_LE(r->staging_bytes, o.memory_bytes);
  EXPECT_FALSE(r->notes.empty());
}

TEST(TuneRecommendTest, YoungDalyWinsOnlyWhenFailuresAreRare) {
  TuneOptions o = Options(64u << 20, 0.05, 0.03);
  o.mtbf_s = 1e6;  // rare: Young/Daly's sqrt(2C/(p t^2)) is far above f* = 20
  Result<TuneRecommendation> rare = Recommend(o, Machine());
  ASSERT_TRUE(rare.ok());
  const double c = 0.03;  // T_w/N
  EXPECT_NEAR(rare->young_daly_interval, std::sqrt(2 * c / (1e-6 * 0.05 * 0.05)), 1e-6);
  EXPECT_EQ(rare->interval_rule, "young-daly");
  EXPECT_EQ(rare->interval, std::lround(rare->young_daly_interval));
  EXPECT_GE(rare->goodput_at_interval, rare->goodput_at_overhead_interval);
  EXPECT_LT(rare->expected_overhead, 0.03);

  o.mtbf_s = 10;  // frequent: Young/Daly (15.5) would go below f*; the budget binds
  Result<TuneRecommendation> often = Recommend(o, Machine());
  ASSERT_TRUE(often.ok());
  EXPECT_LT(often->young_daly_interval, often->interval_overhead);
  EXPECT_EQ(often->interval_rule, "overhead");
  EXPECT_EQ(often->interval, 20);
  EXPECT_FALSE(often->interval_reason.empty());
}

TEST(TuneRecommendTest, RejectsBadOptions) {
  EXPECT_FALSE(Recommend(Options(0, 0.05, 0.03), Machine()).ok());
  EXPECT_FALSE(Recommend(Options(1 << 20, 0, 0.03), Machine()).ok());
  EXPECT_FALSE(Recommend(Options(1 << 20, 0.05, 1.5), Machine()).ok());
  EXPECT_FALSE(Recommend(Options(1 << 20, 0.05, 0.03), TuneMeasurements{}).ok());
}

// A real, small measurement on a scratch directory: every field is filled
// and the recommendation follows from the measurements.
TEST(TuneMeasureTest, MeasuresASmallStateQuickly) {
  const fs::path dir = fs::temp_directory_path() / ("nonstop-tune-" + std::to_string(getpid()));
  TuneOptions o = Options(8u << 20, 0.02, 0.05);
  o.dir = dir.string();
  o.chunk_sizes = {1u << 20, 4u << 20};
  o.writer_counts = {1, 2};
  o.max_in_flight_cap = 2;
  o.repeat = 1;
  o.memory_bytes = 32u << 20;  // room for (2 writers + 2) chunks of either size
  o.medium = MediumKind::kBuffered;  // works on any file system, tmpfs included
  int lines = 0;
  Result<TuneMeasurements> m = MeasureForTune(o, [&](const std::string&) { ++lines; });
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_GT(lines, 0);
  EXPECT_EQ(m->probe_bytes, 8u << 20);
  ASSERT_EQ(m->copy.size(), 2u);
  ASSERT_EQ(m->write.size(), 2u);
  ASSERT_EQ(m->persist.size(), 2u);
  for (const CopyPoint& c : m->copy) EXPECT_GT(c.GBps, 0);
  for (const WritePoint& w : m->write) EXPECT_GT(w.GBps, 0);
  for (const PersistPoint& p : m->persist) EXPECT_GT(p.tw_s, 0);
  EXPECT_GT(m->read_GBps, 0);
  EXPECT_FALSE(m->medium.empty());
  EXPECT_FALSE(fs::exists(dir / ".nonstop-tune"));  // probes cleaned up

  Result<TuneRecommendation> r = Recommend(o, m.value());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GE(r->max_in_flight, 1);
  EXPECT_LE(r->max_in_flight, 2);
  EXPECT_TRUE(r->writers == 1 || r->writers == 2);
  EXPECT_TRUE(r->chunk_bytes == (1u << 20) || r->chunk_bytes == (4u << 20));
  EXPECT_GE(r->chunks, static_cast<uint64_t>(r->writers + 2));
  EXPECT_LE(r->staging_bytes, o.memory_bytes);
  EXPECT_EQ(r->interval,
            std::max(OverheadInterval(r->tw_s, r->max_in_flight, 0.05, 0.02),
                     OverheadInterval(r->stall_s, 1, 0.05, 0.02)));
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(TuneMeasureTest, RefusesADirectoryWithoutRoomForTwoCheckpoints) {
  const fs::path dir =
      fs::temp_directory_path() / ("nonstop-tune-full-" + std::to_string(getpid()));
  TuneOptions o = Options(1ull << 20, 0.02, 0.05);
  o.dir = dir.string();
  o.storage_bytes = (1ull << 20) + 1;
  Result<TuneMeasurements> m = MeasureForTune(o, nullptr);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("fewer than 2 checkpoints"), std::string::npos);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace nonstop
