// Bindings of the multi-step (GoCkpt) schedule, nonstop/multistep.h, as
// nonstop._core.Multistep. It owns its Engine (the schedule makes every engine
// call itself) and takes tensors as plain numbers: this module never sees
// torch. Every method that may block releases the GIL.
#include <unistd.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/jobdir.h"
#include "nonstop/medium.h"
#include "nonstop/multistep.h"
#include "nonstop/optim.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
namespace {

// A torch device ("cpu", "cuda" or "cuda:N"; ChooseMultistep and
// CheckMultistepDevice refuse others) as the engine's; `stream` for CUDA.
Device DeviceOf(const std::string& device, uintptr_t stream) {
  const size_t colon = device.find(':');
  Device d;
  d.kind = device.compare(0, 4, "cuda") == 0 ? DeviceKind::kCuda : DeviceKind::kHost;
  d.index = colon == std::string::npos ? 0 : std::stoi(device.substr(colon + 1));
  d.stream = d.kind == DeviceKind::kCuda ? stream : 0;
  return d;
}

DType DTypeFromCode(int code, const std::string& what) {
  if (code < 0 || code >= kNumDTypes) {
    throw StatusError(
        Status::InvalidArgument(what + ": unknown dtype code " + std::to_string(code)));
  }
  return static_cast<DType>(code);
}

// (name, numel, group, torch device, param, exp_avg, exp_avg_sq,
//  max_exp_avg_sq, momentum_buffer, step); pointers 0 when absent.
using PyOptimizerTensor = std::tuple<std::string, size_t, int, std::string, uintptr_t, uintptr_t,
                                     uintptr_t, uintptr_t, uintptr_t, double>;

std::vector<OptimizerTensor> ToTensors(const std::vector<PyOptimizerTensor>& in,
                                       uintptr_t stream = 0) {
  std::vector<OptimizerTensor> out;
  out.reserve(in.size());
  for (const auto& [name, numel, group, device, p, m, v, vmax, mom, step] : in) {
    OptimizerTensor t;
    t.name = name;
    t.numel = numel;
    t.group = group;
    t.device = DeviceOf(device, stream);
    t.param = reinterpret_cast<const float*>(p);
    t.exp_avg = reinterpret_cast<const float*>(m);
    t.exp_avg_sq = reinterpret_cast<const float*>(v);
    t.max_exp_avg_sq = reinterpret_cast<const float*>(vmax);
    t.momentum_buffer = reinterpret_cast<const float*>(mom);
    t.step = step;
    out.push_back(std::move(t));
  }
  return out;
}

// (name, dtype code, shape, nbytes, data_ptr, torch device): every tensor
// of the state; SetOutputs finds the optimizer's own.
using PyOutput =
    std::tuple<std::string, int, std::vector<int64_t>, uint64_t, uintptr_t, std::string>;

py::dict WindowDict(const MultistepWindowStats& w) {
  py::dict d;
  d["begin_step"] = w.begin_step;
  d["version"] = w.version;
  d["counter"] = w.counter;
  d["stall_s"] = w.stall_s;
  d["state_wait_s"] = w.state_wait_s;
  d["grad_wait_s"] = w.grad_wait_s;
  d["state_bytes"] = w.state_bytes;
  d["grad_bytes"] = w.grad_bytes;
  d["skipped_steps"] = w.skipped_steps;
  d["replay_s"] = w.replay_s;
  d["window_s"] = w.window_s;
  d["error"] = w.error;
  return d;
}

class PyMultistep {
 public:
  PyMultistep(const EngineOptions& eo, const MultistepOptions& mo)
      : pid_(getpid()), replay_(mo.replay) {
    py::gil_scoped_release release;
    engine_ = Take(Engine::Open(eo));
    ms_ = Take(MultistepCheckpoint::Create(engine_.get(), mo));
  }
  ~PyMultistep() {
    if (getpid() != pid_) {  // a forked child: the threads are the parent's; never wait on them
      (void)ms_.release();
      (void)engine_.release();
      return;
    }
    py::gil_scoped_release release;
    if (ms_) (void)ms_->Close();
    if (engine_) (void)engine_->Close();
  }

  // stream: the CUDA stream the optimizer updates on (copies are ordered after it).
  void Begin(int64_t step, const std::string& algorithm, bool amsgrad,
             const std::vector<PyOptimizerTensor>& tensors, uintptr_t stream) {
    optim::OptimizerConfig c;
    if (algorithm == "adamw") {
      c.algorithm = optim::Algorithm::kAdamW;
    } else if (algorithm == "adam") {
      c.algorithm = optim::Algorithm::kAdam;
    } else if (algorithm == "sgd") {
      c.algorithm = optim::Algorithm::kSgd;
    } else {
      throw StatusError(Status::InvalidArgument("multistep: unknown algorithm '" + algorithm +
                                                "'; use adamw, adam or sgd"));
    }
    c.amsgrad = amsgrad;
    auto t = ToTensors(tensors, stream);
    stream_ = stream;
    py::gil_scoped_release release;
    Check(Get().Begin(step, c, std::move(t)));
  }

