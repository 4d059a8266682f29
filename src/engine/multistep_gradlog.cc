// The gradient log of a multi-step window (multistep_internal.h): for each
// step N+j (j = 1..K-1) what the optimizer consumed, and the gradients of
// parts 1..j copied to the host, as the replay needs them.
#include <algorithm>
#include <utility>

#include "engine/multistep_internal.h"

namespace nonstop::multistep_internal {

Status GradientLog::Plan(CopyEngine* copy, const std::vector<OptimizerTensor>& tensors,
                         const std::vector<Part>& parts) {
  const int k = static_cast<int>(parts.size());
  // Step j (1..K-1) holds the prefix of parts 1..j, at most 4 bytes per
  // element (low-precision gradients use part of it). Laid out as staged
  // buffers: with MultistepReplay::kRestore the Engine writes them as they are.
  offset_.assign(k, std::vector<size_t>(tensors.size(), 0));
  covered_.assign(k, std::vector<size_t>(tensors.size(), 0));
  size_t bytes = 0;
  for (int j = 1; j < k; ++j) {
    const size_t prefix = parts[j - 1].flat_end;
    size_t begin = 0;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const size_t covered = prefix > begin ? std::min(tensors[t].numel, prefix - begin) : 0;
      offset_[j][t] = StagedOffset(&bytes, covered * sizeof(float));
      covered_[j][t] = covered;
      begin += tensors[t].numel;
    }
  }
  if (arena_.size() != bytes || arena_.data() == nullptr) {
    if (!arena_.Reset(copy, bytes) && bytes > 0) {
      return Status::Unavailable("multistep: cannot allocate " + std::to_string(bytes) +
                                 " bytes of host memory for gradients");
    }
  }
  log_.assign(k > 1 ? k - 1 : 0, LoggedStep{});
  return Status::OK();
}

Status GradientLog::Record(int j, const std::vector<OptimizerTensor>& tensors,
                           std::span<const optim::StepHyperparameters> groups, bool skipped,
                           std::span<const GradRef> grads) {
  LoggedStep& e = log_[j - 1];
  e.skipped = skipped;
  e.groups.assign(groups.begin(), groups.end());
  e.has_grad.assign(tensors.size(), 0);
  e.grad_dtype.assign(tensors.size(), DType::kFloat32);
  if (skipped) return Status::OK();
  if (grads.size() != tensors.size()) {
    return Status::InvalidArgument("multistep: " + std::to_string(grads.size()) +
                                   " gradients for " + std::to_string(tensors.size()) +
                                   " tensors");
  }
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].group >= static_cast<int>(groups.size())) {
      return Status::InvalidArgument("multistep: tensor '" + tensors[t].name + "' is in group " +
                                     std::to_string(tensors[t].group) + " of " +
                                     std::to_string(groups.size()));
    }
    const DType d = grads[t].dtype;
    if (grads[t].data != nullptr && d != DType::kFloat32 && d != DType::kBFloat16 &&
        d != DType::kFloat16) {
      return Status::InvalidArgument("multistep: gradient of '" + tensors[t].name + "' is " +
                                     std::string(DTypeName(d)) +
                                     "; use float32, bfloat16 or float16");
    }
    e.has_grad[t] = grads[t].data != nullptr;
    e.grad_dtype[t] = d;
  }
  return Status::OK();
}

std::shared_ptr<Batch> GradientLog::Enqueue(int j, const std::vector<OptimizerTensor>& tensors,
                                            std::span<const GradRef> grads, uint64_t block_bytes,
                                            CopyDispatcher* dispatcher, uint64_t* bytes) {
  auto batch = std::make_shared<Batch>();
  std::vector<CopyItem> items;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const size_t covered = covered_[j][t];  // elements of tensor t in parts 1..j
    if (covered == 0 || grads[t].data == nullptr) continue;
    const size_t esize = DTypeSize(grads[t].dtype);
    const size_t chunk = std::max<size_t>(esize, block_bytes / esize * esize);
    const auto* src = static_cast<const uint8_t*>(grads[t].data);
    uint8_t* dst = arena_.data() + offset_[j][t];
    for (size_t off = 0; off < covered * esize; off += chunk) {
      CopyItem it;
      it.src = src + off;
      it.device = grads[t].device;
      it.dst = dst + off;
      it.bytes = std::min(chunk, covered * esize - off);
      it.batch = batch;
      *bytes += it.bytes;
      items.push_back(std::move(it));
    }
  }
  batch->Expect(static_cast<int>(items.size()));
  dispatcher->Enqueue(std::move(items), /*high=*/true);
  return batch;
}

}  // namespace nonstop::multistep_internal
