// nonstop._core.JobDir: the job directory's one owner (include/nonstop/jobdir.h)
// for Python. Thin: every call goes to JobDir with the GIL released around
// its I/O; errors become nonstop.errors classes through StatusError.
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/job_view.h"
#include "jobdir/check_dir.h"
#include "jobdir/planned_steps.h"
#include "jobdir/records.h"
#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "plan/integrations.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

// One selected checkpoint with its file open for reading.
class PySelected {
 public:
  PySelected(std::shared_ptr<JobDir> jd, Selected sel, std::vector<std::string> skipped,
             bool fallback)
      : jd_(std::move(jd)), sel_(std::move(sel)), skipped_(std::move(skipped)),
        fallback_(fallback) {}

  py::dict Info() const { return InfoDict(sel_.info); }
  const std::string& where() const { return sel_.location.where; }
  bool keep() const { return sel_.location.keep; }
  const std::vector<std::string>& skipped() const { return skipped_; }
  bool fallback() const { return fallback_; }
  uint64_t counter() const { return sel_.info.counter; }
  int64_t step() const { return sel_.info.step; }

  void ReadTensor(int tensor, uintptr_t dst, uint64_t nbytes, bool verify) {
    if (tensor < 0 || tensor >= static_cast<int>(sel_.info.tensors.size())) {
      throw StatusError(Status::InvalidArgument("no tensor #" + std::to_string(tensor)));
    }
    const TensorSpec& spec = sel_.info.tensors[tensor].spec;
    if (spec.nbytes != nbytes) {
      throw StatusError(Status::InvalidArgument("tensor '" + spec.name + "' holds " +
                                                std::to_string(spec.nbytes) + " bytes, destination " +
                                                std::to_string(nbytes)));
    }
    py::gil_scoped_release release;
    Status s = sel_.file->ReadTensor(sel_.info, tensor, reinterpret_cast<void*>(dst), verify);
    if (!s.ok()) {
      throw StatusError(s.Annotate(jd_->path() + "/" + sel_.location.where + ": step " +
                                   std::to_string(sel_.info.step) + " tensor '" + spec.name + "'"));
    }
  }

  // Every tensor through the one restore path (ReadCheckpointInto: each crc
  // chunk read and verified once, in parallel), without the GIL. `dst`: one
  // (pointer, nbytes) per tensor in table order; pointer 0 = verify only.
  py::dict ReadInto(const py::sequence& dst, std::optional<int> threads) {
    return ReadIntoDestinations(*sel_.file, sel_.info, dst, threads,
                                jd_->path() + "/" + sel_.location.where + ": step " +
                                    std::to_string(sel_.info.step));
  }

  bool Superseded() {
    py::gil_scoped_release release;
    return Take(jd_->Superseded(sel_));
  }

 private:
  std::shared_ptr<JobDir> jd_;  // keeps the directory (and a writer's lock) alive
  Selected sel_;
  std::vector<std::string> skipped_;
  bool fallback_ = false;
};

class PyJobDir {
 public:
  explicit PyJobDir(std::unique_ptr<JobDir> jd) : jd_(std::move(jd)) {}

  static PyJobDir OpenForWrite(const std::string& path, int rank, int world_size) {
    py::gil_scoped_release release;
    return PyJobDir(Take(JobDir::OpenForWrite(path, rank, world_size)));
  }
  static PyJobDir OpenForRead(const std::string& path) {
    py::gil_scoped_release release;
    return PyJobDir(Take(JobDir::OpenForRead(path)));
  }
  static PyJobDir OpenForMaintenance(const std::string& path) {
    py::gil_scoped_release release;
    return PyJobDir(Take(JobDir::OpenForMaintenance(path)));
  }
  py::list Kept(int rank, const std::string& metric) {
    std::vector<KeptCopy> k;
    {
      py::gil_scoped_release release;
      k = Take(jd().KeptCopies(rank, metric));
    }
    py::list out;
    for (const auto& c : k) {
      py::dict d;
      d["step"] = c.step;
      d["counter"] = c.counter;
      d["metric"] = c.metric ? py::object(py::float_(*c.metric)) : py::object(py::none());
      out.append(d);
    }
    return out;
  }
  void DeleteKept(int64_t step) {
    py::gil_scoped_release release;
    Check(jd().DeleteKept(step));
  }
  void DeleteKeptShare(int64_t step) {
    py::gil_scoped_release release;
    Check(jd().DeleteKeptShare(step));
  }