  void OnBackwardBegin() {
    py::gil_scoped_release release;
    Check(Get().OnBackwardBegin());
  }

  // grads: (data_ptr or 0, dtype code) per tensor of begin(); all on `device`.
  void OnUpdateBegin(int64_t step, const py::list& groups, bool skipped,
                     const std::vector<std::pair<uintptr_t, int>>& grads,
                     const std::string& device, uintptr_t stream) {
    std::vector<optim::StepHyperparameters> hs;
    hs.reserve(groups.size());
    for (const auto& g : groups) hs.push_back(HyperparametersFromGroup(g.cast<py::dict>()));
    std::vector<GradRef> gs(grads.size());
    const Device dev = DeviceOf(device, stream);
    for (size_t i = 0; i < grads.size(); ++i) {
      gs[i].data = reinterpret_cast<const void*>(grads[i].first);
      gs[i].dtype = DTypeFromCode(grads[i].second, "gradient");
      gs[i].device = dev;
    }
    py::gil_scoped_release release;
    Check(Get().OnUpdateBegin(step, hs, skipped, gs));
  }

  void OnUpdateEnd(int64_t step, const std::optional<std::vector<PyOptimizerTensor>>& refreshed) {
    std::vector<OptimizerTensor> r;
    if (refreshed) r = ToTensors(*refreshed, stream_);
    py::gil_scoped_release release;
    Check(Get().OnUpdateEnd(step, r));
  }

  // stream: the CUDA stream the optimizer updates on (the CUDA tensors' copies wait for it).
  void SetOutputs(const std::vector<PyOutput>& outputs, std::string meta_json, uintptr_t stream) {
    std::vector<OutputTensor> out;
    out.reserve(outputs.size());
    for (const auto& [name, dtype, shape, nbytes, ptr, device] : outputs) {
      Check(CheckMultistepDevice("tensor '" + name + "' of the state", device, replay_));
      OutputTensor o;
      o.spec.name = name;
      o.spec.dtype = DTypeFromCode(dtype, "tensor '" + name + "'");
      o.spec.shape = shape;
      o.spec.nbytes = nbytes;
      o.data = reinterpret_cast<const void*>(ptr);
      o.device = DeviceOf(device, stream);
      out.push_back(std::move(o));
    }
    py::gil_scoped_release release;
    Check(Get().SetOutputs(std::move(out), std::move(meta_json)));
  }

  bool GradientCopiesPending() { return Get().GradientCopiesPending(); }
  bool active() { return Get().active(); }
  int64_t version() { return Get().version(); }
  void CountUpdate(bool scaler_inside) { Check(Get().CountUpdate(scaler_inside)); }
  int64_t next_step() { return Get().next_step(); }
  bool MarkStep(int64_t step, bool due) {
    py::gil_scoped_release release;  // a skipped step may wait for the window's copies
    return Take(Get().MarkStep(step, due));
  }
  bool RequestCheckpoint() { return Get().RequestCheckpoint(); }
  bool outputs_due() { return Get().outputs_due(); }
  bool needs_refresh() { return Get().needs_refresh(); }

  void Wait() {
    py::gil_scoped_release release;
    Check(Get().Wait());
  }

  std::optional<std::pair<uint64_t, int64_t>> Latest() {
    py::gil_scoped_release release;
    return CounterAndStep(Get().Latest());
  }

  void AdoptRestored(uint64_t counter) {
    py::gil_scoped_release release;
    Check(Get().AdoptRestored(counter));
  }
  // max_to_keep/best on the engine this schedule owns (JobDir::Retain).
  void SetRetention(uint64_t max_to_keep, const std::string& best_metric, bool best_higher,
                    uint64_t best_k) {
    Get();
    RetentionPolicy p = RetentionFromPy(max_to_keep, best_metric, best_higher, best_k);
    py::gil_scoped_release release;
    Check(engine_->SetRetention(p));
  }

