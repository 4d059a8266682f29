// ChunkPlan: how a slot's data region maps onto staging chunks.
//
// The data region (SlotLayout) is cut into chunks of `chunk_bytes` (the last
// one may be shorter; every length stays a multiple of kStoreAlign because
// data_bytes is). Chunk j covers slot data bytes [j*b, j*b + len) and is
// filled from the pieces of the tensors that overlap it; bytes of the region
// that belong to no tensor (alignment padding) are zeroed so the chunk's crc
// is that of the bytes on the medium. One staging chunk carries one slot chunk
// and one crc: staging chunk size == the table's crc_chunk_bytes.
//
// The plan is immutable and shared by every checkpoint of one registration.
// It is indexed both ways (chunk -> pieces, tensor -> chunk range) so a
// layer-wise schedule can later dispatch the chunks of one tensor alone.
#pragma once

#include <cstdint>
#include <vector>

#include "nonstop/store.h"

namespace nonstop {

struct ChunkPiece {
  uint32_t tensor = 0;         // index into the layout's tensors
  uint64_t tensor_offset = 0;  // first byte of the tensor this piece carries
  uint32_t chunk_offset = 0;   // where it goes inside the chunk
  uint32_t bytes = 0;
};

struct ChunkSpan {
  uint32_t offset = 0;  // inside the chunk
  uint32_t bytes = 0;
};

struct PlannedChunk {
  uint64_t slot_offset = 0;  // from the start of the slot's data region
  uint32_t bytes = 0;
  std::vector<ChunkPiece> pieces;  // in data-offset order
  std::vector<ChunkSpan> gaps;     // bytes no tensor covers: zero-filled
};

struct ChunkPlan {
  uint64_t chunk_bytes = 0;
  uint64_t data_bytes = 0;
  std::vector<PlannedChunk> chunks;
  // [first, last] chunk touched by each tensor; first > last for an empty tensor.
  std::vector<std::pair<uint32_t, uint32_t>> tensor_chunks;

  // `include` (same size as layout.tensors, or empty = all) selects the tensors
  // whose bytes are planned; unselected tensors' ranges become gaps.
  static ChunkPlan Build(const std::vector<TensorEntry>& tensors, uint64_t data_bytes,
                         uint64_t chunk_bytes, const std::vector<bool>& include = {});
};

}  // namespace nonstop
