// nonstop._core.restore: the one restore path (include/nonstop/restore.h) for
// Python. Thin: RestoreFromJobDir runs with the GIL released; it takes the GIL
// only to call the Python `prepare` (checks a selected checkpoint against the
// live objects and says where each tensor goes) and `progress` callbacks.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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
  return d;
}

}  // namespace

py::dict ReadIntoDestinations(SlotFile& file, const CheckpointInfo& info,
                              const std::vector<std::pair<uintptr_t, uint64_t>>& dst,
                              int threads, const std::string& where, uint64_t data_begin,
                              uint64_t data_end) {
  if (dst.size() != info.tensors.size()) {
    throw StatusError(Status::InvalidArgument("read_into got " + std::to_string(dst.size()) +
                                              " destinations for " +
                                              std::to_string(info.tensors.size()) + " tensors"));
  }
  std::vector<void*> ptrs(dst.size(), nullptr);
  for (size_t i = 0; i < dst.size(); ++i) {
    const TensorSpec& spec = info.tensors[i].spec;
    if (dst[i].first != 0 && dst[i].second != spec.nbytes) {
      throw StatusError(Status::InvalidArgument("tensor '" + spec.name + "' holds " +
                                                std::to_string(spec.nbytes) +
                                                " bytes, its destination " +
                                                std::to_string(dst[i].second)));
    }
    ptrs[i] = reinterpret_cast<void*>(dst[i].first);
  }
  RestoreOptions opts;
  opts.threads = std::max(1, threads);
  opts.data_begin = data_begin;
  opts.data_end = data_end;
  RestoreStats st;
  Status s;
  {
    py::gil_scoped_release release;
    s = ReadCheckpointInto(file, info, ptrs, opts, &st);
  }
  if (!s.ok()) throw StatusError(s.Annotate(where));
  return StatsDict(st);
}

namespace {

// restore(path, rank, prepare, step=None, include_keep=True, threads=4,
//         progress=None, exclude=[], direct=True) -> dict or None (no checkpoint)
//   exclude: counters the caller found unusable (skipped as damaged).
//   prepare(info: dict) -> [(ptr, nbytes), ...] in info["tensors"] order
//     (ptr 0: verify that tensor, keep nothing), or a str: this checkpoint
//     is malformed (the str says why), try the next older one. An exception
//     stops the restore and is raised as it is.
//   progress(done_bytes, total_bytes) -> falsy to cancel (None goes on).
//   direct: read what is not in the page cache with O_DIRECT (RestoreOptions).
py::object Restore(const std::string& path, int rank, const py::function& prepare,
                   std::optional<int64_t> step, bool include_keep, int threads,
                   const py::object& progress, const std::vector<uint64_t>& exclude,
                   bool direct) {
  std::unique_ptr<JobDir> jd;
  {
    py::gil_scoped_release release;
    jd = Take(JobDir::OpenForRead(path));
  }
  PendingError pending;
  RestorePrepare prep = [&](const Selected& s) -> Result<std::vector<void*>> {
    py::gil_scoped_acquire gil;
    try {
      py::dict info = InfoDict(s.info);
      info["where"] = s.location.where;
      info["keep"] = s.location.keep;
      py::object answer = prepare(info);
      if (py::isinstance<py::str>(answer)) return Status::Corruption(answer.cast<std::string>());
      py::list got = answer.cast<py::list>();
      if (got.size() != s.info.tensors.size()) {
        return Status::InvalidArgument("prepare gave " + std::to_string(got.size()) +
                                       " destinations for " +
                                       std::to_string(s.info.tensors.size()) + " tensors");
      }
      std::vector<void*> dst(got.size(), nullptr);
      for (size_t i = 0; i < got.size(); ++i) {
        auto [ptr, nbytes] = got[i].cast<std::pair<uintptr_t, uint64_t>>();
        const TensorSpec& spec = s.info.tensors[i].spec;
        if (ptr != 0 && nbytes != spec.nbytes) {
          return Status::InvalidArgument("tensor '" + spec.name + "' holds " +
                                         std::to_string(spec.nbytes) + " bytes, its destination " +
                                         std::to_string(nbytes));
        }
        dst[i] = reinterpret_cast<void*>(ptr);
      }
      return dst;
    } catch (py::error_already_set& e) {
      pending.error = std::move(e);
      return Status::Aborted("restore stopped by its prepare callback");
    }
  };
  RestoreOptions opts;
  opts.threads = threads;
  opts.direct = direct;
  // NONSTOP_RESTORE_QUEUE: O_DIRECT reads in flight (RestoreOptions::queue_depth),
  // for comparisons; 1 per thread is the old one-read-per-thread path.
  if (const char* q = std::getenv("NONSTOP_RESTORE_QUEUE")) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(q, &end, 10);
    if (end != q && *end == '\0' && v >= 1 && v <= 1024) opts.queue_depth = static_cast<unsigned>(v);
  }
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
  {
    py::gil_scoped_release release;
    r.emplace(RestoreFromJobDir(*jd, rank, so, prep, opts));
  }
  if (pending.error) throw std::move(*pending.error);
  RestoreResult res = Take(std::move(*r));
  if (!res.chosen) return py::none();
  // The tensors and metadata went to prepare(); the result says which one won.
  py::dict d;
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
  return d;
}

}  // namespace

void InitRestore(py::module_& m) {
  m.def("restore", &Restore, py::arg("path"), py::arg("rank"), py::arg("prepare"),
        py::arg("step") = py::none(), py::arg("include_keep") = true, py::arg("threads") = 4,
        py::arg("progress") = py::none(), py::arg("exclude") = std::vector<uint64_t>{},
        py::arg("direct") = true);
}

}  // namespace nonstop::py_bindings