  JobDir& jd() const {
    if (!jd_) throw StatusError(Status::FailedPrecondition("the job directory is closed"));
    return *jd_;
  }
  // Releases the lock (a writer) once no selection holds the directory.
  void Close() { jd_.reset(); }
  std::string path() const { return jd().path(); }
  bool writable() const { return jd().writable(); }
  int rank() const { return jd().rank(); }
  std::string SlotPath(int rank) const { return jd().SlotPath(rank); }
  std::vector<std::string> ForeignEntries() {
    py::gil_scoped_release release;
    return Take(jd().ForeignEntries());
  }

  std::optional<PySelected> Select(int rank, std::optional<int64_t> step, bool verify_data,
                                   bool include_keep) {
    JobDir& j = jd();
    SelectOptions o;
    o.step = step;
    o.verify_data = verify_data;
    o.include_keep = include_keep;
    Selection sel;
    {
      py::gil_scoped_release release;
      sel = Take(j.Select(rank, o));
    }
    if (!sel.chosen) return std::nullopt;
    return PySelected(jd_, std::move(*sel.chosen), std::move(sel.skipped), sel.fallback);
  }

  py::dict SelectCommon(int world_size, std::optional<int64_t> step,
                        std::optional<int> set_aside_world, bool verify_data,
                        std::optional<int64_t> max_step) {
    JobDir& j = jd();
    SelectOptions o;
    o.step = step;
    o.max_step = max_step;
    o.verify_data = verify_data;
    CommonSelection cs;
    {
      py::gil_scoped_release release;
      cs = Take(j.SelectCommon(world_size, o, set_aside_world));
    }
    return CommonDict(std::move(cs));
  }

  std::optional<py::dict> SelectReshard(int world_size, std::optional<int64_t> step,
                                        std::optional<int64_t> max_step, bool verify_data,
                                        const std::vector<std::tuple<int, int, std::string>>& extra) {
    JobDir& j = jd();
    SelectOptions o;
    o.step = step;
    o.max_step = max_step;
    o.verify_data = verify_data;
    for (const auto& [w, r, path] : extra) o.extra.push_back(SelectOptions::ExtraFile{w, r, path});
    std::optional<ReshardSelection> rs;
    {
      py::gil_scoped_release release;
      rs = Take(j.SelectReshard(world_size, o));
    }
    if (!rs) return std::nullopt;
    py::dict d = CommonDict(std::move(rs->common));
    d["old_world"] = rs->old_world;
    d["dir"] = rs->dir;
    return d;
  }

  std::string SingleSource(std::optional<int64_t> step) {
    JobDir& j = jd();
    py::gil_scoped_release release;
    switch (nonstop::ChooseSingleSource(j, step)) {
      case nonstop::SingleSource::kOwn: return "own";
      case nonstop::SingleSource::kReshard: return "reshard";
      case nonstop::SingleSource::kReshardElseOwn: return "reshard_else_own";
    }
    return "own";
  }

  py::list List(int rank) {
    std::vector<ListedCheckpoint> l;
    {
      py::gil_scoped_release release;
      l = Take(jd().List(rank));
    }
    py::list out;
    for (const auto& c : l) {
      py::dict d;
      d["counter"] = c.counter;
      d["step"] = c.step;
      d["where"] = c.location.where;
      d["keep"] = c.location.keep;
      d["state"] = c.state == ListedCheckpoint::State::kCommitted ? "committed"
                   : c.state == ListedCheckpoint::State::kAbandoned ? "abandoned"
                                                                    : "damaged";
      d["reason"] = c.reason;
      d["commit_unix_ns"] = c.commit_unix_ns;
      d["data_bytes"] = c.data_bytes;
      d["rotated"] = c.rotated;
      py::dict metrics;
      for (const auto& [k, v] : c.metrics) {
        metrics[py::reinterpret_steal<py::str>(
            PyUnicode_DecodeUTF8(k.data(), static_cast<Py_ssize_t>(k.size()), "replace"))] = v;
      }
      d["metrics"] = metrics;
      out.append(d);
    }
    return out;
  }

