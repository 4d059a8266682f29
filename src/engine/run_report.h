// The table `make demo` prints (python -m nonstop.demo, docs/PYTHON.md "The
// demo"): its four training runs' step events summed up into rows of
// (label, value), and the rows as the aligned text it prints. Python runs
// the processes and collects their events; the numbers are made here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace nonstop {

// One training step as a demo run reported it: its seconds (dt), whether a
// checkpoint was taken after it and the seconds the training thread was
// blocked by it (stall), and when it ended, in seconds since the process
// was spawned (t).
struct RunStep {
  int64_t step = 0;
  double dt = 0;
  bool saved = false;
  double stall = 0;
  double t = 0;
};

// The demo's runs, each's steps in step order: the reference (no
// checkpoints), torch.save every `every` steps, nonstop killed after step
// `killed_after`, and nonstop resumed from `restored_step` (its restore()
// took `restore_s`, read from `restored_from`; its model was built
// `ready_t`, its restore() returned `restored_t` seconds after its spawn).
struct DemoRuns {
  int64_t every = 1;
  std::vector<RunStep> reference, torchsave, killed, resumed;
  int64_t killed_after = 0;
  int64_t restored_step = 0;
  double restore_s = 0;
  std::string restored_from;
  double ready_t = 0;
  double restored_t = 0;
  bool identical = false;
};

using Rows = std::vector<std::pair<std::string, std::string>>;

// The rows: steps/s of each scheme (each run's first two steps, its
// warm-up, left out), the mean stall per checkpoint, the kill and the
// resume, the steps lost, the times to recover, and whether the final state
// is identical.
Rows DemoRows(const DemoRuns& r);

// The rows between two dashed lines, labels left-aligned, values
// right-aligned in 12 columns.
std::string FormatRows(const Rows& rows);

}  // namespace nonstop
