// nonstop._core's distributed decisions (include/nonstop/dist.h) for
// _distributed.py (and hf.py): every answer and every error line comes from
// C++. The pure ones are quick (no I/O) and keep the GIL; the drivers of the
// rounds (dist_recover, dist_reshard, dist_set_aside, dist_tidy_kept,
// dist_agree_on_step) run with the GIL released and call back into Python,
// taking it, for each gather (the Comm's, over the gloo group) and each read.
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "jobdir/planned_steps.h"
#include "nonstop/dist.h"
#include "plan/replica_check.h"
#include "python/bindings.h"
#include "restore/state_tree.h"

namespace py = pybind11;

namespace nonstop::py_bindings {

// bindings.cc: whether a Python exception is a checkpoint's failure
// (nonstop's CheckpointError or an OSError), not a bug or an interrupt.
bool IsCheckpointFailure(PyObject* exc);

namespace {

// A driver's Python hooks: each runs with the GIL taken. A checkpoint's
// failure (nonstop's error, an OSError) becomes a Status of its code and
// str() (kDamage: Corruption for any OSError too, the reshard's rule); any
// other exception (a bug, an interrupt), and with kRaise any at all (the
// process group's failure, a collective hook's error), is kept and the
// driver stops (Aborted): it is raised as it is afterwards.
class Hooks {
 public:
  enum class On { kLine, kDamage, kRaise };

  template <typename F>
  Status Call(F&& f, On on = On::kLine) {
    py::gil_scoped_acquire g;
    try {
      f();
      return Status::OK();
    } catch (py::error_already_set& e) {
      const std::string line = py::str(e.value()).cast<std::string>();
      if (on == On::kRaise || !IsCheckpointFailure(e.value().ptr())) {
        if (fatal_.is_none()) fatal_ = e.value();
        return Status::Aborted(line);
      }
      StatusCode code = StatusCodeOfException(e.value().ptr());
      if (on == On::kDamage && PyObject_IsInstance(e.value().ptr(), PyExc_OSError) == 1) {
        code = StatusCode::kCorruption;
      }
      PyErr_Clear();
      return Status(code == StatusCode::kAborted ? StatusCode::kInternal : code, line);
    } catch (py::cast_error& e) {  // a hook returned the wrong type: a bug
      if (fatal_.is_none()) {
        fatal_ = py::reinterpret_steal<py::object>(
            PyObject_CallFunction(PyExc_TypeError, "s", e.what()));
      }
      return Status::Aborted(e.what());
    }
  }

  // Every rank's text: the Comm's gather (JSON over the gloo group). The
  // texts are bytes; surrogateescape carries any byte through a str.
  dist::Gather Gather(const py::object& gather) {  // `gather` outlives the driver
    return [this, &gather](const std::string& mine) -> Result<std::vector<std::string>> {
      std::vector<std::string> out;
      Status s = Call([&] {
        py::object text = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(
            mine.data(), static_cast<Py_ssize_t>(mine.size()), "surrogateescape"));
        if (!text) throw py::error_already_set();
        for (py::handle t : gather(text)) {
          py::object b = py::reinterpret_steal<py::object>(
              PyUnicode_AsEncodedString(t.ptr(), "utf-8", "surrogateescape"));
          if (!b) throw py::error_already_set();
          out.push_back(b.cast<std::string>());
        }
      }, On::kRaise);
      if (s.ok()) return out;
      return s;
    };
  }

  // After the driver (GIL held): its warnings, then the hook's exception or its error.
  void Finish(const Status& s, const std::vector<std::string>& warnings, int stacklevel) {
    for (const std::string& w : warnings) {
      if (PyErr_WarnEx(PyExc_UserWarning, w.c_str(), stacklevel) < 0) throw py::error_already_set();
    }
    if (!fatal_.is_none()) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(fatal_.ptr())), fatal_.ptr());
      throw py::error_already_set();
    }
    Check(s);
  }

 private:
  py::object fatal_ = py::none();
};

// The rounds' clock (CLOCK_MONOTONIC, Python's time.monotonic()), in seconds.
double MonotonicS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

const char* KindName(dist::RecoverOutcome::Kind k) {
  switch (k) {
    case dist::RecoverOutcome::Kind::kFresh: return "fresh";
    case dist::RecoverOutcome::Kind::kResharded: return "resharded";
    case dist::RecoverOutcome::Kind::kRestored: return "restored";
  }
  return "?";
}

}  // namespace

