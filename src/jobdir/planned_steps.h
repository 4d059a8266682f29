// The recovery planner's order of one rank's checkpoints, as steps: what a
// rank offers in a distributed restart's agreement (docs/DISTRIBUTED.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "nonstop/dist.h"
#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "nonstop/status.h"

namespace nonstop {

// The steps of rank R's checkpoints in `jd` in the recovery planner's order
// (MakePlan over JobDir::List and the lineage: newest counter of the lineage
// first; abandoned, damaged and overwritten ones left out), each step once;
// with `step`, only it, keep copies included. The ranks gather these and
// restore the first step every rank holds (nonstop/dist.h CommonSteps).
// A listed disk or keep checkpoint as the planner's candidate (tier disk or
// keep; an abandoned one counts as committed: the planner reads the lineage).
PlanCandidate ListedCandidate(const ListedCheckpoint& c);

Result<std::vector<int64_t>> PlannedSteps(JobDir& jd, int rank,
                                          std::optional<int64_t> step = std::nullopt);

// max_to_keep/best with world size > 1, before the engine opens: deletes
// this writer's (rank `rank`'s) file of each of its kept steps that is not in
// `common` (the steps every rank keeps: a step kept on some ranks only is
// never restored, since recovery needs it on every rank), so that every rank
// ranks the same kept steps. A copy already gone, one a restore protects and
// the newest committed checkpoint stay (DeleteKeptShare's NotFound and
// FailedPrecondition). Returns the steps deleted, oldest first.
Result<std::vector<int64_t>> TidyKeptShares(JobDir& jd, int rank,
                                            const std::vector<int64_t>& common);

// Restoring with world size 1 where set-aside checkpoints of another world
// size exist: kOwn when rank 0's own file holds a committed checkpoint (of
// `step`, when given), or when its listing fails (the ordinary read reports
// it); else the newest set-aside one resharded, falling back to the own file
// when it lists any checkpoint (kReshardElseOwn: its error is the one to see).
enum class SingleSource { kOwn, kReshard, kReshardElseOwn };
SingleSource ChooseSingleSource(JobDir& jd, std::optional<int64_t> step);

// ---- A distributed restart (Distributed, _distributed.py) ----

// What rank `rank` brings to a distributed restore (dist.h RecoverRequest's
// error, mine and foreign): its PlannedSteps (`step`: only it) and whether
// `dir` holds rank files of another world than `world` not set aside
// (NeedsSetAside). A directory that does not exist holds nothing; any other
// failure is the error line (the steps then empty).
struct LocalSteps {
  std::optional<std::string> error;
  std::vector<int64_t> steps;
  bool foreign = false;
};
LocalSteps ListLocalSteps(const std::string& dir, int rank, int world,
                          std::optional<int64_t> step, Env* env = nullptr);

// Collective, over dist.h's Gather:

// The step a Hugging Face Trainer resumes from (hf.py resume_from under
// torchrun, resume_from_checkpoint=True): each rank's CheckJobDirectory
// (check_dir.h; its world size only when `world` > 1) and ListLocalSteps
// gathered (dist.h GatherPlannedSteps: any rank's error is every rank's
// line; rank files of another world size count only when `world` > 1),
// then the first step every rank holds in rank 0's order (dist.h
// CommonSteps), as a distributed restore picks it; nullopt on a fresh start
// (no rank holds a step and none was asked for), else NoCommonStep's
// NotFound. `env` null: DefaultEnv().
Result<std::optional<int64_t>> AgreeOnStep(const std::string& dir, int rank, int world,
                                           std::optional<int64_t> step,
                                           const dist::Gather& gather, Env* env = nullptr);

// TidyKeptShares on every rank together (Distributed.tidy_kept), before the
// engine opens: each rank's kept steps (its writer's open first redoes its
// interrupted copies; no directory: none) gathered, each rank deletes its
// file of those not every rank keeps. A rank's failure to list or delete
// is one IOError line on every rank (dist.h JoinErrors). Returns the steps
// deleted here. `env` null: DefaultEnv().
Result<std::vector<int64_t>> TidyKeptTogether(const std::string& dir, int rank, int world,
                                              const dist::Gather& gather, Env* env = nullptr);

// Rank files a job of another world size wrote in `dir`, moved to `dir`/
// world-W/ for resharding (JobDir::SetAside), collective: each rank looks
// (JobDir::NeedsSetAside: one file each, so a same-size restart costs one
// header per rank); when any rank saw some, the ranks take turns, each
// under its own writer lock (released before the engine takes it), so each
// file is moved once on a shared file system. A failure is one
// FailedPrecondition line on every rank. Returns the old world sizes this
// rank moved files of (SetAsideWarning's line).
Result<std::vector<int>> SetAsideTogether(const std::string& dir, int rank, int world,
                                          const dist::Gather& gather, Env* env = nullptr);
// "nonstop: DIR holds a checkpoint of world size W; this job has world size
// N: its rank files are moved to DIR/world-W and restore() reshards them";
// empty when `moved` is.
std::string SetAsideWarning(const std::string& dir, int world, const std::vector<int>& moved);

}  // namespace nonstop
