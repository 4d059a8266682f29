// The names of a job directory's entries: spelled here and nowhere else.
#include <charconv>
#include <cstdio>

#include "nonstop/jobdir.h"

namespace nonstop {
namespace {

std::string Rank5(int rank) {
  char b[32];
  std::snprintf(b, sizeof(b), "%05d", rank);
  return b;
}

// Parses the digits of `s` (all of it) into `out`; false when not all digits.
template <typename T>
bool ParseDigits(std::string_view s, T* out) {
  if (s.empty() || s.size() > 18) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

std::string JobDirNames::Slot(int rank) { return "rank-" + Rank5(rank) + ".nsck"; }
std::string JobDirNames::TempSlot(int rank) { return Slot(rank) + ".tmp"; }
std::string JobDirNames::Lock(int rank) {
  return rank == 0 ? ".nonstop.lock" : ".nonstop.rank-" + Rank5(rank) + ".lock";
}
std::string JobDirNames::Lineage(int rank) { return "lineage-rank-" + Rank5(rank) + ".json"; }
std::string JobDirNames::Agreed(int rank) { return "agreed-rank-" + Rank5(rank) + ".json"; }
std::string JobDirNames::Manifest(int rank) { return "manifest-rank-" + Rank5(rank) + ".json"; }
std::string JobDirNames::MemoryRecord(int rank) { return ".nonstop.memory-rank-" + Rank5(rank); }
std::string JobDirNames::KeepRoot() { return "keep"; }
std::string JobDirNames::KeepStep(int64_t step) {
  char b[48];
  std::snprintf(b, sizeof(b), "step-%012lld", static_cast<long long>(step));
  return b;
}
std::string JobDirNames::World(int world_size) { return "world-" + std::to_string(world_size); }

std::optional<int> JobDirNames::ParseSlot(std::string_view name) {
  constexpr std::string_view kPre = "rank-", kSuf = ".nsck";
  if (name.size() != kPre.size() + 5 + kSuf.size()) return std::nullopt;
  if (name.substr(0, kPre.size()) != kPre || name.substr(kPre.size() + 5) != kSuf) {
    return std::nullopt;
  }
  int r = 0;
  if (!ParseDigits(name.substr(kPre.size(), 5), &r)) return std::nullopt;
  return r;
}

bool JobDirNames::IsRankFile(std::string_view name) {
  auto ranked = [name](std::string_view pre, std::string_view suf) {
    if (name.size() != pre.size() + 5 + suf.size() || name.substr(0, pre.size()) != pre ||
        name.substr(pre.size() + 5) != suf) {
      return false;
    }
    int r = 0;
    return ParseDigits(name.substr(pre.size(), 5), &r);
  };
  for (std::string_view suf : {"", ".tmp"}) {
    const std::string nsck = std::string(".nsck") += suf, json = std::string(".json") += suf;
    if (ranked("rank-", nsck) || ranked("lineage-rank-", json) || ranked("agreed-rank-", json) ||
        ranked("manifest-rank-", json)) {
      return true;
    }
  }
  return false;
}

std::optional<int64_t> JobDirNames::ParseKeepStep(std::string_view name) {
  constexpr std::string_view kPre = "step-";
  if (name.size() < kPre.size() + 12 || name.substr(0, kPre.size()) != kPre) return std::nullopt;
  int64_t s = 0;
  if (!ParseDigits(name.substr(kPre.size()), &s)) return std::nullopt;
  if (KeepStep(s) != name) return std::nullopt;  // one spelling per step
  return s;
}

std::optional<int> JobDirNames::ParseWorld(std::string_view name) {
  constexpr std::string_view kPre = "world-";
  if (name.size() <= kPre.size() || name.substr(0, kPre.size()) != kPre) return std::nullopt;
  int w = 0;
  if (!ParseDigits(name.substr(kPre.size()), &w) || w < 1) return std::nullopt;
  if (World(w) != name) return std::nullopt;
  return w;
}

}  // namespace nonstop
