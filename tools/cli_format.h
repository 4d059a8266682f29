// Text formatting shared by the subcommands (store_cmds.cc, manage_cmds.cc).
#pragma once

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <string>

namespace nonstop::cli {

// 1536 -> "1.5 KiB"; below 1 KiB the exact count ("512 B").
inline std::string HumanBytes(uint64_t n) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(n));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  }
  return buf;
}

// Nanoseconds since the epoch as ISO 8601 UTC; "-" for 0 (not recorded).
inline std::string UtcTime(uint64_t unix_ns) {
  if (unix_ns == 0) return "-";
  std::time_t t = static_cast<std::time_t>(unix_ns / 1000000000ull);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace nonstop::cli
