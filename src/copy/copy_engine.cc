// CopyEngine's defaults: the answers of an engine with no device memory.
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

class DoneCopy final : public CopyCompletion {
 public:
  explicit DoneCopy(Status status) : status_(std::move(status)) {}
  Status Wait() override { return status_; }
  bool Ready() override { return true; }

 private:
  Status status_;
};

}  // namespace

std::unique_ptr<CopyCompletion> MakeDoneCopy(Status status) {
  return std::make_unique<DoneCopy>(std::move(status));
}

std::unique_ptr<CopyCompletion> CopyEngine::SnapshotToDevice(const void* /*src*/,
                                                             const Device& /*src_device*/,
                                                             void* /*dst*/, size_t /*bytes*/) {
  return MakeDoneCopy(
      Status::Unavailable(Describe() + " keeps no snapshots in device memory (copy='device')"));
}

std::unique_ptr<CopyCompletion> CopyEngine::DrainToHost(const void* /*src*/, int /*device*/,
                                                        void* /*dst*/, size_t /*bytes*/) {
  return MakeDoneCopy(
      Status::Unavailable(Describe() + " keeps no snapshots in device memory (copy='device')"));
}

std::unique_ptr<CopyCompletion> CopyEngine::CopyToDevice(const void* /*src*/, void* /*dst*/,
                                                         const Device& /*dst_device*/,
                                                         size_t /*bytes*/) {
  return MakeDoneCopy(Status::Unavailable(Describe() + " cannot copy into device memory"));
}

}  // namespace nonstop
