// MultistepCheckpoint: multi-step overlapped checkpoints (GoCkpt, Zhang et al. §4).
//
// When copying the whole training state off the device takes longer than one
// step, a single-step scheme stalls. A multi-step checkpoint spreads the copy
// over K steps and repairs the version skew on the CPU:
//
//   * Begin(N), after the update of step N, splits the optimizer's state
//     (master parameters and every optimizer state: exp_avg, exp_avg_sq,
//     max_exp_avg_sq, momentum_buffer) into K parts of `block_bytes` blocks.
//     Each parameter block is followed by the same block of every state.
//   * Part k (1..K) is copied during step N+k, after the update of step
//     N+k-1, so it reaches the host at version N+k-1. It must be on the host
//     before the update of step N+k; if it is not, that update waits (stall).
//   * For every part already copied, the gradients of the later steps
//     N+k..N+K-1 are copied too, as the optimizer consumed them (captured in
//     OnUpdateBegin, after unscaling and clipping). Gradient copies go ahead
//     of state copies. Without `overlap_gradients` (GoCkpt) the update waits
//     for its own gradient copies; with it (GoCkpt-O) they overlap the update
//     and the next forward pass, and only the next backward (or zero_grad)
//     waits for them, since gradients stay untouched until then.
//   * The hyperparameters of every step (per group) and whether it was
//     skipped (GradScaler overflow) are logged.
//   * When part K is on the host (OnUpdateBegin of step N+K), a background
//     thread replays the logged steps on each part with the CPU optimizer
//     (nonstop/optim.h), bitwise as torch computes them, until every part is
//     at version N+K-1, and persists the result through the Engine. The host
//     buffers the parts were copied into and replayed in are the
//     checkpoint's staging: they are registered as staged
//     (TensorRef::staged) and the Engine writes them to the medium as they
//     are (BeginCheckpoint/EndCheckpoint(N+K-1, meta), its one write path and
//     committer), so the state is copied once, device to host.
//
// The checkpoint is at version V = N+K-1, the version of the last part: it
// needs the gradients of steps N+1..N+K-1 only, (K-1)/2 gradient copies of the
// whole model in total. (Version N+K would need one more step's gradients of
// every part, (K+1)/2 in total, for no gain.) With K = 1 this is Async-O: the
// whole state is copied during one step.
//
// Thread safety: the hooks and Begin/SetOutputs are for the training thread.
// Engine calls made through this class (Wait, Latest, Stats) are serialised
// with the background thread's; the caller must not use the Engine directly
// while a MultistepCheckpoint uses it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/optim.h"
#include "nonstop/status.h"
#include "nonstop/types.h"

namespace nonstop {

// Where a closed window's parts are brought to one version
// (docs/MULTISTEP.md, "Replay at restore").
enum class MultistepReplay : uint8_t {
  // The CPU kernels (nonstop/optim.h), bitwise torch's single-tensor CPU
  // path, in the background: the checkpoint is the state at N+K-1.
  kHost,
  // No replay here: every part is written at the version it was copied at,
  // with the gradient log (tensors "multistep_replay/g<j>/<t>") and the
  // replay plan (key "multistep_plan" added to the metadata: which elements
  // of which tensor take which logged step, in order, and each step's
  // hyperparameters and step counts). Whoever restores it applies the plan
  // with the training optimizer itself, on the device it restores to.
  kRestore,
};

struct MultistepOptions {
  int parts = 7;                          // K (GoCkpt's optimum)
  uint64_t block_bytes = 4ull << 20;      // parameter bytes per block (multiple of 4)
  bool overlap_gradients = true;          // GoCkpt-O
  int copy_window = 2;                    // copies handed to the copy engine at once
  int replay_threads = 0;                 // 0 = hardware concurrency (kHost)
  MultistepReplay replay = MultistepReplay::kHost;
  optim::MklVmsSqrtFn mkl_vms_sqrt = nullptr;  // see nonstop/optim.h (torch's sqrt)
};

// One parameter the optimizer updates: its fp32 master copy and its optimizer
// states, where they live now. A state that does not exist yet (torch creates
// them at the first update) is null: it is read as zeros ("fresh").
struct OptimizerTensor {
  std::string name;  // for error messages
  size_t numel = 0;
  int group = 0;     // index of its parameter group
  Device device;     // of the parameter and its states
  const float* param = nullptr;
  const float* exp_avg = nullptr;          // Adam/AdamW
  const float* exp_avg_sq = nullptr;       // Adam/AdamW
  const float* max_exp_avg_sq = nullptr;   // Adam/AdamW with amsgrad
  const float* momentum_buffer = nullptr;  // SGD with momentum
  double step = 0;  // Adam/AdamW: state["step"] at Begin (0 when fresh)
};

// A gradient as the optimizer consumes it; null data = the parameter has no
// gradient this step (torch skips it).
struct GradRef {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;  // kFloat32, kBFloat16 or kFloat16
  Device device;
};

enum class StateRole : uint8_t { kParam, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMomentumBuffer };

// A tensor of the persisted checkpoint: either a reconstructed buffer
// (`tensor` >= 0: index into Begin's list, and `role`), or bytes copied when
// SetOutputs is called (`tensor` < 0: `data` on `device`). SetOutputs makes
// an output given as bytes that are a window tensor's own (its parameter or
// a kept state: the same float32 data pointer and size) that reconstructed
// buffer, so the caller may pass every tensor of its state as bytes.
struct OutputTensor {
  TensorSpec spec;
  int tensor = -1;
  StateRole role = StateRole::kParam;
  const void* data = nullptr;
  Device device;
};

// One checkpoint window, as measured.
struct MultistepWindowStats {
  int64_t begin_step = 0;          // N
  int64_t version = 0;             // N + K - 1
  uint64_t counter = 0;            // engine counter (0 until started)
  double stall_s = 0;              // training thread blocked in this window's hooks
  double state_wait_s = 0;         // part of the stall: state copies not done
  double grad_wait_s = 0;          // part of the stall: gradient copies not done
  uint64_t state_bytes = 0, grad_bytes = 0;
  int skipped_steps = 0;
  double replay_s = 0;             // CPU replay, all parts
  double window_s = 0;             // Begin -> last copy on the host
  std::string error;
};

struct MultistepStats {
  uint64_t windows = 0, persisted = 0, failed = 0;
  double stall_s_total = 0;
  uint64_t host_bytes = 0;  // state (the checkpoint's staging) + gradient + other host buffers
  std::string copy_engine;
  std::vector<MultistepWindowStats> recent;  // last 64 windows, oldest first
};

class MultistepCheckpoint {
 public:
  // `engine` must outlive this object; `copy` moves device bytes to the host
  // (null: MakeBestCopyEngine(1)).
  static Result<std::unique_ptr<MultistepCheckpoint>> Create(
      Engine* engine, const MultistepOptions& options, std::unique_ptr<CopyEngine> copy = nullptr);
  virtual ~MultistepCheckpoint() = default;

