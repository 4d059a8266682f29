#include "engine/layerwise_plan.h"

#include <algorithm>
#include <numeric>

namespace nonstop {
namespace {

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

LayerPlan LayerPlan::Build(const SlotLayout& layout, uint64_t chunk_bytes) {
  LayerPlan plan;
  plan.chunk_bytes = chunk_bytes;
  plan.data_bytes = layout.data_bytes;
  const size_t n = layout.tensors.size();
  plan.tensor_units.resize(n);
  plan.is_small.resize(n);
  std::vector<uint32_t> large;
  plan.small_begin = layout.data_bytes;
  for (size_t t = 0; t < n; ++t) {
    const TensorEntry& e = layout.tensors[t];
    plan.is_small[t] = e.spec.nbytes < kLargeTensorBytes;
    if (plan.is_small[t]) {
      plan.small_begin = std::min(plan.small_begin, e.data_offset / kStoreAlign * kStoreAlign);
    } else {
      large.push_back(static_cast<uint32_t>(t));
    }
  }
  std::sort(large.begin(), large.end(), [&](uint32_t a, uint32_t b) {
    return layout.tensors[a].data_offset < layout.tensors[b].data_offset;
  });
  // The large region ends where the last extent ends; the small region, if
  // any, starts there too (SlotLayout aligns it to 4 KiB).
  uint64_t large_end = 0;
  for (uint32_t t : large) {
    const TensorEntry& e = layout.tensors[t];
    uint64_t pos = e.data_offset;
    const uint64_t tensor_end = e.data_offset + e.spec.nbytes;
    const uint64_t end = AlignUp(tensor_end, kStoreAlign);
    while (pos < end) {
      const uint64_t j = pos / chunk_bytes;
      const uint64_t len = std::min(end, (j + 1) * chunk_bytes) - pos;
      LayerUnit u;
      u.slot_offset = pos;
      u.bytes = static_cast<uint32_t>(len);
      u.chunk = static_cast<uint32_t>(j);
      u.tensor = static_cast<int32_t>(t);
      u.tensor_offset = pos - e.data_offset;
      u.tensor_bytes = static_cast<uint32_t>(std::min(tensor_end, pos + len) - pos);
      plan.tensor_units[t].push_back(static_cast<uint32_t>(plan.units.size()));
      plan.units.push_back(u);
      pos += len;
    }
    large_end = end;
  }
  plan.small_begin = std::max(plan.small_begin, large_end);
  for (uint64_t pos = plan.small_begin; pos < layout.data_bytes;) {
    const uint64_t j = pos / chunk_bytes;
    const uint64_t len = std::min(layout.data_bytes, (j + 1) * chunk_bytes) - pos;
    LayerUnit u;
    u.slot_offset = pos;
    u.bytes = static_cast<uint32_t>(len);
    u.chunk = static_cast<uint32_t>(j);
    plan.small_units.push_back(static_cast<uint32_t>(plan.units.size()));
    plan.units.push_back(u);
    pos += len;
  }
  const uint64_t chunks = chunk_bytes == 0 ? 0 : (layout.data_bytes + chunk_bytes - 1) / chunk_bytes;
  plan.chunk_units.assign(chunks, {0, 0});
  for (uint32_t i = 0; i < plan.units.size(); ++i) {
    auto& r = plan.chunk_units[plan.units[i].chunk];
    if (r.first == r.second) r.first = i;
    r.second = i + 1;
  }
  return plan;
}

std::vector<uint32_t> LayerPlan::ChunkCrcs(const std::vector<uint32_t>& unit_crcs) const {
  std::vector<uint32_t> crcs(chunk_units.size());
  for (size_t j = 0; j < chunk_units.size(); ++j) {
    const auto [first, last] = chunk_units[j];
    uint32_t crc = first < last ? unit_crcs[first] : 0;
    for (uint32_t i = first + 1; i < last; ++i) {
      crc = Crc32cCombine(crc, unit_crcs[i], units[i].bytes);
    }
    crcs[j] = crc;
  }
  return crcs;
}

LayerRoute ChooseLayerRoute(LayerCopy requested, DeviceKind source, bool aligned_medium,
                            bool has_device_buffer) {
  const bool host = source == DeviceKind::kHost;
  switch (requested) {
    case LayerCopy::kHost:
      return LayerRoute::kStage;
    case LayerCopy::kDirect:
      return host && !aligned_medium ? LayerRoute::kDirect : LayerRoute::kStage;
    case LayerCopy::kDevice:
      if (host) return LayerRoute::kHostSnapshot;
      return has_device_buffer ? LayerRoute::kDeviceSnapshot : LayerRoute::kStage;
  }
  return LayerRoute::kStage;
}

const char* LayerRouteName(LayerRoute route) {
  switch (route) {
    case LayerRoute::kStage:
      return "stage";
    case LayerRoute::kDirect:
      return "direct";
    case LayerRoute::kHostSnapshot:
      return "host-snapshot";
    case LayerRoute::kDeviceSnapshot:
      return "device-snapshot";
  }
  return "?";
}

}  // namespace nonstop
