// A checkpoint as one safetensors file: the single-rank export of `nonstop
// export` and nonstop.export (docs/PYTHON.md "Inspecting and exporting"), in
// one place, and the file writer that a multi-rank job's consolidated export
// (Python: python/nonstop/_export.py, which reassembles the shares with
// torch) uses too.
//
// The safetensors layout: 8 bytes (little-endian) of header length, the
// header (JSON: each tensor's dtype, shape and data_offsets, in order, then
// "__metadata__", string to string), spaces up to a multiple of 8, then the
// tensors' bytes back to back.
//
// Python (src/python/restore_bindings.cc, module nonstop._core):
//   export_safetensors(dir, out, step=None, rank=0, include=[], include_text="--include",
//       strip="", window_bytes=256 MiB, threads=4, progress=None, remove_temp_link=True)
//       -> dict(world_size, step, counter, tensors, bytes, notes)
//   export_names(names, include, include_text, strip, what) -> [(name, index)]
//   write_safetensors(out, [(name, dtype code, shape, pointer, nbytes)], meta,
//       progress=None, remove_temp_link=True) -> bytes written
// Both run with the GIL released; progress(done, total) takes it per call.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nonstop/dist.h"
#include "nonstop/env.h"
#include "nonstop/status.h"
#include "nonstop/types.h"

namespace nonstop {

// One tensor of a safetensors file.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
};

// Where a safetensors file goes, and how.
struct SafetensorsTarget {
  std::string path;  // OUT, as the caller named it (messages name it, never OUT.tmp)
  // Something other than a regular file at OUT.tmp (a symlink planted there):
  // true removes it (unlink never follows a link; the Python front end),
  // false refuses to write (InvalidArgument naming OUT.tmp; the CLI). A
  // regular file there (an interrupted export) is removed either way.
  bool remove_temp_link = false;
  // (bytes written, bytes in all) at most every 0.1 s and once at the end;
  // false cancels (Aborted, OUT.tmp removed).
  std::function<bool(uint64_t done, uint64_t total)> progress;
  Env* env = nullptr;  // null: DefaultEnv()
};

// The bytes of entry `i` (called once per entry with bytes, in order); the
// view stays valid until the next call.
using SafetensorsSource = std::function<Result<std::string_view>(size_t i)>;

// Writes the safetensors file of `entries` (names as given) and `meta`, the
// bytes from `source`, through the Env: OUT.tmp is created O_EXCL|O_NOFOLLOW
// relative to the fd of OUT's directory, written, synced, renamed over OUT,
// and the directory synced; any failure removes OUT.tmp. Returns the bytes of
// tensor data. Errors: InvalidArgument for a name two entries share (or
// "__metadata__"), a dtype safetensors cannot hold (complex128), an OUT that
// names no file; IOError "cannot export to OUT: ..." for the output; the
// source's errors as they are.
Result<uint64_t> WriteSafetensors(const SafetensorsTarget& target,
                                  const std::vector<SafetensorsEntry>& entries,
                                  const std::vector<std::pair<std::string, std::string>>& meta,
                                  const SafetensorsSource& source);

// The names an export writes, of `names` in order: those matching a glob of
// `include` (fnmatch, '*' matches '/' too; all when it is empty), with the
// prefix `strip` removed where they start with it: (name, index in `names`).
// None matching is InvalidArgument naming `what` and `include_text`.
Result<std::vector<std::pair<std::string, size_t>>> ExportNames(
    const std::vector<std::string>& names, const std::vector<std::string>& include,
    const std::string& include_text, const std::string& strip, const std::string& what);

// The "names" of a checkpoint's metadata (the Python front end's parameter
// names, python/nonstop/_unwrap.py), as JSON text, checked before the DCP export
// renames by them (it comes from the file): null, or an object whose
// "modules" (when present) maps names to prefix strings and whose
// "optimizers" (when present) maps names to {"module": str, "params": [str]}.
// Else Corruption "checkpoint metadata 'names' is malformed: WHY", one line.
Status CheckExportNames(std::string_view names_json);

