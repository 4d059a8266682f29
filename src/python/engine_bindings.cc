// Bindings of nonstop::Engine (the write side) and of a job directory's slot
// file (the read side: scan, read tensors). A thin layer: it converts types,
// releases the GIL around every call that may block, and turns a non-OK
// Status into the nonstop.errors class for its code, with its one-line
// message. Tensors arrive as plain numbers (data pointer, byte count, dtype
// code, shape, device, stream): this module never sees torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/commit_watch.h"
#include "engine/memory_tier.h"
#include "engine/preempt.h"
#include "nonstop/engine.h"
#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/plan.h"
#include "nonstop/restore.h"
#include "nonstop/status.h"
#include "nonstop/store.h"
#include "nonstop/types.h"
#include "nonstop/jobdir.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

// (name, dtype code, shape, nbytes, data_ptr, device kind, device index,
//  stream, copy_at_checkpoint)
using PyTensorRef = std::tuple<std::string, int, std::vector<int64_t>, uint64_t, uintptr_t, int,
                               int, uintptr_t, bool>;

// (global_shape, global_offset) of a rank's piece of a tensor.
using PyLayout = std::tuple<std::vector<int64_t>, uint64_t>;

TensorRef ToTensorRef(const PyTensorRef& t) {
  const auto& [name, dtype, shape, nbytes, ptr, dev_kind, dev_index, stream, copy_now] = t;
  if (dtype < 0 || dtype >= kNumDTypes) {
    throw StatusError(Status::InvalidArgument("tensor '" + name + "': unknown dtype code " +
                                              std::to_string(dtype)));
  }
  TensorRef r;
  r.spec.name = name;
  r.spec.dtype = static_cast<DType>(dtype);
  r.spec.shape = shape;
  r.spec.nbytes = nbytes;
  r.data = reinterpret_cast<const void*>(ptr);
  r.device.kind = dev_kind == 1 ? DeviceKind::kCuda : DeviceKind::kHost;
  r.device.index = dev_index;
  r.device.stream = stream;
  r.copy_at_checkpoint = copy_now;
  return r;
}

// Whether `s` is well-formed UTF-8 (no overlong forms, no surrogates, at
// most U+10FFFF): what Python can decode into a str.
bool IsUtf8(const std::string& s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

}  // namespace

