// MediumWrapper: a Medium that forwards every call to another one. A medium
// that changes one behaviour (refuses writes, delays or counts them) derives
// from it and overrides just that, like LevelDB's EnvWrapper.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "nonstop/medium.h"

namespace nonstop::media {

class MediumWrapper : public Medium {
 public:
  explicit MediumWrapper(std::unique_ptr<Medium> inner) : inner_(std::move(inner)) {}

  Status Write(uint64_t offset, const void* buf, size_t n) override {
    return inner_->Write(offset, buf, n);
  }
  Status Read(uint64_t offset, void* buf, size_t n) override {
    return inner_->Read(offset, buf, n);
  }
  Status Sync() override { return inner_->Sync(); }
  Status Resize(uint64_t size) override { return inner_->Resize(size); }
  uint64_t Size() const override { return inner_->Size(); }
  size_t Alignment() const override { return inner_->Alignment(); }
  MediumKind kind() const override { return inner_->kind(); }
  std::string Describe() const override { return inner_->Describe(); }
  Result<uint64_t> CachedBytes(uint64_t offset, uint64_t n) override {
    return inner_->CachedBytes(offset, n);
  }
  bool InMemory() const override { return inner_->InMemory(); }
  // OpenReadQueue is deliberately not forwarded: a wrapper that changes Read
  // (fault injection) must see queued reads too, so it gets the plain queue
  // over its own Read. Wrappers that leave reads alone forward it themselves.

 protected:
  Medium& inner() { return *inner_; }
  const Medium& inner() const { return *inner_; }

 private:
  std::unique_ptr<Medium> inner_;
};

}  // namespace nonstop::media
