#include "engine/mode_choice.h"

#include <gtest/gtest.h>

#include <vector>

namespace nonstop {
namespace {

// A job whose windows cost `c` (concurrent) and `l` (layer-wise) seconds per
// step, 10 steps a window, one checkpoint each; stall = a tenth of the wall.
struct Job {
  Job(double c_s, double l_s) : c(c_s), l(l_s) {}
  double c, l;
  std::vector<CkptMode> seen;  // the mode of each window fed
  CkptMode Run(ModeChooser* m, int windows) {
    for (int i = 0; i < windows; ++i) {
      const CkptMode mode = m->active();
      seen.push_back(mode);
      const double per_step = mode == CkptMode::kConcurrent ? c : l;
      m->Observe({10, 10 * per_step, per_step, 1});
    }
    return m->active();
  }
};

TEST(ModeChoiceTest, ProbeAlternatesSkippingSettleWindowsThenPicksTheCheaper) {
  ModeChooser m = ModeChooser::Make({}).value();  // rounds 2, settle 1, margin 5 %
  Job job{0.100, 0.080};
  EXPECT_EQ(m.active(), CkptMode::kConcurrent);
  EXPECT_EQ(job.Run(&m, 8), CkptMode::kLayerwise);
  EXPECT_TRUE(m.decided());
  // first window and every settle window unmeasured: C C | L L | C C | L L
  using M = CkptMode;
  EXPECT_EQ(job.seen, (std::vector<M>{M::kConcurrent, M::kConcurrent, M::kLayerwise,
                                      M::kLayerwise, M::kConcurrent, M::kConcurrent,
                                      M::kLayerwise, M::kLayerwise}));
  ModeChoiceState s = m.State();
  EXPECT_EQ(s.modes[0].windows, 2);
  EXPECT_EQ(s.modes[1].windows, 2);
  EXPECT_NEAR(s.modes[0].step_s, 0.100, 1e-12);
  EXPECT_NEAR(s.modes[1].step_s, 0.080, 1e-12);
  EXPECT_NEAR(s.modes[1].stall_per_ckpt_s, 0.080, 1e-12);
  EXPECT_NEAR(s.modes[1].busy_step_s, 0.072, 1e-12);
  EXPECT_EQ(s.switches, 3);  // C->L, L->C, C->L; the choice keeps layer-wise
  EXPECT_NE(s.reason.find("layerwise -20.0 %"), std::string::npos) << s.reason;

  ModeChooser m2 = ModeChooser::Make({}).value();
  Job slow_lw{0.080, 0.100};
  EXPECT_EQ(slow_lw.Run(&m2, 8), CkptMode::kConcurrent);
  EXPECT_TRUE(m2.decided());
  EXPECT_NE(m2.State().reason.find("concurrent stays"), std::string::npos);
}

TEST(ModeChoiceTest, LayerwiseNeedsToBeCheaperByTheMargin) {
  // 3 % cheaper is inside the 5 % margin: concurrent stays; 6 % is not.
  ModeChooser a = ModeChooser::Make({}).value();
  Job close{0.100, 0.097};
  EXPECT_EQ(close.Run(&a, 8), CkptMode::kConcurrent);
  ModeChooser b = ModeChooser::Make({}).value();
  Job clear{0.100, 0.094};
  EXPECT_EQ(clear.Run(&b, 8), CkptMode::kLayerwise);
  // margin 0: any gain wins
  ModeChooser z = ModeChooser::Make({.margin = 0}).value();
  Job close2{0.100, 0.097};
  EXPECT_EQ(close2.Run(&z, 8), CkptMode::kLayerwise);
}

TEST(ModeChoiceTest, SettleWindowsAreNotMeasured) {
  // The windows right after a switch hold the previous mode's tail: make
  // them absurdly expensive; the choice must not see them.
  ModeChooser m = ModeChooser::Make({}).value();
  int after_switch = 1;  // the job's first window too
  for (int i = 0; i < 8; ++i) {
    const CkptMode mode = m.active();
    double per_step = mode == CkptMode::kConcurrent ? 0.100 : 0.080;
    if (after_switch > 0) per_step = 10.0;
    const CkptMode next = m.Observe({10, 10 * per_step, 0, 1});
    after_switch = next != mode ? 1 : 0;
  }
  EXPECT_TRUE(m.decided());
  EXPECT_EQ(m.active(), CkptMode::kLayerwise);
  EXPECT_NEAR(m.State().modes[0].step_s, 0.100, 1e-12);
  EXPECT_NEAR(m.State().modes[1].step_s, 0.080, 1e-12);
}

TEST(ModeChoiceTest, WatchSwitchesOnlyAfterPatienceWindowsOverTheMargin) {
  ModeChooser m = ModeChooser::Make({.patience = 3, .alpha = 1.0}).value();
  Job job{0.100, 0.080};
  ASSERT_EQ(job.Run(&m, 8), CkptMode::kLayerwise);
  // Layer-wise gets slower: 0.104 is within 5 % of concurrent's 0.100 -> stays.
  job.l = 0.104;
  EXPECT_EQ(job.Run(&m, 10), CkptMode::kLayerwise);
  // 0.110: over the margin; two windows, then one back under: the count restarts.
  job.l = 0.110;
  EXPECT_EQ(job.Run(&m, 2), CkptMode::kLayerwise);
  job.l = 0.090;
  EXPECT_EQ(job.Run(&m, 1), CkptMode::kLayerwise);
  job.l = 0.110;
  EXPECT_EQ(job.Run(&m, 2), CkptMode::kLayerwise);
  EXPECT_EQ(job.Run(&m, 1), CkptMode::kConcurrent);  // the third in a row
  ModeChoiceState s = m.State();
  EXPECT_EQ(s.switches, 4);
  EXPECT_NE(s.reason.find("watch: layerwise"), std::string::npos) << s.reason;
  // Back on concurrent: its settle window is skipped, the next replaces its
  // probe figure; concurrent at 0.100 vs layer-wise 0.110: stays.
  EXPECT_EQ(job.Run(&m, 20), CkptMode::kConcurrent);
  EXPECT_EQ(m.State().switches, 4);
}

TEST(ModeChoiceTest, NoiseInsideTheMarginNeverFlips) {
  // Alternating costs around equality: in the probe and after, nothing
  // crosses 5 %, so concurrent is kept and never left.
  ModeChooser m = ModeChooser::Make({}).value();
  for (int i = 0; i < 200; ++i) {
    const double jitter = (i % 2 == 0 ? 1.02 : 0.98);
    const double per_step = 0.1 * jitter;
    m.Observe({10, 10 * per_step, 0, 1});
  }
  EXPECT_TRUE(m.decided());
  EXPECT_EQ(m.active(), CkptMode::kConcurrent);
  EXPECT_EQ(m.State().switches, 4);  // the probe's own
}

// Step cuts the windows: steps since the last checkpoint (exclusive) up to
// the next (inclusive), wall and stall as differences of the caller's totals.
TEST(ModeChoiceTest, StepCutsWindowsAtCheckpoints) {
  ModeChooser m = ModeChooser::Make({1, 0, 0.05, 3, 0.3}).value();  // rounds 1, settle 0
  m.Start(100.0, 5.0);
  // the job's first window is not measured: 3 steps, then its checkpoint
  EXPECT_EQ(m.Step(101.0, 5.0, false), CkptMode::kConcurrent);
  m.Step(102.0, 5.5, false);
  m.Step(103.0, 6.0, true);
  EXPECT_EQ(m.State().windows, 1);
  EXPECT_EQ(m.State().modes[0].windows, 0);
  // concurrent: 4 steps in 8 s, 2 s of it stall -> 2 s/step, busy 1.5 s/step
  for (int i = 1; i <= 4; ++i) m.Step(103.0 + 2 * i, 6.0 + 0.5 * i, i == 4);
  ModeChoiceState st = m.State();
  EXPECT_EQ(st.modes[0].windows, 1);
  EXPECT_DOUBLE_EQ(st.modes[0].step_s, 2.0);
  EXPECT_DOUBLE_EQ(st.modes[0].busy_step_s, 1.5);
  EXPECT_DOUBLE_EQ(st.modes[0].stall_per_ckpt_s, 2.0);
  EXPECT_EQ(st.active, CkptMode::kLayerwise);  // the probe goes on
  // layer-wise: 2 steps of 1 s after a Start (a restore) that drops what came before
  m.Step(500.0, 50.0, false);
  m.Start(1000.0, 100.0);
  m.Step(1001.0, 100.0, false);
  EXPECT_EQ(m.Step(1002.0, 100.0, true), CkptMode::kLayerwise);  // 1 s/step: decided
  st = m.State();
  EXPECT_EQ(st.modes[1].windows, 1);
  EXPECT_DOUBLE_EQ(st.modes[1].step_s, 1.0);
  EXPECT_TRUE(st.decided);
}

TEST(ModeChoiceTest, PinnedStaysConcurrentAndObservesNothing) {
  ModeChooser m = ModeChooser::Make({}).value();
  m.Start(0, 0);
  m.Pin("layerwise cannot run here (a DDP model in state): concurrent");
  for (int i = 1; i <= 50; ++i) EXPECT_EQ(m.Step(i, 0, i % 2 == 0), CkptMode::kConcurrent);
  const ModeChoiceState st = m.State();
  EXPECT_TRUE(st.decided);
  EXPECT_EQ(st.windows, 0);
  EXPECT_EQ(st.reason, "layerwise cannot run here (a DDP model in state): concurrent");
}

TEST(ModeChoiceTest, LayerwiseRefusesZeroRanksWithoutDdpAndFindUnused) {
  auto refusal = [](const LayerwiseSetup& s) {
    const Status st = CheckLayerwise(s);
    EXPECT_TRUE(st.ok() || st.code() == StatusCode::kInvalidArgument);
    return st.message();
  };
  EXPECT_TRUE(CheckLayerwise({}).ok());
  EXPECT_TRUE(CheckLayerwise({false, 4, 1, false}).ok());
  EXPECT_NE(refusal({true, 1, 0, false}).find("ZeroRedundancyOptimizer cannot do"),
            std::string::npos);
  EXPECT_NE(refusal({false, 2, 0, false}).find("world_size > 1 needs the model wrapped"),
            std::string::npos);
  EXPECT_NE(refusal({false, 1, 1, true}).find("find_unused_parameters=True"), std::string::npos);
  EXPECT_NE(refusal({true, 2, 0, true}).find("ZeroRedundancyOptimizer"), std::string::npos);
  // mode="auto": any DDP model, before the other reasons
  EXPECT_TRUE(CheckLayerwise({false, 4, 1, false, false}).ok());
  EXPECT_EQ(refusal({false, 4, 1, true, true}).rfind("a DDP model in state: mode='auto'", 0), 0u);
  EXPECT_TRUE(CheckLayerwise({false, 1, 0, false, true}).ok());
}

TEST(ModeChoiceTest, RejectsBadSettings) {
  for (ModeChoiceOptions o : {ModeChoiceOptions{.rounds = 0}, ModeChoiceOptions{.settle = -1},
                              ModeChoiceOptions{.margin = 1.0}, ModeChoiceOptions{.margin = -0.1},
                              ModeChoiceOptions{.patience = 0}, ModeChoiceOptions{.alpha = 0}}) {
    EXPECT_EQ(ModeChooser::Make(o).status().code(), StatusCode::kInvalidArgument);
  }
  // A window without steps changes nothing.
  ModeChooser m = ModeChooser::Make({.settle = 0}).value();
  m.Observe({0, 1.0, 0, 0});
  EXPECT_EQ(m.State().modes[0].windows, 0);
}

}  // namespace
}  // namespace nonstop