  py::dict Stats() {
    MultistepStats s;
    EngineStats e;
    {
      py::gil_scoped_release release;
      s = Get().Stats();
      e = engine_->Stats();
    }
    py::dict d;
    d["windows"] = s.windows;
    d["persisted"] = s.persisted;
    d["failed"] = s.failed;
    d["stall_s_total"] = s.stall_s_total;
    d["host_bytes"] = s.host_bytes;
    d["staging_bytes"] = e.staging_bytes;  // the state is not in it: it is staged
    d["copy_engine"] = s.copy_engine;
    AddMemoryTierStats(d, e);  // its engine's restart tier in memory
    py::list recent;
    for (const auto& w : s.recent) recent.append(WindowDict(w));
    d["recent"] = recent;
    d["engine_committed"] = e.committed;
    d["engine_failed"] = e.failed;
    d["medium"] = e.medium;
    return d;
  }

  void Close() {
    if (!ms_) return;
    Status s, e;
    {
      py::gil_scoped_release release;
      s = ms_->Close();
      e = engine_->Close();
    }
    ms_.reset();
    engine_.reset();
    Check(s.ok() ? e : s);
  }

 private:
  pid_t pid_;
  MultistepReplay replay_;  // which devices the state's tensors may be on
  uintptr_t stream_ = 0;  // Begin's
  MultistepCheckpoint& Get() {
    if (!ms_) throw StatusError(Status::FailedPrecondition("the checkpointer is closed"));
    return *ms_;
  }
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<MultistepCheckpoint> ms_;
};

// ChooseMultistep's description of a torch optimizer, as plain values.
// Group: (fused, capturable, differentiable, foreach or None, torch picks
// foreach, amsgrad, decoupled_weight_decay, hyperparameter held as a tensor
// or ""). Tensor: (parameter index, state key or "", device, dtype, contiguous).
using PyGroupDesc =
    std::tuple<bool, bool, bool, std::optional<bool>, bool, bool, bool, std::string>;
using PyTensorDesc = std::tuple<int, std::string, std::string, std::string, bool>;

// (replay "host" or "torch", algorithm, amsgrad, the parameters' device)
std::tuple<std::string, std::string, bool, std::string> Choose(
    const std::string& name, bool torch_class, const std::vector<PyGroupDesc>& groups,
    const std::vector<PyTensorDesc>& tensors, const std::string& replay) {
  MultistepOptimizerDesc d;
  d.name = name;
  d.torch_class = torch_class;
  for (const auto& [fused, capturable, differentiable, foreach, picks, amsgrad, decoupled,
                    tensor] : groups) {
    d.groups.push_back({fused, capturable, differentiable, foreach, picks, amsgrad, decoupled,
                        tensor});
  }
  for (const auto& [param, state, device, dtype, contiguous] : tensors) {
    d.tensors.push_back({param, state, device, dtype, contiguous});
  }
  const MultistepChoice c = Take(ChooseMultistep(d, replay));
  const char* algorithm = c.algorithm == optim::Algorithm::kSgd    ? "sgd"
                          : c.algorithm == optim::Algorithm::kAdam ? "adam"
                                                                   : "adamw";
  return {c.replay == MultistepReplay::kHost ? "host" : "torch", algorithm, c.amsgrad, c.device};
}

}  // namespace

