// The Checkpointer's keywords and its config= file checked by
// engine/checkpointer_args.h (each Python value becomes an Arg: its kind,
// value and repr), and its first checkpoint's size estimate; nothing is
// decided here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "engine/checkpointer_args.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

Arg ToArg(py::handle v) {
  const std::string repr = py::repr(v).cast<std::string>();
  if (v.is_none()) return Arg{};
  if (PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr())) {
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow == 0) return Arg::Int(x);
  } else if (PyFloat_Check(v.ptr())) {
    return Arg::Real(PyFloat_AsDouble(v.ptr()), repr);
  } else if (PyUnicode_Check(v.ptr())) {
    Arg a = Arg::Text(v.cast<std::string>());
    a.repr = repr;
    return a;
  }
  return Arg::Other(repr);
}

// d[key] as an Arg, or `fallback` when the key is missing.
Arg Get(const py::dict& d, const char* key, Arg fallback) {
  return d.contains(key) ? ToArg(d[key]) : fallback;
}

}  // namespace

void InitOptions(py::module_& m) {
  m.def(
      "check_checkpointer_args",
      [](const py::dict& kw, int64_t world_size) {
        CheckpointerArgs a;
        a.mode = Get(kw, "mode", a.mode);
        a.every = Get(kw, "every", a.every);
        a.max_in_flight = Get(kw, "max_in_flight", a.max_in_flight);
        a.keep = Get(kw, "keep", a.keep);
        a.tier = Get(kw, "tier", a.tier);
        a.device_snapshot_bytes = Get(kw, "device_snapshot_bytes", a.device_snapshot_bytes);
        a.disk_every = Get(kw, "disk_every", a.disk_every);
        a.copy = Get(kw, "copy", a.copy);
        a.replay = Get(kw, "replay", a.replay);
        a.clip_grad_norm = kw.contains("clip_grad_norm") && !kw["clip_grad_norm"].is_none();
        a.best = kw.contains("best") && !kw["best"].is_none();
        a.world_size = world_size;
        const EngineChoices e = Take(CheckCheckpointerArgs(a));
        py::dict out;
        out["keep_every"] = e.keep_every;
        if (e.disk_every != 1) out["disk_every"] = e.disk_every;
        if (e.device_snapshot_bytes) out["device_snapshot_bytes"] = *e.device_snapshot_bytes;
        if (!e.memory_tier.empty()) out["memory_tier"] = e.memory_tier;
        if (!e.layer_copy.empty()) out["layer_copy"] = e.layer_copy;
        return out;
      },
      py::arg("kw"), py::arg("world_size") = 1,
      "Checks the Checkpointer's keywords in `kw` (a missing one: its default) "
      "(engine/checkpointer_args.h); returns what they set of the Engine's "
      "arguments (keep_every, and disk_every, device_snapshot_bytes, "
      "memory_tier, layer_copy where not the default); CheckpointMismatchError otherwise.");
  m.def(
      "check_config",
      [](const std::string& path, const py::object& doc, const std::vector<std::string>& known) {
        std::optional<std::vector<ConfigItem>> items;
        std::vector<py::object> values;
        if (py::isinstance<py::dict>(doc)) {
          items.emplace();
          for (auto [k, v] : py::reinterpret_borrow<py::dict>(doc)) {
            const std::string key = py::str(k).cast<std::string>();
            items->push_back({key, py::repr(k).cast<std::string>(), ToArg(v)});
            values.push_back(py::reinterpret_borrow<py::object>(v));
          }
        }
        py::dict out;
        for (const ConfigSetting& s : Take(CheckConfigFile(path, items, known))) {
          const py::object& v = values[s.item];
          out[py::str(s.name)] = s.real ? py::float_(v) : v;
        }
        return out;
      },
      py::arg("path"), py::arg("doc"), py::arg("known"),
      "config=PATH's JSON value (`doc`) checked (engine/checkpointer_args.h): "
      "{argument: value} of the `known` arguments it sets; CheckpointMismatchError otherwise.");
  m.def(
      "estimate_first_checkpoint_bytes",
      [](const std::vector<uint64_t>& tensor_bytes,
         const std::vector<std::pair<int64_t, std::vector<uint64_t>>>& fresh) {
        std::vector<FreshOptimizer> f;
        for (const auto& [moments, params] : fresh) f.push_back({moments, params});
        return EstimateFirstCheckpointBytes(tensor_bytes, f);
      },
      py::arg("tensor_bytes"), py::arg("fresh"),
      "The first checkpoint's bytes (engine/checkpointer_args.h): `tensor_bytes` of the "
      "state now, `fresh`: (moments per parameter, [parameter bytes]) per optimizer without "
      "state yet.");
  m.def(
      "check_state_fits",
      [](const std::string& where, int64_t step, const std::string& dir,
         const std::vector<std::string>& saved_keys, const py::list& live,
         const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>& saved) {
        using Descs = std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>;
        std::vector<LiveState> states;
        for (const py::handle e : live) {
          const auto t = e.cast<py::tuple>();
          LiveState s;
          s.key = t[0].cast<std::string>();
          s.key_repr = py::repr(t[0]).cast<std::string>();
          for (const auto& [name, dtype, shape] : t[1].cast<Descs>()) {
            s.tensors.push_back({name, dtype, shape});
          }
          s.required = t[2].cast<bool>();
          s.live_groups = t[3].cast<std::vector<int64_t>>();
          s.saved_groups = t[4].cast<std::vector<int64_t>>();
          states.push_back(std::move(s));
        }
        std::vector<TensorDesc> got;
        for (const auto& [name, dtype, shape] : saved) got.push_back({name, dtype, shape});
        Check(CheckStateFits(where, step, dir, saved_keys, states, got));
      },
      py::arg("where"), py::arg("step"), py::arg("dir"), py::arg("saved_keys"), py::arg("live"),
      py::arg("saved"),
      "restore()'s check of the live state against a checkpoint (engine/checkpointer_args.h "
      "CheckStateFits): `live` as (key, [(name, dtype, shape)], required, live group sizes, "
      "saved group sizes), `saved` the checkpoint's (name, dtype, shape); "
      "CheckpointMismatchError for the first misfit.");
  m.def(
      "check_option_names",
      [](const std::string& who, const std::vector<std::string>& given,
         const std::vector<std::string>& known, const std::vector<std::string>& own) {
        Check(CheckOptionNames(who, given, known, own));
      },
      py::arg("who"), py::arg("given"), py::arg("known"), py::arg("own"),
      "An integration's Checkpointer keywords (`given`): none in `own`, each in `known` "
      "(engine/checkpointer_args.h CheckOptionNames); CheckpointMismatchError naming the "
      "closest known one otherwise.");
}

}  // namespace nonstop::py_bindings
