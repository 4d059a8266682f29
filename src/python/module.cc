// nonstop._core: the pybind11 module. Each binding file defines an Init*
// function called here; the module holds no checkpoint logic.
#include <pybind11/pybind11.h>

#include "nonstop/copy_engine.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nonstop::py_bindings {
void InitDist(py::module_& m);  // dist_bindings.cc (a distributed restart's decisions, dist.h)
void InitOptions(py::module_& m);  // options_bindings.cc (the Checkpointer's keywords, config=)
}  // namespace nonstop::py_bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "nonstop C++ engine bindings";
  m.def("built_with_cuda", &nonstop::BuiltWithCuda);
  nonstop::py_bindings::RegisterStatusTranslator(m);
  nonstop::py_bindings::InitEngine(m);
  nonstop::py_bindings::InitOptim(m);
  nonstop::py_bindings::InitMultistep(m);
  nonstop::py_bindings::InitRemote(m);
  nonstop::py_bindings::InitJobDir(m);
  nonstop::py_bindings::InitRestore(m);
  nonstop::py_bindings::InitSchedule(m);
  nonstop::py_bindings::InitEnv(m);
  nonstop::py_bindings::InitPeer(m);
  nonstop::py_bindings::InitDist(m);
  nonstop::py_bindings::InitOptions(m);
}