// A str from bytes that may not be UTF-8 (a damaged or hostile file's names
// inside a message): invalid bytes become U+FFFD instead of an exception.
py::str LossyStr(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

py::dict TensorDict(const TensorEntry& e) {
  py::dict d;
  d["name"] = LossyStr(e.spec.name);
  d["dtype"] = static_cast<int>(e.spec.dtype);
  d["shape"] = e.spec.shape;
  d["nbytes"] = e.spec.nbytes;
  d["global_shape"] = e.spec.global.global_shape;
  d["global_offset"] = e.spec.global.global_offset;
  d["data_offset"] = e.data_offset;
  return d;
}

std::string BadTensorName(const CheckpointInfo& info) {
  for (size_t i = 0; i < info.tensors.size(); ++i) {
    if (!IsUtf8(info.tensors[i].spec.name)) {
      return "tensor #" + std::to_string(i) + "'s name is not valid UTF-8";
    }
  }
  return "";
}

py::dict InfoDict(const CheckpointInfo& info) {
  py::dict d;
  d["counter"] = info.counter;
  d["step"] = info.step;
  d["sequence"] = info.sequence;
  d["slot"] = info.slot;
  d["rank"] = info.rank;
  d["world_size"] = info.world_size;
  d["commit_unix_ns"] = info.commit_unix_ns;
  d["data_offset"] = info.data_offset;
  d["data_bytes"] = info.data_bytes;
  d["meta_json"] = py::bytes(info.meta_json);
  py::list tensors;
  for (const auto& e : info.tensors) tensors.append(TensorDict(e));
  d["tensors"] = tensors;
  return d;
}

// The memory tier's part of the engine's stats (engine and Multistep).
void AddMemoryTierStats(py::dict& d, const EngineStats& s) {
  d["memory_tier"] = s.memory_tier;
  d["memory_segment"] = s.memory_segment;
  d["memory_mirrored"] = s.memory_mirrored;
  d["memory_skipped"] = s.memory_skipped;
  d["memory_swept"] = s.memory_swept;
  d["memory_counter"] = s.memory_counter;
  d["memory_failures"] = s.memory_failures;
  d["memory_error"] = LossyStr(s.memory_error);
  d["restored_from_memory"] = s.restored_from_memory;
  // The tiered cadence (EngineOptions::disk_every).
  d["disk_every"] = s.disk_every;
  d["persisted"] = s.persisted;
  d["persisted_counter"] = s.persisted_counter;
  d["persist_failures"] = s.persist_failures;
  d["persist_s_total"] = s.persist_s_total;
  d["persist_error"] = LossyStr(s.persist_error);
}

namespace {

py::dict CheckpointStatsDict(const CheckpointStats& c) {
  py::dict d;
  d["counter"] = c.counter;
  d["step"] = c.step;
  d["bytes"] = c.bytes;
  d["stall_s"] = c.stall_s;
  d["copy_s"] = c.copy_s;
  d["persist_s"] = c.persist_s;
  d["write_GBps"] = c.write_GBps;
  d["committed"] = c.committed;
  d["tiers"] = c.tiers;  // "disk", "memory" (memory only: lost with the node), "memory+disk"
  d["error"] = c.error;
  d["snapshot_bytes"] = c.snapshot_bytes;
  d["direct_bytes"] = c.direct_bytes;
  d["drain_s"] = c.drain_s;
  return d;
}

py::dict EngineStatsDict(const EngineStats& s) {
  py::dict d;
  d["started"] = s.started;
  d["committed"] = s.committed;
  d["failed"] = s.failed;
  d["superseded"] = s.superseded;
  d["abandoned"] = s.abandoned;
  d["in_flight"] = s.in_flight;
  d["stall_s_total"] = s.stall_s_total;
  d["staging_wait_s_total"] = s.staging_wait_s_total;
  d["staging_alloc_waits"] = s.staging_alloc_waits;
  d["staging_alloc_wait_s"] = s.staging_alloc_wait_s;
  d["staging_prepared_bytes"] = s.staging_prepared_bytes;
  d["slot_file_prepared_bytes"] = s.slot_file_prepared_bytes;
  d["slot_file_wait_s"] = s.slot_file_wait_s;
  d["staging_bytes"] = s.staging_bytes;
  d["chunk_bytes"] = s.chunk_bytes;
  d["writers"] = s.writers;
  d["max_in_flight"] = s.max_in_flight;
  d["medium"] = s.medium;
  d["copy_engine"] = s.copy_engine;
  d["layer_copy"] = s.layer_copy;
  AddMemoryTierStats(d, s);
  d["restore_s"] = s.restore_s;
  d["restore_read_s"] = s.restore_read_s;
  d["restore_h2d_wait_s"] = s.restore_h2d_wait_s;
  d["restore_h2d_bytes"] = s.restore_h2d_bytes;
  d["device_snapshot_capacity"] = s.device_snapshot_capacity;
  d["snapshot_bytes_total"] = s.snapshot_bytes_total;
  d["direct_bytes_total"] = s.direct_bytes_total;
  d["drain_s_total"] = s.drain_s_total;
  d["snapshot_busy"] = s.snapshot_busy;
  d["device_snapshot_note"] = s.device_snapshot_note;
  py::list recent;
  for (const auto& c : s.recent) recent.append(CheckpointStatsDict(c));
  d["recent"] = recent;
  return d;
}

// The Engine, owned by Python. Every method that may block releases the GIL.
class PyEngine {
 public:
  explicit PyEngine(const EngineOptions& opts) : pid_(getpid()) {
    py::gil_scoped_release release;
    engine_ = Take(Engine::Open(opts));
  }
  ~PyEngine() {
    if (engine_ && getpid() != pid_) {
      // A forked child: the engine's threads were not copied and its locks
      // may be held by them, so closing would wait forever. Leave it.
      (void)engine_.release();
      return;
    }
    if (engine_) {
      py::gil_scoped_release release;
      (void)engine_->Close();
    }
  }

  // `layouts`, when given, holds per tensor None or (global_shape,
  // global_offset): where this rank's piece lies in the global tensor.
  void Register(const std::vector<PyTensorRef>& refs,
                const std::optional<std::vector<std::optional<PyLayout>>>& layouts) {
    std::vector<TensorRef> tensors;
    tensors.reserve(refs.size());
    for (const auto& r : refs) tensors.push_back(ToTensorRef(r));
    if (layouts) {
      if (layouts->size() != tensors.size()) {
        throw StatusError(Status::InvalidArgument("register: " + std::to_string(layouts->size()) +
                                                  " layouts for " +
                                                  std::to_string(tensors.size()) + " tensors"));
      }
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (!(*layouts)[i]) continue;
        tensors[i].spec.global.global_shape = std::get<0>(*(*layouts)[i]);
        tensors[i].spec.global.global_offset = std::get<1>(*(*layouts)[i]);
      }
    }
    py::gil_scoped_release release;
    Check(Get().Register(std::move(tensors)));
  }
  uint64_t Checkpoint(int64_t step, std::string meta_json) {
    py::gil_scoped_release release;
    return Take(Get().Checkpoint(step, std::move(meta_json)));
  }
  void WaitCopied() {
    py::gil_scoped_release release;
    Check(Get().WaitCopied());
  }
  // Raises the oldest queued background failure (and forgets it); returns
  // None when there is none. Never blocks.
  void PrepareStaging(uint64_t state_bytes) {
    py::gil_scoped_release release;
    Check(Get().PrepareStaging(state_bytes));
  }
  void TakeError() {
    Status s;
    {
      py::gil_scoped_release release;
      s = Get().TakeError();
    }
    Check(s);
  }
  void WaitCommitted(uint64_t counter) {
    py::gil_scoped_release release;
    Check(Get().WaitCommitted(counter));
  }
  // Layer-wise checkpoints (docs/LAYERWISE.md). CopyTensors is called from
  // autograd hooks: it only queues work, but still drops the GIL.
  uint64_t BeginCheckpoint(int64_t step) {
    py::gil_scoped_release release;
    return Take(Get().BeginCheckpoint(step));
  }
  void CopyTensors(uint64_t counter, const std::vector<uint32_t>& tensors) {
    py::gil_scoped_release release;
    Check(Get().CopyTensors(counter, tensors));
  }
  void WaitTensorsCopied(const std::vector<uint32_t>& tensors) {
    py::gil_scoped_release release;
    Check(Get().WaitTensorsCopied(tensors));
  }
  // stream: torch.cuda.current_stream(device).cuda_stream.
  void WaitTensorsCopiedOnStream(const std::vector<uint32_t>& tensors, int device,
                                 uintptr_t stream) {
    py::gil_scoped_release release;
    Check(Get().WaitTensorsCopiedOnStream(tensors, Device{DeviceKind::kCuda, device, stream}));
  }
  void EndCheckpoint(uint64_t counter, int64_t step, std::string meta_json) {
    py::gil_scoped_release release;
    Check(Get().EndCheckpoint(counter, step, std::move(meta_json)));
  }
  std::optional<std::pair<uint64_t, int64_t>> Latest() {
    py::gil_scoped_release release;
    return CounterAndStep(Get().Latest());
  }
  py::dict Restore(std::optional<int64_t> step) {
    Result<CheckpointInfo> r = Status::Internal("unset");
    {
      py::gil_scoped_release release;
      r = Get().Restore(step);
    }
    return InfoDict(Take(std::move(r)));
  }
  void AdoptRestored(uint64_t counter) {
    py::gil_scoped_release release;
    Check(Get().AdoptRestored(counter));
  }
  void SetRetention(uint64_t max_to_keep, const std::string& best_metric, bool best_higher,
                    uint64_t best_k) {
    RetentionPolicy p = RetentionFromPy(max_to_keep, best_metric, best_higher, best_k);
    py::gil_scoped_release release;
    Check(Get().SetRetention(p));
  }
  void DeleteKept(int64_t step) {
    py::gil_scoped_release release;
    Check(Get().DeleteKept(step));
  }
  // A preemption's emergency checkpoint, waited for (engine/preempt.h):
  // (committed on this rank, its record or None, an older failure's line or None).
  py::tuple AwaitEmergency(uint64_t counter, int64_t step) {
    Engine& engine = Get();
    Result<EmergencyOutcome> r = Status::Internal("unset");
    {
      py::gil_scoped_release release;
      r = nonstop::AwaitEmergency(engine, counter, step);
    }
    const EmergencyOutcome o = Take(std::move(r));
    return py::make_tuple(o.committed,
                          o.record ? py::object(CheckpointStatsDict(*o.record)) : py::none(),
                          o.older.empty() ? py::none() : py::object(LossyStr(o.older)));
  }
  int AbandonOlderThan(uint64_t counter) {
    py::gil_scoped_release release;
    return Take(Get().AbandonOlderThan(counter));
  }
  // Distributed mode (docs/DISTRIBUTED.md); called from the agreement thread.
  void Pin(uint64_t counter) {
    py::gil_scoped_release release;
    Check(Get().Pin(counter));
  }
  std::optional<std::pair<uint64_t, int64_t>> Candidate() {
    py::gil_scoped_release release;
    return CounterAndStep(Get().Candidate());
  }
  // The agreed record of this rank, written durably through the engine's
  // job directory (it holds the writer lock).
  void WriteAgreed(const py::dict& d) {
    AgreedRecord r = AgreedFromDict(d, -1);
    py::gil_scoped_release release;
    Check(Get().WriteAgreed(r));
  }
  void DropCandidate(uint64_t counter) {
    py::gil_scoped_release release;
    Check(Get().DropCandidate(counter));
  }
  // (candidate counter or None, candidate step, newest committed step,
  // newest started step), -1 for none: this rank's offer of a round.
  std::tuple<std::optional<uint64_t>, int64_t, int64_t, int64_t> Offer() {
    nonstop::AgreeOffer o;
    {
      py::gil_scoped_release release;
      o = Get().Offer();
    }
    std::optional<uint64_t> counter;
    if (o.candidate >= 0) counter = o.counter;
    return {counter, o.candidate, o.committed, o.started};
  }
  bool Aim(int64_t step) {
    py::gil_scoped_release release;
    return Take(Get().Aim(step));
  }
  py::dict Stats() {
    EngineStats s;
    std::optional<CommittedCheckpoint> latest;
    {
      py::gil_scoped_release release;
      s = Get().Stats();
      latest = Get().Latest();
    }
    py::dict d = EngineStatsDict(s);
    // The newest committed checkpoint and the tiers that hold it: "disk"
    // (with the memory tier's copy or not), or "memory" only (the tiered
    // cadence, not persisted yet: a node loss loses it).
    if (latest) {
      py::dict l;
      l["counter"] = latest->counter;
      l["step"] = latest->step;
      l["on_disk"] = latest->on_disk;
      l["tiers"] = latest->on_disk ? "disk" : "memory";
      d["latest"] = l;
    } else {
      d["latest"] = py::none();
    }
    return d;
  }
  void Close() {
    if (!engine_) return;
    if (getpid() != pid_) {
      (void)engine_.release();  // a forked child: see ~PyEngine
      throw StatusError(Status::FailedPrecondition(
          "this engine belongs to process " + std::to_string(pid_) +
          "; a forked child cannot use or close it"));
    }
    Status s;
    {
      py::gil_scoped_release release;
      s = engine_->Close();
    }
    engine_.reset();
    Check(s);
  }
  bool closed() const { return engine_ == nullptr; }
  std::shared_ptr<CommitWatch> Watch() { return Get().Watch(); }

 private:
  Engine& Get() {
    if (!engine_) throw StatusError(Status::FailedPrecondition("the checkpointer is closed"));
    if (getpid() != pid_) {
      throw StatusError(Status::FailedPrecondition(
          "this engine belongs to process " + std::to_string(pid_) +
          "; a forked child cannot use it: create a new Checkpointer in the child"));
    }
    return *engine_;
  }
  pid_t pid_;
  std::unique_ptr<Engine> engine_;
};

// One rank's slot file, opened for reading: the scan report and tensor reads.
class PyReader {
 public:
  PyReader(const std::string& dir, int rank, bool verify_data) {
    py::gil_scoped_release release;
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      throw StatusError(Status::NotFound("checkpoint directory " + dir + " does not exist"));
    }
    path_ = (fs::path(dir) / SlotFileName(rank)).string();
    if (!fs::exists(path_, ec)) {
      throw StatusError(Status::NotFound("no nonstop checkpoint for rank " + std::to_string(rank) +
                                         " in " + dir + " (no " + SlotFileName(rank) + ")"));
    }
    MediumOptions mopts;
    mopts.read_only = true;  // nonstop.load() and export() read read-only files too
    auto medium = Take(OpenMedium(path_, MediumKind::kBuffered, mopts));
    Result<std::unique_ptr<SlotFile>> file = SlotFile::Open(std::move(medium));
    if (!file.ok()) throw StatusError(file.status().Annotate(path_));
    file_ = std::move(file).value();
    ScanOptions sopts;
    sopts.verify_data = verify_data;
    Result<ScanReport> report = file_->Scan(sopts);
    if (!report.ok()) throw StatusError(report.status().Annotate(path_));
    report_ = std::move(report).value();
    // The job directory's lineage: an abandoned counter is never the newest valid.
    std::unique_ptr<JobDir> jd = Take(JobDir::OpenForRead(dir));
    lineage_ = Take(jd->ReadLineage(rank));
  }

  // A memory-tier segment (memory_tier.h), already opened and verified.
  explicit PyReader(MemorySegment seg)
      : path_(std::move(seg.path)), file_(std::move(seg.file)), report_(std::move(seg.report)) {}

  py::dict Geometry() const {
    const StoreGeometry& g = file_->geometry();
    py::dict d;
    d["slots"] = g.slots;
    d["slot_bytes"] = g.slot_bytes;
    d["rank"] = g.rank;
    d["world_size"] = g.world_size;
    return d;
  }
  // A checkpoint whose tensor names are not UTF-8 is reported damaged (not
  // committed, with its reason), so readers fall back to an older one.
  py::list Checkpoints() const {
    py::list out;
    for (const auto& c : report_.checkpoints) {
      py::dict d = InfoDict(c.info);
      std::string bad = BadName(c.info);
      d["committed"] = c.state == CheckpointState::kCommitted && bad.empty();
      d["reason"] = bad.empty() ? LossyStr(c.reason) : LossyStr(bad);
      out.append(d);
    }
    return out;
  }
  py::list Skipped() const {
    py::list out;
    for (const auto& line : report_.skipped) out.append(LossyStr(line));
    for (const auto& c : report_.checkpoints) {
      std::string bad = BadName(c.info);
      if (c.state == CheckpointState::kCommitted && !bad.empty()) {
        out.append(LossyStr("checkpoint " + std::to_string(c.info.counter) + " (step " +
                            std::to_string(c.info.step) + "): " + bad));
      }
    }
    return out;
  }
  // The checkpoint recovery would read (an index into Checkpoints(), -1 for
  // none), as the planner orders them: lineage, damage, names.
  int NewestValid() const {
    std::vector<PlanCandidate> cands;
    for (size_t i = 0; i < report_.checkpoints.size(); ++i) {
      const auto& c = report_.checkpoints[i];
      const std::string bad = BadName(c.info);
      cands.push_back(PlanCandidate{Tier::kDisk, path_, c.info.step, c.info.counter,
                                    c.state == CheckpointState::kCommitted && bad.empty(),
                                    bad.empty() ? c.reason : bad, false, i});
    }
    PlanRequest scanned;  // Scan verified what it was asked to
    scanned.verify = false;
    const Plan plan = Take(MakePlan(cands, lineage_, scanned));
    return plan.chosen() ? static_cast<int>(cands[*plan.chosen()].handle) : -1;
  }
  const std::string& path() const { return path_; }

  // Reads tensor `tensor` of checkpoint `ckpt` (indices into Checkpoints())
  // into host memory at `dst`, which must hold `nbytes`.
  void ReadTensor(int ckpt, int tensor, uintptr_t dst, uint64_t nbytes, bool verify) {
    if (ckpt < 0 || ckpt >= static_cast<int>(report_.checkpoints.size())) {
      throw StatusError(Status::InvalidArgument("no checkpoint #" + std::to_string(ckpt)));
    }
    const CheckpointInfo& info = report_.checkpoints[ckpt].info;
    if (tensor < 0 || tensor >= static_cast<int>(info.tensors.size())) {
      throw StatusError(Status::InvalidArgument("no tensor #" + std::to_string(tensor)));
    }
    const TensorSpec& spec = info.tensors[tensor].spec;
    if (spec.nbytes != nbytes) {
      throw StatusError(Status::InvalidArgument(
          "tensor '" + spec.name + "' holds " + std::to_string(spec.nbytes) +
          " bytes, destination " + std::to_string(nbytes)));
    }
    py::gil_scoped_release release;
    Status s = file_->ReadTensor(info, tensor, reinterpret_cast<void*>(dst), verify);
    if (!s.ok()) {
      throw StatusError(s.Annotate(path_ + ": step " + std::to_string(info.step) + " tensor '" +
                                   spec.name + "'"));
    }
  }

  // Reads every tensor of committed checkpoint `ckpt` through the one restore
  // path (ReadCheckpointInto: every crc chunk read and verified once, in
  // parallel, straight into the destinations), without the GIL. `dst`: one
  // (pointer, nbytes) per tensor in table order; pointer 0 = verify only.
  py::dict ReadInto(int ckpt, const py::sequence& dst, std::optional<int> threads) {
    if (ckpt < 0 || ckpt >= static_cast<int>(report_.checkpoints.size())) {
      throw StatusError(Status::InvalidArgument("no checkpoint #" + std::to_string(ckpt)));
    }
    const ScannedCheckpoint& sc = report_.checkpoints[ckpt];
    if (sc.state != CheckpointState::kCommitted) {
      throw StatusError(Status::InvalidArgument(path_ + ": checkpoint #" +
                                                std::to_string(sc.info.counter) +
                                                " is not committed"));
    }
    return ReadIntoDestinations(*file_, sc.info, dst, threads,
                                path_ + ": step " + std::to_string(sc.info.step));
  }

 private:
  static std::string BadName(const CheckpointInfo& info) { return BadTensorName(info); }

  std::string path_;
  std::unique_ptr<SlotFile> file_;
  ScanReport report_;
  LineageRecord lineage_;  // empty for a memory segment
};