  // Starts a window after the update of step `step` (N). `tensors` are at
  // version N. Fails while a window is open. Waits (stall) until the previous
  // window's host buffers have been written to the medium.
  virtual Status Begin(int64_t step, const optim::OptimizerConfig& config,
                       std::vector<OptimizerTensor> tensors) = 0;
  // True from Begin until the last part is on the host.
  virtual bool active() const = 0;
  // The version the open (or last) window produces: N + K - 1.
  virtual int64_t version() const = 0;

  // The paper's hooks, once per training step while a window is open (no-ops
  // otherwise). OnBackwardBegin: GoCkpt-O waits for the last step's gradient
  // copies. OnUpdateBegin: `groups` holds each parameter group's
  // hyperparameters as the optimizer will use them; `grads` one entry per
  // tensor of Begin (ignored when skipped). A skipped step (no update) still
  // calls OnUpdateBegin(skipped=true) and OnUpdateEnd.
  virtual Status OnBackwardBegin() = 0;
  virtual Status OnUpdateBegin(int64_t step, std::span<const optim::StepHyperparameters> groups,
                               bool skipped, std::span<const GradRef> grads) = 0;
  // True while gradient copies of an earlier step are in flight (GoCkpt-O):
  // the gradients must stay unchanged until it turns false or OnBackwardBegin
  // returns. Errors of those copies are returned by the next hook.
  virtual bool GradientCopiesPending() = 0;
  // `refreshed` (optional, same order and sizes as Begin): state pointers
  // that appeared since (optimizer states are created at the first update).
  virtual Status OnUpdateEnd(int64_t step,
                             std::span<const OptimizerTensor> refreshed = {}) = 0;
  // Whether a tensor of the open window lacks its first optimizer state
  // (exp_avg; SGD: momentum_buffer), which the optimizer makes at the
  // tensor's first update: OnUpdateEnd then wants `refreshed`.
  virtual bool needs_refresh() const = 0;

  // The checkpoint's tensors and metadata at version N+K-1: call after the
  // update of step N+K-1 and before that of step N+K. Tensors with
  // tensor < 0 are copied now (counted as stall).
  virtual Status SetOutputs(std::vector<OutputTensor> outputs, std::string meta_json) = 0;

