// Tests only: damages a committed checkpoint's data on a FaultDisk, durably
// (a bad sector under it), as the fallback tests need.
#ifndef NONSTOP_ENGINE_DAMAGE_STEP_H_
#define NONSTOP_ENGINE_DAMAGE_STEP_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "media/fault_medium.h"
#include "nonstop/store.h"

namespace nonstop {

// Overwrites 4 KiB of the data of step `step`'s committed checkpoint, at the
// 4 KiB block `fraction` of the way into its data (0: the first block).
inline void DamageStep(FaultDisk& disk, int64_t step, double fraction = 0) {
  auto sf = SlotFile::Open(disk.Open());
  ASSERT_TRUE(sf.ok()) << sf.status().ToString();
  ScanOptions so;
  so.verify_data = false;
  auto rep = (*sf)->Scan(so);
  ASSERT_TRUE(rep.ok());
  for (const ScannedCheckpoint& c : rep->checkpoints) {
    if (c.state != CheckpointState::kCommitted || c.info.step != step) continue;
    std::vector<uint8_t> junk(4096, 0xA5);
    const auto block = static_cast<uint64_t>(static_cast<double>(c.info.data_bytes) * fraction);
    const uint64_t at = c.info.data_offset + block / 4096 * 4096;
    ASSERT_TRUE((*sf)->medium().Write(at, junk.data(), junk.size()).ok());
    ASSERT_TRUE((*sf)->medium().Sync().ok());
    return;
  }
  FAIL() << "no committed checkpoint of step " << step;
}

}  // namespace nonstop

#endif  // NONSTOP_ENGINE_DAMAGE_STEP_H_
