// nonstop._core.restore: the one restore path (include/nonstop/restore.h) for
// Python. Thin: RestoreFromJobDir runs with the GIL released; it takes the GIL
// only to call the Python `prepare` (checks a selected checkpoint against the
// live objects and says where each tensor goes) and `progress` callbacks.
// The safetensors exports (include/nonstop/export.h) likewise.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

#include "engine/job_view.h"
#include "engine/memory_tier.h"
#include "nonstop/copy_engine.h"
#include "nonstop/export.h"
#include "nonstop/jobdir.h"
#include "nonstop/restore.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

// A Python exception raised inside a callback, kept until the GIL-released
// call returns, then raised again as it was.
struct PendingError {
  std::optional<py::error_already_set> error;
};

py::dict StatsDict(const RestoreStats& s) {
  py::dict d;
  d["data_bytes"] = s.data_bytes;
  d["tensor_bytes"] = s.tensor_bytes;
  d["direct_bytes"] = s.direct_bytes;
  d["pieces"] = s.pieces;
  d["odirect_bytes"] = s.odirect_bytes;
  d["retried_pieces"] = s.retried_pieces;
  d["read_s"] = s.seconds;
  d["threads"] = s.threads;
  d["h2d_bytes"] = s.h2d_bytes;
  d["h2d_wait_s"] = s.h2d_wait_s;
  return d;
}

// Destinations from Python, in table order: (pointer, nbytes) in host
// memory, or (pointer, nbytes, device index, stream) in CUDA memory of that
// device, copied there after the work enqueued on that stream (pointer 0:
// verify only). Checked against the table's sizes.
Result<RestoreDestinations> ParseDestinations(const py::sequence& got, const CheckpointInfo& info,
                                              bool* any_device) {
  if (got.size() != info.tensors.size()) {
    return Status::InvalidArgument("got " + std::to_string(got.size()) + " destinations for " +
                                   std::to_string(info.tensors.size()) + " tensors");
  }
  RestoreDestinations out;
  out.ptrs.assign(got.size(), nullptr);
  for (size_t i = 0; i < got.size(); ++i) {
    const py::sequence d = got[i].cast<py::sequence>();
    if (d.size() != 2 && d.size() != 4) {
      return Status::InvalidArgument("a destination is (pointer, nbytes) or (pointer, nbytes, "
                                     "device, stream)");
    }
    const uintptr_t ptr = d[0].cast<uintptr_t>();
    const uint64_t nbytes = d[1].cast<uint64_t>();
    const TensorSpec& spec = info.tensors[i].spec;
    if (ptr != 0 && nbytes != spec.nbytes) {
      return Status::InvalidArgument("tensor '" + spec.name + "' holds " +
                                     std::to_string(spec.nbytes) + " bytes, its destination " +
                                     std::to_string(nbytes));
    }
    out.ptrs[i] = reinterpret_cast<void*>(ptr);
    if (d.size() == 4 && ptr != 0) {
      if (out.devices.empty()) out.devices.resize(got.size());
      out.devices[i] = Device{DeviceKind::kCuda, d[2].cast<int>(), d[3].cast<uintptr_t>()};
      *any_device = true;
    }
  }
  return out;
}

// The copy engine for device destinations (made once per restore call that
// has some): the CUDA engine, or an error saying why there is none.
Status DeviceCopyEngine(int threads, std::unique_ptr<CopyEngine>* engine) {
  if (*engine) return Status::OK();
  std::string note;
  std::unique_ptr<CopyEngine> e = MakeBestCopyEngine(std::max(1, threads), &note);
  if (!e->CanCopyToDevice(Device{DeviceKind::kCuda, 0, 0})) {
    return Status::Unavailable("a destination is in CUDA memory and " + e->Describe() +
                               " cannot copy into it" + (note.empty() ? "" : " (" + note + ")"));
  }
  *engine = std::move(e);
  return Status::OK();
}

}  // namespace

py::dict ReadIntoDestinations(SlotFile& file, const CheckpointInfo& info, const py::sequence& dst,
                              std::optional<int> threads, const std::string& where) {
  bool any_device = false;
  Result<RestoreDestinations> d = ParseDestinations(dst, info, &any_device);
  if (!d.ok()) throw StatusError(Status(d.status().code(), "read_into " + d.status().message()));
  RestoreOptions opts;
  opts.threads = std::max(1, threads.value_or(RestoreOptionsFromEnv().threads));
  opts.dst_devices = d->devices;
  RestoreStats st;
  Status s;
  {
    py::gil_scoped_release release;
    std::unique_ptr<CopyEngine> copy;
    if (any_device) s = DeviceCopyEngine(opts.threads, &copy);
    opts.copy = copy.get();
    if (s.ok()) s = ReadCheckpointInto(file, info, d->ptrs, opts, &st);
  }
  if (!s.ok()) throw StatusError(s.Annotate(where));
  return StatsDict(st);
}