  void RecordRestore(int rank, uint64_t counter) {
    py::gil_scoped_release release;
    Check(jd().RecordRestore(rank, counter));
  }
  py::dict Lineage(int rank) {
    LineageRecord r;
    {
      py::gil_scoped_release release;
      r = Take(jd().ReadLineage(rank));
    }
    py::dict d;
    d["restored"] = r.restored_counter;
    d["abandoned"] = r.abandoned;
    d["abandoned_through"] = r.abandoned_through;
    d["not_durable"] = r.not_durable;
    return d;
  }
  uint64_t NextCounter(int rank) {
    py::gil_scoped_release release;
    return Take(jd().NextCounter(rank));
  }
  std::optional<uint64_t> ProtectedCounter(int rank) {
    py::gil_scoped_release release;
    return Take(jd().ProtectedCounter(rank));
  }

  bool NeedsSetAside(int world_size) {
    py::gil_scoped_release release;
    return Take(jd().NeedsSetAside(world_size));
  }
  std::vector<int> SetAside(int world_size) {
    py::gil_scoped_release release;
    return Take(jd().SetAside(world_size));
  }
  std::vector<int> SetAsideWorlds() {
    py::gil_scoped_release release;
    return Take(jd().SetAsideWorlds());
  }

  void WriteAgreed(const py::dict& d) {
    AgreedRecord r = AgreedFromDict(d, jd().rank());
    py::gil_scoped_release release;
    Check(jd().WriteAgreed(r));
  }
  std::optional<py::dict> ReadAgreed(int rank) {
    std::optional<AgreedRecord> r;
    {
      py::gil_scoped_release release;
      r = Take(jd().ReadAgreed(rank));
    }
    if (!r) return std::nullopt;
    return AgreedToDict(*r);
  }

 private:
  py::dict CommonDict(CommonSelection cs) const {
    py::dict d;
    d["step"] = cs.step;
    d["run_id"] = cs.run_id;
    py::list ranks;
    for (auto& s : cs.ranks) ranks.append(PySelected(jd_, std::move(s), {}, false));
    d["ranks"] = ranks;
    d["skipped"] = cs.skipped;
    return d;
  }

  std::shared_ptr<JobDir> jd_;
};

}  // namespace

AgreedRecord AgreedFromDict(const py::dict& d, int default_rank) {
  AgreedRecord r;
  r.step = d["step"].cast<int64_t>();
  r.counter = DictGet<int64_t>(d, "counter", -1);
  r.lineage = DictGet<uint64_t>(d, "lineage", 0);
  r.rank = DictGet<int>(d, "rank", default_rank);
  r.world_size = DictGet<int>(d, "world_size", 1);
  r.unix_s = DictGet<double>(d, "unix_s", 0.0);
  if (d.contains("resharded_from") && !d["resharded_from"].is_none()) {
    auto rf = d["resharded_from"].cast<std::pair<std::string, int>>();
    r.resharded_from = rf.first;
    r.resharded_from_world = rf.second;
  }
  return r;
}

py::dict AgreedToDict(const AgreedRecord& r) {
  py::dict d;
  d["step"] = r.step;
  d["counter"] = r.counter;
  d["lineage"] = r.lineage;
  d["rank"] = r.rank;
  d["world_size"] = r.world_size;
  d["unix_s"] = r.unix_s;
  if (!r.resharded_from.empty()) {
    d["resharded_from"] = py::make_tuple(r.resharded_from, r.resharded_from_world);
  }
  return d;
}

