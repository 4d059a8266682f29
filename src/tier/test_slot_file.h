// For the peer tier's tests (peer_test.cc, peer_gather_test.cc): a one-slot
// file holding one committed checkpoint of the caller's layout and data,
// written as the memory tier replaces its segment (under "<name>.w", then
// renamed over `name`). Header-only; tests only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/store.h"

namespace nonstop::testing {

// Which checkpoint the file holds.
struct SlotCheckpoint {
  uint32_t rank = 0;
  uint32_t world = 4;
  uint64_t counter = 1;
  int64_t step = 1;
  std::string meta_json = "{}";
  uint32_t chunk_bytes = 64 << 10;  // the crc chunk
};

inline Status WriteSlotFile(Env* env, const std::string& dir, const std::string& name,
                            const SlotLayout& layout, const std::vector<uint8_t>& data,
                            const SlotCheckpoint& c) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, env->OpenDirectory(dir, true));
  StoreGeometry g;
  g.slots = 1;
  g.rank = c.rank;
  g.world_size = c.world;
  g.slot_bytes = StoreGeometry::SlotBytesFor(layout, 4096);
  const std::string tmp = name + ".w";
  (void)d->Unlink(tmp);
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m,
                           d->CreateFile(tmp, MediumKind::kBuffered, {}));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> f, SlotFile::Create(std::move(m), g));
  NONSTOP_RETURN_IF_ERROR(f->WriteData(0, 0, data.data(), data.size()));
  CommitRequest req;
  req.slot = 0;
  req.counter = c.counter;
  req.step = c.step;
  req.layout = &layout;
  req.crc_chunk_bytes = c.chunk_bytes;
  for (size_t o = 0; o < data.size(); o += c.chunk_bytes) {
    req.chunk_crcs.push_back(
        Crc32c(data.data() + o, std::min<size_t>(c.chunk_bytes, data.size() - o)));
  }
  req.meta_json = c.meta_json;
  NONSTOP_RETURN_IF_ERROR(f->Commit(req).status());
  f.reset();
  return d->Rename(tmp, name);
}

}  // namespace nonstop::testing
