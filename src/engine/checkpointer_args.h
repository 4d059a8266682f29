// The Checkpointer's keyword arguments (python/nonstop/_options.py) and its
// config=PATH file (_options.py load_config, docs/TUNE.md): which values and which
// combinations are legal, decided here, in one place, with one-line
// messages that name the keyword and the value as Python wrote it (its
// repr). The binding (src/python/options_bindings.cc) turns each Python
// value into an Arg; Python only gathers them and builds its option objects.
// Also the size of the first checkpoint, estimated before the engine opens.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/status.h"

namespace nonstop {

// A keyword argument's value as the front end got it.
struct Arg {
  enum class Kind { kNone, kInt, kReal, kText, kOther };  // kOther: a bool, a list, ...
  Kind kind = Kind::kNone;
  int64_t i = 0;       // kInt
  double real = 0;     // kReal, and kInt's value
  std::string text;    // kText
  std::string repr = "None";  // as Python prints it (messages)

  static Arg Int(int64_t v) {
    return {Kind::kInt, v, static_cast<double>(v), "", std::to_string(v)};
  }
  static Arg Real(double v, std::string repr) { return {Kind::kReal, 0, v, "", std::move(repr)}; }
  static Arg Text(const std::string& s) { return {Kind::kText, 0, 0, s, "'" + s + "'"}; }
  static Arg Other(std::string repr) { return {Kind::kOther, 0, 0, "", std::move(repr)}; }
  bool none() const { return kind == Kind::kNone; }
  bool is(const char* s) const { return kind == Kind::kText && text == s; }
};

// The keywords whose values and combinations are checked before the job
// directory is opened (config= already applied); the defaults are
// Checkpointer's.
struct CheckpointerArgs {
  Arg mode = Arg::Text("concurrent");  // concurrent, layerwise, multistep, auto
  Arg every = Arg::Int(10);            // an int >= 1 or "auto"
  Arg max_in_flight = Arg::Int(2);
  Arg keep;                            // None or an int >= 1
  Arg tier = Arg::Text("auto");        // auto, memory, disk
  Arg device_snapshot_bytes;           // None or an int >= 0 (> 0: concurrent/auto only)
  Arg disk_every = Arg::Int(1);        // an int >= 0 or "auto" (0)
  Arg copy = Arg::Text("host");        // layerwise/auto only when not "host"
  Arg replay = Arg::Text("auto");      // multistep only when not "auto"
  bool clip_grad_norm = false;         // given (layerwise/auto only)
  bool best = false;                   // best= given
  int64_t world_size = 1;
};

// What the keywords decide of the engine's constructor arguments
// (nonstop._core.Engine; the multistep window's too).
struct EngineChoices {
  int64_t keep_every = 0;      // keep=, 0 when None
  int64_t disk_every = 1;      // "auto": 0
  // Device snapshots are whole checkpoints of the concurrent mode (and
  // auto's): the other modes get 0, so they hold no device memory; nullopt:
  // the engine's default (a quarter of free device memory).
  std::optional<int64_t> device_snapshot_bytes;
  std::string memory_tier;     // "": the engine's default ("auto")
  std::string layer_copy;      // layer-wise modes only ("" otherwise)
};

// The engine's choices, or InvalidArgument naming the first keyword or
// combination that is not legal.
Result<EngineChoices> CheckCheckpointerArgs(const CheckpointerArgs& a);

// The config file's format tag (docs/TUNE.md).
inline constexpr const char* kConfigFormat = "nonstop.config/1";

// One key of a config file's JSON object and its value.
struct ConfigItem {
  std::string key;
  std::string key_repr;  // as Python prints it
  Arg value;
};

// A setting the file makes: its Checkpointer argument and the item holding
// its value (`real`: given as a number, to be taken as a float).
struct ConfigSetting {
  std::string name;
  size_t item = 0;
  bool real = false;
};

// config=PATH: the items of the file's JSON object in order (nullopt: the
// file holds another JSON value); `known`: the Checkpointer arguments a file
// may set. Keys that are records (format, tune, inputs, measured, notes) are
// skipped; a `nonstop tune --json` output (no format, `interval` and
// `max_in_flight`) sets `every` from `interval` and skips what it measured.
// InvalidArgument "config PATH: ..." for a wrong format, an unknown key or a
// value of the wrong type or range.
Result<std::vector<ConfigSetting>> CheckConfigFile(
    const std::string& path, const std::optional<std::vector<ConfigItem>>& items,
    const std::vector<std::string>& known);

// A torch optimizer that has no state yet: the moments it creates per
// parameter at its first step (Adam-style: 2, momentum: 1, none: 0) and the
// bytes of each of its parameters.
struct FreshOptimizer {
  int64_t moments = 0;
  std::vector<uint64_t> param_bytes;
};

// The bytes the first checkpoint of a state will hold, as far as they can
// be told before it (the staging the engine prepares in the background):
// every tensor as it is now (`tensor_bytes`), plus the moments and a small
// `step` tensor per parameter of each fresh optimizer; each tensor padded by
// the slot layout's alignment (kStoreAlign).
uint64_t EstimateFirstCheckpointBytes(const std::vector<uint64_t>& tensor_bytes,
                                      const std::vector<FreshOptimizer>& fresh);


// restore(): whether a checkpoint fits the live `state` argument, decided
// before any object is changed (python/nonstop/_apply.py prepare).
// A tensor by its checkpoint name, dtype as torch names it without
// "torch." ("float32") and shape.
struct TensorDesc {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

// One key of the live state: its live tensors (a module's, an optimizer's,
// a plain tensor), whether each must be in the checkpoint (modules and
// tensors; an optimizer's state may hold fewer), and an optimizer's
// parameter group sizes, live and saved (both empty: not compared).
struct LiveState {
  std::string key;
  std::string key_repr;  // as Python prints it
  std::vector<TensorDesc> tensors;
  bool required = false;
  std::vector<int64_t> live_groups;
  std::vector<int64_t> saved_groups;
};

// InvalidArgument (one line) for the first misfit between the live state
// and the checkpoint `where` names ("checkpoint step 5 in DIR"; `step` and
// `dir` for a tensor's message), in this order: a key of the state that
// the checkpoint lacks (`saved_keys`: its keys), then per key in order: a
// required tensor it lacks, a tensor whose dtype or shape differs
// (`saved`: the checkpoint's tensors), an optimizer's group sizes.
Status CheckStateFits(const std::string& where, int64_t step, const std::string& dir,
                      const std::vector<std::string>& saved_keys,
                      const std::vector<LiveState>& live, const std::vector<TensorDesc>& saved);


// The Checkpointer keywords an integration (nonstop.hf, nonstop.lightning)
// was given, checked when it is made: InvalidArgument "WHO sets K= itself"
// for one in `own`, or "WHO: unknown option K= (did you mean N=?); ..." for
// one not in `known` (Checkpointer's), N the closest known name as Python's
// difflib.get_close_matches(K, known, n=1) picks it (ratio >= 0.6).
Status CheckOptionNames(const std::string& who, const std::vector<std::string>& given,
                        const std::vector<std::string>& known,
                        const std::vector<std::string>& own);

}  // namespace nonstop
