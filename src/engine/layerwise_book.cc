#include "engine/layerwise_book.h"

#include <cstddef>
#include <unordered_map>

namespace nonstop {

LayerwiseBook::LayerwiseBook(uint64_t group_bytes, std::vector<int> devices)
    : group_bytes_(group_bytes),
      devices_(std::move(devices)),
      pending_(devices_.size()),
      batched_(devices_.size()) {}

void LayerwiseBook::Plan(const std::vector<uint64_t>& ref_ptrs,
                         const std::vector<std::vector<uint64_t>>& param_ptrs) {
  std::unordered_map<uint64_t, std::vector<uint32_t>> index;
  for (uint32_t i = 0; i < ref_ptrs.size(); ++i) index[ref_ptrs[i]].push_back(i);
  plan_.assign(devices_.size(), {});
  for (std::size_t p = 0; p < param_ptrs.size() && p < plan_.size(); ++p) {
    for (uint64_t ptr : param_ptrs[p]) {
      auto it = index.find(ptr);
      if (it != index.end()) plan_[p].insert(plan_[p].end(), it->second.begin(), it->second.end());
    }
  }
}

void LayerwiseBook::Open() {
  groups_ = plan_;
  open_ = true;
}

LayerwiseBook::Before LayerwiseBook::Update(const std::vector<uint32_t>& ids) {
  Before b;
  for (uint32_t id : ids) {
    if (id < batched_.size() && batched_[id]) {
      b.copy = Flush();
      break;
    }
  }
  std::vector<uint32_t> host;
  for (uint32_t id : ids) {
    if (id >= pending_.size() || !pending_[id]) continue;
    pending_[id] = false;
    const std::vector<uint32_t>& g = groups_[id];
    if (devices_[id] < 0) {
      host.insert(host.end(), g.begin(), g.end());
      continue;
    }
    auto it = b.waits.begin();
    while (it != b.waits.end() && it->first != devices_[id]) ++it;
    if (it == b.waits.end()) it = b.waits.insert(it, {devices_[id], {}});
    it->second.insert(it->second.end(), g.begin(), g.end());
  }
  if (!host.empty()) b.waits.insert(b.waits.begin(), {-1, std::move(host)});
  return b;
}

std::vector<uint32_t> LayerwiseBook::Updated(uint32_t id, uint64_t bytes) {
  if (!open_ || id >= groups_.size() || groups_[id].empty()) return {};
  if (!batched_[id]) {
    batched_[id] = true;
    batch_.push_back(id);
  }
  batch_bytes_ += bytes;
  return batch_bytes_ >= group_bytes_ ? Flush() : std::vector<uint32_t>{};
}

std::vector<uint32_t> LayerwiseBook::Flush() {
  std::vector<uint32_t> copy;
  for (uint32_t id : batch_) {
    copy.insert(copy.end(), groups_[id].begin(), groups_[id].end());
    pending_[id] = true;
    batched_[id] = false;
  }
  batch_.clear();
  batch_bytes_ = 0;
  return copy;
}

void LayerwiseBook::Seal() {
  open_ = false;
  pending_.assign(pending_.size(), !groups_.empty());
  batched_.assign(batched_.size(), false);
  batch_.clear();
  batch_bytes_ = 0;
}

void LayerwiseBook::Reset() {
  open_ = false;
  plan_.clear();
  groups_.clear();
  pending_.assign(pending_.size(), false);
  batched_.assign(batched_.size(), false);
  batch_.clear();
  batch_bytes_ = 0;
}

}  // namespace nonstop
