#include "engine/checkpointer_args.h"

#include <algorithm>
#include <array>
#include <unordered_map>

#include "nonstop/engine.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

Status Bad(const std::string& what) { return Status::InvalidArgument(what); }

bool IntAtLeast(const Arg& a, int64_t least) { return a.kind == Arg::Kind::kInt && a.i >= least; }

bool OneOf(const Arg& a, std::initializer_list<const char*> names) {
  return std::any_of(names.begin(), names.end(), [&](const char* n) { return a.is(n); });
}

}  // namespace

Result<EngineChoices> CheckCheckpointerArgs(const CheckpointerArgs& a) {
  const bool auto_every = a.every.is("auto");
  // every="auto": the interval adapts to keep the visible stall near
  // max_overhead of wall time (Schedule::Auto, docs/TUNE.md).
  if (auto_every && !a.mode.is("concurrent")) {
    return Bad("every=\"auto\" works with mode=\"concurrent\" only (mode=\"auto\" compares the "
               "modes over fixed windows: every=N)");
  }
  if (!OneOf(a.mode, {"concurrent", "layerwise", "multistep", "auto"})) {
    return Bad("mode " + a.mode.repr +
               " is not available in this version; use one of concurrent, layerwise, "
               "multistep, auto");
  }
  if (!auto_every && !IntAtLeast(a.every, 1)) {
    return Bad("every must be a positive integer or \"auto\", got " + a.every.repr);
  }
  const bool layer_modes = OneOf(a.mode, {"layerwise", "auto"});
  if (!layer_modes && (!a.copy.is("host") || a.clip_grad_norm)) {
    return Bad("copy= and clip_grad_norm= apply to mode='layerwise' (or 'auto') only");
  }
  LayerCopy copy = LayerCopy::kHost;
  if (layer_modes && (a.copy.kind != Arg::Kind::kText || !ParseLayerCopy(a.copy.text, &copy))) {
    return Bad("unknown copy " + a.copy.repr + "; use host, direct or device");
  }
  if (!a.mode.is("multistep") && !a.replay.is("auto")) {
    return Bad("replay= applies to mode='multistep' only");
  }
  if (!a.keep.none() && !IntAtLeast(a.keep, 1)) {
    return Bad("keep must be None or a positive integer, got " + a.keep.repr);
  }
  if (a.best && auto_every && a.world_size > 1) {
    return Bad("best= with world_size > 1 needs every=N: every rank must checkpoint the same "
               "steps (their metrics are agreed at each checkpoint)");
  }
  if (!IntAtLeast(a.max_in_flight, 1)) {
    return Bad("max_in_flight must be a positive integer, got " + a.max_in_flight.repr);
  }
  if (!OneOf(a.tier, {"auto", "memory", "disk"})) {
    return Bad("tier must be \"auto\", \"memory\" or \"disk\", got " + a.tier.repr);
  }
  // Device snapshots (docs/CUDA.md) are whole checkpoints of the concurrent mode.
  const Arg& dsb = a.device_snapshot_bytes;
  if (!dsb.none() && !IntAtLeast(dsb, 0)) {
    return Bad("device_snapshot_bytes must be None or a non-negative integer, got " + dsb.repr);
  }
  if (!dsb.none() && dsb.i > 0 && !OneOf(a.mode, {"concurrent", "auto"})) {
    return Bad("device_snapshot_bytes= applies to mode='auto' or mode='concurrent' only");
  }
  if (a.world_size > 1 && a.mode.is("auto")) {
    // Under DDP layer-wise installs a communication hook, which DDP cannot
    // remove again; each rank would also measure (and pick) on its own.
    return Bad("mode='auto' is single-process only for now; with world_size > 1 choose "
               "mode='concurrent' or 'layerwise'");
  }
  if (a.world_size > 1 && a.mode.is("multistep")) {
    return Bad("mode 'multistep' is single-process only for now; use mode='concurrent' with "
               "world_size > 1");
  }
  // The tiered cadence (docs/PYTHON.md, "disk_every"): 1, N > 1, or "auto" (0).
  const int64_t every_disk = a.disk_every.is("auto") ? 0 : a.disk_every.i;
  if (!a.disk_every.is("auto") && !IntAtLeast(a.disk_every, 0)) {
    return Bad("disk_every must be a positive integer or \"auto\", got " + a.disk_every.repr);
  }
  if (every_disk != 1 && (a.tier.is("disk") || a.mode.is("multistep") || a.world_size > 1)) {
    return Bad("disk_every != 1 needs the memory tier (tier='auto' or 'memory'), "
               "mode='concurrent', 'layerwise' or 'auto', and world_size 1");
  }
  EngineChoices e;
  e.keep_every = a.keep.none() ? 0 : a.keep.i;
  e.disk_every = every_disk;
  if (!OneOf(a.mode, {"concurrent", "auto"})) {
    e.device_snapshot_bytes = 0;
  } else if (!dsb.none()) {
    e.device_snapshot_bytes = dsb.i;
  }
  if (!a.tier.is("auto")) e.memory_tier = a.tier.text;
  if (layer_modes) e.layer_copy = a.copy.text;
  return e;
}

