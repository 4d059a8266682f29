// The pieces of nonstop._core that several binding files use (bindings.h).
#include "python/bindings.h"

#include <pybind11/stl.h>

#include <utility>

#include "nonstop/medium.h"

namespace py = pybind11;

namespace nonstop::py_bindings {

void RegisterStatusTranslator() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object classes = py::module_::import("nonstop.errors").attr("BY_STATUS_CODE");
      py::object cls = classes.attr("get")(static_cast<int>(e.status().code()),
                                           py::module_::import("builtins").attr("RuntimeError"));
      PyErr_SetString(cls.ptr(), e.status().message().c_str());
    }
  });
}

EngineOptions EngineOptionsFromPy(const std::string& dir, uint32_t rank, uint32_t world_size,
                                  int max_in_flight, int writers, uint64_t staging_bytes,
                                  uint64_t chunk_bytes, int copy_threads,
                                  const std::string& medium, uint64_t keep_every) {
  EngineOptions o;
  o.dir = dir;
  o.rank = rank;
  o.world_size = world_size;
  o.max_in_flight = max_in_flight;
  o.writers = writers;
  o.staging_bytes = staging_bytes;
  o.chunk_bytes = chunk_bytes;
  o.copy_threads = copy_threads;
  o.keep_every = keep_every;
  if (!ParseMediumKind(medium, &o.medium)) {
    throw StatusError(Status::InvalidArgument(
        "unknown medium '" + medium + "'; use auto, buffered, direct, uring, mmap or pmem"));
  }
  return o;
}

optim::StepHyperparameters HyperparametersFromGroup(const py::dict& group) {
  optim::StepHyperparameters h;
  h.lr = DictGet<double>(group, "lr", h.lr);
  if (group.contains("betas") && !group["betas"].is_none()) {
    auto betas = group["betas"].cast<std::pair<double, double>>();
    h.beta1 = betas.first;
    h.beta2 = betas.second;
  }
  h.eps = DictGet<double>(group, "eps", h.eps);
  h.weight_decay = DictGet<double>(group, "weight_decay", h.weight_decay);
  h.momentum = DictGet<double>(group, "momentum", h.momentum);
  h.dampening = DictGet<double>(group, "dampening", h.dampening);
  h.nesterov = DictGet<bool>(group, "nesterov", h.nesterov);
  h.maximize = DictGet<bool>(group, "maximize", h.maximize);
  return h;
}

}  // namespace nonstop::py_bindings
