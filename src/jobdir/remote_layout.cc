// The layout and commit rules of a remote checkpoint (jobdir/remote_layout.h).
#include "jobdir/remote_layout.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <memory>
#include <set>

#include "jobdir/records.h"

namespace nonstop::remote {
namespace {

using jobdir_internal::Json;
using jobdir_internal::JsonString;
using jobdir_internal::ParseJson;

std::string Padded(uint64_t v, int width) {
  std::string s = std::to_string(v);
  if (static_cast<int>(s.size()) < width) s.insert(0, width - s.size(), '0');
  return s;
}

std::string RankName(uint32_t rank, std::string_view ext) {
  return "rank-" + Padded(rank, 5) + std::string(ext);
}

// Exactly `digits` decimal digits.
std::optional<uint64_t> Digits(std::string_view s, size_t digits) {
  if (s.size() != digits) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

std::string Seconds(double unix_s) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.6f", unix_s);
  return b;
}

// The fields every document has: format, step, world_size, lineage.
Status CommonFields(const Json& j, const std::string& what, Doc* out) {
  if (j.type != Json::Type::kObject) return Status::Corruption(what + " is not a JSON object");
  const Json* fmt = j.Get("format");
  if (fmt == nullptr || fmt->type != Json::Type::kString || fmt->text != kFormat) {
    return Status::Corruption(what + " is not a nonstop remote document");
  }
  const Json* step = j.Get("step");
  const Json* world = j.Get("world_size");
  const Json* lineage = j.Get("lineage");
  uint64_t w = 0;
  if (step == nullptr || !step->AsInt64(&out->step) || out->step < 0 || out->step > kMaxStep) {
    return Status::Corruption(what + ": field 'step' is missing or not a step");
  }
  if (world == nullptr || !world->AsUint64(&w) || w < 1 || w > kMaxWorld) {
    return Status::Corruption(what + ": field 'world_size' is missing or out of range");
  }
  out->world_size = static_cast<uint32_t>(w);
  if (lineage == nullptr || !lineage->AsInt64(&out->lineage)) {
    return Status::Corruption(what + ": field 'lineage' is missing or not an integer");
  }
  return Status::OK();
}

Status RankField(const Json& j, const std::string& what, uint32_t world, uint32_t* out) {
  const Json* rank = j.Get("rank");
  uint64_t r = 0;
  if (rank == nullptr || !rank->AsUint64(&r) || r >= world) {
    return Status::Corruption(what + ": field 'rank' is missing or not below world_size");
  }
  *out = static_cast<uint32_t>(r);
  return Status::OK();
}

Status CheckLength(std::string_view text, const std::string& what) {
  if (text.size() > kMaxDocBytes) {
    return Status::Corruption(what + " is " + std::to_string(text.size()) +
                              " bytes, more than a nonstop remote document (" +
                              std::to_string(kMaxDocBytes) + ")");
  }
  return Status::OK();
}

}  // namespace

std::string StepDir(int64_t step) {
  return "step-" + Padded(static_cast<uint64_t>(std::clamp<int64_t>(step, 0, kMaxStep)), 12);
}
std::string PartKey(int64_t step, uint32_t rank) { return StepDir(step) + "/" + RankName(rank, ".nsck"); }
std::string ManifestKey(int64_t step, uint32_t rank) {
  return StepDir(step) + "/" + RankName(rank, ".json");
}
std::string MarkerKey(int64_t step) { return StepDir(step) + "/COMMITTED"; }
std::string LeadKey(int64_t step) { return StepDir(step) + "/LEAD"; }
std::string JobKey() { return "JOB"; }
std::string SkipKey(int64_t step, uint32_t rank) { return StepDir(step) + "/" + RankName(rank, ".skip"); }

std::optional<Key> ParseKey(std::string_view key) {
  const size_t slash = key.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  const std::string_view dir = key.substr(0, slash);
  const std::string_view name = key.substr(slash + 1);
  if (dir.substr(0, 5) != "step-" || name.empty() || name.find('/') != std::string_view::npos) {
    return std::nullopt;
  }
  const std::optional<uint64_t> step = Digits(dir.substr(5), 12);
  if (!step) return std::nullopt;
  Key k;
  k.step = static_cast<int64_t>(*step);
  if (name == "COMMITTED") {
    k.kind = Key::Kind::kMarker;
  } else if (name == "LEAD") {
    k.kind = Key::Kind::kLead;
  } else if (name.size() == 15 && name.substr(0, 5) == "rank-") {
    const std::optional<uint64_t> rank = Digits(name.substr(5, 5), 5);
    const std::string_view ext = name.substr(10);
    if (rank && *rank < kMaxWorld) {
      k.rank = static_cast<uint32_t>(*rank);
      if (ext == ".nsck") k.kind = Key::Kind::kPart;
      if (ext == ".json") k.kind = Key::Kind::kManifest;
      if (ext == ".skip") k.kind = Key::Kind::kSkip;
    }
  }
  return k;
}

uint64_t ChecksumUnit(uint64_t size, uint64_t preferred) {
  uint64_t unit = std::clamp(preferred, kMinPartBytes, kMaxPartBytes);
  // size / unit rounded up, without overflowing near 2^64
  while (unit < kMaxPartBytes && size / unit + (size % unit != 0 ? 1 : 0) > kMaxParts) unit *= 2;
  return unit;
}

Result<Doc> DecodeDoc(std::string_view text, const std::string& what) {
  NONSTOP_RETURN_IF_ERROR(CheckLength(text, what));
  NONSTOP_ASSIGN_OR_RETURN(Json j, ParseJson(text, what));
  Doc d;
  NONSTOP_RETURN_IF_ERROR(CommonFields(j, what, &d));
  if (const Json* c = j.Get("counter"); c != nullptr) {
    uint64_t v = 0;
    if (!c->AsUint64(&v)) return Status::Corruption(what + ": field 'counter' is not a counter");
    d.counter = v;
  }
  if (const Json* t = j.Get("unix_s"); t != nullptr) {
    double v = 0;
    if (t->AsDouble(&v)) d.unix_s = v;
  }
  if (j.Get("rank") != nullptr) {
    uint32_t r = 0;
    NONSTOP_RETURN_IF_ERROR(RankField(j, what, d.world_size, &r));
    d.rank = r;
  }
  return d;
}

Result<Manifest> DecodeManifest(std::string_view text, const std::string& what) {
  NONSTOP_RETURN_IF_ERROR(CheckLength(text, what));
  NONSTOP_ASSIGN_OR_RETURN(Json j, ParseJson(text, what));
  Doc d;
  NONSTOP_RETURN_IF_ERROR(CommonFields(j, what, &d));
  Manifest m;
  m.step = d.step;
  m.world_size = d.world_size;
  m.lineage = d.lineage;
  NONSTOP_RETURN_IF_ERROR(RankField(j, what, m.world_size, &m.rank));
  const Json* counter = j.Get("counter");
  if (counter == nullptr || !counter->AsUint64(&m.counter)) {
    return Status::Corruption(what + ": field 'counter' is missing or not a counter");
  }
  const Json* bytes = j.Get("bytes");
  const Json* part = j.Get("part_bytes");
  const Json* crcs = j.Get("part_crc32");
  if (bytes == nullptr || !bytes->AsUint64(&m.bytes) || part == nullptr ||
      !part->AsUint64(&m.part_bytes) || m.part_bytes < kMinPartBytes ||
      m.part_bytes > kMaxPartBytes) {
    return Status::Corruption(what + ": sizes are missing or out of range");
  }
  // The count the sizes imply, checked against the list before it is copied.
  const uint64_t want = m.bytes / m.part_bytes + (m.bytes % m.part_bytes != 0 ? 1 : 0);
  if (crcs == nullptr || crcs->type != Json::Type::kArray || want > kMaxParts ||
      crcs->items.size() != want) {
    return Status::Corruption(what + ": " + std::to_string(m.bytes) + " bytes in units of " +
                              std::to_string(m.part_bytes) + " need " + std::to_string(want) +
                              " part checksums; the list does not have them");
  }
  m.part_crc32.reserve(want);
  for (const Json& c : crcs->items) {
    uint64_t v = 0;
    if (!c.AsUint64(&v) || v > 0xffffffffu) {
      return Status::Corruption(what + ": a part checksum is not a crc32");
    }
    m.part_crc32.push_back(static_cast<uint32_t>(v));
  }
  return m;
}

std::string EncodeManifest(const Manifest& m, double unix_s) {
  std::string out = "{\"format\": " + JsonString(kFormat) + ", \"step\": " + std::to_string(m.step) +
                    ", \"counter\": " + std::to_string(m.counter) +
                    ", \"rank\": " + std::to_string(m.rank) +
                    ", \"world_size\": " + std::to_string(m.world_size) +
                    ", \"lineage\": " + std::to_string(m.lineage) +
                    ", \"bytes\": " + std::to_string(m.bytes) +
                    ", \"part_bytes\": " + std::to_string(m.part_bytes) + ", \"part_crc32\": [";
  for (size_t i = 0; i < m.part_crc32.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(m.part_crc32[i]);
  }
  return out + "], \"unix_s\": " + Seconds(unix_s) + "}";
}

namespace {
std::string DocHead(const Doc& d) {
  return "{\"format\": " + JsonString(kFormat) + ", \"step\": " + std::to_string(d.step) +
         ", \"world_size\": " + std::to_string(d.world_size) +
         ", \"lineage\": " + std::to_string(d.lineage);
}
}  // namespace

std::string EncodeMarker(const Doc& marker, const std::vector<Manifest>& manifests, double unix_s) {
  std::string out = DocHead(marker);
  if (marker.counter) out += ", \"counter\": " + std::to_string(*marker.counter);
  out += ", \"ranks\": {";
  for (size_t i = 0; i < manifests.size(); ++i) {
    if (i) out += ", ";
    out += "\"" + std::to_string(manifests[i].rank) + "\": " + std::to_string(manifests[i].bytes);
  }
  return out + "}, \"unix_s\": " + Seconds(unix_s) + "}";
}

std::string EncodeLead(const Doc& lead, double unix_s) {
  return DocHead(lead) + ", \"unix_s\": " + Seconds(unix_s) + "}";
}

std::string EncodeSkip(const Doc& skip, double unix_s) {
  return DocHead(skip) + ", \"rank\": " + std::to_string(skip.rank.value_or(0)) +
         ", \"unix_s\": " + Seconds(unix_s) + "}";
}

std::string EncodeJob(const std::string& job, double unix_s) {
  return std::string("{\"format\": ") + JsonString(kFormat) + ", \"kind\": \"job\", \"job\": " +
         JsonString(job) + ", \"unix_s\": " + Seconds(unix_s) + "}";
}

Result<std::string> DecodeJob(std::string_view text, const std::string& what) {
  NONSTOP_RETURN_IF_ERROR(CheckLength(text, what));
  NONSTOP_ASSIGN_OR_RETURN(Json j, ParseJson(text, what));
  const Json* f = j.Get("format");
  const Json* k = j.Get("kind");
  const Json* n = j.Get("job");
  if (f == nullptr || f->type != Json::Type::kString || f->text != kFormat || k == nullptr ||
      k->type != Json::Type::kString || k->text != "job" || n == nullptr ||
      n->type != Json::Type::kString || n->text.size() > 4096) {
    return Status::Corruption(what + ": not a nonstop JOB document");
  }
  return n->text;
}

bool Committed(const Doc& marker, const std::vector<Manifest>& manifests) {
  if (marker.world_size == 0 || manifests.size() != marker.world_size) return false;
  std::vector<bool> seen(marker.world_size, false);
  for (const Manifest& m : manifests) {
    if (m.step != marker.step || m.lineage != marker.lineage ||
        m.world_size != marker.world_size || m.rank >= marker.world_size || seen[m.rank]) {
      return false;
    }
    seen[m.rank] = true;
  }
  return true;
}

Status CheckFetch(const Doc& marker, const Manifest& manifest, int64_t step, uint32_t rank,
                  const std::string& where) {
  if (marker.step != step) {
    return Status::Corruption(where + ": the COMMITTED marker is of step " +
                              std::to_string(marker.step));
  }
  if (rank >= marker.world_size) {
    return Status::Corruption(where + ": committed by " + std::to_string(marker.world_size) +
                              " rank(s); there is no rank " + std::to_string(rank));
  }
  if (manifest.step != step || manifest.lineage != marker.lineage || manifest.rank != rank ||
      manifest.world_size != marker.world_size) {
    return Status::Corruption(where + ": rank " + std::to_string(rank) +
                              "'s manifest is of another checkpoint");
  }
  return Status::OK();
}

std::vector<int64_t> StepsToDelete(const std::vector<StepState>& steps, const Retention& r) {
  std::vector<const StepState*> committed;
  for (const StepState& s : steps) {
    if (s.committed) committed.push_back(&s);
  }
  if (committed.empty()) return {};
  std::sort(committed.begin(), committed.end(),
            [](const StepState* a, const StepState* b) { return a->step > b->step; });
  std::set<int64_t> stay;
  const size_t newest_n = std::max<uint32_t>(r.max_to_keep, 1);
  for (size_t i = 0; i < committed.size() && i < newest_n; ++i) stay.insert(committed[i]->step);
  if (r.keep_every > 0) {
    uint32_t periodic = 0;
    for (const StepState* s : committed) {
      if (!s->counter || *s->counter % r.keep_every != 0) continue;
      if (r.keep_max > 0 && periodic >= r.keep_max) break;
      stay.insert(s->step);
      ++periodic;
    }
  }
  const int64_t newest = committed.front()->step;
  std::set<int64_t> out;
  for (const StepState& s : steps) {
    if (stay.count(s.step) != 0) continue;
    if (s.committed || s.step < newest) out.insert(s.step);
  }
  return {out.begin(), out.end()};
}

std::vector<std::vector<std::string>> DeleteBatches(const std::vector<std::string>& keys) {
  std::vector<std::string> marker, docs, parts;
  for (const std::string& k : keys) {
    const std::optional<Key> p = ParseKey(k);
    const Key::Kind kind = p ? p->kind : Key::Kind::kOther;
    if (kind == Key::Kind::kMarker) {
      marker.push_back(k);
    } else if (kind == Key::Kind::kManifest || kind == Key::Kind::kLead || kind == Key::Kind::kSkip) {
      docs.push_back(k);
    } else {
      parts.push_back(k);
    }
  }
  std::vector<std::vector<std::string>> out;
  for (auto* b : {&marker, &docs, &parts}) {
    if (!b->empty()) out.push_back(std::move(*b));
  }
  return out;
}

bool LooksLikeRemoteRoot(Env* env, const std::string& path) {
  Result<std::unique_ptr<Directory>> dir = env->OpenDirectory(path, false);
  if (!dir.ok()) return false;
  Result<std::vector<DirEntry>> list = dir.value()->List();
  if (!list.ok()) return false;
  bool step = false;
  for (const DirEntry& e : list.value()) {
    const std::string_view n = e.name;
    if (n.substr(0, 5) == "rank-" && n.size() >= 15 && n.substr(10, 5) == ".nsck") return false;
    if (ParseKey(std::string(n) + "/COMMITTED")) step = true;
  }
  return step;
}

}  // namespace nonstop::remote