void InitDist(py::module_& m) {
  m.def("dist_check_world", [](const std::string& replicated, int rank, int world,
                               bool initialized, int dist_rank, int dist_world) {
    Check(dist::CheckWorld(replicated, rank, world, initialized, dist_rank, dist_world));
  }, py::arg("replicated"), py::arg("rank"), py::arg("world"), py::arg("initialized"),
        py::arg("dist_rank"), py::arg("dist_world"),
        "Distributed's arguments against torch.distributed's (dist.h CheckWorld).");
  m.def("dist_shard", [](const std::vector<std::tuple<std::string, uint64_t, bool, bool>>& tensors,
                         int rank, int world) {
    std::vector<dist::ShardInput> in;
    for (const auto& [name, numel, rank0, contiguous] : tensors) {
      in.push_back({name, numel, rank0, contiguous});
    }
    std::vector<std::tuple<std::string, uint64_t, uint64_t, bool>> out;
    for (const auto& r : dist::Shard(in, rank, world)) out.emplace_back(r.name, r.begin, r.end, r.whole);
    return out;
  }, py::arg("tensors"), py::arg("rank"), py::arg("world"),
        "tensors: [(name, numel, rank 0 writes it whole, contiguous)] -> [(name, begin, end, "
        "whole)] of what this rank writes (dist.h Shard).");
  // State tree rewrites (restore/state_tree.h): (tree as JSON bytes, [(rank, old, new)]).
  auto rewrite = [](Result<TreeRewrite> r) {
    TreeRewrite t = Take(std::move(r));
    return py::make_tuple(py::bytes(t.tree), t.renames);
  };
  m.def("dist_consolidate_zero", [rewrite](const std::string& key,
                                           const std::vector<std::string>& trees,
                                           const std::vector<std::string>& layouts,
                                           const std::vector<std::vector<std::string>>& names) {
    return rewrite(ConsolidateZero(key, trees, layouts, names));
  }, py::arg("key"), py::arg("trees"), py::arg("layouts"), py::arg("names"),
        "A ZeroRedundancyOptimizer's consolidated state tree from every old rank's tree, "
        "layout and tensor names (state_tree.h ConsolidateZero).");
  m.def("dist_rename_module_keys", [rewrite](const std::string& key, const std::string& tree,
                                             bool add, const std::vector<std::string>& names) {
    return rewrite(RenameModuleKeys(key, tree, add, names));
  }, py::arg("key"), py::arg("tree"), py::arg("add"), py::arg("names"),
        "A module's state tree between DDP's \"module.\" keys and none (state_tree.h "
        "RenameModuleKeys).");
  m.def("dist_check_reshardable", [](const std::string& archive, int old_world, int world,
                                     const std::vector<std::string>& local,
                                     const std::vector<std::string>& zero_keys,
                                     const std::vector<std::string>& live_zero) {
    Check(dist::CheckReshardable(archive, old_world, world, local, zero_keys, live_zero));
  }, py::arg("archive"), py::arg("old_world"), py::arg("world"), py::arg("local"),
        py::arg("zero_keys"), py::arg("live_zero"));
  m.def("dist_lay_out_shared",
        [](const std::vector<std::tuple<std::string, std::vector<int64_t>, std::string>>& shared,
           const std::vector<std::tuple<int, size_t, std::string, uint64_t, uint64_t>>& pieces,
           bool complete, const std::string& where, int64_t step) {
          std::vector<dist::SharedTensor> s;
          for (const auto& [name, shape, dtype] : shared) s.push_back({name, shape, dtype});
          std::vector<dist::Piece> p;
          for (const auto& [rank, handle, name, off, nbytes] : pieces) {
            p.push_back({rank, handle, name, off, nbytes});
          }
          dist::SharedLayout l = Take(dist::LayOutShared(s, p, complete, where, step));
          py::list tensors, copies;
          for (const auto& t : l.tensors) tensors.append(py::make_tuple(t.name, t.offset, t.nbytes));
          for (const auto& c : l.copies) {
            copies.append(py::make_tuple(c.rank, c.handle, c.offset, c.nbytes));
          }
          return py::make_tuple(tensors, l.total, copies);
        },
        py::arg("shared"), py::arg("pieces"), py::arg("complete"), py::arg("where"),
        py::arg("step"),
        "shared: [(name, shape, dtype)]; pieces: [(rank, handle, name, global offset in "
        "elements, nbytes)]. Returns ([(name, offset, nbytes)] by name, total bytes, [(rank, "
        "handle, offset, nbytes)]): where each piece's bytes go in one flat buffer.");
  m.def("dist_shard_rows", &dist::ShardRows, py::arg("d0"), py::arg("rank"), py::arg("world"),
        "(begin, end): the rows of dim 0 rank holds under Shard(0), torch.chunk's split "
        "(dist.h ShardRows).");
  m.def("dist_placement", [](const std::string& name, int mesh_ndim,
                             const std::vector<int64_t>& mesh_ranks, const std::string& mesh_text,
                             const std::string& placement, int world) {
    return Take(dist::DTensorPlacement(name, mesh_ndim, mesh_ranks, mesh_text, placement, world));
  }, py::arg("name"), py::arg("mesh_ndim"), py::arg("mesh_ranks"), py::arg("mesh_text"),
        py::arg("placement"), py::arg("world"),
        "'S0' or 'R': a DTensor's placement, checked (dist.h DTensorPlacement).");
  m.def("dist_shard_piece", [](const std::string& name, const std::vector<int64_t>& shape,
                               int rank, int world, std::optional<std::vector<int64_t>> local) {
    dist::ShardPiece p = Take(dist::ShardPieceOf(name, shape, rank, world, local));
    return py::make_tuple(p.offset, p.shape);
  }, py::arg("name"), py::arg("shape"), py::arg("rank"), py::arg("world"),
        py::arg("local") = py::none(),
        "(global offset in elements, shape) of this rank's Shard(0) piece; with `local`, the "
        "live piece's shape, checked (dist.h ShardPieceOf).");
  m.def("dist_plan_dtensor_reshard",
        [](const std::vector<std::tuple<std::string, std::vector<int64_t>, std::string,
                                        std::string>>& doc,
           const std::vector<std::tuple<int, size_t, std::string, uint64_t, uint64_t>>& pieces,
           int rank, int world, const std::string& where, int64_t step) {
          std::vector<dist::DTensorDoc> d;
          for (const auto& [name, shape, dtype, placement] : doc) {
            d.push_back({name, shape, dtype, placement});
          }
          std::vector<dist::Piece> p;
          for (const auto& [r, handle, name, off, nbytes] : pieces) {
            p.push_back({r, handle, name, off, nbytes});
          }
          dist::DTensorReshard plan =
              Take(dist::PlanDTensorReshard(d, p, rank, world, where, step));
          py::list tensors, copies;
          for (const auto& t : plan.tensors) {
            tensors.append(py::make_tuple(t.name, t.dtype, t.shape, t.offset, t.nbytes));
          }
          for (const auto& c : plan.copies) {
            copies.append(py::make_tuple(c.rank, c.handle, c.src, c.dst, c.nbytes));
          }
          return py::make_tuple(tensors, plan.total, copies);
        },
        py::arg("doc"), py::arg("pieces"), py::arg("rank"), py::arg("world"), py::arg("where"),
        py::arg("step"),
        "doc: [(name, global shape, dtype, 'S0'|'R')]; pieces: [(old rank, handle, name, global "
        "offset in elements, nbytes)]. Returns ([(name, dtype, local shape, offset, nbytes)], "
        "total bytes, [(old rank, handle, src, dst, nbytes)]): this rank's new pieces in one "
        "flat buffer and which old bytes fill them (dist.h PlanDTensorReshard).");
  m.def("dist_plan_dtensor_restore",
        [](const std::vector<std::tuple<std::string, std::vector<int64_t>, std::string,
                                        std::string>>& doc,
           int rank, int world, const std::vector<std::string>& live, bool any_mesh, int meshes,
           bool same) {
          std::vector<dist::DTensorDoc> d;
          for (const auto& [name, shape, dtype, placement] : doc) {
            d.push_back({name, shape, dtype, placement});
          }
          py::list out;
          for (const auto& r : Take(dist::PlanDTensorRestore(d, rank, world, live, any_mesh,
                                                              meshes, same))) {
            out.append(py::make_tuple(r.name, r.plain, r.live, r.shard, r.shape, r.local));
          }
          return out;
        },
        py::arg("doc"), py::arg("rank"), py::arg("world"), py::arg("live"), py::arg("any_mesh"),
        py::arg("meshes"), py::arg("same"),
        "doc: [(name, global shape, dtype, 'S0'|'R')]. Returns [(name, plain, on the live "
        "tensor's mesh, Shard(0), global shape, local shape)] in doc's order (dist.h "
        "PlanDTensorRestore).");

  m.def(
      "dist_recover",
      [](const std::string& dir, int rank, int world, std::optional<int64_t> step,
         std::optional<int64_t> peer_step, std::optional<int64_t> agreed, py::object gather,
         py::object check, py::object reshard, py::object open, py::object probe_memory,
         py::object read) {
        dist::RecoverRequest req;
        req.dir = dir;
        req.rank = rank;
        req.step = step;
        req.peer_step = peer_step;
        req.agreed = agreed;
        Hooks hk;
        dist::RecoverHooks h;
        h.gather = hk.Gather(gather);
        h.check = [&] { return hk.Call([&] { check(); }, Hooks::On::kRaise); };
        h.reshard = [&]() -> Result<bool> {
          bool got = false;
          Status s = hk.Call([&] { got = reshard().cast<bool>(); }, Hooks::On::kRaise);
          return s.ok() ? Result<bool>(got) : Result<bool>(s);
        };
        h.open = [&](int64_t s, bool peer) -> Result<uint64_t> {
          uint64_t run = 0;
          Status st = hk.Call([&] { run = open(s, peer).cast<uint64_t>(); });
          return st.ok() ? Result<uint64_t>(run) : Result<uint64_t>(st);
        };
        h.probe_memory = [&](int64_t s) -> Result<std::string> {
          std::string why;
          Status st = hk.Call([&] { why = probe_memory(s).cast<std::string>(); });
          return st.ok() ? Result<std::string>(why) : Result<std::string>(st);
        };
        h.read = [&](int64_t s, bool memory) { return hk.Call([&] { read(s, memory); }); };
        dist::RecoverOutcome out;
        Status s;
        {
          py::gil_scoped_release r;
          LocalSteps local = ListLocalSteps(dir, rank, world, step);
          req.error = std::move(local.error);
          req.mine = std::move(local.steps);
          req.foreign = local.foreign;
          s = dist::Recover(req, h, &out);
        }
        hk.Finish(s, out.warnings, 3);
        return py::make_tuple(KindName(out.kind), out.step, out.source, out.sources,
                              out.memory_unused);
      },
      py::arg("dir"), py::arg("rank"), py::arg("world"), py::arg("step"), py::arg("peer_step"),
      py::arg("agreed"), py::arg("gather"), py::arg("check"), py::arg("reshard"),
      py::arg("open"), py::arg("probe_memory"), py::arg("read"),
      "The recovery of a distributed restore, this rank's part, collective (dist.h Recover, "
      "over planned_steps.h ListLocalSteps of dir): the peer replica's step, the agreed "
      "step; hooks gather(text) -> every rank's text, check(), "
      "reshard() -> bool, open(step, peer) -> run id, probe_memory(step) -> '' or why, "
      "read(step, memory). Returns (\"fresh\"|\"resharded\"|\"restored\", step, source, "
      "every rank's source, memory unused because). Warnings are given; errors are one line.");
  m.def(
      "dist_reshard",
      [](const std::string& dir, int world, py::object gather, py::object pick,
         py::object rebuild, std::optional<std::string> missing) -> py::object {
        Hooks hk;
        dist::ReshardHooks h;
        h.gather = hk.Gather(gather);
        h.missing = std::move(missing);
        py::object picked = py::none();  // the last pick's dict, for rebuild
        h.pick = [&](std::optional<int64_t> max_step) -> Result<std::optional<dist::ReshardPick>> {
          std::optional<dist::ReshardPick> got;
          Status s = hk.Call([&] {
            picked = pick(max_step);
            if (picked.is_none()) return;
            const py::dict p = picked.cast<py::dict>();
            got = dist::ReshardPick{{p["old_world"].cast<int>(), p["step"].cast<int64_t>(),
                                     p["run_id"].cast<uint64_t>()},
                                    (std::filesystem::path(dir) /
                                     p["dir"].cast<std::string>()).string()};
          });
          return s.ok() ? Result<std::optional<dist::ReshardPick>>(got)
                        : Result<std::optional<dist::ReshardPick>>(s);
        };
        h.rebuild = [&](const dist::ReshardPick& p) {
          return hk.Call([&] { rebuild(picked, p.archive); }, Hooks::On::kDamage);
        };
        Result<std::optional<dist::ReshardKey>> got = Status::Internal("not run");
        std::vector<std::string> warnings;
        {
          py::gil_scoped_release r;
          got = dist::ReshardTogether(dir, world, h, &warnings);
        }
        hk.Finish(got.status(), warnings, 4);
        if (!got.value()) return py::none();
        const dist::ReshardKey& k = *got.value();
        return py::make_tuple(k.old_world, k.step, k.run_id);
      },
      py::arg("dir"), py::arg("world"), py::arg("gather"), py::arg("pick"), py::arg("rebuild"),
      py::arg("missing") = py::none(),
      "The reshard's rounds, collective (dist.h ReshardTogether): pick(max_step) -> None or "
      "JobDir.select_reshard's dict; rebuild(that dict, its archive dir under dir) "
      "(a CorruptCheckpointError or OSError: damage, all fall back); missing: this rank's line "
      "of the old files no peer held (a reshard from peers' memory). Returns (old world, step, "
      "run id) every rank rebuilt, or None: nothing to reshard.");

  m.def("dist_local_steps", [](const std::string& dir, int rank, int world,
                               std::optional<int64_t> step) {
    LocalSteps l;
    {
      py::gil_scoped_release r;
      l = ListLocalSteps(dir, rank, world, step);
    }
    return py::make_tuple(l.error, l.steps, l.foreign);
  }, py::arg("dir"), py::arg("rank"), py::arg("world"), py::arg("step") = py::none(),
        "(error line or None, planned steps, foreign rank files) of this rank's job directory "
        "(planned_steps.h ListLocalSteps): what it brings to dist_recover.");
  m.def("dist_agree_on_step", [](const std::string& dir, int rank, int world,
                                 std::optional<int64_t> step, py::object gather) {
    Hooks hk;
    const dist::Gather g = hk.Gather(gather);
    Result<std::optional<int64_t>> got = Status::Internal("not run");
    {
      py::gil_scoped_release r;
      got = AgreeOnStep(dir, rank, world, step, g);
    }
    hk.Finish(got.status(), {}, 1);
    return got.value();
  }, py::arg("dir"), py::arg("rank"), py::arg("world"), py::arg("step"), py::arg("gather"),
        "The step a Trainer resumes from, collective (planned_steps.h AgreeOnStep): the first "
        "step every rank committed, or None on a fresh start.");
  m.def("dist_tidy_kept", [](const std::string& dir, int rank, int world, py::object gather) {
    Hooks hk;
    const dist::Gather g = hk.Gather(gather);
    Result<std::vector<int64_t>> gone = Status::Internal("not run");
    {
      py::gil_scoped_release r;
      gone = TidyKeptTogether(dir, rank, world, g);
    }
    hk.Finish(gone.status(), {}, 1);
    return gone.value();
  }, py::arg("dir"), py::arg("rank"), py::arg("world"), py::arg("gather"),
        "max_to_keep/best with world_size > 1, collective, before the engine opens "
        "(planned_steps.h TidyKeptTogether): the steps whose kept copy this rank deleted.");
  m.def("dist_set_aside", [](const std::string& dir, int rank, int world, py::object gather) {
    Hooks hk;
    const dist::Gather g = hk.Gather(gather);
    Result<std::vector<int>> moved = Status::Internal("not run");
    {
      py::gil_scoped_release r;
      moved = SetAsideTogether(dir, rank, world, g);
    }
    std::vector<std::string> warnings, dirs;
    if (moved.ok() && !moved.value().empty()) {
      warnings.push_back(SetAsideWarning(dir, world, moved.value()));
    }
    hk.Finish(moved.status(), warnings, 4);
    for (int w : moved.value()) {
      dirs.push_back((std::filesystem::path(dir) / JobDirNames::World(w)).string());
    }
    return dirs;
  }, py::arg("dir"), py::arg("rank"), py::arg("world"), py::arg("gather"),
        "Rank files of another world size moved to dir/world-W/ for resharding, collective "
        "(planned_steps.h SetAsideTogether), with a warning: the directories this rank moved "
        "files into.");

  using AR = dist::AgreementRounds;
  py::class_<AR>(m, "AgreementRounds")
      .def(py::init<>())
      .def("round", [](AR& a, py::object engine, py::object gather, py::object record,
                       bool stopping, std::optional<int64_t> agreed) {
        // Each hook calls the engine's Python method (Engine's binding; or a
        // test's stand-in), with the GIL taken; errors are raised as they are.
        Hooks hk;
        auto call = [&](auto&& f) { return hk.Call(f, Hooks::On::kRaise); };
        using Newest = std::optional<std::pair<uint64_t, int64_t>>;
        AR::Hooks h;
        h.offer = [&]() -> Result<AgreeOffer> {
          AgreeOffer o;
          Status s = call([&] {
            auto [counter, step, committed, started] =
                engine.attr("agree_offer")()
                    .cast<std::tuple<std::optional<uint64_t>, int64_t, int64_t, int64_t>>();
            o = AgreeOffer{step, committed, started, counter.value_or(0)};
          });
          return s.ok() ? Result<AgreeOffer>(o) : Result<AgreeOffer>(s);
        };
        h.latest = [&]() -> Result<Newest> {
          Newest n;
          Status s = call([&] { n = engine.attr("latest")().cast<Newest>(); });
          return s.ok() ? Result<Newest>(n) : Result<Newest>(s);
        };
        h.gather = [&](const std::vector<int64_t>& mine) -> Result<std::vector<std::vector<int64_t>>> {
          std::vector<std::vector<int64_t>> every;
          Status s = call([&] { every = gather(mine).cast<std::vector<std::vector<int64_t>>>(); });
          if (s.ok()) return every;
          return s;
        };
        h.pin = [&](uint64_t counter) { return call([&] { engine.attr("pin")(counter); }); };
        h.aim = [&](int64_t step) -> Result<bool> {
          bool dropped = false;
          Status s = call([&] { dropped = engine.attr("aim")(step).cast<bool>(); });
          return s.ok() ? Result<bool>(dropped) : Result<bool>(s);
        };
        h.candidate = [&]() -> Result<std::optional<uint64_t>> {
          Newest c;
          Status s = call([&] { c = engine.attr("candidate")().cast<Newest>(); });
          if (!s.ok()) return s;
          return c ? std::optional<uint64_t>(c->first) : std::nullopt;
        };
        h.record = [&](uint64_t counter, int64_t step) {
          return call([&] { record(counter, step); });
        };
        h.now = MonotonicS;
        Result<bool> done = Status::Internal("not run");
        {
          py::gil_scoped_release r;
          done = a.Round(h, stopping, agreed);
        }
        hk.Finish(done.status(), {}, 1);
        return done.value();
      }, py::arg("engine"), py::arg("gather"), py::arg("record"), py::arg("stopping"),
           py::arg("agreed"),
           "One round of the agreement thread (dist.h AgreementRounds::Round) on `engine` "
           "(agree_offer, latest, pin, aim, candidate: Engine's methods); gather([candidate, "
           "committed, started, stopping, newest]) -> every rank's; record(counter, step) "
           "writes the agreed record. True after the last round.")
      .def("stats", [](AR& a, bool running) {
        py::dict d;
        d["rounds"] = a.rounds;
        d["agreements"] = a.agreements;
        d["candidate_drops"] = a.candidate_drops;
        d["max_drops_in_row"] = a.max_drops_in_row;
        std::optional<double> now;
        if (running) now = MonotonicS();
        d["max_agree_gap_s"] = a.MaxGap(now);
        return d;
      }, py::arg("running"),
           "The progress counters; with `running`, the gap still open (no agreement since) "
           "counts too.")
      .def_readonly("rounds", &AR::rounds);

  // Replicated means equal (_replica.py): on the gathered names' counts, then digests.
  m.def(
      "check_replica_names",
      [](int rank, const std::vector<std::vector<int64_t>>& heads) {
        Check(dist::CheckReplicaNames(rank, heads));
      },
      py::arg("rank"), py::arg("heads"));
  m.def(
      "check_replica_digests",
      [](const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& digests) {
        Check(dist::CheckReplicaDigests(names, digests));
      },
      py::arg("names"), py::arg("digests"));
}

}  // namespace nonstop::py_bindings