// (counter, record dict or None, error line or None, cancelled): how each
// tracked checkpoint settled (commit_watch.h).
py::list OutcomeList(const std::vector<WatchOutcome>& got) {
  py::list out;
  for (const WatchOutcome& o : got) {
    out.append(py::make_tuple(
        o.counter, o.record ? py::object(CheckpointStatsDict(*o.record)) : py::none(),
        o.error.empty() ? py::none() : py::object(LossyStr(o.error)),
        o.kind == WatchOutcome::Kind::kCancelled));
  }
  return out;
}

}  // namespace

void InitEngine(py::module_& m) {
  m.def("slot_file_name", &SlotFileName, py::arg("rank"));

  // The engine's watch of finished checkpoints: Python's handles settle from
  // next(), which blocks with the GIL released until some did (or stop()).
  py::class_<CommitWatch, std::shared_ptr<CommitWatch>>(m, "CommitWatch")
      .def("track", &CommitWatch::Track, py::arg("counter"), py::arg("step"),
           py::call_guard<py::gil_scoped_release>())
      .def("next",
           [](CommitWatch& w) -> py::object {
             std::optional<std::vector<WatchOutcome>> got;
             {
               py::gil_scoped_release release;
               got = w.Next();
             }
             return got ? py::object(OutcomeList(*got)) : py::none();
           })
      .def("stop", &CommitWatch::Stop, py::call_guard<py::gil_scoped_release>())
      .def(
          "abandon",
          [](CommitWatch& w, const std::string& why) {
            std::vector<WatchOutcome> got;
            {
              py::gil_scoped_release release;
              got = w.Abandon(why);
            }
            return OutcomeList(got);
          },
          py::arg("why"));

  py::class_<PyEngine> engine(m, "Engine");
  DefInitWithEngineOptions(
      engine,
      py::init([](const std::string& dir, uint32_t rank, uint32_t world_size, int max_in_flight,
                  int writers, uint64_t staging_bytes, uint64_t chunk_bytes, int copy_threads,
                  const std::string& medium, uint32_t extra_slots, const std::string& layer_copy,
                  bool global_agreement, uint64_t keep_every, const std::string& memory_tier,
                  const std::string& shm_dir, double memory_tier_share,
                  double memory_tier_orphan_s, bool small_initial_staging,
                  int64_t device_snapshot_bytes, int disk_every) {
        LayerCopy copy = LayerCopy::kHost;
        if (!ParseLayerCopy(layer_copy, &copy)) {
          throw StatusError(Status::InvalidArgument("unknown copy '" + layer_copy +
                                                    "'; use host, direct or device"));
        }
        EngineOptions o =
            EngineOptionsFromPy(dir, rank, world_size, max_in_flight, writers, staging_bytes,
                                chunk_bytes, copy_threads, medium, keep_every);
        o.extra_slots = extra_slots;
        o.layer_copy = copy;
        o.global_agreement = global_agreement;
        o.memory_tier = memory_tier;
        o.shm_dir = shm_dir;
        o.memory_tier_share = memory_tier_share;
        o.memory_tier_orphan_s = memory_tier_orphan_s;
        o.small_initial_staging = small_initial_staging;
        o.device_snapshot_bytes = device_snapshot_bytes;
        o.disk_every = disk_every;
        return std::make_unique<PyEngine>(o);
      }),
      py::arg("extra_slots") = 0, py::arg("layer_copy") = "host",
      py::arg("global_agreement") = false, py::arg("keep_every") = 0,
      py::arg("memory_tier") = "auto", py::arg("shm_dir") = "",
      py::arg("memory_tier_share") = 0.1, py::arg("memory_tier_orphan_s") = 3600.0,
      py::arg("small_initial_staging") = false, py::arg("device_snapshot_bytes") = -1,
      py::arg("disk_every") = 1);
  engine
      .def("register", &PyEngine::Register, py::arg("tensors"), py::arg("layouts") = py::none(),
           "Registers tensors: a list of (name, dtype code, shape, nbytes, data_ptr, device "
           "kind, device index, stream, copy_at_checkpoint); `layouts`: per tensor None or "
           "(global_shape, global_offset).")
      .def("checkpoint", &PyEngine::Checkpoint, py::arg("step"), py::arg("meta_json"))
      .def("wait_copied", &PyEngine::WaitCopied)
      .def("take_error", &PyEngine::TakeError)
      .def("prepare_staging", &PyEngine::PrepareStaging, py::arg("state_bytes"),
           "Allocates staging for a state of state_bytes in the background; returns at once.")
      .def("begin_checkpoint", &PyEngine::BeginCheckpoint, py::arg("step"))
      .def("copy_tensors", &PyEngine::CopyTensors, py::arg("counter"), py::arg("tensors"))
      .def("wait_tensors_copied", &PyEngine::WaitTensorsCopied, py::arg("tensors"))
      .def("wait_tensors_copied_on_stream", &PyEngine::WaitTensorsCopiedOnStream,
           py::arg("tensors"), py::arg("device"), py::arg("stream"))
      .def("end_checkpoint", &PyEngine::EndCheckpoint, py::arg("counter"), py::arg("step"),
           py::arg("meta_json"))
      .def("wait_committed", &PyEngine::WaitCommitted, py::arg("counter") = 0)
      .def("latest", &PyEngine::Latest)
      .def("restore", &PyEngine::Restore, py::arg("step") = py::none())
      .def("adopt_restored", &PyEngine::AdoptRestored, py::arg("counter"))
      .def("set_retention", &PyEngine::SetRetention, py::arg("max_to_keep") = 0,
           py::arg("best_metric") = "", py::arg("best_higher") = false, py::arg("best_k") = 0)
      .def("delete_kept", &PyEngine::DeleteKept, py::arg("step"))
      .def("stats", &PyEngine::Stats)
      .def("pin", &PyEngine::Pin, py::arg("counter"))
      .def("candidate", &PyEngine::Candidate)
      .def("drop_candidate", &PyEngine::DropCandidate, py::arg("counter"))
      .def("agree_offer", &PyEngine::Offer)
      .def("aim", &PyEngine::Aim, py::arg("step"))
      .def("write_agreed", &PyEngine::WriteAgreed, py::arg("record"))
      .def("await_emergency", &PyEngine::AwaitEmergency, py::arg("counter"), py::arg("step"))
      .def("abandon_older_than", &PyEngine::AbandonOlderThan,
           py::arg("counter") = std::numeric_limits<uint64_t>::max())
      .def("close", &PyEngine::Close)
      .def("watch", &PyEngine::Watch)
      .def_property_readonly("closed", &PyEngine::closed);

  m.def(
      "open_memory_segment",
      [](const std::string& dir, int rank, const std::string& shm_dir,
         std::optional<int64_t> step) -> py::tuple {
        std::string why;
        Result<std::optional<MemorySegment>> seg{Status::Internal("unset")};
        {
          py::gil_scoped_release release;
          seg = OpenMemorySegment(dir, rank, shm_dir, nullptr, nullptr, &why, step);
        }
        if (!seg.ok()) return py::make_tuple(py::none(), LossyStr(seg.status().ToString()));
        if (!seg.value().has_value()) return py::make_tuple(py::none(), LossyStr(why));
        return py::make_tuple(py::cast(PyReader(std::move(*seg.value()))), "");
      },
      py::arg("dir"), py::arg("rank") = 0, py::arg("shm_dir") = "", py::arg("step") = py::none(),
      "The memory tier's segment of `rank` as a Reader, when it verifies and holds exactly the "
      "newest committed checkpoint on disk (with step=: the one the job directory selects for "
      "that step): (reader, \"\"); else (None, why).");

  py::class_<PyReader>(m, "Reader")
      .def(py::init<const std::string&, int, bool>(), py::arg("dir"), py::arg("rank") = 0,
           py::arg("verify_data") = true)
      .def_property_readonly("geometry", &PyReader::Geometry)
      .def_property_readonly("checkpoints", &PyReader::Checkpoints)
      .def_property_readonly("skipped", &PyReader::Skipped)
      .def_property_readonly("newest_valid", &PyReader::NewestValid)
      .def_property_readonly("path", &PyReader::path)
      .def("read_tensor", &PyReader::ReadTensor, py::arg("checkpoint"), py::arg("tensor"),
           py::arg("dst"), py::arg("nbytes"), py::arg("verify") = true)
      .def("read_into", &PyReader::ReadInto, py::arg("checkpoint"), py::arg("dst"),
           py::arg("threads") = py::none());
}

}  // namespace nonstop::py_bindings