// nonstop._core.plan: the recovery planner (nonstop/plan.h) for what Python
// lists (a remote tier's listing, the ranks' gathered lists). No verifier:
// the caller verifies as it reads and asks again with `exclude`.
py::dict PlanBinding(const py::list& candidates, const std::optional<py::dict>& lineage,
                     std::optional<int64_t> step, std::optional<int64_t> max_step,
                     const std::vector<uint64_t>& exclude) {
  std::vector<PlanCandidate> cands;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const py::dict c = candidates[i].cast<py::dict>();
    PlanCandidate pc;
    const std::string tier = c.contains("tier") ? c["tier"].cast<std::string>() : "disk";
    const std::optional<Tier> t = ParseTier(tier);
    if (!t) throw StatusError(Status::InvalidArgument("plan: unknown tier '" + tier + "'"));
    pc.tier = *t;
    pc.where = c.contains("where") ? c["where"].cast<std::string>() : tier;
    pc.step = c["step"].cast<int64_t>();
    pc.counter = c["counter"].cast<uint64_t>();
    pc.committed = c.contains("committed") ? c["committed"].cast<bool>() : true;
    pc.damage = c.contains("damage") && !c["damage"].is_none() ? c["damage"].cast<std::string>() : "";
    pc.overwritten = c.contains("overwritten") && c["overwritten"].cast<bool>();
    pc.handle = i;
    cands.push_back(std::move(pc));
  }
  LineageRecord l;
  if (lineage) {
    const py::dict& d = *lineage;
    if (d.contains("abandoned")) {
      l.abandoned = d["abandoned"].cast<std::vector<std::pair<uint64_t, uint64_t>>>();
    }
    if (d.contains("not_durable")) l.not_durable = d["not_durable"].cast<std::vector<uint64_t>>();
    if (d.contains("restored")) l.restored_counter = d["restored"].cast<uint64_t>();
  }
  PlanRequest req;
  req.step = step;
  req.max_step = max_step;
  req.exclude = exclude;
  req.verify = false;
  Plan plan;
  {
    py::gil_scoped_release release;
    plan = Take(MakePlan(cands, l, req));
  }
  py::dict out;
  out["order"] = plan.order;
  out["skipped"] = plan.skipped;
  out["fallback"] = plan.fallback;
  out["saw_damage"] = plan.saw_damage;
  return out;
}

// The job view (engine/job_view.h) as nonstop.list() returns it.
py::dict JobViewDict(const std::string& dir, int rank, const std::string& shm_dir) {
  Result<JobView> r = Status::Internal("unset");
  {
    py::gil_scoped_release release;
    r = ViewJob(dir, rank, nullptr, shm_dir);
  }
  const JobView v = Take(std::move(r));
  py::list rows;
  for (const ViewRow& row : v.rows) {
    py::dict d;
    d["step"] = row.step;
    d["counter"] = row.counter;
    d["where"] = row.where;
    d["path"] = row.path;
    d["state"] = row.state;
    d["reason"] = row.reason;
    d["time"] = row.commit_unix_ns ? py::cast(static_cast<double>(row.commit_unix_ns) / 1e9)
                                   : py::object(py::none());
    d["bytes"] = row.bytes;
    py::dict metrics;
    for (const auto& [k, x] : row.metrics) metrics[py::str(k)] = x;
    d["metrics"] = metrics;
    py::list tiers;
    for (const ViewHolder& h : row.tiers) {
      py::dict t;
      t["tier"] = h.tier;
      t["where"] = h.where;
      t["recorded"] = h.recorded;
      tiers.append(t);
    }
    d["tiers"] = tiers;
    d["job"] = v.job;
    rows.append(d);
  }
  py::dict out;
  out["job"] = v.job;
  out["rows"] = rows;
  out["notes"] = v.notes;
  return out;
}

namespace {

// A Python int that is not a bool (nullopt otherwise, or past int64).
std::optional<int64_t> PlainInt(py::handle v) {
  if (PyBool_Check(v.ptr()) || !PyLong_Check(v.ptr())) return std::nullopt;
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow != 0) return std::nullopt;
  return static_cast<int64_t>(x);
}

[[noreturn]] void Mismatch(const std::string& what) {
  throw StatusError(Status::InvalidArgument(what));
}

std::string Repr(py::handle v) { return py::repr(v).cast<std::string>(); }

