// Bounded JSON for the job directory's records and a checkpoint's metadata (records.h).
#include "jobdir/records.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "store/format.h"

namespace nonstop::jobdir_internal {
namespace {

// Parses into a Json tree, or (Value(nullptr, 0)) only checks: nothing is
// built, so a check allocates nothing whatever the text holds.
class Parser {
 public:
  Parser(std::string_view s, const std::string& what, const JsonLimits& limits)
      : s_(s), what_(what), limits_(limits) {}

  Result<Json> Run() {
    Json v;
    NONSTOP_RETURN_IF_ERROR(Check(&v));
    return v;
  }
  // Run() into `v`, or (nullptr) without building anything.
  Status Check(Json* v) {
    if (s_.size() > limits_.max_bytes) {
      return Status::Corruption(what_ + ": " + std::to_string(s_.size()) +
                                " bytes, more than the limit of " +
                                std::to_string(limits_.max_bytes));
    }
    if (!Value(v, 0)) return Err();
    Ws();
    if (i_ != s_.size()) {
      msg_ = "trailing bytes";
      return Err();
    }
    return Status::OK();
  }

 private:
  Status Err() const {
    return Status::Corruption(what_ + ": not valid JSON (" + msg_ + " at byte " +
                              std::to_string(i_) + ")");
  }
  void Ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) {
      ++i_;
    }
  }
  bool Lit(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) {
      msg_ = "unexpected token";
      return false;
    }
    i_ += w.size();
    return true;
  }
  bool Count() {
    if (++elements_ > limits_.max_elements) {
      msg_ = "too many elements";
      return false;
    }
    return true;
  }
  // `depth`: how many arrays and objects hold this value; at most max_depth
  // of them nest (a scalar inside the innermost is fine).
  bool Value(Json* v, int depth) {
    if (!Count()) return false;
    Ws();
    if (i_ >= s_.size()) {
      msg_ = "unexpected end";
      return false;
    }
    const char c = s_[i_];
    if ((c == '{' || c == '[') && depth >= limits_.max_depth) {
      msg_ = "nested too deep";
      return false;
    }
    if (c == '{') return Object(v, depth);
    if (c == '[') return Array(v, depth);
    if (c == '"') {
      if (v) v->type = Json::Type::kString;
      return String(v ? &v->text : nullptr);
    }
    if (c == 't' || c == 'f') {
      if (v) {
        v->type = Json::Type::kBool;
        v->b = c == 't';
      }
      return Lit(c == 't' ? "true" : "false");
    }
    if (c == 'n') return Lit("null");
    if (c != '-' && (c < '0' || c > '9')) {
      msg_ = "unexpected character";
      return false;
    }
    return Number(v);
  }
  // Digits from s_[i_]; how many.
  size_t Digits() {
    const size_t b = i_;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    return i_ - b;
  }
  // RFC 8259's number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  bool Number(Json* v) {
    const size_t b = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    const size_t int0 = i_;
    bool ok = Digits() > 0 && (s_[int0] != '0' || i_ == int0 + 1);
    if (ok && i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      ok = Digits() > 0;
    }
    if (ok && i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      ok = Digits() > 0;
    }
    if (!ok || i_ - b > limits_.max_number_chars) {
      msg_ = "bad number";
      return false;
    }
    if (v) {
      v->type = Json::Type::kNumber;
      v->text = std::string(s_.substr(b, i_ - b));
    }
    return true;
  }
  static void Utf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }
  bool Hex4(uint32_t* cp) {
    if (i_ + 4 > s_.size()) return false;
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= h - '0';
      else if (h >= 'a' && h <= 'f') v |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') v |= h - 'A' + 10;
      else return false;
    }
    *cp = v;
    return true;
  }
  // A string from its opening quote, into `out` (nullptr: only checked).
  bool String(std::string* out) {
    std::string scratch;  // a check's escapes (at most 4 bytes, no allocation)
    ++i_;  // opening quote
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) {
        msg_ = "control character in a string";
        return false;
      }
      if (c != '\\') {
        if (out) out->push_back(c);
        continue;
      }
      if (i_ >= s_.size()) break;
      std::string* to = out ? out : &scratch;
      scratch.clear();
      const char e = s_[i_++];
      switch (e) {
        case '"': to->push_back('"'); break;
        case '\\': to->push_back('\\'); break;
        case '/': to->push_back('/'); break;
        case 'b': to->push_back('\b'); break;
        case 'f': to->push_back('\f'); break;
        case 'n': to->push_back('\n'); break;
        case 'r': to->push_back('\r'); break;
        case 't': to->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          if (!Hex4(&cp)) {
            msg_ = "bad \\u escape";
            return false;
          }
          if (cp >= 0xD800 && cp < 0xDC00 && s_.substr(i_, 2) == "\\u") {
            i_ += 2;
            uint32_t lo = 0;
            if (!Hex4(&lo) || lo < 0xDC00 || lo > 0xDFFF) {
              msg_ = "bad surrogate pair";
              return false;
            }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          Utf8(cp, to);
          break;
        }
        default:
          msg_ = "bad escape";
          return false;
      }
    }
    msg_ = "unterminated string";
    return false;
  }
  // The items of an array or object after its opening bracket: `item`
  // parses one (for an object, its key and value), separated by ',' up to
  // `close`. One loop for both, so their bounds and errors cannot diverge.
  template <typename Item>
  bool Items(char close, Item item) {
    ++i_;
    Ws();
    if (i_ < s_.size() && s_[i_] == close) {
      ++i_;
      return true;
    }
    while (true) {
      if (!item()) return false;
      Ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == close) {
        ++i_;
        return true;
      }
      msg_ = close == ']' ? "expected ',' or ']'" : "expected ',' or '}'";
      return false;
    }
  }
  bool Array(Json* v, int depth) {
    if (!v) return Items(']', [&] { return Value(nullptr, depth + 1); });
    v->type = Json::Type::kArray;
    return Items(']', [&] {
      v->items.emplace_back();
      return Value(&v->items.back(), depth + 1);
    });
  }
  bool Object(Json* v, int depth) {
    if (v) v->type = Json::Type::kObject;
    return Items('}', [&] {
      Ws();
      if (i_ >= s_.size() || s_[i_] != '"') {
        msg_ = "expected a key";
        return false;
      }
      std::string key;
      if (!String(v ? &key : nullptr)) return false;
      Ws();
      if (i_ >= s_.size() || s_[i_] != ':') {
        msg_ = "expected ':'";
        return false;
      }
      ++i_;
      if (!v) return Value(nullptr, depth + 1);
      v->keys.push_back(std::move(key));
      v->items.emplace_back();
      return Value(&v->items.back(), depth + 1);
    });
  }

  std::string_view s_;
  const std::string& what_;
  JsonLimits limits_;
  size_t i_ = 0;
  size_t elements_ = 0;
  std::string msg_;
};