// A checkpoint's state tree (its metadata's "state", or a part of it, as
// JSON text; python/nonstop/_state.py flatten writes it), checked before the
// Python front end rebuilds it (unflatten, which then trusts it): each
// one-key "__...__" object is a known tag, well formed, decoded from fixed
// lists only: "__tensor__"/"__ndarray__" name one of `tensors`, "__float__"
// is 16 hex digits, "__tuple__" a list, "__dict__" a list of [key, value]
// pairs whose keys are hashable in Python, "__npscalar__" [numpy numeric
// dtype string, number], "__dtype__" one of torch's dtype names,
// "__device__" one of torch's device types with an optional index. Else
// Corruption "malformed checkpoint metadata: state[...]: WHY", one line.
Status CheckStateTree(std::string_view tree_json, const std::vector<std::string>& tensors);

// The fixed lists CheckStateTree decodes those tags from, which the Python
// front end's flatten checks a live dtype or device against too
// (python/nonstop/_state.py takes them from here): torch's dtype names and
// device types.
std::vector<std::string> StateTreeDtypes();
std::vector<std::string> StateTreeDevices();

// What restore() needs of a value: anything, a tensor, a dict (a stateful
// object's state dict), an optimizer's state dict.
enum class StateKind { kAny, kTensor, kStateDict, kOptimizer };
struct StateKey {
  std::string key;
  std::string key_repr;  // as Python prints it
  StateKind kind = StateKind::kAny;
};

// restore()'s check of a checkpoint's state tree before anything of it is
// rebuilt (python/nonstop/_apply.py prepare): `state_json` (the metadata's
// "state", JSON text) is an object, and the tree of each of `keys` it holds
// is well formed (CheckStateTree against `tensors`, the checkpoint's tensor
// names, once for all keys: _state.rebuild then trusts it) and, in `keys`'
// order, of its kind: a tensor; a dict; an optimizer's state dict ("state"
// a dict, "param_groups" a list of dicts each with a "params" list) unless
// it is a ZeRO optimizer's consolidated one. Returns per key of `keys` the
// saved parameter group sizes of a kOptimizer's (nullopt for any other: not
// compared). Else Corruption "WHERE: ...", one line naming the key.
Result<std::vector<std::optional<std::vector<int64_t>>>> CheckSavedState(
    const std::string& where, std::string_view state_json, const std::vector<StateKey>& keys,
    const std::vector<std::string>& tensors);

// A checkpoint's RNG record (its metadata's "rng", JSON text;
// python/nonstop/_rng.py capture writes it), checked before restore builds
// a generator state from it: an object whose parts, each optional, are
// "random" {"t": [3, {"t": [625 integers < 2^32, the last <= 624]}, null or a
// number]} (Python's random.getstate, tuples as {"t": [...]}), "numpy"
// ["MT19937", [624 integers < 2^32], position 0..624, has_gauss 0 or 1, a
// number], "torch" a hex string and "cuda" a list of hex strings (each not empty, at
// most 1 MiB of text; torch checks its own states' sizes). Else Corruption "RNG
// record 'PART' is malformed: WHY" (or "RNG record is a T, not a dict"), one line.
Status CheckRngRecord(std::string_view record_json);

// State `key`'s tree (JSON text: a value DcpLayout places, or a
// ZeroRedundancyOptimizer's consolidated tree) under get_state_dict's names,
// from the metadata's "names" (`names_json`, as CheckExportNames checks it),
// as JSON text: a module's dict (names "modules"[key] a prefix) with that
// prefix removed from its keys; an optimizer's ("optimizers"[key]) "state"
// keyed and its "param_groups"' "params" listed by parameter name, when
// those indices are exactly 0..len(params)-1 (else it is not the optimizer
// the names were taken from); any other value as it is. A dict is written
// as a plain object, or {"__dict__": pairs} where a key is not a string or
// starts with "__" (python/nonstop/_state.py). Corruption on malformed JSON.
Result<std::string> DcpRename(const std::string& key, std::string_view tree_json,
                              std::string_view names_json);

