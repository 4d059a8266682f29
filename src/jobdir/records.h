// The small JSON records of a job directory (lineage, agreed): a bounded
// parser (size, depth and element counts limited before anything grows) and
// their encoding; and the check of a checkpoint's metadata document.
// Internal to src/jobdir.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/jobdir.h"
#include "nonstop/status.h"

namespace nonstop::jobdir_internal {

inline constexpr uint64_t kMaxRecordBytes = 256 << 10;
inline constexpr int kMaxJsonDepth = 8;
inline constexpr size_t kMaxJsonElements = 20000;
inline constexpr size_t kMaxAbandonedRanges = 8192;
inline constexpr size_t kMaxNotDurable = 1024;

struct Json {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject } type = Type::kNull;
  bool b = false;
  std::string text;  // number text, or string value
  std::vector<Json> items;  // array items; object values (keys in `keys`)
  std::vector<std::string> keys;

  const Json* Get(std::string_view key) const;
  bool AsUint64(uint64_t* out) const;
  bool AsInt64(int64_t* out) const;
  bool AsDouble(double* out) const;
};

// Parses `text` (at most kMaxRecordBytes). Corruption naming `what` on any error.
Result<Json> ParseJson(std::string_view text, const std::string& what);
// The same with other bounds, for a document that is already in memory and
// may be larger than a record (a multistep replay plan).
struct JsonLimits {
  uint64_t max_bytes = kMaxRecordBytes;
  size_t max_elements = kMaxJsonElements;
  int max_depth = kMaxJsonDepth;
  size_t max_number_chars = 40;
};
Result<Json> ParseJson(std::string_view text, const std::string& what, const JsonLimits& limits);

// A checkpoint's metadata document (meta_json, docs/FORMAT.md), a hostile
// file's bytes, checked before the Python front end parses it: at most
// format::kMaxMetaBytes, valid UTF-8, one JSON value (RFC 8259 numbers of at
// most kMaxMetaNumberChars characters: Python's int() limit) whose arrays
// and objects nest at most kMaxMetaDepth levels. Builds nothing. Corruption,
// one line.
inline constexpr int kMaxMetaDepth = 200;
inline constexpr size_t kMaxMetaNumberChars = 4300;
Status CheckMetaJson(std::string_view text);
// CheckMetaJson's bounds for a tree that is built (elements unbounded): at
// most `max_bytes`, kMaxMetaDepth levels, kMaxMetaNumberChars per number.
JsonLimits MetaJsonLimits(uint64_t max_bytes);
// The text of the value of `key` in the top-level object of `text`, found by
// a scan without recursion (hostile bytes); empty when absent or when `text`
// is not an object the scan understands.
std::string_view TopLevelValue(std::string_view text, std::string_view key);
// A JSON string literal for `s` (quotes included).
std::string JsonString(std::string_view s);
// The JSON text of `j` without spaces, each number as its original text (a
// float stays exactly what was parsed), appended to `out`.
void AppendJson(const Json& j, std::string* out);

std::string EncodeLineage(const LineageRecord& rec, int rank);
Result<LineageRecord> DecodeLineage(std::string_view text, const std::string& what);
std::string EncodeAgreed(const AgreedRecord& rec);
Result<AgreedRecord> DecodeAgreed(std::string_view text, const std::string& what);

}  // namespace nonstop::jobdir_internal
