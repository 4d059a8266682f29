#include "engine/preempt.h"

#include <gtest/gtest.h>

#include <string>

namespace nonstop {
namespace {

TEST(PreemptTest, BandwidthIsTheMedianOfTheLastFiveCommitted) {
  EXPECT_EQ(PersistBandwidth({}), std::nullopt);
  EXPECT_EQ(PersistBandwidth({{false, 100, 1.0}, {true, 0, 1.0}, {true, 100, 0}}), std::nullopt);
  // failed and unmeasured ones are skipped; an even count takes the upper median
  EXPECT_EQ(PersistBandwidth({{true, 100, 1.0}, {false, 100, 0.01}, {true, 300, 1.0}}), 300);
  // only the last five count: the 1 B/s one is older
  EXPECT_EQ(PersistBandwidth({{true, 1, 1.0},
                              {true, 50, 1.0},
                              {true, 40, 1.0},
                              {true, 30, 1.0},
                              {true, 20, 1.0},
                              {true, 10, 1.0}}),
            30);
}

TEST(PreemptTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(12), "12 B");
  EXPECT_EQ(HumanBytes(3 << 10), "3.0 KiB");
  EXPECT_EQ(HumanBytes((int64_t{3} << 30) / 2), "1.5 GiB");
}

TEST(PreemptTest, EstimateSaysWhetherTheCheckpointFitsTheGrace) {
  PreemptNotice n{.reason = "SIGTERM", .rank = 0, .notice_step = 7,
                  .state_bytes = int64_t{3} << 30, .bandwidth = 1e9, .step_s = 0.5,
                  .lag_steps = 0, .grace_s = 30, .latest = 5};
  PreemptEstimate e = EstimatePreempt(n);
  ASSERT_TRUE(e.expected_s);
  EXPECT_NEAR(*e.expected_s, 0.5 + 3.0 * (1 << 30) / 1e9, 1e-9);
  EXPECT_EQ(e.line,
            "nonstop: preemption notice (SIGTERM) during step 7 on rank 0: emergency checkpoint "
            "of 3.0 GiB expected in ~3.7 s (finish step ~0.50 s + write ~3.22 s at 1000 MB/s "
            "measured); grace 30 s: fits");
  n.grace_s = 2;
  n.lag_steps = 1;  // several ranks: one more step before the boundary that acts
  e = EstimatePreempt(n);
  EXPECT_NEAR(*e.expected_s, 1.0 + 3.0 * (1 << 30) / 1e9, 1e-9);
  EXPECT_NE(e.line.find("grace 2 s: WILL NOT FIT (needs ~4.2 s); trying anyway, the previous "
                        "committed checkpoint (step 5) stays intact"),
            std::string::npos);
  n.latest.reset();
  EXPECT_NE(EstimatePreempt(n).line.find("(none yet) stays intact"), std::string::npos);
  n.bandwidth.reset();
  e = EstimatePreempt(n);
  EXPECT_FALSE(e.expected_s);
  EXPECT_NE(e.line.find("time unknown (no checkpoint measured yet); grace 2 s: cannot tell"),
            std::string::npos);
  // before anything is registered and without a grace: no size, no verdict
  PreemptNotice bare;
  bare.reason = "rank 3";
  bare.rank = 1;
  bare.bandwidth = 1e9;
  e = EstimatePreempt(bare);
  EXPECT_EQ(e.line,
            "nonstop: preemption notice (rank 3) on rank 1: emergency checkpoint of size unknown "
            "(no checkpoint yet); time unknown (no checkpoint measured yet)");
}

}  // namespace
}  // namespace nonstop
