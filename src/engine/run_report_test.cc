#include "engine/run_report.h"

#include <gtest/gtest.h>

#include <string>

namespace nonstop {
namespace {

// `n` steps from `first`, each `dt` seconds, a checkpoint after every
// `every`-th (stalling `stall`), ending `dt` apart from t = 1.
std::vector<RunStep> Steps(int64_t first, int64_t n, double dt, int64_t every = 0,
                           double stall = 0) {
  std::vector<RunStep> out;
  for (int64_t s = first; s < first + n; ++s) {
    const bool saved = every > 0 && (s + 1) % every == 0;
    const double t = 1.0 + dt * static_cast<double>(s - first + 1);
    out.push_back({s, dt, saved, saved ? stall : 0.0, t});
  }
  return out;
}

std::string Value(const Rows& rows, const std::string& label) {
  for (const auto& [k, v] : rows) {
    if (k == label) return v;
  }
  return "(no row)";
}

TEST(RunReportTest, TheDemoRowsSumUpItsRuns) {
  DemoRuns r;
  r.every = 10;
  r.reference = Steps(0, 40, 0.5);
  r.reference[0].dt = r.reference[1].dt = 100;  // the warm-up is left out
  r.torchsave = Steps(0, 40, 0.25, 10, 0.2);
  r.killed = Steps(0, 35, 1.0, 10, 0.004);
  r.resumed = Steps(30, 10, 1.0, 10, 0.002);
  r.killed_after = 34;
  r.restored_step = 29;
  r.restore_s = 0.0123;
  r.restored_from = "memory";
  r.ready_t = 1.5;
  r.restored_t = 1.75;
  r.identical = true;
  const Rows rows = DemoRows(r);
  ASSERT_EQ(rows.size(), 13u);
  EXPECT_EQ(Value(rows, "steps/s, no checkpoints"), "2.000");
  EXPECT_EQ(Value(rows, "steps/s, nonstop every 10"), "1.000");
  EXPECT_EQ(Value(rows, "steps/s, torch.save every 10"), "4.000");
  // Checkpoints after steps 9, 19, 29 (killed) and 39 (resumed).
  EXPECT_EQ(Value(rows, "mean stall per checkpoint, nonstop"), "3.5 ms");
  EXPECT_EQ(Value(rows, "mean stall per checkpoint, torch.save"), "200.0 ms");
  EXPECT_EQ(Value(rows, "killed after step"), "34");
  EXPECT_EQ(Value(rows, "resumed from checkpoint at step"), "29");
  EXPECT_EQ(Value(rows, "steps lost to the crash"), "5");
  EXPECT_EQ(Value(rows, "time to recover: restore()"), "0.012 s from memory");
  EXPECT_EQ(Value(rows, "time to recover: start to first step done"), "2.00 s");
  EXPECT_EQ(Value(rows, "  of which start to model built"), "1.50 s");
  EXPECT_EQ(Value(rows, "  of which Checkpointer() + restore()"), "0.25 s");
  EXPECT_EQ(Value(rows, "final state vs reference"), "IDENTICAL");
  // No step after the warm-up, no checkpoint, no first resumed step: nan and "-".
  r.reference = Steps(0, 2, 0.5);
  r.torchsave = Steps(0, 5, 0.5);
  r.resumed = {};
  r.identical = false;
  const Rows bare = DemoRows(r);
  EXPECT_EQ(Value(bare, "steps/s, no checkpoints"), "nan");
  EXPECT_EQ(Value(bare, "mean stall per checkpoint, torch.save"), "nan ms");
  EXPECT_EQ(Value(bare, "time to recover: start to first step done"), "-");
  EXPECT_EQ(Value(bare, "final state vs reference"), "DIFFERENT");
}

TEST(RunReportTest, RowsPrintBetweenDashedLinesAligned) {
  EXPECT_EQ(FormatRows({{"a", "1.0"}, {"longer", "x"}}),
            std::string(22, '-') + "\n" +
            "a                1.0\n"
            "longer             x\n" +
            std::string(22, '-') + "\n");
  // A value wider than 12 columns is not cut.
  EXPECT_EQ(FormatRows({{"k", "0.123 s from memory"}}),
            std::string(17, '-') + "\nk  0.123 s from memory\n" + std::string(17, '-') + "\n");
}

}  // namespace
}  // namespace nonstop