Result<std::vector<ConfigSetting>> CheckConfigFile(
    const std::string& path, const std::optional<std::vector<ConfigItem>>& items,
    const std::vector<std::string>& known) {
  const std::string where = "config " + path + ": ";
  if (!items) return Bad(where + "expected a JSON object");
  const auto find = [&](const char* key) -> const ConfigItem* {
    for (const ConfigItem& it : *items) {
      if (it.key == key) return &it;
    }
    return nullptr;
  };
  const ConfigItem* fmt = find("format");
  const bool no_format = fmt == nullptr || fmt->value.none();
  if (!no_format && !fmt->value.is(kConfigFormat)) {
    return Bad(where + "format " + fmt->value.repr + " is not '" + kConfigFormat + "'");
  }
  // `nonstop tune --json` also prints what it measured; its `interval` is `every`.
  const bool tune_json =
      no_format && find("interval") != nullptr && find("max_in_flight") != nullptr;
  const auto is_known = [&](const std::string& k) {
    return std::find(known.begin(), known.end(), k) != known.end();
  };
  static const std::array<const char*, 5> kRecords = {"format", "tune", "inputs", "measured",
                                                     "notes"};
  static const std::array<const char*, 5> kCounts = {"max_in_flight", "writers", "staging_bytes",
                                                    "chunk_bytes", "copy_threads"};
  std::vector<ConfigSetting> out;
  for (size_t i = 0; i < items->size(); ++i) {
    const ConfigItem& it = (*items)[i];
    if (std::find(kRecords.begin(), kRecords.end(), it.key) != kRecords.end()) continue;
    std::string key = it.key;
    if (tune_json) {
      if (key == "interval") {
        key = "every";
      } else if (!is_known(key)) {
        continue;
      }
    }
    if (!is_known(key)) {
      std::string names;
      for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
      return Bad(where + "unknown setting " + it.key_repr + "; known: " + names);
    }
    const Arg& v = it.value;
    const auto must = [&](const std::string& expected) {
      return Bad(where + key + " must be " + expected + ", got " + v.repr);
    };
    bool real = false;
    if (v.none()) {
      // None: the default
    } else if (key == "every") {
      if (!v.is("auto") && !IntAtLeast(v, 1)) return must("a positive integer or \"auto\"");
    } else if (std::find(kCounts.begin(), kCounts.end(), key) != kCounts.end()) {
      if (!IntAtLeast(v, 0)) return must("a non-negative integer");
    } else if (key == "mode" || key == "medium") {
      if (v.kind != Arg::Kind::kText) return must("a string");
    } else if (key == "max_overhead") {
      const bool number = v.kind == Arg::Kind::kInt || v.kind == Arg::Kind::kReal;
      if (!number || !(v.real > 0 && v.real < 1)) return must("a fraction in (0, 1), e.g. 0.03");
      real = true;
    }
    out.push_back({key, i, real});
  }
  return out;
}

uint64_t EstimateFirstCheckpointBytes(const std::vector<uint64_t>& tensor_bytes,
                                      const std::vector<FreshOptimizer>& fresh) {
  uint64_t n = 0;
  for (const uint64_t b : tensor_bytes) n += b + kStoreAlign;
  for (const FreshOptimizer& o : fresh) {
    for (const uint64_t b : o.param_bytes) {
      n += static_cast<uint64_t>(o.moments) * (b + kStoreAlign) + 64;  // moments, `step`
    }
  }
  return n;
}


