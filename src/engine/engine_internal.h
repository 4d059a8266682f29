// Seams of the engine for tests and tools: open it over media that are not
// plain files (the FaultDisk of src/media/fault_medium.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/medium.h"

namespace nonstop {

struct EngineMedia {
  // Tests: wraps or replaces the medium of each slot file the engine opens
  // through the job directory (`name` is its name there; `created`: the file
  // was just created), e.g. to put its bytes on a FaultDisk. Every file and
  // directory operation still goes through EngineOptions::env and JobDir.
  // Empty: the file's own medium.
  std::function<Result<std::unique_ptr<Medium>>(std::unique_ptr<Medium> opened,
                                                const std::string& name, bool created)>
      wrap;
  // Tests: the copy engine for `copy_threads` (empty: MakeBestCopyEngine).
  std::function<std::unique_ptr<CopyEngine>(int copy_threads)> copy;
};

// Engine::Open(opts) is OpenEngine(opts, EngineMedia{}).
Result<std::unique_ptr<Engine>> OpenEngine(const EngineOptions& opts, EngineMedia media);

// The staging pool the engine picks when EngineOptions::staging_bytes is 0
// (docs/ENGINE.md): the whole registered state, so that a checkpoint's copy
// never waits for the medium (the stall is the copy, not the write), but at
// least 256 MiB and `min_chunks` chunks, rounded up to whole chunks; at most
// a quarter of physical memory, and for pinned (CUDA) staging at most
// 32 GiB, where `capped` is set and `note` says so. Never below min_chunks.
struct StagingSize {
  uint64_t bytes = 0;
  bool capped = false;
  std::string note;  // empty unless capped
};
inline constexpr uint64_t kStagingFloorBytes = uint64_t{256} << 20;
inline constexpr uint64_t kPinnedStagingCapBytes = uint64_t{32} << 30;
StagingSize DefaultStagingSize(uint64_t state_bytes, uint64_t chunk_bytes, uint32_t min_chunks,
                               uint64_t ram_bytes, bool pinned);
// Physical memory of this machine in bytes (0 if unknown).
uint64_t PhysicalMemoryBytes();

// The slot size PrepareStaging creates a slot file with before the first
// Register, from the state's estimate (which counts each tensor's 4 KiB
// alignment): the estimate plus room for the tensor table (1 MiB of
// metadata, the entries, the chunk crcs; StoreGeometry::SlotBytesFor),
// rounded up to 4 KiB. The first Register adopts the file when
// PreparedSlotFits: its layout needs at most that, and not much less (at
// most an eighth plus 8 MiB less: an estimate far above the real state would
// waste disk in every slot; then it creates a slot file as without it).
uint64_t PreparedSlotBytes(uint64_t state_bytes);
bool PreparedSlotFits(uint64_t prepared_slot_bytes, uint64_t needed_slot_bytes);

}  // namespace nonstop
