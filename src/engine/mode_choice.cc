#include "engine/mode_choice.h"

#include <cstdio>
#include <string>

namespace nonstop {

namespace {
int Index(CkptMode m) { return static_cast<int>(m); }
CkptMode Other(CkptMode m) {
  return m == CkptMode::kConcurrent ? CkptMode::kLayerwise : CkptMode::kConcurrent;
}
}  // namespace

const char* CkptModeName(CkptMode m) {
  return m == CkptMode::kLayerwise ? "layerwise" : "concurrent";
}

Status CheckLayerwise(const LayerwiseSetup& s) {
  if (s.auto_mode && s.ddp_models > 0) {
    return Status::InvalidArgument(
        "a DDP model in state: mode='auto' could not remove layer-wise's DDP communication "
        "hook again (use mode='layerwise')");
  }
  if (s.zero) {
    return Status::InvalidArgument(
        "mode='layerwise' updates one parameter at a time, which ZeroRedundancyOptimizer "
        "cannot do: use mode='concurrent'");
  }
  if (s.world_size > 1 && s.ddp_models == 0) {
    return Status::InvalidArgument(
        "mode='layerwise' with world_size > 1 needs the model wrapped in "
        "DistributedDataParallel in state (its comm hook says when a gradient is reduced): "
        "use mode='concurrent' otherwise");
  }
  if (s.find_unused) {
    return Status::InvalidArgument(
        "mode='layerwise' does not support DDP's find_unused_parameters=True: use "
        "mode='concurrent'");
  }
  return Status::OK();
}

Result<ModeChooser> ModeChooser::Make(const ModeChoiceOptions& opts) {
  if (opts.rounds < 1) {
    return Status::InvalidArgument("mode='auto': rounds must be >= 1, got " +
                                   std::to_string(opts.rounds));
  }
  if (opts.settle < 0) return Status::InvalidArgument("mode='auto': settle must be >= 0");
  if (!(opts.margin >= 0 && opts.margin < 1)) {
    return Status::InvalidArgument("mode='auto': margin must be in [0, 1), got " +
                                   std::to_string(opts.margin));
  }
  if (opts.patience < 1) return Status::InvalidArgument("mode='auto': patience must be >= 1");
  if (!(opts.alpha > 0 && opts.alpha <= 1)) {
    return Status::InvalidArgument("mode='auto': alpha must be in (0, 1], got " +
                                   std::to_string(opts.alpha));
  }
  ModeChooser c;
  c.opts_ = opts;
  return c;
}

// Probe: the mean over the measured windows (sums kept in the figures'
// units, i.e. the running mean updated exactly); after it: an EWMA, except
// the first window after a switch, which replaces a figure measured before.
void ModeChooser::Measure(CkptMode m, const ModeWindow& w) {
  ModeFigures& f = fig_[Index(m)];
  const double steps = static_cast<double>(w.steps);
  const double step_s = w.wall_s / steps;
  const double busy_s = (w.wall_s - w.stall_s) / steps;
  const double per_ckpt = w.checkpoints > 0 ? w.stall_s / static_cast<double>(w.checkpoints)
                                            : w.stall_s;
  if (!decided_ || f.windows == 0 || fresh_) {
    // exact running mean during the probe (and a fresh start after a switch)
    const double n = fresh_ && decided_ ? 0.0 : static_cast<double>(f.windows);
    f.step_s = (f.step_s * n + step_s) / (n + 1);
    f.busy_step_s = (f.busy_step_s * n + busy_s) / (n + 1);
    f.stall_per_ckpt_s = (f.stall_per_ckpt_s * n + per_ckpt) / (n + 1);
  } else {
    const double a = opts_.alpha;
    f.step_s = (1 - a) * f.step_s + a * step_s;
    f.busy_step_s = (1 - a) * f.busy_step_s + a * busy_s;
    f.stall_per_ckpt_s = (1 - a) * f.stall_per_ckpt_s + a * per_ckpt;
  }
  fresh_ = false;
  ++f.windows;
}

std::string ModeChooser::Figures() const {
  char buf[256];
  const ModeFigures& c = fig_[0];
  const ModeFigures& l = fig_[1];
  std::snprintf(buf, sizeof(buf),
                "concurrent %.2f ms/step (stall %.2f ms/checkpoint, %lld windows), "
                "layerwise %.2f ms/step (stall %.2f ms/checkpoint, %lld windows)",
                c.step_s * 1e3, c.stall_per_ckpt_s * 1e3, static_cast<long long>(c.windows),
                l.step_s * 1e3, l.stall_per_ckpt_s * 1e3, static_cast<long long>(l.windows));
  return buf;
}

void ModeChooser::SwitchTo(CkptMode m, const std::string& why) {
  reason_ = why;
  if (m == active_) return;
  active_ = m;
  ++switches_;
  skip_ = opts_.settle;
  over_ = 0;
  fresh_ = decided_;
}

void ModeChooser::Decide() {
  decided_ = true;
  const double c = fig_[0].step_s, l = fig_[1].step_s;
  char pct[64];
  std::snprintf(pct, sizeof(pct), "%+.1f %%", c > 0 ? (l / c - 1) * 100 : 0.0);
  if (l < c * (1 - opts_.margin)) {
    SwitchTo(CkptMode::kLayerwise, std::string("probe: layerwise ") + pct +
                                       " per step vs concurrent (margin " +
                                       std::to_string(static_cast<int>(opts_.margin * 100)) +
                                       " %): " + Figures());
  } else {
    SwitchTo(CkptMode::kConcurrent,
             std::string("probe: layerwise ") + pct + " per step vs concurrent, not below -" +
                 std::to_string(static_cast<int>(opts_.margin * 100)) +
                 " % (concurrent stays unless clearly slower): " + Figures());
  }
}

CkptMode ModeChooser::Observe(const ModeWindow& w) {
  ++windows_;
  if (w.steps < 1) return active_;
  if (skip_ > 0) {
    --skip_;
    return active_;
  }
  Measure(active_, w);
  const CkptMode other = Other(active_);
  if (!decided_) {
    const bool other_short = fig_[Index(other)].windows < opts_.rounds;
    const bool mine_short = fig_[Index(active_)].windows < opts_.rounds;
    if (other_short) {
      SwitchTo(other, std::string("probing: ") + Figures());
    } else if (!mine_short) {
      Decide();
    } else {
      reason_ = std::string("probing: ") + Figures();
    }
    return active_;
  }
  const double mine = fig_[Index(active_)].step_s, theirs = fig_[Index(other)].step_s;
  if (mine > theirs * (1 + opts_.margin)) {
    ++over_;
  } else {
    over_ = 0;
  }
  if (over_ >= opts_.patience) {
    SwitchTo(other, std::string("watch: ") + CkptModeName(active_) + " over " +
                        CkptModeName(other) + "'s last figure by more than the margin in " +
                        std::to_string(opts_.patience) + " windows in a row: " + Figures());
  }
  return active_;
}

void ModeChooser::Start(double now_s, double stall_total_s) {
  t0_ = now_s;
  stall0_ = stall_total_s;
  steps_ = 0;
}

CkptMode ModeChooser::Step(double now_s, double stall_total_s, bool checkpoint) {
  ++steps_;
  if (!checkpoint) return active_;
  if (!pinned_) Observe({steps_, now_s - t0_, stall_total_s - stall0_, 1});
  Start(now_s, stall_total_s);
  return active_;
}

void ModeChooser::Pin(const std::string& why) {
  pinned_ = decided_ = true;
  active_ = CkptMode::kConcurrent;
  reason_ = why;
}

ModeChoiceState ModeChooser::State() const {
  ModeChoiceState s;
  s.active = active_;
  s.decided = decided_;
  s.windows = windows_;
  s.switches = switches_;
  s.modes = fig_;
  s.reason = reason_;
  return s;
}

}  // namespace nonstop
