// The CUDA engine's entry points in a build without CUDA: callers compile
// and link the same way in both builds and learn at run time why there is no
// CUDA engine.
#include "copy/cuda_copy_engine.h"

namespace nonstop {

int CudaDeviceCount(std::string* error) {
  if (error != nullptr) *error = "built without CUDA (configure with -DNONSTOP_CUDA=ON)";
  return 0;
}

Result<std::unique_ptr<CudaCopyEngine>> MakeCudaCopyEngine(
    const CudaCopyOptions& /*options*/, std::unique_ptr<CopyEngine> /*host_fallback*/) {
  return Status::Unavailable("built without CUDA (configure with -DNONSTOP_CUDA=ON)");
}

}  // namespace nonstop
