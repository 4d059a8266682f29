// The pieces of nonstop._core that several binding files use (bindings.h).
#include "python/bindings.h"

#include <pybind11/stl.h>

#include <utility>

#include "nonstop/medium.h"

namespace py = pybind11;

namespace nonstop::py_bindings {

namespace {

// The Python class raised for each StatusCode, registered by the nonstop
// package at import (RegisterErrorClasses). Strong references, kept for the
// life of the process: the translator may run until the interpreter ends.
// Written and read with the GIL held.
constexpr int kNumStatusCodes = static_cast<int>(StatusCode::kInternal) + 1;
PyObject* g_error_classes[kNumStatusCodes] = {};

// Takes nonstop.errors.BY_STATUS_CODE ({code: class}). Every non-OK code must
// map to an exception class; nothing is changed unless all of them do.
void RegisterErrorClasses(const py::dict& by_code) {
  PyObject* classes[kNumStatusCodes] = {};
  for (int code = 1; code < kNumStatusCodes; ++code) {
    py::object key = py::int_(code);
    if (!by_code.contains(key)) {
      throw py::value_error("register_errors: no class for status code " + std::to_string(code));
    }
    py::object cls = by_code[key];
    if (!PyExceptionClass_Check(cls.ptr())) {
      throw py::type_error("register_errors: the class for status code " +
                           std::to_string(code) + " is not an exception class");
    }
    classes[code] = cls.ptr();
  }
  for (int code = 1; code < kNumStatusCodes; ++code) {
    Py_INCREF(classes[code]);
    Py_XDECREF(g_error_classes[code]);
    g_error_classes[code] = classes[code];
  }
}

}  // namespace

void RegisterStatusTranslator(py::module_& m) {
  m.def("register_errors", &RegisterErrorClasses, py::arg("by_status_code"),
        "Sets the exception class raised for each nonstop Status code (the nonstop "
        "package passes nonstop.errors.BY_STATUS_CODE at import).");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const int code = static_cast<int>(e.status().code());
      PyObject* cls = code > 0 && code < kNumStatusCodes ? g_error_classes[code] : nullptr;
      PyErr_SetString(cls != nullptr ? cls : PyExc_RuntimeError, e.status().message().c_str());
    }
  });
}

bool IsCheckpointFailure(PyObject* exc) {
  PyObject* base = g_error_classes[static_cast<int>(StatusCode::kInternal)];  // CheckpointError
  const bool ours = base != nullptr && PyObject_IsInstance(exc, base) == 1;
  const bool os = PyObject_IsInstance(exc, PyExc_OSError) == 1;
  PyErr_Clear();
  return ours || os;
}

StatusCode StatusCodeOfException(PyObject* exc) {
  // the specific classes before kAborted..kInternal (nonstop.errors: all
  // three are CheckpointError, the base of the others)
  constexpr StatusCode kOrder[] = {StatusCode::kNotFound, StatusCode::kCorruption,
                                   StatusCode::kFailedPrecondition, StatusCode::kInvalidArgument,
                                   StatusCode::kIOError};
  for (StatusCode c : kOrder) {
    PyObject* cls = g_error_classes[static_cast<int>(c)];
    if (cls != nullptr && PyObject_IsInstance(exc, cls) == 1) return c;
  }
  if (PyObject_IsInstance(exc, PyExc_FileNotFoundError) == 1) return StatusCode::kNotFound;
  if (PyObject_IsInstance(exc, PyExc_OSError) == 1) return StatusCode::kIOError;
  PyErr_Clear();
  return StatusCode::kInternal;
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
