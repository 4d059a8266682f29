// The Checkpointer's keyword arguments (python/nonstop/_options.py) and its
// config=PATH file (_config.py, docs/TUNE.md): which values and which
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

}  // namespace nonstop
