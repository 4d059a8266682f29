// Deterministic small checkpoints for the crash tests (jobdir_crash_test,
// tier_crash_test): every byte a function of a seed, so what a recovery
// reads can be compared with what was written for it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/store.h"

namespace nonstop::crash_ckpt {

constexpr uint32_t kCrcChunk = 4096;

// splitmix64's finaliser.
inline uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Ckpt {
  SlotLayout layout;
  std::vector<uint8_t> data;
  std::vector<uint32_t> crcs;
  std::string meta;
};

// 1 to `max_tensors` uint8 tensors named `prefix`0, `prefix`1, ... of
// `min_bytes` + (a draw % `span`) bytes each, their bytes and the chunk
// checksums drawn from `seed`; `meta` as the metadata.
inline Ckpt Make(uint64_t seed, int max_tensors, const std::string& prefix, int64_t min_bytes,
                 int64_t span, std::string meta) {
  uint64_t s = seed;
  std::vector<TensorSpec> specs;
  const int n = 1 + static_cast<int>(s % static_cast<uint64_t>(max_tensors));
  for (int i = 0; i < n; ++i) {
    s = Mix(s);
    TensorSpec t;
    t.name = prefix + std::to_string(i);
    t.dtype = DType::kUInt8;
    const int64_t bytes = min_bytes + static_cast<int64_t>(s % static_cast<uint64_t>(span));
    t.shape = {bytes};
    t.nbytes = static_cast<uint64_t>(bytes);
    specs.push_back(t);
  }
  Ckpt c;
  c.layout = SlotLayout::Plan(specs).value();
  c.data.assign(c.layout.data_bytes, 0);
  for (const TensorEntry& te : c.layout.tensors) {
    for (uint64_t i = 0; i < te.spec.nbytes; ++i) {
      if (i % 8 == 0) s = Mix(s);
      c.data[te.data_offset + i] = static_cast<uint8_t>(s >> (8 * (i % 8)));
    }
  }
  for (size_t off = 0; off < c.data.size(); off += kCrcChunk) {
    c.crcs.push_back(Crc32c(c.data.data() + off, std::min<size_t>(kCrcChunk, c.data.size() - off)));
  }
  c.meta = std::move(meta);
  return c;
}

// Writes `c` into `slot` of `f` and commits it as checkpoint `counter` of `step`.
inline Result<CheckpointInfo> Commit(SlotFile& f, uint32_t slot, uint64_t counter, int64_t step,
                                     const Ckpt& c) {
  NONSTOP_RETURN_IF_ERROR(f.WriteData(slot, 0, c.data.data(), c.data.size()));
  CommitRequest req;
  req.slot = slot;
  req.counter = counter;
  req.step = step;
  req.layout = &c.layout;
  req.crc_chunk_bytes = kCrcChunk;
  req.chunk_crcs = c.crcs;
  req.meta_json = c.meta;
  return f.Commit(req);
}

}  // namespace nonstop::crash_ckpt