  // The training loop's steps as a driver sees them (the Python front end:
  // an optimizer step pre-hook, ckpt.step and ckpt.save). CountUpdate: an
  // update is about to run (also while no window is open);
  // InvalidArgument for a second one since the last MarkStep while a
  // window is open, and with replay kRestore for one that GradScaler runs
  // inside a fused optimizer (`scaler_inside`: the kernel unscales and skips
  // overflow steps itself, after the log saw the step). next_step(): the
  // step that update belongs to, the last marked + 1 (0 before any).
  virtual Status CountUpdate(bool scaler_inside = false) = 0;
  virtual int64_t next_step() const = 0;
  // After the update of `step` (ckpt.step): while a window is open, a step
  // without an update is logged as skipped (GradScaler skipped it). `due`:
  // a checkpoint is due after it; it begins now when no window is open,
  // else at the first MarkStep after the open one closed. True when the
  // caller must Begin(step, ...) now.
  virtual Result<bool> MarkStep(int64_t step, bool due) = 0;
  // ckpt.save: true when the caller must Begin now; false when a window is
  // open (the checkpoint is then due at the first MarkStep after it closes).
  virtual bool RequestCheckpoint() = 0;
  // Whether SetOutputs is due now: the window's version was updated (or
  // skipped) and its outputs are not set yet.
  virtual bool outputs_due() const = 0;

  // Waits until every window is persisted and committed (or failed; returns
  // its error).
  virtual Status Wait() = 0;
  virtual std::optional<CommittedCheckpoint> Latest() = 0;
  // Engine::AdoptRestored through this class (the caller restored committed
  // checkpoint `counter` with its own reader): it stays intact until a newer
  // one commits, and a rollback is recorded in the job directory's lineage
  // before anything new is written. Waits for the windows in flight;
  // FailedPrecondition while a window is open (between Begin and SetOutputs).
  virtual Status AdoptRestored(uint64_t counter) = 0;
  virtual MultistepStats Stats() = 0;
  // Waits for the background work and stops it. Idempotent. Does not close the engine.
  virtual Status Close() = 0;
};

std::string_view StateRoleName(StateRole role);

// ---- What mode="multistep" accepts (docs/MULTISTEP.md, "Supported
// optimizers" and "Replay"). The Python driver describes the torch
// optimizer as plain values; these decide, one line naming what to change.

// One param_group, with torch's names for its flags.
struct MultistepGroupDesc {
  bool fused = false, capturable = false, differentiable = false;
  std::optional<bool> foreach;       // nullopt: None (torch decides)
  bool torch_picks_foreach = false;  // torch's choice for foreach=None over its tensors
  bool amsgrad = false, decoupled_weight_decay = false;
  std::string tensor_hyperparameter;  // the first hyperparameter held as a tensor ("": none)
};

// A tensor the window copies: parameter `param` of the optimizer (state
// empty) or its optimizer state `state` (torch's key: "exp_avg", "step"...).
struct MultistepTensorDesc {
  int param = 0;
  std::string state;
  std::string device;             // as torch prints it: "cpu", "cuda:0", "meta"
  std::string dtype = "float32";  // parameters: as torch names it, without "torch."
  bool contiguous = true;
};

struct MultistepOptimizerDesc {
  std::string name;          // its class's name
  bool torch_class = false;  // exactly torch.optim.AdamW, Adam or SGD (not a subclass)
  std::vector<MultistepGroupDesc> groups;
  std::vector<MultistepTensorDesc> tensors;
};

struct MultistepChoice {
  MultistepReplay replay = MultistepReplay::kHost;
  optim::Algorithm algorithm = optim::Algorithm::kAdamW;
  bool amsgrad = false;
  std::string device = "cpu";  // the parameters' one device
};

// Whether the replay takes a tensor on `device` (kHost: the CPU only, its
// kernels are the CPU's; kRestore: CPU and CUDA). InvalidArgument naming
// `what` otherwise.
Status CheckMultistepDevice(std::string_view what, std::string_view device,
                            MultistepReplay replay);

// replay= "host", "torch" (kRestore) or "auto" ("host" where every
// parameter is on the CPU and the host's kernels match the optimizer, else
// "torch"); then every check of the optimizer for that replay, in order:
// the parameters' devices (one device), their states' (kRestore: beside
// their parameter), the class and each group's flags, contiguous float32
// parameters. InvalidArgument naming what to change when one fails.
Result<MultistepChoice> ChooseMultistep(const MultistepOptimizerDesc& opt,
                                        std::string_view replay);

// What a restore replays a replay="torch" checkpoint with: this run's
// arithmetic (torch's version, the device type and model, the optimizer's
// class) and the optimizer's and the checkpoint's shapes.
struct MultistepRun {
  std::string torch, device, device_name, optimizer;
  size_t groups = 0;                         // the optimizer's param_groups
  std::vector<uint64_t> param_numel;         // per parameter, in the optimizer's order
  std::map<std::string, uint64_t> tensors;   // the checkpoint's tensors: elements
};

// Before restore() changes anything: the metadata's "multistep" record and
// "multistep_plan" (JSON text; "null" when absent) of checkpoint `where`.
// InvalidArgument where this run's arithmetic is not the one it was saved
// with (restore it where it was trained); Corruption where the record is
// malformed or the plan does not fit the optimizer or the gradient log.
Status CheckMultistepRestore(std::string_view record_json, std::string_view plan_json,
                             const MultistepRun& run, const std::string& where);

}  // namespace nonstop
