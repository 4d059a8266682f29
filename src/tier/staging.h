// The remote tier's local staging area, DIR/remote/step-N/rank-R.nsck: the
// one-slot copy of a committed checkpoint that an upload sends (the slot
// ring may reuse the slot meanwhile), and the removal of older copies. Every
// file and folder operation goes through the Env: the copy is created
// O_EXCL|O_NOFOLLOW relative to the step folder, and a link planted at the
// copy's name, at a step folder or anywhere in one is removed as a link,
// never followed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/status.h"

namespace nonstop::tier {

struct StagedCopy {
  std::string dir;   // job_dir/remote/step-N
  std::string name;  // rank-R.nsck
  int64_t step = 0;
  uint64_t counter = 0;
  int64_t lineage = 0;  // the checkpoint's run (its metadata's dist.lineage; 0: one process)
};

// The staged copy of committed checkpoint `counter` (of `step`) of rank
// `rank`'s slot file in `job_dir`: a copy of that counter already staged
// (before a restart, or fetched) is kept; anything else at the name is
// removed and the checkpoint copied again (CopyCheckpoint: every chunk
// verified; a slot reused meanwhile fails the check, never a mix of two).
Result<StagedCopy> StageCopy(Env* env, const std::string& job_dir, uint32_t rank, uint64_t counter,
                             int64_t step);

// Removes every staged step folder of `job_dir` but `keep_step`'s. Goes on
// past a failure; one line per folder left (for the next round).
std::vector<std::string> DropStaged(Env* env, const std::string& job_dir, int64_t keep_step);

}  // namespace nonstop::tier
