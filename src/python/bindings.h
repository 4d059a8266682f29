// Each binding file of nonstop._core defines one Init* function; module.cc
// calls them all. Owners: engine/store bindings (Python front end), optim
// bindings (CPU optimizer replay).
#pragma once

#include <pybind11/pybind11.h>

namespace nonstop::py_bindings {
void InitEngine(pybind11::module_& m);
void InitOptim(pybind11::module_& m);
void InitMultistep(pybind11::module_& m);  // multistep_bindings.cc (GoCkpt schedule)
}  // namespace nonstop::py_bindings
