// nonstop._core's distributed decisions (include/nonstop/dist.h) for
// _distributed.py: Python gathers what each rank found over its gloo group and
// hands the lists here; every answer and every error line comes from C++.
// Pure and quick (no I/O): nothing blocks, so the GIL is kept.
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nonstop/dist.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

using dist::RankError;
using Gathered = std::optional<std::pair<int, std::string>>;  // (Status code, message)

std::optional<RankError> ErrorOf(const Gathered& g) {
  if (!g) return std::nullopt;
  return RankError{static_cast<StatusCode>(g->first), g->second};
}

}  // namespace

void InitDist(py::module_& m) {
  m.def("dist_join_errors", [](const std::vector<Gathered>& every) {
    std::vector<std::optional<RankError>> in;
    for (const Gathered& g : every) in.push_back(ErrorOf(g));
    Check(dist::JoinErrors(in));
  }, py::arg("every"),
        "Raises when any rank failed: every rank's None or (Status code, message), "
        "one line (dist.h JoinErrors).");
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
  m.def("dist_zero_global_ids", [](const std::vector<int64_t>& index,
                                   const std::vector<int64_t>& params,
                                   const std::vector<int64_t>& state_ids, const std::string& where) {
    return Take(dist::ZeroGlobalIds(index, params, state_ids, where));
  }, py::arg("index"), py::arg("params"), py::arg("state_ids"), py::arg("where"),
        "Each state id's global ZeRO index (dist.h ZeroGlobalIds).");
  m.def("dist_common_steps", &dist::CommonSteps, py::arg("every"),
        "The steps every rank's planned_steps list holds, in rank 0's order.");
  m.def("dist_no_common_step", [](const std::string& dir, int rank, std::optional<int64_t> step,
                                  const std::vector<std::vector<int64_t>>& every) {
    Check(dist::NoCommonStep(dir, rank, step, every));
  }, py::arg("dir"), py::arg("rank"), py::arg("step"), py::arg("every"),
        "No common step and nothing to reshard: returns on a fresh start, else raises.");
  m.def("dist_check_foreign", [](const std::string& dir, int world, const std::vector<bool>& every) {
    Check(dist::CheckForeign(dir, world, every));
  }, py::arg("dir"), py::arg("world"), py::arg("every"));
  m.def("dist_recover_step", [](const std::string& dir, const std::vector<int64_t>& order, size_t n,
                                const std::vector<std::pair<std::optional<std::string>, uint64_t>>&
                                    every) {
    std::vector<dist::StepRead> in;
    for (const auto& [err, run] : every) in.push_back({err, run});
    return Take(dist::DecideRecoverStep(dir, order, n, in));
  }, py::arg("dir"), py::arg("order"), py::arg("n"), py::arg("every"),
        "Every rank's (error or None, run id) of step order[n]: '' to restore it, a warning "
        "to fall back to order[n + 1]; raises when it was the last.");
  m.def("dist_memory", [](const std::vector<std::optional<std::string>>& whys) {
    dist::MemoryChoice c = dist::DecideMemory(whys);
    return std::make_pair(c.use, c.unused);
  }, py::arg("whys"), "(use the memory tier, 'rank R: why; ...' of the ranks that cannot).");
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

  using AR = dist::AgreementRounds;
  py::class_<AR>(m, "AgreementRounds")
      .def(py::init<>())
      .def("on_round", [](AR& a, const std::vector<std::vector<int64_t>>& every,
                          std::optional<int64_t> agreed, double now_s) {
        std::vector<dist::RoundOffer> in;
        for (const auto& g : every) {
          if (g.size() != 5) throw StatusError(Status::InvalidArgument("a round offer has 5 fields"));
          dist::RoundOffer r;
          r.offer.candidate = g[0];
          r.offer.committed = g[1];
          r.offer.started = g[2];
          r.stopping = g[3] != 0;
          r.newest = g[4];
          in.push_back(r);
        }
        const AR::Step s = a.OnRound(in, agreed, now_s);
        const char* kind = s.kind == AR::Step::Kind::kPin   ? "pin"
                           : s.kind == AR::Step::Kind::kAim ? "aim"
                                                            : "wait";
        return py::make_tuple(kind, s.aim, s.close, s.close_step);
      }, py::arg("every"), py::arg("agreed"), py::arg("now_s"),
           "Every rank's [candidate, committed, started, stopping, newest] -> (\"pin\"|\"aim\"|"
           "\"wait\", aim step, last round, step to record on closing or -1).")
      .def("pinned", &AR::Pinned, py::arg("now_s"))
      .def("dropped", &AR::Dropped)
      .def("max_gap", &AR::MaxGap, py::arg("now_s") = py::none())
      .def_readonly("rounds", &AR::rounds)
      .def_readonly("agreements", &AR::agreements)
      .def_readonly("candidate_drops", &AR::candidate_drops)
      .def_readonly("max_drops_in_row", &AR::max_drops_in_row);

  using RA = dist::ReshardAgreement;
  auto next_name = [](RA::Next n) {
    switch (n) {
      case RA::Next::kNone: return "none";
      case RA::Next::kRetry: return "retry";
      case RA::Next::kProceed: return "proceed";
      case RA::Next::kDone: return "done";
    }
    return "?";
  };
  py::class_<RA>(m, "ReshardAgreement")
      .def(py::init<std::string, int>(), py::arg("dir"), py::arg("world"))
      .def_property_readonly("max_step", &RA::max_step)
      .def_property_readonly("key", [](const RA& a) {
        return py::make_tuple(a.key().old_world, a.key().step, a.key().run_id);
      })
      .def_property_readonly("warning", &RA::warning)
      .def("on_picks", [next_name](RA& a,
                                   const std::vector<std::pair<Gathered, std::optional<std::tuple<
                                       int, int64_t, uint64_t>>>>& every) {
        std::vector<RA::Pick> in;
        for (const auto& [err, key] : every) {
          RA::Pick p{ErrorOf(err), std::nullopt};
          if (key) p.key = dist::ReshardKey{std::get<0>(*key), std::get<1>(*key), std::get<2>(*key)};
          in.push_back(std::move(p));
        }
        return std::string(next_name(Take(a.OnPicks(in))));
      }, py::arg("every"), "Every rank's (error or None, (old world, step, run id) or None).")
      .def("on_rebuilt", [next_name](RA& a,
                                     const std::vector<std::pair<std::optional<std::string>,
                                                                 std::optional<std::string>>>& every,
                                     const std::string& archive) {
        std::vector<RA::Rebuilt> in;
        for (const auto& [err, fatal] : every) in.push_back({err, fatal});
        return std::string(next_name(Take(a.OnRebuilt(in, archive))));
      }, py::arg("every"), py::arg("archive"), "Every rank's (damage or None, fatal or None).");
}

}  // namespace nonstop::py_bindings
