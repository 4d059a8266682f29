// MakeBestCopyEngine: the CUDA engine where this binary has CUDA and the
// machine a usable device, else the host engine with a note that says why.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "copy/cuda_copy_engine.h"
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

#ifndef NONSTOP_HAVE_HOST_COPY_ENGINE
// Stands in for MakeHostCopyEngine until the engine module's memcpy threads
// land (cuda.cmake defines NONSTOP_HAVE_HOST_COPY_ENGINE once they do): a
// synchronous memcpy into page-aligned, pre-faulted memory.
class InlineHostCopyEngine : public CopyEngine {
 public:
  class Done : public CopyCompletion {
   public:
    explicit Done(Status s) : status_(std::move(s)) {}
    Status Wait() override { return status_; }
    bool Ready() override { return true; }

   private:
    Status status_;
  };

  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device& src_device, void* dst,
                                       size_t bytes) override {
    if (src_device.kind != DeviceKind::kHost) {
      return std::make_unique<Done>(
          Status::Unavailable("a CUDA tensor reached the host copy engine: no usable CUDA device"));
    }
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return std::make_unique<Done>(Status::OK());
  }
  void* AllocHost(size_t bytes, bool* pinned) override {
    if (pinned != nullptr) *pinned = false;
    size_t rounded = (bytes + 4095) & ~size_t{4095};
    if (rounded == 0) return nullptr;
    void* p = std::aligned_alloc(4096, rounded);
    if (p != nullptr) std::memset(p, 0, rounded);  // pre-fault
    return p;
  }
  void FreeHost(void* p, size_t /*bytes*/) override { std::free(p); }
  std::string Describe() const override { return "host copy engine: memcpy in the caller"; }
};
#endif

std::unique_ptr<CopyEngine> MakeHostEngine(int threads) {
#ifdef NONSTOP_HAVE_HOST_COPY_ENGINE
  return MakeHostCopyEngine(threads);
#else
  (void)threads;
  return std::make_unique<InlineHostCopyEngine>();
#endif
}

}  // namespace

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
    auto cuda = MakeCudaCopyEngine(CudaCopyOptions{}, MakeHostEngine(host_threads));
    if (cuda.ok()) {
      if (note != nullptr) *note = cuda.value()->Describe();
      return std::move(cuda).value();
    }
    why = cuda.status().message() + "; using host copies";
  } else {
    why = "built without CUDA; using host copies";
  }
  if (note != nullptr) *note = why;
  return MakeHostEngine(host_threads);
}

}  // namespace nonstop
