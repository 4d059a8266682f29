// MakeBestCopyEngine: the CUDA engine where this binary has CUDA and the
// machine a usable device, else the host engine with a note that says why.
#include <memory>
#include <string>
#include <utility>

#include "copy/cuda_copy_engine.h"
#include "nonstop/copy_engine.h"

namespace nonstop {

bool BuiltWithCuda() {
#ifdef NONSTOP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::unique_ptr<CopyEngine> MakeBestCopyEngine(int host_threads, std::string* note) {
  std::string why;
  if (BuiltWithCuda()) {
    // Host-resident tensors still go through the host engine's threads.
    auto cuda = MakeCudaCopyEngine(CudaCopyOptions{}, MakeHostCopyEngine(host_threads));
    if (cuda.ok()) {
      if (note != nullptr) *note = cuda.value()->Describe();
      return std::move(cuda).value();
    }
    why = cuda.status().message() + "; using host copies";
  } else {
    why = "built without CUDA; using host copies";
  }
  if (note != nullptr) *note = why;
  return MakeHostCopyEngine(host_threads);
}

}  // namespace nonstop
