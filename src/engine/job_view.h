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
#include <string>
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

// The NotFound of `step` asked of rank `rank` in `dir` (restore(step=)):
// one line with the committed steps there are ("7, 8, 9 in the ring; 2, 4
// kept"), and that it was overwritten when the ring reused its slot.
Status StepNotFound(const std::string& dir, int rank, int64_t step, Env* env = nullptr);
// delete(step) found no kept copy (`original`): a step in the ring is not
// deleted (the ring reuses its slots itself), said with the committed steps;
// otherwise `original`.
Status NotKept(const std::string& dir, int64_t step, const Status& original, Env* env = nullptr);

}  // namespace nonstop
