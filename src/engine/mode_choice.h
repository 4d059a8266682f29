// ModeChooser: mode="auto" picks layer-wise or concurrent checkpoints from
// what each one costs this job (docs/LAYERWISE.md, "mode='auto'").
//
// The unit of measurement is a *window*: the steps after one checkpoint's
// step up to and including the next checkpoint's step. In steady state a
// window holds the whole cost of one checkpoint in either mode (concurrent:
// the previous checkpoint's wait before the first update, then save();
// layer-wise: the previous checkpoint's per-layer waits, then this one's
// copies requested from backward and the seal), plus whatever the mode does
// to every step (layer-wise runs the optimizer one parameter at a time in
// backward). A window's cost is its wall time per step: visible stall and
// step-time inflation together, with nothing modelled.
//
// The rule:
//   probe    the modes alternate, concurrent first, one measured window
//            each per round, for `rounds` rounds (interleaved, so a load
//            change on the machine hits both). The first window after every
//            switch is not measured (`settle`): it still holds the tail of
//            the previous mode's checkpoint. The first window of the job is
//            not measured either (allocation, optimizer state created).
//   choose   layer-wise when its mean cost per step is below concurrent's by
//            more than `margin` (a fraction); otherwise concurrent (the
//            default mode, and the one with device snapshots on CUDA).
//   watch    the active mode's cost keeps being measured (EWMA). When it
//            exceeds the other mode's last known cost by more than `margin`
//            in `patience` windows in a row, switch (the other is then
//            measured again after its settle window, and the same rule may
//            switch back): hysteresis, so noise does not flip the mode.
//
// Switches happen only between windows, i.e. right after a checkpoint's
// step has been started/sealed: the caller makes every copy in flight be
// waited for before the next update (python/nonstop/_checkpointer.py).
// Not thread-safe: the training thread owns it. No clock inside.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "nonstop/status.h"

namespace nonstop {

enum class CkptMode : int { kConcurrent = 0, kLayerwise = 1 };
const char* CkptModeName(CkptMode m);

struct ModeChoiceOptions {
  int64_t rounds = 2;    // measured windows per mode in the probe (>= 1)
  int64_t settle = 1;    // windows not measured after each switch (>= 0)
  double margin = 0.05;  // relative cost difference needed to leave a mode, in [0, 1)
  int64_t patience = 3;  // windows in a row over the margin before a switch after the probe
  double alpha = 0.3;    // EWMA weight of a new window after the probe, in (0, 1]
};

// One window, measured by the caller in the active mode.
struct ModeWindow {
  int64_t steps = 0;    // training steps in the window (>= 1)
  double wall_s = 0;    // wall time of those steps
  double stall_s = 0;   // visible stall in them (inside nonstop, training thread)
  int64_t checkpoints = 0;  // checkpoints started in the window (1 in steady state)
};

struct ModeFigures {
  int64_t windows = 0;       // measured windows
  double step_s = 0;         // cost: wall time per step (probe: mean; after: EWMA)
  double stall_per_ckpt_s = 0;  // visible stall per checkpoint, same averaging
  double busy_step_s = 0;    // wall time per step without the stall (inflation shows here)
};

struct ModeChoiceState {
  CkptMode active = CkptMode::kConcurrent;
  bool decided = false;     // the probe is over
  int64_t windows = 0;      // windows observed (measured or not)
  int64_t switches = 0;
  std::array<ModeFigures, 2> modes;  // indexed by CkptMode
  std::string reason;       // one line: why `active`
};

// What mode="layerwise" needs of the training setup, as the Python driver
// finds it in the state (docs/LAYERWISE.md, "DDP"). mode="auto" runs
// concurrent, pinned, where this refuses.
struct LayerwiseSetup {
  bool zero = false;         // a ZeroRedundancyOptimizer in state
  int64_t world_size = 1;
  int64_t ddp_models = 0;    // DistributedDataParallel modules in state
  bool find_unused = false;  // one of them has find_unused_parameters=True
  bool auto_mode = false;    // mode="auto", which must be able to remove the hooks again
};
// InvalidArgument, one line saying what to use instead, where layer-wise
// cannot run: ZeRO (it cannot update one parameter at a time), several
// ranks without DDP (a hook would see this rank's gradient alone),
// find_unused_parameters (a bucket does not say which gradients DDP left alone);
// under mode="auto", any DDP model (its communication hook cannot be removed).
Status CheckLayerwise(const LayerwiseSetup& s);

class ModeChooser {
 public:
  static Result<ModeChooser> Make(const ModeChoiceOptions& opts);

  CkptMode active() const { return active_; }
  bool decided() const { return decided_; }

  // One window measured in active(), ended right after its checkpoint.
  // Returns the mode for the next window (a switch when it differs).
  CkptMode Observe(const ModeWindow& w);

  ModeChoiceState State() const;

  // The windows cut by the chooser itself, for a caller that reports every
  // step (the clock and the stall total are the caller's). Start opens a
  // window (construction, a restore); Step counts one step and, when
  // `checkpoint` (its checkpoint ended the window), observes the window and
  // opens the next. Returns the mode for the next step.
  void Start(double now_s, double stall_total_s);
  CkptMode Step(double now_s, double stall_total_s, bool checkpoint);
  // Layer-wise cannot run here: concurrent from now on, decided, `why` the
  // reason; Step observes nothing.
  void Pin(const std::string& why);

 private:
  ModeChooser() = default;
  void Measure(CkptMode m, const ModeWindow& w);
  void SwitchTo(CkptMode m, const std::string& why);
  void Decide();
  std::string Figures() const;

  ModeChoiceOptions opts_;
  CkptMode active_ = CkptMode::kConcurrent;
  bool decided_ = false;
  int64_t skip_ = 1;  // windows still to skip (the job's first window, then settle)
  int64_t windows_ = 0, switches_ = 0, over_ = 0;
  bool fresh_ = false;  // after a switch past the probe: the next window replaces the figure
  std::array<ModeFigures, 2> fig_{};
  std::string reason_ = "probing: concurrent first";
  bool pinned_ = false;
  int64_t steps_ = 0;  // in the open window
  double t0_ = 0, stall0_ = 0;  // when it opened
};

}  // namespace nonstop