namespace {

// "float32[32, 16]", as the messages print a tensor.
std::string Describe(const TensorDesc& t) {
  std::string s = t.dtype + "[";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string IntList(const std::vector<int64_t>& v) {
  return Describe({"", "", v});
}

}  // namespace

Status CheckStateFits(const std::string& where, int64_t step, const std::string& dir,
                      const std::vector<std::string>& saved_keys,
                      const std::vector<LiveState>& live, const std::vector<TensorDesc>& saved) {
  for (const LiveState& s : live) {
    if (std::find(saved_keys.begin(), saved_keys.end(), s.key) != saved_keys.end()) continue;
    std::string have;
    for (const std::string& k : saved_keys) have += (have.empty() ? "" : ", ") + k;
    return Bad(where + " has no state " + s.key_repr + " (it has " +
               (have.empty() ? "nothing" : have) + ")");
  }
  std::unordered_map<std::string, const TensorDesc*> by_name;
  for (const TensorDesc& t : saved) by_name.emplace(t.name, &t);
  const std::string in = "checkpoint step " + std::to_string(step) + " in " + dir;
  for (const LiveState& s : live) {
    for (const TensorDesc& t : s.tensors) {
      const auto it = by_name.find(t.name);
      if (it == by_name.end()) {
        if (s.required) return Bad("tensor '" + t.name + "' is not in " + in);
        continue;
      }
      if (it->second->dtype != t.dtype || it->second->shape != t.shape) {
        return Bad("tensor '" + t.name + "': checkpoint step " + std::to_string(step) + " has " +
                   Describe(*it->second) + ", the state has " + Describe(t));
      }
    }
    if (s.live_groups != s.saved_groups) {
      return Bad(where + ": optimizer " + s.key_repr + " has parameter groups of sizes " +
                 IntList(s.saved_groups) + ", the live optimizer " + IntList(s.live_groups));
    }
  }
  return Status::OK();
}


namespace {

// The characters of a[alo:ahi] and b[blo:bhi] in matching blocks, found as
// difflib.SequenceMatcher finds them (no junk): the longest common block
// (the earliest in a, then in b), then the same left and right of it.
size_t Matching(const std::string& a, size_t alo, size_t ahi, const std::string& b, size_t blo,
                size_t bhi) {
  size_t bi = alo, bj = blo, bk = 0;
  for (size_t i = alo; i < ahi; ++i) {
    for (size_t j = blo; j < bhi; ++j) {
      size_t k = 0;
      while (i + k < ahi && j + k < bhi && a[i + k] == b[j + k]) ++k;
      if (k > bk) bi = i, bj = j, bk = k;
    }
  }
  if (bk == 0) return 0;
  return bk + Matching(a, alo, bi, b, blo, bj) + Matching(a, bi + bk, ahi, b, bj + bk, bhi);
}

}  // namespace

Status CheckOptionNames(const std::string& who, const std::vector<std::string>& given,
                        const std::vector<std::string>& known,
                        const std::vector<std::string>& own) {
  for (const std::string& k : given) {
    if (std::find(own.begin(), own.end(), k) != own.end()) {
      return Bad(who + " sets " + k + "= itself");
    }
    if (std::find(known.begin(), known.end(), k) != known.end()) continue;
    // get_close_matches: the best ratio 2 M / (|x| + |k|) >= 0.6; a tie: the greater name.
    double best = 0.6;
    std::string near;
    for (const std::string& x : known) {
      const double r = 2.0 * static_cast<double>(Matching(x, 0, x.size(), k, 0, k.size())) /
                       static_cast<double>(x.size() + k.size());
      if (r > best || (r == best && (near.empty() || x > near))) best = r, near = x;
    }
    return Bad(who + ": unknown option " + k + "=" +
               (near.empty() ? "" : " (did you mean " + near + "=?)") +
               "; the options are nonstop.Checkpointer's (docs/PYTHON.md)");
  }
  return Status::OK();
}

}  // namespace nonstop
