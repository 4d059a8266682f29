// How the CLI turns a checkpoint's metadata (bytes from a file that may be
// hostile) into JSON, bounded before anything is parsed: at most
// kMaxMetaParseBytes bytes and kMaxJsonDepth levels of nesting are parsed,
// anything else (too big, too deep, not JSON) is shown as a JSON string.
// Header-only so the fuzz target (tests/fuzz) runs exactly this code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace nonstop::cli {

inline constexpr size_t kMaxJsonDepth = 128;
inline constexpr size_t kMaxMetaParseBytes = 16u << 20;

// The deepest nesting of [ and { in `text` outside JSON strings, counted
// without recursion; stops counting (returns limit + 1) once past `limit`.
inline size_t JsonNestingDepth(std::string_view text, size_t limit = kMaxJsonDepth) {
  size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest) deepest = depth;
      if (deepest > limit) return limit + 1;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

// The metadata as JSON: parsed when it is small and shallow enough and
// valid, else the text itself as a JSON string; null when empty. Never
// throws a json exception.
inline nlohmann::json MetaJson(std::string_view meta) {
  if (meta.empty()) return nullptr;
  if (meta.size() <= kMaxMetaParseBytes && JsonNestingDepth(meta) <= kMaxJsonDepth) {
    nlohmann::json j = nlohmann::json::parse(meta.begin(), meta.end(), nullptr,
                                             /*allow_exceptions=*/false);
    if (!j.is_discarded()) return j;
  }
  return nlohmann::json(std::string(meta));
}

// JSON text for the CLI's output: invalid UTF-8 anywhere (a file name, a
// string from a hostile file) is replaced with U+FFFD instead of throwing.
inline std::string DumpJson(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

}  // namespace nonstop::cli
