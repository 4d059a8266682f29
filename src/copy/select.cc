// Placeholder until the engine module lands: reports the build's CUDA support.
#include "nonstop/copy_engine.h"

namespace nonstop {
bool BuiltWithCuda() {
#ifdef NONSTOP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}
}  // namespace nonstop
