#include "engine/run_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace nonstop {
namespace {

std::string Fixed(double v, int digits, const char* unit = "") {
  if (std::isnan(v)) return std::string("nan") + unit;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f%s", digits, v, unit);
  return buf;
}

// Steps per second over `runs` after each one's first two steps.
double StepsPerS(std::initializer_list<const std::vector<RunStep>*> runs) {
  double n = 0, s = 0;
  for (const auto* run : runs) {
    for (size_t i = 2; i < run->size(); ++i) n += 1, s += (*run)[i].dt;
  }
  return n > 0 ? n / s : NAN;
}

// The mean stall of the steps a checkpoint followed.
double MeanStall(std::initializer_list<const std::vector<RunStep>*> runs) {
  double n = 0, s = 0;
  for (const auto* run : runs) {
    for (const RunStep& e : *run) {
      if (e.saved) n += 1, s += e.stall;
    }
  }
  return n > 0 ? s / n : NAN;
}

}  // namespace

Rows DemoRows(const DemoRuns& r) {
  const std::string every = std::to_string(r.every);
  const auto first = std::find_if(r.resumed.begin(), r.resumed.end(), [&](const RunStep& e) {
    return e.step == r.restored_step + 1;
  });
  return {
      {"steps/s, no checkpoints", Fixed(StepsPerS({&r.reference}), 3)},
      {"steps/s, nonstop every " + every, Fixed(StepsPerS({&r.killed, &r.resumed}), 3)},
      {"steps/s, torch.save every " + every, Fixed(StepsPerS({&r.torchsave}), 3)},
      {"mean stall per checkpoint, nonstop",
       Fixed(MeanStall({&r.killed, &r.resumed}) * 1e3, 1, " ms")},
      {"mean stall per checkpoint, torch.save", Fixed(MeanStall({&r.torchsave}) * 1e3, 1, " ms")},
      {"killed after step", std::to_string(r.killed_after)},
      {"resumed from checkpoint at step", std::to_string(r.restored_step)},
      // The steps the killed run printed after its last completed checkpoint.
      {"steps lost to the crash", std::to_string(r.killed_after - r.restored_step)},
      {"time to recover: restore()", Fixed(r.restore_s, 3, " s from ") + r.restored_from},
      // From the resumed process's spawn (interpreter, imports and model
      // included) to the end of its first training step.
      {"time to recover: start to first step done",
       first == r.resumed.end() ? "-" : Fixed(first->t, 2, " s")},
      {"  of which start to model built", Fixed(r.ready_t, 2, " s")},
      {"  of which Checkpointer() + restore()", Fixed(r.restored_t - r.ready_t, 2, " s")},
      {"final state vs reference", r.identical ? "IDENTICAL" : "DIFFERENT"},
  };
}

std::string FormatRows(const Rows& rows) {
  size_t w = 0;
  for (const auto& [k, v] : rows) w = std::max(w, k.size());
  const std::string line(w + 16, '-');
  std::string out = line + "\n";
  for (const auto& [k, v] : rows) {
    out += k + std::string(w - k.size(), ' ') + "  ";
    out += std::string(v.size() < 12 ? 12 - v.size() : 0, ' ') + v + "\n";
  }
  return out + line + "\n";
}

}  // namespace nonstop