bool IsInteger(const std::string& t) {
  if (t.empty()) return false;
  for (size_t k = 0; k < t.size(); ++k) {
    if (!(t[k] >= '0' && t[k] <= '9') && !(k == 0 && t[k] == '-')) return false;
  }
  return true;
}

std::string Num(double d) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.6f", d);
  return b;
}

}  // namespace

const Json* Json::Get(std::string_view key) const {
  if (type != Type::kObject) return nullptr;
  for (size_t k = 0; k < keys.size(); ++k) {
    if (keys[k] == key) return &items[k];
  }
  return nullptr;
}

bool Json::AsUint64(uint64_t* out) const {
  if (type != Type::kNumber || !IsInteger(text) || text[0] == '-') return false;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && p == text.data() + text.size();
}

bool Json::AsInt64(int64_t* out) const {
  if (type != Type::kNumber || !IsInteger(text)) return false;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && p == text.data() + text.size();
}

bool Json::AsDouble(double* out) const {
  if (type != Type::kNumber) return false;
  char* end = nullptr;
  *out = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && std::isfinite(*out);
}

// Scans the top-level object of `text` without recursion and returns the
// text of the value of `key` (empty when absent, or when `text` is not an
// object this scan understands). Trailing white space is not part of the value.
std::string_view TopLevelValue(std::string_view text, std::string_view key) {
  size_t i = 0;
  const size_t n = text.size();
  auto ws = [&] {
    while (i < n && (text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r')) ++i;
  };
  // Skips a string starting at text[i] == '"'; false when unterminated.
  auto skip_string = [&]() -> bool {
    for (++i; i < n; ++i) {
      if (text[i] == '\\') {
        ++i;
      } else if (text[i] == '"') {
        ++i;
        return true;
      }
    }
    return false;
  };
  ws();
  if (i >= n || text[i] != '{') return {};
  ++i;
  while (true) {
    ws();
    if (i >= n || text[i] != '"') return {};
    const size_t k0 = i + 1;
    if (!skip_string()) return {};
    const std::string_view k = text.substr(k0, i - 1 - k0);
    ws();
    if (i >= n || text[i] != ':') return {};
    ++i;
    ws();
    const size_t v0 = i;
    size_t depth = 0;
    while (i < n) {
      const char c = text[i];
      if (c == '"') {
        if (!skip_string()) return {};
        if (depth == 0) break;
        continue;
      }
      if (c == '{' || c == '[') {
        ++depth;
      } else if (c == '}' || c == ']') {
        if (depth == 0) break;  // the end of the top-level object
        if (--depth == 0) {
          ++i;
          break;
        }
      } else if (c == ',' && depth == 0) {
        break;
      }
      ++i;
    }
    if (i > n) return {};
    if (k == key) {
      std::string_view v = text.substr(v0, i - v0);
      while (!v.empty() && (v.back() == ' ' || v.back() == '\n' || v.back() == '\t' || v.back() == '\r')) {
        v.remove_suffix(1);
      }
      return v;
    }
    ws();
    if (i >= n) return {};
    if (text[i] == '}') return {};
    if (text[i] != ',') return {};
    ++i;
  }
}

Result<Json> ParseJson(std::string_view text, const std::string& what) {
  return Parser(text, what, JsonLimits{}).Run();
}

Result<Json> ParseJson(std::string_view text, const std::string& what, const JsonLimits& limits) {
  return Parser(text, what, limits).Run();
}

Status CheckMetaJson(std::string_view text) {
  const std::string what = "metadata";
  if (text.size() <= format::kMaxMetaBytes && !format::IsValidUtf8(text)) {
    return Status::Corruption("metadata is not valid UTF-8");
  }
  return Parser(text, what, MetaJsonLimits(format::kMaxMetaBytes)).Check(nullptr);
}

JsonLimits MetaJsonLimits(uint64_t max_bytes) {
  JsonLimits limits;
  limits.max_bytes = max_bytes;
  limits.max_elements = SIZE_MAX;
  limits.max_depth = kMaxMetaDepth;
  limits.max_number_chars = kMaxMetaNumberChars;
  return limits;
}

std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\u%04x", u);
      out += b;
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
  return out;
}

void AppendJson(const Json& j, std::string* out) {
  switch (j.type) {
    case Json::Type::kNull: *out += "null"; return;
    case Json::Type::kBool: *out += j.b ? "true" : "false"; return;
    case Json::Type::kNumber: *out += j.text; return;
    case Json::Type::kString: *out += JsonString(j.text); return;
    case Json::Type::kArray:
    case Json::Type::kObject:
      break;
  }
  const bool obj = j.type == Json::Type::kObject;
  out->push_back(obj ? '{' : '[');
  for (size_t i = 0; i < j.items.size(); ++i) {
    if (i) out->push_back(',');
    if (obj) *out += JsonString(j.keys[i]) + ":";
    AppendJson(j.items[i], out);
  }
  out->push_back(obj ? '}' : ']');
}

std::string EncodeLineage(const LineageRecord& rec, int rank) {
  std::string out = "{\"format\": \"nonstop-lineage\", \"version\": 1, \"rank\": " +
                    std::to_string(rank) +
                    ", \"restored\": " + std::to_string(rec.restored_counter) + ", \"abandoned\": [";
  for (size_t k = 0; k < rec.abandoned.size(); ++k) {
    if (k) out += ", ";
    out += "[" + std::to_string(rec.abandoned[k].first) + ", " +
           std::to_string(rec.abandoned[k].second) + "]";
  }
  out += "]";
  if (!rec.not_durable.empty()) {
    out += ", \"not_durable\": [";
    for (size_t k = 0; k < rec.not_durable.size(); ++k) {
      if (k) out += ", ";
      out += std::to_string(rec.not_durable[k]);
    }
    out += "]";
  }
  out += "}\n";
  return out;
}

Result<LineageRecord> DecodeLineage(std::string_view text, const std::string& what) {
  NONSTOP_ASSIGN_OR_RETURN(Json j, ParseJson(text, what));
  auto bad = [&](const std::string& why) {
    return Status::Corruption(what + ": not a lineage record (" + why + ")");
  };
  const Json* fmt = j.Get("format");
  if (fmt == nullptr || fmt->type != Json::Type::kString || fmt->text != "nonstop-lineage") {
    return bad("no \"format\": \"nonstop-lineage\"");
  }
  const Json* ver = j.Get("version");
  uint64_t version = 0;
  if (ver == nullptr || !ver->AsUint64(&version) || version != 1) return bad("version is not 1");
  LineageRecord rec;
  const Json* restored = j.Get("restored");
  if (restored == nullptr || !restored->AsUint64(&rec.restored_counter)) {
    return bad("\"restored\" is not a counter");
  }
  const Json* ab = j.Get("abandoned");
  if (ab == nullptr || ab->type != Json::Type::kArray) return bad("\"abandoned\" is not a list");
  if (ab->items.size() > kMaxAbandonedRanges) return bad("too many abandoned ranges");
  uint64_t prev_hi = 0;
  for (const Json& r : ab->items) {
    uint64_t lo = 0, hi = 0;
    if (r.type != Json::Type::kArray || r.items.size() != 2 || !r.items[0].AsUint64(&lo) ||
        !r.items[1].AsUint64(&hi) || lo == 0 || lo > hi || lo <= prev_hi) {
      return bad("abandoned ranges must be sorted, disjoint [lo, hi] counter pairs");
    }
    rec.abandoned.emplace_back(lo, hi);
    prev_hi = hi;
  }
  rec.abandoned_through = prev_hi;
  const Json* nd = j.Get("not_durable");  // optional (older records have none)
  if (nd != nullptr) {
    if (nd->type != Json::Type::kArray || nd->items.size() > kMaxNotDurable) {
      return bad("\"not_durable\" is not a list of at most " + std::to_string(kMaxNotDurable) +
                 " counters");
    }
    uint64_t prev = 0;
    for (const Json& c : nd->items) {
      uint64_t v = 0;
      const bool parsed = c.AsUint64(&v);
      const bool in_range = std::any_of(rec.abandoned.begin(), rec.abandoned.end(),
                                        [&](const auto& r) { return v >= r.first && v <= r.second; });
      if (!parsed || v <= prev || !in_range) {
        return bad("\"not_durable\" must list ascending abandoned counters");
      }
      rec.not_durable.push_back(v);
      prev = v;
    }
  }
  return rec;
}

std::string EncodeAgreed(const AgreedRecord& rec) {
  std::string out = "{\"step\": " + std::to_string(rec.step) +
                    ", \"counter\": " + std::to_string(rec.counter) +
                    ", \"lineage\": " + std::to_string(rec.lineage) +
                    ", \"rank\": " + std::to_string(rec.rank) +
                    ", \"world_size\": " + std::to_string(rec.world_size) +
                    ", \"unix_s\": " + Num(rec.unix_s);
  if (!rec.resharded_from.empty()) {
    out += ", \"resharded_from\": [" + JsonString(rec.resharded_from) + ", " +
           std::to_string(rec.resharded_from_world) + "]";
  }
  out += "}\n";
  return out;
}

Result<AgreedRecord> DecodeAgreed(std::string_view text, const std::string& what) {
  NONSTOP_ASSIGN_OR_RETURN(Json j, ParseJson(text, what));
  auto bad = [&](const std::string& why) {
    return Status::Corruption(what + ": not an agreed record (" + why + ")");
  };
  if (j.type != Json::Type::kObject) return bad("not an object");
  AgreedRecord rec;
  int64_t v = 0;
  const Json* f = j.Get("step");
  if (f == nullptr || !f->AsInt64(&rec.step)) return bad("\"step\" is not an integer");
  f = j.Get("counter");
  if (f == nullptr || !f->AsInt64(&rec.counter)) return bad("\"counter\" is not an integer");
  f = j.Get("lineage");
  if (f == nullptr || !f->AsUint64(&rec.lineage)) return bad("\"lineage\" is not an integer");
  f = j.Get("rank");
  if (f == nullptr || !f->AsInt64(&v) || v < 0 || v > 99999) return bad("\"rank\" is not a rank");
  rec.rank = static_cast<int>(v);
  f = j.Get("world_size");
  if (f == nullptr || !f->AsInt64(&v) || v < 1 || v > 100000) {
    return bad("\"world_size\" is not a world size");
  }
  rec.world_size = static_cast<int>(v);
  f = j.Get("unix_s");
  if (f != nullptr && !f->AsDouble(&rec.unix_s)) return bad("\"unix_s\" is not a number");
  f = j.Get("resharded_from");
  if (f != nullptr && f->type != Json::Type::kNull) {
    if (f->type != Json::Type::kArray || f->items.size() != 2 ||
        f->items[0].type != Json::Type::kString || !f->items[1].AsInt64(&v) || v < 1 ||
        v > 100000) {
      return bad("\"resharded_from\" is not [dir, world size]");
    }
    rec.resharded_from = f->items[0].text;
    rec.resharded_from_world = static_cast<int>(v);
  }
  return rec;
}

}  // namespace nonstop::jobdir_internal

namespace nonstop {

std::optional<uint64_t> CheckpointRunId(std::string_view meta_json) {
  using jobdir_internal::TopLevelValue;
  const std::string_view dist = TopLevelValue(meta_json, "dist");
  if (dist.empty() || dist.front() != '{') return uint64_t{0};  // not a distributed checkpoint
  const std::string_view v = TopLevelValue(dist, "lineage");
  if (v.empty() || v == "null") return uint64_t{0};
  uint64_t id = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), id);
  if (ec != std::errc() || p != v.data() + v.size()) return std::nullopt;
  return id;
}

}  // namespace nonstop
