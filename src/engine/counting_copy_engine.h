// Tests only: the host copy engine, counting the bytes the engine copies
// through it (how the multi-step and staged-tensor tests show a copy is gone).
#ifndef NONSTOP_ENGINE_COUNTING_COPY_ENGINE_H_
#define NONSTOP_ENGINE_COUNTING_COPY_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "nonstop/copy_engine.h"

namespace nonstop {

class CountingCopyEngine final : public CopyEngine {
 public:
  CountingCopyEngine(int threads, std::shared_ptr<std::atomic<uint64_t>> copied)
      : inner_(MakeHostCopyEngine(threads)), copied_(std::move(copied)) {}
  std::unique_ptr<CopyCompletion> Copy(const void* src, const Device& d, void* dst,
                                       size_t bytes) override {
    copied_->fetch_add(bytes);
    return inner_->Copy(src, d, dst, bytes);
  }
  void* AllocHost(size_t bytes, bool* pinned) override { return inner_->AllocHost(bytes, pinned); }
  void FreeHost(void* p, size_t bytes) override { inner_->FreeHost(p, bytes); }
  std::string Describe() const override { return "counting " + inner_->Describe(); }

 private:
  std::unique_ptr<CopyEngine> inner_;
  std::shared_ptr<std::atomic<uint64_t>> copied_;
};

}  // namespace nonstop

#endif  // NONSTOP_ENGINE_COUNTING_COPY_ENGINE_H_