// keep=, max_to_keep=, best=: (max_to_keep, metric, higher, k) for
// Engine.set_retention.
py::tuple CheckRetention(py::object keep, py::object max_to_keep, py::object best) {
  std::optional<int64_t> most;
  if (!max_to_keep.is_none()) {
    most = PlainInt(max_to_keep);
    if (!most || *most < 1) {
      Mismatch("max_to_keep must be None or a positive integer, got " + Repr(max_to_keep));
    }
  }
  std::string metric;
  bool higher = false;
  int64_t k = 0;
  if (!best.is_none()) {
    bool ok = (py::isinstance<py::tuple>(best) || py::isinstance<py::list>(best)) &&
              py::len(best) == 3;
    if (ok) {
      py::sequence b = py::reinterpret_borrow<py::sequence>(best);
      const std::optional<int64_t> n = PlainInt(b[2]);
      ok = py::isinstance<py::str>(b[0]) && !b[0].cast<std::string>().empty() &&
           py::isinstance<py::str>(b[1]) &&
           (b[1].cast<std::string>() == "min" || b[1].cast<std::string>() == "max") && n &&
           *n >= 1;
      if (ok) {
        metric = b[0].cast<std::string>();
        higher = b[1].cast<std::string>() == "max";
        k = *n;
      }
    }
    if (!ok) {
      Mismatch("best must be (metric name, \"min\" or \"max\", k >= 1), e.g. (\"loss\", "
               "\"min\", 3); got " + Repr(best));
    }
  }
  if (most && keep.is_none()) {
    Mismatch("max_to_keep bounds the copies keep= makes: give keep=k as well");
  }
  return py::make_tuple(most.value_or(0), metric, higher, k);
}

// metrics= of save()/step(): a dict of name -> finite number, as floats (a
// 0-d tensor or numpy scalar converted by its item()).
py::object CheckMetrics(py::object metrics) {
  if (metrics.is_none()) return py::none();
  if (!py::isinstance<py::dict>(metrics)) {
    Mismatch("metrics must be a dict of name -> number, got " +
             py::str(py::type::handle_of(metrics).attr("__name__")).cast<std::string>());
  }
  py::dict out;
  for (auto [k, v] : py::reinterpret_borrow<py::dict>(metrics)) {
    if (!py::isinstance<py::str>(k) || k.cast<std::string>().empty()) {
      Mismatch("metrics: name " + Repr(k) + " is not a non-empty string");
    }
    py::object x = py::reinterpret_borrow<py::object>(v);
    if (py::hasattr(x, "item") && PyCallable_Check(x.attr("item").ptr())) x = x.attr("item")();
    bool ok = !PyBool_Check(x.ptr()) && (PyLong_Check(x.ptr()) || PyFloat_Check(x.ptr()));
    double d = 0;
    if (ok) {
      d = PyFloat_AsDouble(x.ptr());
      if (PyErr_Occurred() != nullptr) {
        PyErr_Clear();
        ok = false;
      }
      ok = ok && std::isfinite(d);
    }
    if (!ok) Mismatch("metrics[" + Repr(k) + "] must be a finite number, got " + Repr(x));
    out[k] = d;
  }
  return out;
}

// A keyword as integrations.h takes it (absent: None).
IntOption IntArg(py::handle v) {
  if (v.is_none()) return {};
  return IntOption{true, PlainInt(v), Repr(v)};
}

py::object BestTuple(const std::optional<BestOption>& b) {
  if (!b) return py::none();
  return py::make_tuple(b->metric, b->higher ? "max" : "min", b->k);
}

}  // namespace

