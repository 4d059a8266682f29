// The job view (issues #23, #27; docs/TIERS.md "Which tiers hold a step"):
// per checkpoint of one rank, every tier that holds it durably (disk: the
// ring or a kept copy; memory: the segment; remote: the object store; peer:
// which partner), whether it is committed, abandoned by a rollback or
// damaged, and the job's identity. `nonstop ls DIR` and nonstop.list(DIR)
// print it; `nonstop ls URL` prints a remote in the same rows.
//
// Made from the tiers themselves every time: the slot file's and kept
// copies' commit records and the lineage (JobDir::List), the memory segment
// (OpenMemorySegment: only one the recovery planner would read), and, for
// what cannot be seen from this node without the network, the job manifest
// (jobdir/manifest.h), a record the remote uploader and peer replicator
// write after the fact. A manifest entry never outranks a tier: one the
// lineage abandoned is shown abandoned; one whose counter a local tier holds
// at another step is dropped with a line in `notes`; a damaged manifest is a
// damaged row (the local tiers are still listed). Reads only, through the Env.
#pragma once

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/status.h"

namespace nonstop {

// One tier holding a checkpoint.
struct ViewHolder {
  std::string tier;       // "disk", "memory", "remote", "peer"
  std::string where;      // the slot file or kept copy, the segment, the URL, the partner
  bool recorded = false;  // from the manifest (the tier said so then; not checked now)
};

// One row: a checkpoint at one place, as `nonstop ls` has always listed it,
// with every tier holding that checkpoint.
struct ViewRow {
  int64_t step = 0;
  uint64_t counter = 0;
  std::string where;   // this row's place: "ring", "keep", "memory", "remote", "peer", "manifest"
  std::string path;    // its file or URL
  std::string state;   // "committed", "abandoned", "damaged"
  std::string reason;  // why not committed (one line); empty when committed
  uint64_t commit_unix_ns = 0;
  uint64_t bytes = 0;
  std::vector<std::pair<std::string, double>> metrics;
  std::vector<ViewHolder> tiers;  // every tier holding this checkpoint durably (committed rows)
  bool unreadable = false;        // a file that could not be read at all (ls exits 1)
};

struct JobView {
  std::string job;                 // the job's identity (from the manifest); empty when unknown
  std::vector<ViewRow> rows;       // newest counter first; at one counter ring, keep, memory, remote, peer
  std::vector<std::string> notes;  // manifest entries not shown and why (one line each)
};

// The view of rank `rank` of job directory `dir` (see above). `shm_dir`:
// the memory tier's directory ("" = the default). NotFound when `dir` does
// not exist; damaged files are rows, never errors.
Result<JobView> ViewJob(const std::string& dir, int rank, Env* env = nullptr,
                        const std::string& shm_dir = "");

// "disk+memory+remote+peer": the tier names of a row, in that order, each once.
std::string TierList(const ViewRow& row);

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

// `s` on one line for a terminal: control characters (escape sequences,
// newlines from a hostile name or file) as \xNN (lowercase hex); past
// `max_bytes` of text the rest is cut and "..." shown (nothing cut by default).
std::string OneLine(std::string_view s, size_t max_bytes = std::string::npos);

// The table `nonstop ls` prints of `view`, rank `rank` of `where` (a job
// directory, or a remote: one format for both): the job, then one line per
// row (step, where, state, committed (UTC), size, tiers, and the metrics or,
// when there is one, the reason: why it is not committed or not readable).
std::string LsText(const JobView& view, int rank, const std::string& where);

// The NotFound of `step` asked of rank `rank` in `dir` (restore(step=)):
// one line with the committed steps there are ("7, 8, 9 in the ring; 2, 4
// kept"), and that it was overwritten when the ring reused its slot.
Status StepNotFound(const std::string& dir, int rank, int64_t step, Env* env = nullptr);
// delete(step) found no kept copy (`original`): a step in the ring is not
// deleted (the ring reuses its slots itself), said with the committed steps;
// otherwise `original`.
Status NotKept(const std::string& dir, int64_t step, const Status& original, Env* env = nullptr);

}  // namespace nonstop