namespace {

// restore(path, rank, prepare, step=None, include_keep=True, threads=None,
//         progress=None, exclude=[], direct=None) -> dict or None (no checkpoint)
//   threads, direct: None takes them from the environment (RestoreOptionsFromEnv).
//   exclude: counters the caller found unusable (skipped as damaged).
//   prepare(info: dict) -> [(ptr, nbytes), ...] in info["tensors"] order
//     (ptr 0: verify that tensor, keep nothing; (ptr, nbytes, device, stream):
//     in CUDA memory, copied there through pinned buffers), or a str: this checkpoint
//     is malformed (the str says why), try the next older one. An exception
//     stops the restore and is raised as it is.
//   progress(done_bytes, total_bytes) -> falsy to cancel (None goes on).
//   direct: read what is not in the page cache with O_DIRECT (RestoreOptions).
//   With `step`: CheckpointNotFoundError names the steps there are
//   (StepNotFound), and CorruptCheckpointError says that step is damaged.
//   memory: the memory tier's segment first (engine/memory_tier.h), when it
//     verifies and the planner puts one of its checkpoints first
//     (RestoreFromSlotFile); else, or when none of them reads back intact,
//     the job directory into the same destinations: "from" says which, and
//     "memory_unused_because" why not the segment.
py::object Restore(const std::string& path, int rank, const py::function& prepare,
                   std::optional<int64_t> step, bool include_keep, std::optional<int> threads,
                   const py::object& progress, const std::vector<uint64_t>& exclude,
                   std::optional<bool> direct, bool memory) {
  std::unique_ptr<JobDir> jd;
  {
    py::gil_scoped_release release;
    jd = Take(JobDir::OpenForRead(path));
  }
  PendingError pending;
  // The copy engine for CUDA destinations, made at the first checkpoint that has some.
  std::unique_ptr<CopyEngine> copy;
  // NONSTOP_RESTORE_THREADS/_DIRECT/_QUEUE where the caller gives no threads/direct.
  RestoreOptions opts = RestoreOptionsFromEnv();
  bool in_memory = false;
  RestorePrepareDevices prep = [&](const Selected& s) -> Result<RestoreDestinations> {
    bool any_device = false;
    std::optional<Result<RestoreDestinations>> dst;
    {
      py::gil_scoped_acquire gil;
      try {
        py::dict info = InfoDict(s.info);
        info["where"] = s.location.where;
        info["keep"] = s.location.keep;
        info["memory"] = in_memory;  // the memory tier's segment (memory=True), not the disk
        py::object answer = prepare(info);
        if (py::isinstance<py::str>(answer)) return Status::Corruption(answer.cast<std::string>());
        dst.emplace(ParseDestinations(answer.cast<py::sequence>(), s.info, &any_device));
        if (!dst->ok()) {
          return Status(dst->status().code(), "prepare " + dst->status().message());
        }
      } catch (py::error_already_set& e) {
        pending.error = std::move(e);
        return Status::Aborted("restore stopped by its prepare callback");
      }
    }
    if (any_device) {
      NONSTOP_RETURN_IF_ERROR(DeviceCopyEngine(opts.threads, &copy));
      opts.copy = copy.get();
    }
    return std::move(*dst);
  };
  if (threads) opts.threads = *threads;
  if (direct) opts.direct = *direct;
  if (!progress.is_none()) {
    opts.progress = [&](uint64_t done, uint64_t total) -> bool {
      py::gil_scoped_acquire gil;
      try {
        py::object r = progress(done, total);
        return r.is_none() || r.cast<bool>();
      } catch (py::error_already_set& e) {  // KeyboardInterrupt during a long restore
        if (!pending.error) pending.error = std::move(e);
        return false;
      }
    };
  }
  SelectOptions so;
  so.step = step;
  so.include_keep = include_keep;
  so.exclude = exclude;
  std::optional<Result<RestoreResult>> r;
  std::string unused;  // why the memory tier's segment was not restored
  bool from_memory = false;
  {
    py::gil_scoped_release release;
    if (memory) {
      Result<std::optional<MemorySegment>> seg =
          OpenMemorySegment(path, rank, "", nullptr, nullptr, &unused);
      if (!seg.ok()) unused = seg.status().ToString();
      if (seg.ok() && seg->has_value()) {
        MemorySegment& m = **seg;
        Result<LineageRecord> lineage = jd->ReadLineage(rank);
        if (!lineage.ok()) {
          r.emplace(lineage.status());
        } else {
          in_memory = true;
          r.emplace(RestoreFromSlotFile(
              *m.file, m.path, m.report, *lineage, exclude,
              [&](const Selected& s) -> Result<RestoreDestinations> {
                std::string bad = BadTensorName(s.info);
                if (!bad.empty()) return Status::Corruption(bad);
                return prep(s);
              },
              opts));
          in_memory = false;
        }
        if (r->ok() && !(*r)->chosen) {  // none of its checkpoints: the disk, into the same memory
          for (const std::string& line : (*r)->skipped) unused += (unused.empty() ? "" : "; ") + line;
          r.reset();
        }
      }
    }
    from_memory = r.has_value();
    if (!r) r.emplace(RestoreFromJobDir(*jd, rank, so, prep, opts));
  }
  if (pending.error) throw std::move(*pending.error);
  if (!r->ok() && step) {  // restore(step=): the steps there are, or that step's damage
    const Status& st = r->status();
    if (st.code() == StatusCode::kNotFound) {
      py::gil_scoped_release release;
      r.emplace(StepNotFound(path, rank, *step));  // engine/job_view.h
    } else if (st.code() == StatusCode::kCorruption &&
               st.message().find("is damaged") == std::string::npos) {
      r.emplace(Status::Corruption("checkpoint at step " + std::to_string(*step) + " in " + path +
                                   " is damaged: " + st.message()));
    }
  }
  RestoreResult res = Take(std::move(*r));
  if (!res.chosen) return py::none();
  // The tensors and metadata went to prepare(); the result says which one won.
  py::dict d;
  d["from"] = from_memory ? "memory" : "disk";
  d["counter"] = res.chosen->info.counter;
  d["step"] = res.chosen->info.step;
  d["data_bytes"] = res.chosen->info.data_bytes;
  d["where"] = res.chosen->location.where;
  d["keep"] = res.chosen->location.keep;
  d["skipped"] = res.skipped;
  d["fallback"] = res.fallback;
  d["attempts"] = res.attempts;
  d["restore_s"] = res.seconds;
  d["stats"] = StatsDict(res.stats);
  d["memory_unused_because"] = LossyStr(unused);
  return d;
}

// A Python progress(done, total) for an export, called with the GIL taken;
// an exception it raises cancels the export and is raised again after it.
std::function<bool(uint64_t, uint64_t)> ExportProgress(const py::object& progress,
                                                       PendingError* pending) {
  if (progress.is_none()) return nullptr;
  return [&progress, pending](uint64_t done, uint64_t total) -> bool {
    py::gil_scoped_acquire gil;
    try {
      py::object r = progress(done, total);
      return r.is_none() || r.cast<bool>();
    } catch (py::error_already_set& e) {  // KeyboardInterrupt during a long export
      if (!pending->error) pending->error = std::move(e);
      return false;
    }
  };
}

// export_safetensors(dir, out, step=None, rank=0, include=[], include_text="--include",
//     strip="", window_bytes=256 MiB, threads=None (NONSTOP_RESTORE_THREADS, else 4),
//     progress=None, remove_temp_link=True)
//   -> dict(world_size, step, counter, tensors, bytes, notes); world_size > 1:
//   nothing written (a multi-rank job is exported consolidated, by Python).
py::dict ExportSafetensorsPy(const std::string& dir, const std::string& out,
                             std::optional<int64_t> step, int rank,
                             const std::vector<std::string>& include,
                             const std::string& include_text, const std::string& strip,
                             uint64_t window_bytes, std::optional<int> threads,
                             const py::object& progress,
                             bool remove_temp_link) {
  ExportRequest req;
  req.dir = dir;
  req.rank = rank;
  req.step = step;
  req.include = include;
  req.include_text = include_text;
  req.strip = strip;
  req.window_bytes = window_bytes;
  req.threads = threads.value_or(RestoreOptionsFromEnv().threads);
  PendingError pending;
  SafetensorsTarget target;
  target.path = out;
  target.remove_temp_link = remove_temp_link;
  target.progress = ExportProgress(progress, &pending);
  std::optional<Result<ExportResult>> r;
  {
    py::gil_scoped_release release;
    r.emplace(ExportSafetensors(req, target));
  }
  if (pending.error) throw std::move(*pending.error);
  const ExportResult res = Take(std::move(*r));
  py::dict d;
  d["world_size"] = res.world_size;
  d["step"] = res.step;
  d["counter"] = res.counter;
  d["tensors"] = res.tensors;
  d["bytes"] = res.bytes;
  d["notes"] = res.notes;
  return d;
}

// write_safetensors(out, [(name, dtype code, shape, pointer, nbytes)], [(key, value)],
//     progress=None, remove_temp_link=True) -> tensor bytes written. The
// caller keeps the memory at each pointer alive and unchanged meanwhile.
uint64_t WriteSafetensorsPy(
    const std::string& out,
    const std::vector<std::tuple<std::string, int, std::vector<int64_t>, uintptr_t, uint64_t>>& got,
    const std::vector<std::pair<std::string, std::string>>& meta, const py::object& progress,
    bool remove_temp_link) {
  std::vector<SafetensorsEntry> entries;
  std::vector<const char*> at;
  for (const auto& [name, code, shape, ptr, nbytes] : got) {
    if (code < 0 || code >= kNumDTypes) {
      throw StatusError(Status::InvalidArgument("tensor '" + name + "': dtype code " +
                                                std::to_string(code) + " is not one of nonstop's"));
    }
    entries.push_back(SafetensorsEntry{name, static_cast<DType>(code), shape, nbytes});
    at.push_back(reinterpret_cast<const char*>(ptr));
  }
  PendingError pending;
  SafetensorsTarget target;
  target.path = out;
  target.remove_temp_link = remove_temp_link;
  target.progress = ExportProgress(progress, &pending);
  std::optional<Result<uint64_t>> r;
  {
    py::gil_scoped_release release;
    r.emplace(WriteSafetensors(target, entries, meta, [&](size_t i) -> Result<std::string_view> {
      return std::string_view(at[i], entries[i].nbytes);
    }));
  }
  if (pending.error) throw std::move(*pending.error);
  return Take(std::move(*r));
}

}  // namespace

