#include "engine/preempt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <string>
#include <vector>

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

TEST(PreemptTest, TheFirstNoticeWinsAndTakesTheStepAfterTheLastBoundary) {
  PreemptNotices n(/*rank=*/0, /*world=*/1);
  EXPECT_FALSE(n.noticed());
  EXPECT_EQ(n.Flag(), 0);
  n.Boundary(4, 10.0);
  n.Boundary(6, 11.0);  // two steps in 1 s
  EXPECT_EQ(n.step_s(), 0.5);
  n.Boundary(7, 12.5);
  EXPECT_DOUBLE_EQ(*n.step_s(), 0.8 * 0.5 + 0.2 * 1.5);
  n.Boundary(7, 20.0);  // the same step again: not timed
  EXPECT_DOUBLE_EQ(*n.step_s(), 0.8 * 0.5 + 0.2 * 1.5);
  EXPECT_TRUE(n.Notice("SIGTERM", std::nullopt, 21.0));
  EXPECT_FALSE(n.Notice("preempt()", 3, 22.0));
  EXPECT_EQ(n.reason(), "SIGTERM");
  EXPECT_EQ(n.notice_s(), 21.0);
  EXPECT_EQ(n.notice_step(), 8);  // running after boundary 7
  n.HandledAt(9);
  EXPECT_EQ(n.notice_step(), 8);
  PreemptEstimate e = n.Estimate(1 << 20, 1e6, 30, 7);
  EXPECT_NE(e.line.find("(SIGTERM) during step 8 on rank 0: emergency checkpoint of 1.0 MiB"),
            std::string::npos);
  EXPECT_NEAR(*e.expected_s, 0.8 * 0.5 + 0.2 * 1.5 + 1.048576, 1e-9);  // one step + write

  PreemptNotices early(0, 1);  // before the first boundary: the step it is handled at
  EXPECT_TRUE(early.Notice("SIGTERM", std::nullopt, 1.0));
  EXPECT_EQ(early.notice_step(), std::nullopt);
  early.HandledAt(0);
  EXPECT_EQ(early.notice_step(), 0);
}

TEST(PreemptTest, TheFlagsMaxNamesTheLowestNoticingRank) {
  const int world = 4;
  std::deque<PreemptNotices> ranks;  // (a Mutex does not move)
  for (int r = 0; r < world; ++r) ranks.emplace_back(r, world);
  EXPECT_EQ(ranks[0].FirstRank(0), std::nullopt);
  ranks[3].Notice("SIGTERM", 5, 1.0);
  ranks[1].Notice("SIGTERM", 5, 1.0);
  int64_t reduced = 0;
  for (const PreemptNotices& n : ranks) reduced = std::max(reduced, n.Flag());
  for (const PreemptNotices& n : ranks) EXPECT_EQ(n.FirstRank(reduced), 1);
  // several ranks: the agreement lags one boundary, one more step to finish
  ranks[1].Boundary(5, 0.0);
  ranks[1].Boundary(6, 2.0);
  EXPECT_NE(ranks[1].Estimate(1000, 1000, std::nullopt, std::nullopt).line.find(
                "expected in ~5.0 s (finish step ~4.00 s + write ~1.00 s"),
            std::string::npos);
}

}  // namespace
}  // namespace nonstop

