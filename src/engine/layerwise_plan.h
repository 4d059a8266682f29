// LayerPlan: how a layer-wise checkpoint (LightCheck; docs/LAYERWISE.md) cuts
// a slot's data region into write units that can be copied and written in any
// order, tensor by tensor, while the table keeps one crc per chunk.
//
// SlotLayout puts every large tensor at a 4 KiB boundary and the next one at
// the next 4 KiB boundary after it, then the small tensors packed from a 4 KiB
// boundary. So the large tensors' extents [offset, AlignUp(offset + nbytes))
// tile the large region exactly, and each is that tensor's own (its tail is
// zero padding). A unit is the piece of one extent inside one chunk: its
// start and end are 4 KiB-aligned (O_DIRECT works), it belongs to one tensor,
// and it can be written as soon as that tensor is copied. The small region is
// assembled in one host buffer per checkpoint (small tensors share chunks and
// are tiny) and cut at chunk boundaries into units written once every tensor
// is copied.
//
// The crc of chunk j is then the crcs of its units, in slot order, combined
// with Crc32cCombine: each unit's crc is computed by whoever writes it, in any
// order, and the committer combines them. The format is unchanged: a
// layer-wise checkpoint is read like any other.
//
// Immutable once built; shared by every checkpoint of one registration.
#pragma once

#include <cstdint>
#include <vector>

#include "base/crc32c_combine.h"
#include "nonstop/engine.h"
#include "nonstop/store.h"
#include "nonstop/types.h"

namespace nonstop {

struct LayerUnit {
  uint64_t slot_offset = 0;    // from the start of the data region; multiple of 4096
  uint32_t bytes = 0;          // multiple of 4096
  uint32_t chunk = 0;          // crc chunk this unit lies in
  int32_t tensor = -1;         // the large tensor it carries, -1 for a small-region unit
  uint64_t tensor_offset = 0;  // first byte of the tensor it carries
  uint32_t tensor_bytes = 0;   // tensor bytes in the unit; the rest, up to `bytes`, is zero
};

struct LayerPlan {
  uint64_t chunk_bytes = 0;
  uint64_t data_bytes = 0;
  uint64_t small_begin = 0;  // start of the small region (== data_bytes when there is none)
  std::vector<LayerUnit> units;  // in slot order; they tile [0, data_bytes)
  // Per tensor (layout order): its units for a large tensor, empty for a small one.
  std::vector<std::vector<uint32_t>> tensor_units;
  std::vector<bool> is_small;     // per tensor
  std::vector<uint32_t> small_units;  // the units of the small region
  // Per chunk: [first, last) indices into `units`.
  std::vector<std::pair<uint32_t, uint32_t>> chunk_units;

  static LayerPlan Build(const SlotLayout& layout, uint64_t chunk_bytes);

  // The crc of every chunk from the crcs of the units (same order as `units`).
  std::vector<uint32_t> ChunkCrcs(const std::vector<uint32_t>& unit_crcs) const;
};

// How the dispatcher moves one large tensor of a layer-wise checkpoint. A
// pure function of the requested strategy and the tensor's memory, so the
// rule is tested without a GPU (layerwise_test, LayerRouteTest).
enum class LayerRoute {
  kStage,           // the copy engine copies it into staging chunks; writers write them
  kDirect,          // writers write straight from the tensor's host memory (LightCheck-D)
  kHostSnapshot,    // memcpy into the host second buffer, writers write from it
                    // (LightCheck-G for host tensors: no copy engine, no CUDA call)
  kDeviceSnapshot,  // CUDA D2D snapshot into the device second buffer, drained to
                    // host on the copy stream, writers write from there (LightCheck-G)
};

// `source` is where the bytes are now: a copy_at_checkpoint tensor is read
// from its host snapshot even when it lives on a GPU. Host memory never goes
// to a CUDA-only path: kDevice of a host tensor is a host memcpy, kDirect of a
// host tensor is a write from that memory. Device memory goes through
// staging unless it has a device second buffer (kDevice with the CUDA
// engine); kDirect of device memory and kDirect on media that need aligned
// buffers (O_DIRECT) use staging.
LayerRoute ChooseLayerRoute(LayerCopy requested, DeviceKind source, bool aligned_medium,
                            bool has_device_buffer);
const char* LayerRouteName(LayerRoute route);

}  // namespace nonstop