// The global tensors of a multi-rank job's DCP export (python/nonstop/_dcp.py
// gather), from rank 0's metadata "dist" document (`dist_json`): its
// "shared" table ({name: [shape, dtype]}, replicated tensors) and its
// "dtensor" table ({name: [shape, dtype, placement]}, FSDP2's: each rank
// wrote its Shard(0) rows with a replicated share's global layout, so they
// reassemble the same way; a name in both is "shared"'s), by name; and where
// each of `pieces` (every rank's tensor table) goes: `offset` bytes into its
// tensor (dist::LayOutShared, complete). Corruption "WHERE: ...", one line,
// for tables of another form, a dtype not one nonstop writes ("the metadata
// of tensor 'N' names dtype ..."), and LayOutShared's refusals (a piece
// outside its tensor, pieces that overlap or leave a gap, a size out of
// range), before anything is allocated.
struct DcpTensor {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kUInt8;
};
struct DcpGather {
  std::vector<DcpTensor> tensors;
  std::vector<dist::PieceCopy> copies;  // offset: into the piece's tensor
};
Result<DcpGather> DcpGatherLayout(std::string_view dist_json,
                                  const std::vector<dist::Piece>& pieces,
                                  const std::string& where, int64_t step);

// One value of a DCP export in get_state_dict's layout (python/nonstop/_dcp.py
// layout(), docs/DISTRIBUTED.md "Interop with DCP"): state `key` of rank
// `rank`'s tree (-1: rank 0's, a global value; else under "rank-R"), whole
// or only its `entries`; `zero`: the ZeroRedundancyOptimizer consolidated
// from every rank's shard.
struct DcpValue {
  std::string key;
  int rank = -1;
  bool whole = true;
  std::vector<std::string> entries;  // when !whole
  bool zero = false;
};
// The values of the DCP export of a job of states.size() ranks, in the order
// of rank 0's state keys. `states`: each rank's "state" tree (JSON text;
// Corruption when one does not parse or is no object); `shared`: the names
// of the global tensors; `names_json`: rank 0's metadata "names" (checked
// first, CheckExportNames), whose "modules" are the keys that are a module's
// state_dict; `dist_json`: rank 0's metadata "dist", whose "zero" (an
// object) has a ZeroRedundancyOptimizer's keys (more than one rank only). In
// a multi-rank job a value referring to a tensor not in `shared` is
// rank-local: a module's entries that do are each rank's (the others one
// global value), any other value is each rank's whole.
Result<std::vector<DcpValue>> DcpLayout(const std::vector<std::string>& states,
                                        const std::vector<std::string>& shared,
                                        std::string_view names_json, std::string_view dist_json);

struct ExportRequest {
  std::string dir;                   // the job directory
  int rank = 0;
  std::optional<int64_t> step;       // nullopt: what recovery would load
  std::vector<std::string> include;  // fnmatch globs over the names; empty: every tensor
  std::string include_text = "--include";  // how the messages name `include`
  std::string strip;                 // a prefix removed from the names that start with it
  uint64_t window_bytes = 256ull << 20;  // stored tensor bytes read (and held) at a time
  int threads = 4;                   // reader threads (RestoreOptions::threads)
};

struct ExportResult {
  int world_size = 1;     // > 1: nothing was written; a multi-rank job is exported
                          // consolidated (Python's reassembly)
  int64_t step = 0;
  uint64_t counter = 0;
  uint64_t tensors = 0;   // names written (a tied weight under each of its names)
  uint64_t bytes = 0;     // tensor bytes written
  std::vector<std::string> notes;  // damage the slot file's open worked around (salvaged)
};

// Exports rank `rank`'s checkpoint of `req.dir`: the one the planner chooses
// (JobDir::Select: newest committed, not abandoned, verified; of req.step when
// given), refused when its metadata says restore() must replay its optimizer
// (mode='multistep' with replay='torch'). Every stored tensor under its name,
// then each tied weight's other names from the metadata's state tree (the
// bytes again, so a strict load_state_dict finds every name); `include`
// filters them (none matching: InvalidArgument), `strip` shortens them. The
// data is read through ReadCheckpointInto (every crc chunk verified) about
// window_bytes at a time, in parallel; memory stays bounded by the window or
// the largest tensor. "__metadata__": nonstop.step, nonstop.counter and
// nonstop.meta (the checkpoint's metadata). Written by WriteSafetensors.
Result<ExportResult> ExportSafetensors(const ExportRequest& req, const SafetensorsTarget& target);

}  // namespace nonstop
