// Plain value types shared by the store, the engine and the bindings.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace nonstop {

// Element types. The numeric values are part of the on-disk format: never
// renumber, only append.
enum class DType : uint8_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBool = 9,
  kComplex64 = 10,
  kComplex128 = 11,
  kUInt16 = 12,
  kUInt32 = 13,
  kUInt64 = 14,
  kFloat8E4M3 = 15,
  kFloat8E5M2 = 16,
};
constexpr int kNumDTypes = 17;

// Bytes per element; 0 for a value outside the enum.
size_t DTypeSize(DType t);
// Short names as torch and safetensors spell them ("float32", "bfloat16", ...).
std::string_view DTypeName(DType t);
// Safetensors spelling ("F32", "BF16", ...).
std::string_view DTypeSafetensorsName(DType t);
// Parses DTypeName() spellings; false when unknown.
bool ParseDType(std::string_view name, DType* out);

// Where a tensor's bytes live. Host pointers are plain CPU memory; CUDA
// pointers are device memory on `device_index`, read on `stream` (a
// cudaStream_t as an integer, 0 = legacy default stream).
enum class DeviceKind : uint8_t { kHost = 0, kCuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kHost;
  int index = 0;
  uintptr_t stream = 0;
};

// The place of a tensor (or of this rank's piece of it) in the global model.
// For an unsharded tensor, global_shape == shape and the range is the whole
// tensor. For a flat 1/world share of a replicated tensor, `shape` is the
// local piece's shape ({numel}) and [global_offset, global_offset + numel)
// is the element range of the flattened global tensor this rank holds.
struct GlobalLayout {
  std::vector<int64_t> global_shape;
  uint64_t global_offset = 0;  // in elements of the flattened global tensor
};

// Describes one tensor as stored: no pointer, only what the format records.
struct TensorSpec {
  std::string name;             // unique within a checkpoint, UTF-8, <= 4096 bytes
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;   // local shape; numel * DTypeSize(dtype) == nbytes
  uint64_t nbytes = 0;
  GlobalLayout global;          // empty global_shape means "same as shape"
};

// Number of elements of a shape (1 for a scalar).
uint64_t NumElements(const std::vector<int64_t>& shape);

}  // namespace nonstop
