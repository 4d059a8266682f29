// What the binding files of nonstop._core share: each defines one Init*
// function that module.cc calls; the Status -> Python error mapping; the
// engine options that Engine and Multistep both take; the param_group parser
// that Multistep and optim.replay both use. Owners: engine/store bindings
// (Python front end), optim bindings (CPU optimizer replay).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/engine.h"
#include "nonstop/jobdir.h"
#include "nonstop/optim.h"
#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop::py_bindings {

void InitEngine(pybind11::module_& m);
void InitOptim(pybind11::module_& m);
void InitMultistep(pybind11::module_& m);  // multistep_bindings.cc (GoCkpt schedule)
void InitRemote(pybind11::module_& m);     // remote_bindings.cc (copy_checkpoint)
void InitJobDir(pybind11::module_& m);     // jobdir_bindings.cc (the job directory)
void InitRestore(pybind11::module_& m);    // restore_bindings.cc (the one restore path)
void InitSchedule(pybind11::module_& m);
void InitPeer(pybind11::module_& m);        // peer_bindings.cc (the peer tier, tier/peer.h)
void InitEnv(pybind11::module_& m);         // env_bindings.cc (the Env seam: Directory)   // schedule_bindings.cc (when a checkpoint is due)

// Carries a non-OK Status to Python, also out of a GIL-released region: the
// translator (RegisterStatusTranslator) raises the class registered for its
// code (nonstop.errors) with its one-line message.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status s) : status_(std::move(s)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

// Registers the StatusError translator and _core.register_errors; module.cc
// calls it before the Init*s. The extension imports no Python module: the
// nonstop package hands it nonstop.errors' classes at import
// (register_errors(BY_STATUS_CODE)); until then a StatusError raises
// RuntimeError with the same one-line message.
void RegisterStatusTranslator(pybind11::module_& m);

// A committed checkpoint's record as a dict (engine_bindings.cc): counter,
// step, slot, sizes, meta_json (bytes) and tensors (name, dtype, shape,
// nbytes, global layout, data_offset); names that are not UTF-8 come out
// with U+FFFD instead of raising. The one shape Engine.restore,
// Reader.checkpoints and JobDir selections share.
pybind11::dict InfoDict(const CheckpointInfo& info);
// "" when every tensor name of `info` is UTF-8, else which one is not (a
// reader falls back past such a checkpoint).
std::string BadTensorName(const CheckpointInfo& info);
// `s` as a str, bytes that are not UTF-8 replaced by U+FFFD.
pybind11::str LossyStr(const std::string& s);
// The memory tier's keys of an engine's stats (memory_tier, memory_counter, ...).
void AddMemoryTierStats(pybind11::dict& d, const EngineStats& s);

// Reads every tensor of checkpoint `info` of `file` into `dst` (one (pointer,
// nbytes) per tensor in table order; pointer 0: verified, not kept;
// (pointer, nbytes, device, stream): in CUDA memory, through the copy
// engine's pinned buffers, RestoreOptions::dst_devices) through
// the one restore path (ReadCheckpointInto) with the GIL released; a
// destination whose nbytes differs from its tensor's is refused before any
// read. Returns the read's stats as a dict (data_bytes, tensor_bytes,
// direct_bytes, pieces, read_s, threads, h2d_bytes, h2d_wait_s); errors name `where`
// (restore_bindings.cc). Reader.read_into and JobDir selections' read_into;
// threads None: NONSTOP_RESTORE_THREADS, else 4 (RestoreOptionsFromEnv).
pybind11::dict ReadIntoDestinations(SlotFile& file, const CheckpointInfo& info,
                                    const pybind11::sequence& dst,
                                    std::optional<int> threads, const std::string& where);

// An agreed record (jobdir.h) from/to its dict (jobdir_bindings.cc): step,
// counter, lineage, rank, world_size, unix_s, resharded_from=(dir, world).
AgreedRecord AgreedFromDict(const pybind11::dict& d, int default_rank);
pybind11::dict AgreedToDict(const AgreedRecord& r);

// The StatusCode of a Python exception (an instance), by the classes
// nonstop.errors registered (most specific first), then the builtins:
// FileNotFoundError -> kNotFound, other OSError -> kIOError, anything else
// kInternal. With the GIL held. A Python transport's failures (remote_
// bindings.cc) reach the C++ tier as these codes.
StatusCode StatusCodeOfException(PyObject* exc);

inline void Check(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(r).value();
}

// d[key] as T, or `fallback` when the key is missing or None.
template <typename T>
T DictGet(const pybind11::dict& d, const char* key, T fallback) {
  if (!d.contains(key) || d[key].is_none()) return fallback;
  return d[key].cast<T>();
}

// (counter, step) of a committed checkpoint, as latest() and candidate() return it.
inline std::optional<std::pair<uint64_t, int64_t>> CounterAndStep(
    const std::optional<CommittedCheckpoint>& c) {
  if (!c) return std::nullopt;
  return std::make_pair(c->counter, c->step);
}

// The EngineOptions that nonstop._core.Engine and Multistep both take as
// arguments; `medium` by name (InvalidArgument naming the choices otherwise).
EngineOptions EngineOptionsFromPy(const std::string& dir, uint32_t rank, uint32_t world_size,
                                  int max_in_flight, int writers, uint64_t staging_bytes,
                                  uint64_t chunk_bytes, int copy_threads,
                                  const std::string& medium, uint64_t keep_every);

// cls.def(init, <the arguments of EngineOptionsFromPy but keep_every, with their
// defaults>, extra...): `init` takes those nine first, then its own `extra`.
template <typename Class, typename Init, typename... Extra>
Class& DefInitWithEngineOptions(Class& cls, Init&& init, const Extra&... extra) {
  namespace py = pybind11;
  return cls.def(std::forward<Init>(init), py::arg("dir"), py::arg("rank") = 0,
                 py::arg("world_size") = 1, py::arg("max_in_flight") = 2, py::arg("writers") = 0,
                 py::arg("staging_bytes") = 0, py::arg("chunk_bytes") = 0,
                 py::arg("copy_threads") = 1, py::arg("medium") = "auto", extra...);
}

// The retention that Engine.set_retention and Multistep.set_retention take.
inline RetentionPolicy RetentionFromPy(uint64_t max_to_keep, const std::string& best_metric,
                                       bool best_higher, uint64_t best_k) {
  RetentionPolicy p;
  p.max_to_keep = max_to_keep;
  p.best_metric = best_metric;
  p.best_higher = best_higher;
  p.best_k = best_k;
  return p;
}

// The hyperparameters of one torch param_group dict ('lr', 'betas', 'eps',
// 'weight_decay', 'momentum', 'dampening', 'nesterov', 'maximize'); missing
// or None keys keep StepHyperparameters' defaults, other keys are ignored.
optim::StepHyperparameters HyperparametersFromGroup(const pybind11::dict& group);

}  // namespace nonstop::py_bindings
