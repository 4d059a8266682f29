#include "engine/chunk_plan.h"

#include <algorithm>
#include <numeric>

namespace nonstop {

ChunkPlan ChunkPlan::Build(const std::vector<TensorEntry>& tensors, uint64_t data_bytes,
                           uint64_t chunk_bytes, const std::vector<bool>& include) {
  ChunkPlan plan;
  plan.chunk_bytes = chunk_bytes;
  plan.data_bytes = data_bytes;
  const uint64_t n = chunk_bytes == 0 ? 0 : (data_bytes + chunk_bytes - 1) / chunk_bytes;
  plan.chunks.resize(n);
  for (uint64_t j = 0; j < n; ++j) {
    plan.chunks[j].slot_offset = j * chunk_bytes;
    plan.chunks[j].bytes = static_cast<uint32_t>(std::min(chunk_bytes, data_bytes - j * chunk_bytes));
  }
  plan.tensor_chunks.assign(tensors.size(), {1, 0});
  // Visit tensors in data-offset order so each chunk's pieces come out sorted.
  std::vector<uint32_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return tensors[a].data_offset < tensors[b].data_offset;
  });
  for (uint32_t t : order) {
    const TensorEntry& e = tensors[t];
    if (e.spec.nbytes == 0 || (!include.empty() && !include[t])) continue;
    uint64_t pos = e.data_offset;
    const uint64_t end = e.data_offset + e.spec.nbytes;
    plan.tensor_chunks[t].first = static_cast<uint32_t>(pos / chunk_bytes);
    while (pos < end) {
      const uint64_t j = pos / chunk_bytes;
      const uint64_t chunk_end = std::min((j + 1) * chunk_bytes, data_bytes);
      const uint64_t len = std::min(end, chunk_end) - pos;
      plan.chunks[j].pieces.push_back(ChunkPiece{t, pos - e.data_offset,
                                                 static_cast<uint32_t>(pos - j * chunk_bytes),
                                                 static_cast<uint32_t>(len)});
      plan.tensor_chunks[t].second = static_cast<uint32_t>(j);
      pos += len;
    }
  }
  for (PlannedChunk& c : plan.chunks) {
    uint32_t at = 0;
    for (const ChunkPiece& p : c.pieces) {
      if (p.chunk_offset > at) c.gaps.push_back(ChunkSpan{at, p.chunk_offset - at});
      at = p.chunk_offset + p.bytes;
    }
    if (at < c.bytes) c.gaps.push_back(ChunkSpan{at, c.bytes - at});
  }
  return plan;
}

}  // namespace nonstop
