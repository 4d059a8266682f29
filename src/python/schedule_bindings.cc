// _core.Schedule: when a checkpoint is due (engine/schedule.h). Pure
// arithmetic on the training thread: no GIL release, nothing blocks.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "engine/layerwise_book.h"
#include "engine/mode_choice.h"
#include "engine/preempt.h"
#include "engine/schedule.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {

void InitSchedule(py::module_& m) {
  py::class_<Schedule>(m, "Schedule")
      .def_static("every", [](int64_t n) { return Take(Schedule::Every(n)); }, py::arg("n"))
      .def_static(
          "auto",
          [](double target, double alpha, int64_t warmup, int64_t min_interval,
             int64_t max_interval) {
            return Take(Schedule::Auto({target, alpha, warmup, min_interval, max_interval}));
          },
          py::arg("target") = 0.03, py::arg("alpha") = 0.3, py::arg("warmup") = 2,
          py::arg("min_interval") = 1, py::arg("max_interval") = 100000)
      .def_property_readonly("is_auto", &Schedule::is_auto)
      .def_property_readonly("every_n", &Schedule::every)
      .def("due_after", [](const Schedule& s, int64_t step) { return Take(s.DueAfter(step)); },
           py::arg("step"))
      .def("observe_step", &Schedule::ObserveStep, py::arg("stall_total_s"), py::arg("now_s"))
      .def("started", &Schedule::Started, py::arg("stall_total_s"), py::arg("now_s"))
      .def("observe_persist", &Schedule::ObservePersist, py::arg("persist_s"),
           py::arg("max_in_flight"))
      .def(
          "observe_commits",
          [](Schedule& s, const py::iterable& recent, int max_in_flight) {
            for (const auto& item : recent) {  // engine stats()["recent"]: dicts
              const auto r = item.cast<py::dict>();
              if (!r.contains("committed") || !py::bool_(r["committed"])) continue;
              s.ObserveCommitted(r.contains("counter") ? r["counter"].cast<uint64_t>() : 0,
                                 r.contains("persist_s") ? r["persist_s"].cast<double>() : 0.0,
                                 max_in_flight);
            }
          },
          py::arg("recent"), py::arg("max_in_flight"),
          "ObserveCommitted for each committed checkpoint of the engine's stats()['recent']")
      .def("state", [](const Schedule& s) {
        const AutoScheduleState st = s.State();
        py::dict d;
        d["target"] = st.target;
        d["interval"] = st.interval;
        d["overhead"] = st.overhead;
        d["step_s"] = st.step_s;
        d["ckpt_stall_s"] = st.ckpt_stall_s;
        d["persist_s"] = st.persist_s;
        d["budget_s"] = st.budget_s;
        d["checkpoints"] = st.checkpoints;
        d["steps"] = st.steps;
        d["last_interval"] = st.last_interval;
        return d;
      });

  m.def(
      "check_layerwise",
      [](bool zero, int64_t world_size, int64_t ddp_models, bool find_unused, bool auto_mode) {
        Check(CheckLayerwise({zero, world_size, ddp_models, find_unused, auto_mode}));
      },
      py::arg("zero"), py::arg("world_size"), py::arg("ddp_models"), py::arg("find_unused"),
      py::arg("auto_mode") = false,
      "mode='layerwise': one line where it cannot run (engine/mode_choice.h).");
  // mode="auto": layer-wise or concurrent from measured windows (engine/mode_choice.h).
  py::class_<ModeChooser>(m, "ModeChooser")
      .def(py::init([](int64_t rounds, int64_t settle, double margin, int64_t patience,
                       double alpha) {
             return Take(ModeChooser::Make({rounds, settle, margin, patience, alpha}));
           }),
           py::arg("rounds") = 2, py::arg("settle") = 1, py::arg("margin") = 0.05,
           py::arg("patience") = 3, py::arg("alpha") = 0.3)
      .def_property_readonly("active",
                             [](const ModeChooser& c) { return CkptModeName(c.active()); })
      .def_property_readonly("decided", &ModeChooser::decided)
      .def(
          "observe",
          [](ModeChooser& c, int64_t steps, double wall_s, double stall_s, int64_t checkpoints) {
            return std::string(CkptModeName(c.Observe({steps, wall_s, stall_s, checkpoints})));
          },
          py::arg("steps"), py::arg("wall_s"), py::arg("stall_s"), py::arg("checkpoints"))
      .def("start", &ModeChooser::Start, py::arg("now_s"), py::arg("stall_total_s"))
      .def(
          "step",
          [](ModeChooser& c, double now_s, double stall_total_s, bool checkpoint) {
            return std::string(CkptModeName(c.Step(now_s, stall_total_s, checkpoint)));
          },
          py::arg("now_s"), py::arg("stall_total_s"), py::arg("checkpoint"))
      .def("pin", &ModeChooser::Pin, py::arg("why"))
      .def("state", [](const ModeChooser& c) {
        const ModeChoiceState st = c.State();
        py::dict d;
        d["active"] = CkptModeName(st.active);
        d["decided"] = st.decided;
        d["windows"] = st.windows;
        d["switches"] = st.switches;
        d["reason"] = st.reason;
        for (CkptMode m : {CkptMode::kConcurrent, CkptMode::kLayerwise}) {
          const ModeFigures& f = st.modes[static_cast<int>(m)];
          py::dict fd;
          fd["windows"] = f.windows;
          fd["step_s"] = f.step_s;
          fd["stall_per_checkpoint_s"] = f.stall_per_ckpt_s;
          fd["busy_step_s"] = f.busy_step_s;
          d[CkptModeName(m)] = fd;
        }
        return d;
      });

  // mode="layerwise": which engine tensors to hand over and wait for
  // (engine/layerwise_book.h); the driver issues the engine calls.
  py::class_<LayerwiseBook>(m, "LayerwiseBook")
      .def(py::init<uint64_t, std::vector<int>>(), py::arg("group_bytes"), py::arg("devices"))
      .def("plan", &LayerwiseBook::Plan, py::arg("ref_ptrs"), py::arg("param_ptrs"))
      .def("open", &LayerwiseBook::Open)
      .def(
          "update",
          [](LayerwiseBook& b, const std::vector<uint32_t>& ids) {
            LayerwiseBook::Before r = b.Update(ids);
            return py::make_tuple(r.copy, r.waits);
          },
          py::arg("ids"))
      .def("updated", &LayerwiseBook::Updated, py::arg("id"), py::arg("bytes"))
      .def("flush", &LayerwiseBook::Flush)
      .def("seal", &LayerwiseBook::Seal)
      .def("reset", &LayerwiseBook::Reset);

  // A preemption notice (engine/preempt.h): `recent` is Engine.stats()["recent"];
  // the estimates return (line, expected_s). Nothing blocks: no GIL release.
  m.def(
      "persist_bandwidth",
      [](const py::list& recent) {
        std::vector<PersistSample> v;
        for (py::handle h : recent) {
          py::object get = h.attr("get");
          v.push_back({py::bool_(get("committed", false)), get("bytes", 0).cast<double>(),
                       get("persist_s", 0).cast<double>()});
        }
        return PersistBandwidth(v);
      },
      py::arg("recent"));
  m.def(
      "preempt_estimate",
      [](std::string reason, int64_t rank, std::optional<int64_t> notice_step, int64_t state_bytes,
         std::optional<double> bandwidth, std::optional<double> step_s, int64_t lag_steps,
         std::optional<double> grace_s, std::optional<int64_t> latest) {
        PreemptEstimate e = EstimatePreempt({std::move(reason), rank, notice_step, state_bytes,
                                             bandwidth, step_s, lag_steps, grace_s, latest});
        return py::make_tuple(e.line, e.expected_s);
      },
      py::kw_only(), py::arg("reason"), py::arg("rank"), py::arg("notice_step"),
      py::arg("state_bytes"), py::arg("bandwidth"), py::arg("step_s"), py::arg("lag_steps"),
      py::arg("grace_s"), py::arg("latest"));
  m.def(
      "preempt_options",
      [](std::string_view json) {
        PreemptOptions o = Take(ParsePreemptOptions(json));
        py::dict d;
        d["signals"] = o.signals;
        d["exit_code"] = o.exit_code;
        d["grace_s"] = o.grace_s;
        d["chain"] = o.chain;
        d["timeout_s"] = o.timeout_s;
        return d;
      },
      py::arg("json"), "on_preempt's settings but group, from their JSON (engine/preempt.h).");
  m.def(
      "preempt_outcome",
      [](std::string reason, int64_t step, bool committed, std::optional<int64_t> latest,
         double notice_to_safe_s, double checkpoint_s, int exit_code, std::string error) {
        const PreemptOutcome o{std::move(reason), step,         committed, latest,
                               notice_to_safe_s,  checkpoint_s, exit_code, std::move(error)};
        return py::make_tuple(PreemptExitLine(o), PreemptedMessage(o));
      },
      py::kw_only(), py::arg("reason"), py::arg("step"), py::arg("committed"), py::arg("latest"),
      py::arg("notice_to_safe_s"), py::arg("checkpoint_s"), py::arg("exit_code"),
      py::arg("error"), "(the line printed before the exit, str(Preempted)) (engine/preempt.h).");
  py::class_<PreemptNotices>(m, "PreemptNotices")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("world"))
      .def("notice", &PreemptNotices::Notice, py::arg("reason"), py::arg("step"),
           py::arg("now_s"))
      .def("boundary", &PreemptNotices::Boundary, py::arg("step"), py::arg("now_s"))
      .def("flag", &PreemptNotices::Flag)
      .def("first_rank", &PreemptNotices::FirstRank, py::arg("reduced"))
      .def("handled_at", &PreemptNotices::HandledAt, py::arg("step"))
      .def(
          "estimate",
          [](const PreemptNotices& n, int64_t state_bytes, std::optional<double> bandwidth,
             std::optional<double> grace_s, std::optional<int64_t> latest) {
            PreemptEstimate e = n.Estimate(state_bytes, bandwidth, grace_s, latest);
            return py::make_tuple(e.line, e.expected_s);
          },
          py::arg("state_bytes"), py::arg("bandwidth"), py::arg("grace_s"), py::arg("latest"))
      .def_property_readonly("noticed", &PreemptNotices::noticed)
      .def_property_readonly("notice_s", &PreemptNotices::notice_s)
      .def_property_readonly("reason", &PreemptNotices::reason)
      .def_property_readonly("notice_step", &PreemptNotices::notice_step)
      .def_property_readonly("step_s", &PreemptNotices::step_s);
}

}  // namespace nonstop::py_bindings