void InitRestore(py::module_& m) {
  m.def("restore", &Restore, py::arg("path"), py::arg("rank"), py::arg("prepare"),
        py::arg("step") = py::none(), py::arg("include_keep") = true,
        py::arg("threads") = py::none(), py::arg("progress") = py::none(),
        py::arg("exclude") = std::vector<uint64_t>{}, py::arg("direct") = py::none(),
        py::arg("memory") = false);
  m.def("export_safetensors", &ExportSafetensorsPy, py::arg("dir"), py::arg("out"),
        py::arg("step") = py::none(), py::arg("rank") = 0,
        py::arg("include") = std::vector<std::string>{}, py::arg("include_text") = "--include",
        py::arg("strip") = "", py::arg("window_bytes") = uint64_t{256} << 20,
        py::arg("threads") = py::none(), py::arg("progress") = py::none(),
        py::arg("remove_temp_link") = true);
  m.def("export_names", [](const std::vector<std::string>& names,
                           const std::vector<std::string>& include,
                           const std::string& include_text, const std::string& strip,
                           const std::string& what) {
    return Take(ExportNames(names, include, include_text, strip, what));
  });
  m.def(
      "dcp_layout",
      [](const std::vector<std::string>& states, const std::vector<std::string>& shared,
         std::string_view names_json, std::string_view dist_json) {
        std::optional<Result<std::vector<DcpValue>>> r;
        {
          py::gil_scoped_release release;
          r.emplace(DcpLayout(states, shared, names_json, dist_json));
        }
        py::list out;
        for (const DcpValue& v : Take(std::move(*r))) {
          out.append(py::make_tuple(v.key, v.rank, v.whole ? py::object(py::none())
                                                            : py::cast(v.entries), v.zero));
        }
        return out;
      },
      py::arg("states"), py::arg("shared"), py::arg("names_json"), py::arg("dist_json"),
      "[(key, rank or -1 (global), None (whole) or [entries], zero)]: the values of a DCP "
      "export, from each rank's state tree and rank 0's \"names\" and \"dist\" as JSON "
      "(export.h DcpLayout; CorruptCheckpointError, one line, for malformed names).");
  m.def(
      "dcp_rename",
      [](const std::string& key, std::string_view tree_json, std::string_view names_json) {
        std::optional<Result<std::string>> r;
        {
          py::gil_scoped_release release;
          r.emplace(DcpRename(key, tree_json, names_json));
        }
        return Take(std::move(*r));
      },
      py::arg("key"), py::arg("tree_json"), py::arg("names_json"),
      "State `key`'s tree (JSON) under get_state_dict's names, by the metadata's \"names\" "
      "(JSON), as JSON (export.h DcpRename).");
  m.def(
      "check_state_tree",
      [](std::string_view tree_json, const std::vector<std::string>& tensors) {
        Status s;
        {
          py::gil_scoped_release r;
          s = CheckStateTree(tree_json, tensors);
        }
        Check(s);
      },
      py::arg("tree_json"), py::arg("tensors"),
      "A state tree (JSON) before _state.unflatten rebuilds it, `tensors` the names it may "
      "refer to; CorruptCheckpointError, one line, when malformed (export.h CheckStateTree).");
  m.def(
      "dcp_gather_layout",
      [](std::string_view dist_json,
         const std::vector<std::tuple<int, size_t, std::string, uint64_t, uint64_t>>& pieces,
         const std::string& where, int64_t step) {
        std::vector<dist::Piece> p;
        for (const auto& [rank, handle, name, off, nbytes] : pieces) {
          p.push_back({rank, handle, name, off, nbytes});
        }
        std::optional<Result<DcpGather>> r;
        {
          py::gil_scoped_release release;
          r.emplace(DcpGatherLayout(dist_json, p, where, step));
        }
        const DcpGather g = Take(std::move(*r));
        py::list tensors, copies;
        for (const DcpTensor& t : g.tensors) {
          tensors.append(py::make_tuple(t.name, t.shape, static_cast<int>(t.dtype)));
        }
        for (const dist::PieceCopy& c : g.copies) {
          copies.append(py::make_tuple(c.rank, c.handle, c.offset, c.nbytes));
        }
        return py::make_tuple(tensors, copies);
      },
      py::arg("dist_json"), py::arg("pieces"), py::arg("where"), py::arg("step"),
      "The DCP export's global tensors from the metadata's \"dist\" (JSON) and where each "
      "piece goes: pieces [(rank, handle, name, global offset in elements, nbytes)]; returns "
      "([(name, shape, dtype code)] by name, [(rank, handle, byte offset into its tensor, "
      "nbytes)]) (export.h DcpGatherLayout).");
  m.def(
      "state_tree_names",
      [] {
        std::vector<std::string> codes;
        for (int c = 0; c < kNumDTypes; ++c) codes.emplace_back(DTypeName(static_cast<DType>(c)));
        return py::make_tuple(codes, StateTreeDtypes(), StateTreeDevices());
      },
      "(the on-disk dtype names by code, types.h; torch's dtype names and device types a "
      "state tree may name, export.h StateTreeDtypes/StateTreeDevices).");
  m.def(
      "check_saved_state",
      [](const std::string& where, std::string_view state_json,
         const std::vector<std::tuple<std::string, int>>& keys,
         const std::vector<std::string>& tensors) {
        std::vector<StateKey> k;
        for (const auto& [key, kind] : keys) {
          k.push_back({key, py::repr(py::str(key)).cast<std::string>(),
                       static_cast<StateKind>(std::clamp(kind, 0, 3))});
        }
        std::optional<Result<std::vector<std::optional<std::vector<int64_t>>>>> r;
        {
          py::gil_scoped_release release;
          r.emplace(CheckSavedState(where, state_json, k, tensors));
        }
        return Take(std::move(*r));
      },
      py::arg("where"), py::arg("state_json"), py::arg("keys"), py::arg("tensors"),
      "restore()'s check of the metadata's state tree (JSON) before it is rebuilt: `keys` "
      "[(key, kind: 0 any, 1 tensor, 2 state dict, 3 optimizer)], `tensors` the checkpoint's "
      "names; per key the saved optimizer's group sizes (None: not compared); "
      "CorruptCheckpointError, one line (export.h CheckSavedState).");
  m.def(
      "check_rng_record", [](std::string_view record_json) { Check(CheckRngRecord(record_json)); },
      py::arg("record_json"),
      "An RNG record (JSON) before _rng.prepare builds generator states from it; "
      "CorruptCheckpointError, one line, naming the part when malformed (export.h CheckRngRecord).");
  m.def("write_safetensors", &WriteSafetensorsPy, py::arg("out"), py::arg("entries"),
        py::arg("meta"), py::arg("progress") = py::none(), py::arg("remove_temp_link") = true);
}

}  // namespace nonstop::py_bindings
