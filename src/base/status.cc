// Status formatting and dtype tables.
#include <array>

#include "nonstop/status.h"
#include "nonstop/types.h"

namespace nonstop {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kCorruption: return "Corruption";
    case StatusCode::kIOError: return "IOError";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kAborted: return "Aborted";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

namespace {
struct DTypeInfo {
  size_t size;
  std::string_view name;
  std::string_view st_name;
};
// Indexed by the DType value (part of the on-disk format).
constexpr std::array<DTypeInfo, kNumDTypes> kDTypes = {{
    {1, "uint8", "U8"},
    {1, "int8", "I8"},
    {2, "int16", "I16"},
    {4, "int32", "I32"},
    {8, "int64", "I64"},
    {2, "float16", "F16"},
    {2, "bfloat16", "BF16"},
    {4, "float32", "F32"},
    {8, "float64", "F64"},
    {1, "bool", "BOOL"},
    {8, "complex64", "C64"},
    {16, "complex128", "C128"},
    {2, "uint16", "U16"},
    {4, "uint32", "U32"},
    {8, "uint64", "U64"},
    {1, "float8_e4m3fn", "F8_E4M3"},
    {1, "float8_e5m2", "F8_E5M2"},
}};
}  // namespace

size_t DTypeSize(DType t) {
  auto i = static_cast<size_t>(t);
  return i < kDTypes.size() ? kDTypes[i].size : 0;
}

std::string_view DTypeName(DType t) {
  auto i = static_cast<size_t>(t);
  return i < kDTypes.size() ? kDTypes[i].name : std::string_view("invalid");
}

std::string_view DTypeSafetensorsName(DType t) {
  auto i = static_cast<size_t>(t);
  return i < kDTypes.size() ? kDTypes[i].st_name : std::string_view("invalid");
}

bool ParseDType(std::string_view name, DType* out) {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (kDTypes[i].name == name) {
      *out = static_cast<DType>(i);
      return true;
    }
  }
  return false;
}

uint64_t NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d < 0 ? 0 : d);
  return n;
}

}  // namespace nonstop