void InitJobDir(py::module_& m) {
  m.def(
      "check_remote_every",
      [](py::object every, uint32_t world_size) -> py::object {
        if (every.is_none()) return py::none();
        const std::optional<int64_t> n = PlainInt(every);
        if (!n || *n < 1) {
          Mismatch("remote_every must be an int >= 1 (1: every checkpoint, n: every n-th), got " +
                   Repr(every));
        }
        if (world_size > 1) {
          Mismatch("remote_every is for one process: with several ranks the newest checkpoint "
                   "every rank holds is uploaded (leave remote_every out)");
        }
        return py::int_(*n);
      },
      py::arg("every"), py::arg("world_size"),
      "remote_every: None, or an int >= 1 (one process only); CheckpointMismatchError.");
  m.def("check_retention", &CheckRetention, py::arg("keep"), py::arg("max_to_keep"),
        py::arg("best"),
        "(max_to_keep, metric, higher, k) for Engine.set_retention, after checking "
        "max_to_keep= and best=(\"loss\", \"min\", 3); CheckpointMismatchError otherwise.");
  m.def("check_metrics", &CheckMetrics, py::arg("metrics"),
        "metrics= of save()/step() as {name: float} (None stays None); "
        "CheckpointMismatchError for anything but finite numbers under non-empty names.");
  m.def(
      "check_directory",
      [](const std::string& path, int rank, std::optional<int> world_size, bool must_exist) {
        py::gil_scoped_release r;
        return Take(CheckJobDirectory(path, rank, world_size, must_exist));
      },
      py::arg("path"), py::arg("rank"), py::arg("world_size"), py::arg("must_exist"),
      "Whether `path` holds rank's slot file; one-line errors for a missing (must_exist), "
      "foreign or other-world-size directory (check_dir.h CheckJobDirectory).");
  m.def(
      "rank_files",
      [](const std::string& path) {
        py::gil_scoped_release r;
        return Take(RankFiles(path));
      },
      py::arg("path"), "The ranks of the slot files in `path` (check_dir.h RankFiles).");
  m.def(
      "read_lightning_marker",
      [](const std::string& path) -> py::object {
        std::optional<LightningMarker> got;
        {
          py::gil_scoped_release r;
          got = ReadLightningMarker(path);
        }
        if (!got) return py::none();
        py::dict out;
        out["format"] = kLightningMarkerFormat;
        out["dir"] = got->dir;
        out["nonstop_dir"] = got->nonstop_dir;
        out["step"] = got->step;
        out["global_step"] = got->step + 1;
        return out;
      },
      py::arg("path"),
      "nonstop.lightning's marker at `path` as {format, dir, nonstop_dir, step, global_step}, "
      "or None when it holds none (check_dir.h ReadLightningMarker: a link is refused, never "
      "followed).");
  m.def("lightning_marker_json", &LightningMarkerJson, py::arg("step"),
        "The text of the marker naming committed step `step` (check_dir.h LightningMarkerJson).");
  m.def(
      "trainer_options",
      [](py::object metric, std::optional<bool> greater_is_better, py::object save_total_limit,
         bool sharded, bool load_best_model_at_end, const std::string& save_strategy,
         const std::vector<std::string>& given) {
        TrainerArgs a{metric.is_none() ? "" : metric.cast<std::string>(), greater_is_better,
                      IntArg(save_total_limit), sharded, load_best_model_at_end, save_strategy};
        TrainerRetention r = Take(TrainerRetentionOf(a, given));
        py::dict out;
        if (r.best) out["best"] = BestTuple(r.best);
        if (r.max_to_keep) {
          out["keep"] = 1;
          out["max_to_keep"] = *r.max_to_keep;
        }
        return out;
      },
      py::arg("metric_for_best_model"), py::arg("greater_is_better"),
      py::arg("save_total_limit"), py::arg("sharded"), py::arg("load_best_model_at_end"),
      py::arg("save_strategy"), py::arg("given"),
      "The Checkpointer options (best=, keep=, max_to_keep=) TrainingArguments ask for, "
      "after checking them (integrations.h TrainerRetentionOf); CheckpointMismatchError.");
  m.def(
      "lightning_cadence",
      [](py::object every, py::object every_n_train_steps, py::object every_n_epochs,
         py::object interval, std::optional<double> interval_seconds, py::object mode,
         py::object monitor, py::object save_top_k, bool best_given) {
        if (!monitor.is_none() && !py::isinstance<py::str>(monitor)) {
          Mismatch("monitor must be a logged metric's name (a str), got " + Repr(monitor));
        }
        LightningArgs a;
        a.every = IntArg(every);
        a.every_n_train_steps = IntArg(every_n_train_steps);
        a.every_n_epochs = IntArg(every_n_epochs);
        a.save_top_k = IntArg(save_top_k);
        a.interval_given = !interval.is_none();
        a.interval_seconds = interval_seconds;
        a.interval_repr = Repr(interval);
        a.mode = py::isinstance<py::str>(mode) ? mode.cast<std::string>() : "";
        a.mode_repr = Repr(mode);
        if (!monitor.is_none()) a.monitor = monitor.cast<std::string>();
        a.best_given = best_given;
        LightningCadence c = Take(LightningCadenceOf(a));
        return py::make_tuple(c.every, c.every_n_epochs, BestTuple(c.best));
      },
      py::arg("every"), py::arg("every_n_train_steps"), py::arg("every_n_epochs"),
      py::arg("interval"), py::arg("interval_seconds"), py::arg("mode"), py::arg("monitor"),
      py::arg("save_top_k"), py::arg("best_given"),
      "NonstopCheckpoint's keywords checked: (every, every_n_epochs, best= or None) "
      "(integrations.h LightningCadenceOf); CheckpointMismatchError otherwise.");
  m.def(
      "check_loader_order",
      [](const std::string& where, const std::string& type, bool stateful,
         const std::vector<std::tuple<std::string, bool, bool>>& samplers, bool has_generator,
         std::optional<std::string> ddp_wrapped) {
        LoaderFacts f{where, type, stateful, {}, has_generator, std::move(ddp_wrapped)};
        for (const auto& [t, positional, shares] : samplers) f.samplers.push_back({t, positional, shares});
        Check(CheckLoaderOrder(f));
      },
      py::arg("where"), py::arg("type"), py::arg("stateful"), py::arg("samplers"),
      py::arg("has_generator"), py::arg("ddp_wrapped") = py::none(),
      "samplers: [(module.Class, positional only, shares the loader's generator)], outermost "
      "first. CheckpointMismatchError naming the fix when the restored order would differ "
      "(integrations.h CheckLoaderOrder).");
  m.def(
      "check_meta_json",
      [](std::string_view text) {  // str or bytes; the caller's object outlives the view
        Status s;
        {
          py::gil_scoped_release r;
          s = jobdir_internal::CheckMetaJson(text);
        }
        Check(s);
      },
      py::arg("text"),
      "A checkpoint's metadata document (str or bytes) before json.loads: CorruptCheckpointError "
      "(one line) unless it is valid UTF-8 JSON within the format's size and depth bounds "
      "(jobdir/records.h CheckMetaJson).");
  m.def(
      "not_kept",
      [](const std::string& dir, int64_t step, const std::string& message) {
        py::gil_scoped_release r;
        return NotKept(dir, step, Status::NotFound(message)).message();
      },
      py::arg("dir"), py::arg("step"), py::arg("message"),
      "delete(step) found no kept copy (message): the one line to raise (NotKept).");
  m.def("job_view", &JobViewDict, py::arg("dir"), py::arg("rank") = 0, py::arg("shm_dir") = "",
        "The job view of rank `rank` (engine/job_view.h): {job, rows: nonstop.list()'s "
        "[{step, counter, where, path, state, reason, time (s or None), bytes, metrics, "
        "tiers: [{tier, where, recorded}], job}], notes}.");
  py::class_<PySelected>(m, "SelectedCheckpoint")
      .def_property_readonly("info", &PySelected::Info)
      .def_property_readonly("where", &PySelected::where)
      .def_property_readonly("keep", &PySelected::keep)
      .def_property_readonly("skipped", &PySelected::skipped)
      .def_property_readonly("fallback", &PySelected::fallback)
      .def_property_readonly("counter", &PySelected::counter)
      .def_property_readonly("step", &PySelected::step)
      .def("read_tensor", &PySelected::ReadTensor, py::arg("tensor"), py::arg("dst"),
           py::arg("nbytes"), py::arg("verify") = true)
      .def("read_into", &PySelected::ReadInto, py::arg("dst"), py::arg("threads") = py::none())
      // Read like a Reader that holds one checkpoint, index 0 (_read.read_tensors).
      .def_property_readonly("checkpoints",
                             [](const PySelected& s) { return py::make_tuple(s.Info()); })
      .def(
          "read_into",
          [](PySelected& s, int idx, const py::sequence& dst, std::optional<int> threads) {
            if (idx != 0) {
              throw StatusError(Status::InvalidArgument("a selection holds checkpoint 0 only"));
            }
            return s.ReadInto(dst, threads);
          },
          py::arg("idx"), py::arg("dst"), py::arg("threads") = py::none())
      .def("superseded", &PySelected::Superseded);

  py::class_<PyJobDir>(m, "JobDir")
      .def_static("open_for_write", &PyJobDir::OpenForWrite, py::arg("path"), py::arg("rank") = 0,
                  py::arg("world_size") = 1)
      .def_static("open_for_read", &PyJobDir::OpenForRead, py::arg("path"))
      .def_static("open_for_maintenance", &PyJobDir::OpenForMaintenance, py::arg("path"))
      .def("kept", &PyJobDir::Kept, py::arg("rank") = 0, py::arg("metric") = "")
      .def("delete_kept", &PyJobDir::DeleteKept, py::arg("step"))
      .def("delete_kept_share", &PyJobDir::DeleteKeptShare, py::arg("step"))
      .def_static("slot_name", &JobDirNames::Slot, py::arg("rank"))
      .def_static("lock_name", &JobDirNames::Lock, py::arg("rank") = 0)
      .def_static("agreed_name", &JobDirNames::Agreed, py::arg("rank"))
      .def_static("lineage_name", &JobDirNames::Lineage, py::arg("rank"))
      .def_static("keep_step_name", &JobDirNames::KeepStep, py::arg("step"))
      .def_static("world_name", &JobDirNames::World, py::arg("world_size"))
      .def("close", &PyJobDir::Close)
      .def_property_readonly("path", &PyJobDir::path)
      .def_property_readonly("writable", &PyJobDir::writable)
      .def_property_readonly("rank", &PyJobDir::rank)
      .def("slot_path", &PyJobDir::SlotPath, py::arg("rank") = 0)
      .def("foreign_entries", &PyJobDir::ForeignEntries)
      .def("select", &PyJobDir::Select, py::arg("rank") = 0, py::arg("step") = py::none(),
           py::arg("verify_data") = true, py::arg("include_keep") = true)
      .def("select_common", &PyJobDir::SelectCommon, py::arg("world_size"),
           py::arg("step") = py::none(), py::arg("set_aside_world") = py::none(),
           py::arg("verify_data") = true, py::arg("max_step") = py::none())
      .def("select_reshard", &PyJobDir::SelectReshard, py::arg("world_size"),
           py::arg("step") = py::none(), py::arg("max_step") = py::none(),
           py::arg("verify_data") = true,
           py::arg("extra") = std::vector<std::tuple<int, int, std::string>>{},
           "extra: [(old world, old rank, absolute path)]: more copies of old rank files "
           "outside the job directory (the peer tier's, docs/DISTRIBUTED.md).")
      .def("list", &PyJobDir::List, py::arg("rank") = 0)
      .def("single_source", &PyJobDir::SingleSource, py::arg("step") = py::none(),
           "World size 1 beside set-aside files: 'own', 'reshard' or 'reshard_else_own'.")
      .def("record_restore", &PyJobDir::RecordRestore, py::arg("rank"), py::arg("counter"))
      .def("lineage", &PyJobDir::Lineage, py::arg("rank") = 0)
      .def("next_counter", &PyJobDir::NextCounter, py::arg("rank") = 0)
      .def("protected_counter", &PyJobDir::ProtectedCounter, py::arg("rank") = 0)
      .def("needs_set_aside", &PyJobDir::NeedsSetAside, py::arg("world_size"))
      .def("set_aside", &PyJobDir::SetAside, py::arg("world_size"))
      .def("set_aside_worlds", &PyJobDir::SetAsideWorlds)
      .def("write_agreed", &PyJobDir::WriteAgreed, py::arg("record"))
      .def("read_agreed", &PyJobDir::ReadAgreed, py::arg("rank") = 0);
  m.def("plan", &PlanBinding, py::arg("candidates"), py::arg("lineage") = py::none(),
        py::arg("step") = py::none(), py::arg("max_step") = py::none(),
        py::arg("exclude") = std::vector<uint64_t>{});
}

}  // namespace nonstop::py_bindings
