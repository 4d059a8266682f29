// Deterministic checkpoints for the store's crash, kill and fuzz tests.
//
// Everything a checkpoint holds (its tensor set, shapes, dtypes, bytes and
// metadata) is a pure function of its step, so a test can regenerate what was
// written for any step after a crash and compare it with what recovery read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop::testing {

inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The largest data region MakeCheckpoint produces, and a slot that holds it.
inline constexpr uint64_t kMaxDataBytes = 320 << 10;
inline constexpr uint64_t kTestSlotBytes = kMaxDataBytes + (16 << 10);
inline constexpr uint32_t kTestCrcChunk = 16 << 10;

struct TestCheckpoint {
  int64_t step = 0;
  SlotLayout layout;
  std::vector<uint8_t> data;  // the whole data region, padding zeroed
  std::vector<uint32_t> crcs;  // per kTestCrcChunk piece of `data`
  std::string meta_json;
};

// The tensor specs of `step`: 1 to 5 tensors, up to two of them large
// (4 KiB-aligned in the layout), dtypes and shapes varying with the step.
inline std::vector<TensorSpec> SpecsForStep(int64_t step) {
  uint64_t st = static_cast<uint64_t>(step) * 0x2545F4914F6CDD1Dull + 17;
  static constexpr DType kTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kInt64,
                                     DType::kUInt8,   DType::kFloat64,  DType::kInt32};
  const int n = 1 + static_cast<int>(SplitMix64(st) % 5);
  int large = 0;
  std::vector<TensorSpec> specs;
  for (int i = 0; i < n; ++i) {
    TensorSpec s;
    s.name = "layer" + std::to_string(i) + (i % 2 ? ".bias" : ".weight");
    s.dtype = kTypes[SplitMix64(st) % std::size(kTypes)];
    const uint64_t es = DTypeSize(s.dtype);
    // Large: 64..128 KiB; small: 0..16 KiB (a scalar now and then).
    uint64_t bytes = (large < 2 && SplitMix64(st) % 2) ? (64 << 10) + SplitMix64(st) % (64 << 10)
                                                       : SplitMix64(st) % (16 << 10);
    if (bytes >= kLargeTensorBytes) ++large;
    const uint64_t numel = bytes / es;
    if (numel == 1 || SplitMix64(st) % 8 == 0) {
      s.shape = {};
    } else if (numel % 4 == 0 && SplitMix64(st) % 2) {
      s.shape = {4, static_cast<int64_t>(numel / 4)};
    } else {
      s.shape = {static_cast<int64_t>(numel)};
    }
    s.nbytes = NumElements(s.shape) * es;
    specs.push_back(std::move(s));
  }
  return specs;
}

inline std::string MetaForStep(int64_t step) {
  return "{\"step\": " + std::to_string(step) + ", \"lr\": 0.001, \"note\": \"nonstop test\"}";
}

inline std::vector<uint32_t> ChunkCrcs(const std::vector<uint8_t>& data, uint32_t chunk) {
  std::vector<uint32_t> c;
  for (size_t off = 0; off < data.size(); off += chunk) {
    c.push_back(Crc32c(data.data() + off, std::min<size_t>(chunk, data.size() - off)));
  }
  return c;
}

// The bytes of tensor `index` of `step`.
inline void FillTensor(int64_t step, size_t index, uint8_t* dst, uint64_t n) {
  uint64_t st = static_cast<uint64_t>(step) * 1000003u + index * 7919u + 1;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = SplitMix64(st);
    std::memcpy(dst + i, &v, 8);
  }
  if (i < n) {
    uint64_t v = SplitMix64(st);
    std::memcpy(dst + i, &v, n - i);
  }
}

inline TestCheckpoint MakeCheckpoint(int64_t step) {
  TestCheckpoint c;
  c.step = step;
  c.layout = SlotLayout::Plan(SpecsForStep(step)).value();
  c.data.assign(c.layout.data_bytes, 0);
  for (size_t i = 0; i < c.layout.tensors.size(); ++i) {
    const TensorEntry& te = c.layout.tensors[i];
    FillTensor(step, i, c.data.data() + te.data_offset, te.spec.nbytes);
  }
  c.crcs = ChunkCrcs(c.data, kTestCrcChunk);
  c.meta_json = MetaForStep(step);
  return c;
}

inline CommitRequest MakeCommitRequest(const TestCheckpoint& c, uint32_t slot, uint64_t counter) {
  CommitRequest req;
  req.slot = slot;
  req.counter = counter;
  req.step = c.step;
  req.layout = &c.layout;
  req.crc_chunk_bytes = kTestCrcChunk;
  req.chunk_crcs = c.crcs;
  req.meta_json = c.meta_json;
  return req;
}

// Writes the data region in one call and commits it.
inline Status WriteAndCommit(SlotFile& f, const TestCheckpoint& c, uint32_t slot,
                             uint64_t counter) {
  NONSTOP_RETURN_IF_ERROR(f.WriteData(slot, 0, c.data.data(), c.data.size()));
  return f.Commit(MakeCommitRequest(c, slot, counter)).status();
}

// Checks that `info` is exactly what MakeCheckpoint(info.step) wrote: the
// tensor table, the metadata and every tensor's bytes (read with crc checks).
// Returns the first difference, or OK.
inline Status CheckContent(SlotFile& f, const CheckpointInfo& info) {
  const TestCheckpoint want = MakeCheckpoint(info.step);
  const std::string what = "checkpoint #" + std::to_string(info.counter) + " (step " +
                           std::to_string(info.step) + ")";
  if (info.meta_json != want.meta_json) return Status::Corruption(what + ": metadata differs");
  if (info.data_bytes != want.layout.data_bytes ||
      info.tensors.size() != want.layout.tensors.size()) {
    return Status::Corruption(what + ": tensor table differs in size");
  }
  std::vector<uint8_t> got;
  for (size_t i = 0; i < info.tensors.size(); ++i) {
    const TensorEntry& a = info.tensors[i];
    const TensorEntry& b = want.layout.tensors[i];
    if (a.spec.name != b.spec.name || a.spec.dtype != b.spec.dtype || a.spec.shape != b.spec.shape ||
        a.spec.nbytes != b.spec.nbytes || a.data_offset != b.data_offset) {
      return Status::Corruption(what + ": tensor table entry " + std::to_string(i) + " differs");
    }
    got.assign(a.spec.nbytes, 0);
    NONSTOP_RETURN_IF_ERROR(f.ReadTensor(info, static_cast<int>(i), got.data()).Annotate(what));
    if (a.spec.nbytes > 0 &&
        std::memcmp(got.data(), want.data.data() + b.data_offset, a.spec.nbytes) != 0) {
      return Status::Corruption(what + ": bytes of tensor '" + a.spec.name + "' differ");
    }
  }
  return Status::OK();
}

}  // namespace nonstop::testing