namespace nonstop {
namespace {

std::string ParseError(std::string_view json) {
  Result<PreemptOptions> o = ParsePreemptOptions(json);
  EXPECT_FALSE(o.ok()) << json;
  if (o.ok()) return "";
  EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(o.status().message().find('\n'), std::string::npos);
  return o.status().message();
}

TEST(PreemptTest, TheOutcomeSaysWhatCommittedAndTheExitStatus) {
  PreemptOutcome o{.reason = "SIGTERM", .step = 4, .committed = true, .latest = 4,
                   .notice_to_safe_s = 0.5, .checkpoint_s = 0.25, .exit_code = 75, .error = ""};
  EXPECT_EQ(PreemptExitLine(o),
            "nonstop: emergency checkpoint of step 4 committed 0.50 s after the notice "
            "(checkpoint 0.25 s); exiting with status 75");
  EXPECT_EQ(PreemptedMessage(o),
            "preempted (SIGTERM): checkpoint of step 4 committed, newest committed step 4, "
            "0.50 s after the notice; exit status 75");
  o.committed = false;  // some rank did not commit it
  o.latest = 2;
  EXPECT_EQ(PreemptExitLine(o),
            "nonstop: emergency checkpoint of step 4 NOT committed on every rank 0.50 s after "
            "the notice (checkpoint 0.25 s); exiting with status 75");
  EXPECT_EQ(PreemptedMessage(o),
            "preempted (SIGTERM): checkpoint of step 4 NOT committed, newest committed step 2, "
            "0.50 s after the notice; exit status 75");
  o.error = "disk full";
  o.latest.reset();
  EXPECT_EQ(PreemptExitLine(o),
            "nonstop: emergency checkpoint of step 4 failed: disk full; the newest committed "
            "checkpoint is step None");
  EXPECT_EQ(PreemptedMessage(o),
            "preempted (SIGTERM): checkpoint of step 4 NOT committed, newest committed step "
            "None, 0.50 s after the notice; exit status 75");
}

TEST(PreemptTest, OptionsDefaultToSigtermAndStatus75) {
  Result<PreemptOptions> o = ParsePreemptOptions("{}");
  ASSERT_TRUE(o.ok()) << o.status().message();
  EXPECT_EQ(o.value().signals, std::vector<int>{SIGTERM});
  EXPECT_EQ(o.value().exit_code, 75);
  EXPECT_EQ(o.value().grace_s, std::nullopt);
  EXPECT_TRUE(o.value().chain);
  EXPECT_EQ(o.value().timeout_s, 300);
  // names with or without SIG, any case, or numbers; sorted, each once
  o = ParsePreemptOptions(
      R"({"signals": ["SIGUSR1", "term", 2, "SIGTERM"], "grace_s": 30, "exit_code": 143,
          "chain": false, "timeout_s": 5.5, "group": null})");
  ASSERT_TRUE(o.ok()) << o.status().message();
  std::vector<int> want{SIGINT, SIGUSR1, SIGTERM};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(o.value().signals, want);
  EXPECT_EQ(o.value().exit_code, 143);
  EXPECT_EQ(o.value().grace_s, 30);
  EXPECT_FALSE(o.value().chain);
  EXPECT_EQ(o.value().timeout_s, 5.5);
  o = ParsePreemptOptions(R"({"signals": "usr2", "grace_s": null})");  // one; no deadline
  ASSERT_TRUE(o.ok()) << o.status().message();
  EXPECT_EQ(o.value().signals, std::vector<int>{SIGUSR2});
  EXPECT_EQ(o.value().grace_s, std::nullopt);
  o = ParsePreemptOptions(R"({"signals": []})");  // only ckpt.preempt()
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o.value().signals.empty());
}

TEST(PreemptTest, BadOptionsAreRefusedInOneLine) {
  EXPECT_EQ(ParseError(R"({"signals": ["SIGNOPE"]})"), "on_preempt: unknown signal 'SIGNOPE'");
  EXPECT_EQ(ParseError(R"({"signals": ["KILL"]})"),
            "on_preempt: SIGKILL and SIGSTOP cannot be caught");
  EXPECT_EQ(ParseError(R"({"signals": [19, 15]})"),
            "on_preempt: SIGKILL and SIGSTOP cannot be caught");
  EXPECT_EQ(ParseError(R"({"signals": [1.5]})"),
            "on_preempt: signals must be names or numbers, got 1.5");
  EXPECT_EQ(ParseError(R"({"signals": [0]})"), "on_preempt: no signal number 0");
  EXPECT_EQ(ParseError(R"({"exit_code": 300})"),
            "on_preempt: exit_code must be an int in 0..255, got 300");
  EXPECT_EQ(ParseError(R"({"exit_code": "75"})"),
            "on_preempt: exit_code must be an int in 0..255, got '75'");
  EXPECT_EQ(ParseError(R"({"grace_s": -1})"),
            "on_preempt: grace_s must be a positive number of seconds, got -1");
  EXPECT_EQ(ParseError(R"({"timeout_s": 0})"),
            "on_preempt: timeout_s must be a positive number of seconds, got 0");
  EXPECT_EQ(ParseError(R"({"chain": 1})"), "on_preempt: chain must be True or False, got 1");
  EXPECT_EQ(ParseError(R"({"grace": 3, "abc": 1})"),
            "on_preempt: unknown key 'abc'; use chain, exit_code, grace_s, group, signals, "
            "timeout_s");
  EXPECT_EQ(ParseError(R"("SIGTERM")"),
            "on_preempt: True, False or a dict (signals, exit_code, grace_s, ...), got "
            "'SIGTERM'");
  EXPECT_EQ(ParseError("{").rfind("on_preempt: ", 0), 0u);
}

}  // namespace
}  // namespace nonstop
