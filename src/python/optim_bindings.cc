#include "python/bindings.h"

namespace nonstop::py_bindings {
void InitOptim(pybind11::module_& /*m*/) {}
}  // namespace nonstop::py_bindings