void InitMultistep(py::module_& m) {
  py::class_<PyMultistep> multistep(m, "Multistep");
  DefInitWithEngineOptions(
      multistep,
      py::init([](const std::string& dir, uint32_t rank, uint32_t world_size, int max_in_flight,
                  int writers, uint64_t staging_bytes, uint64_t chunk_bytes, int copy_threads,
                  const std::string& medium, int parts, uint64_t block_bytes,
                  bool overlap_gradients, int replay_threads, uintptr_t mkl_vms_sqrt,
                  uint64_t keep_every, const std::string& memory_tier,
                  const std::string& replay, const py::kwargs& other) {
        // The Python front end passes the engine's whole set of options
        // (_options.engine_kwargs): those this schedule does not take yet
        // must be unset; the window's staging is its own.
        for (const auto& [key, value] : other) {
          const std::string k = py::str(key);
          const bool set = py::bool_(py::reinterpret_borrow<py::object>(value));
          if (set && k != "small_initial_staging") {
            throw StatusError(
                Status::InvalidArgument("mode='multistep' does not support " + k + " yet"));
          }
        }
        EngineOptions o =
            EngineOptionsFromPy(dir, rank, world_size, max_in_flight, writers, staging_bytes,
                                chunk_bytes, copy_threads, medium, keep_every);
        o.memory_tier = memory_tier;  // the restart tier in memory (memory_tier.h)
        MultistepOptions mo;
        mo.parts = parts;
        mo.block_bytes = block_bytes;
        mo.overlap_gradients = overlap_gradients;
        mo.replay_threads = replay_threads;
        mo.mkl_vms_sqrt = reinterpret_cast<optim::MklVmsSqrtFn>(mkl_vms_sqrt);
        if (replay == "host") {
          mo.replay = MultistepReplay::kHost;
        } else if (replay == "restore") {
          mo.replay = MultistepReplay::kRestore;
        } else {
          throw StatusError(Status::InvalidArgument("multistep: replay must be 'host' or "
                                                    "'restore', got '" + replay + "'"));
        }
        return std::make_unique<PyMultistep>(o, mo);
      }),
      py::arg("parts") = 7, py::arg("block_bytes") = 4ull << 20,
      py::arg("overlap_gradients") = true, py::arg("replay_threads") = 0,
      py::arg("mkl_vms_sqrt") = 0, py::arg("keep_every") = 0, py::arg("memory_tier") = "auto",
      py::arg("replay") = "host");
  m.def("multistep_choose", &Choose, py::arg("name"), py::arg("torch_class"), py::arg("groups"),
        py::arg("tensors"), py::arg("replay"),
        "mode='multistep': the replay and the optimizer checked (ChooseMultistep); "
        "(replay, algorithm, amsgrad, device)");
  m.def(
      "multistep_restore_check",
      [](const std::string& record_json, const std::string& plan_json, const std::string& torch,
         const std::string& device, const std::string& device_name,
         const std::string& optimizer, size_t groups, std::vector<uint64_t> param_numel,
         std::map<std::string, uint64_t> tensors, const std::string& where) {
        const MultistepRun run{torch, device, device_name, optimizer, groups,
                               std::move(param_numel), std::move(tensors)};
        py::gil_scoped_release release;
        Check(CheckMultistepRestore(record_json, plan_json, run, where));
      },
      py::arg("record_json"), py::arg("plan_json"), py::arg("torch"), py::arg("device"),
      py::arg("device_name"), py::arg("optimizer"), py::arg("groups"), py::arg("param_numel"),
      py::arg("tensors"), py::arg("where"),
      "replay='torch' at restore: this run's arithmetic and the plan checked "
      "(CheckMultistepRestore)");
  multistep
      .def("begin", &PyMultistep::Begin, py::arg("step"), py::arg("algorithm"),
           py::arg("amsgrad"), py::arg("tensors"), py::arg("stream") = 0,
           "tensors: (name, numel, group, torch device, param, exp_avg, exp_avg_sq, "
           "max_exp_avg_sq, momentum_buffer, step) per parameter; pointers 0 when absent.")
      .def("on_backward_begin", &PyMultistep::OnBackwardBegin)
      .def("on_update_begin", &PyMultistep::OnUpdateBegin, py::arg("step"), py::arg("groups"),
           py::arg("skipped"), py::arg("grads"), py::arg("device") = "cpu",
           py::arg("stream") = 0)
      .def("on_update_end", &PyMultistep::OnUpdateEnd, py::arg("step"),
           py::arg("refreshed") = py::none())
      .def("set_outputs", &PyMultistep::SetOutputs, py::arg("outputs"), py::arg("meta_json"),
           py::arg("stream") = 0)
      .def("gradient_copies_pending", &PyMultistep::GradientCopiesPending)
      .def_property_readonly("active", &PyMultistep::active)
      .def_property_readonly("version", &PyMultistep::version)
      .def("count_update", &PyMultistep::CountUpdate, py::arg("scaler_inside") = false)
      .def_property_readonly("next_step", &PyMultistep::next_step)
      .def("mark_step", &PyMultistep::MarkStep, py::arg("step"), py::arg("due"))
      .def("request_checkpoint", &PyMultistep::RequestCheckpoint)
      .def_property_readonly("outputs_due", &PyMultistep::outputs_due)
      .def_property_readonly("needs_refresh", &PyMultistep::needs_refresh)
      .def("wait", &PyMultistep::Wait)
      // The engine's interface, as the session calls it: nothing is read from
      // the live tensors outside the hooks; every window's commit is waited for.
      .def("wait_copied", [](PyMultistep&) {})
      .def(
          "wait_committed", [](PyMultistep& m, uint64_t) { m.Wait(); }, py::arg("counter") = 0)
      .def("latest", &PyMultistep::Latest)
      .def("adopt_restored", &PyMultistep::AdoptRestored, py::arg("counter"))
      .def("set_retention", &PyMultistep::SetRetention, py::arg("max_to_keep") = 0,
           py::arg("best_metric") = "", py::arg("best_higher") = false, py::arg("best_k") = 0)
      .def("stats", &PyMultistep::Stats)
      .def("close", &PyMultistep::Close);
}

}  // namespace nonstop::py_bindings
