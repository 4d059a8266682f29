// PlannedSteps (planned_steps.h): the recovery planner's order of one rank's
// checkpoints, as steps, for the ranks' agreement.
#include "jobdir/planned_steps.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "jobdir/check_dir.h"
#include "nonstop/plan.h"

namespace nonstop {

PlanCandidate ListedCandidate(const ListedCheckpoint& c) {
  PlanCandidate pc;
  pc.tier = c.location.keep ? Tier::kKeep : Tier::kDisk;
  pc.where = c.location.where;
  pc.step = c.step;
  pc.counter = c.counter;
  pc.committed = c.state != ListedCheckpoint::State::kDamaged;
  pc.damage = c.reason;
  pc.overwritten = c.rotated;
  return pc;
}

Result<std::vector<int64_t>> PlannedSteps(JobDir& jd, int rank, std::optional<int64_t> step) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<ListedCheckpoint> listed, jd.List(rank));
  NONSTOP_ASSIGN_OR_RETURN(LineageRecord lineage, jd.ReadLineage(rank));
  std::vector<PlanCandidate> cands;
  for (const ListedCheckpoint& c : listed) {
    if (c.counter == 0 || (!step && c.location.keep)) continue;
    cands.push_back(ListedCandidate(c));
  }
  PlanRequest req;
  req.step = step;
  req.verify = false;
  NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, lineage, req));
  std::vector<int64_t> out;
  for (size_t i : plan.order) {
    if (std::find(out.begin(), out.end(), cands[i].step) == out.end()) out.push_back(cands[i].step);
  }
  return out;
}

Result<std::vector<int64_t>> TidyKeptShares(JobDir& jd, int rank,
                                            const std::vector<int64_t>& common) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<KeptCopy> kept, jd.KeptCopies(rank));
  std::vector<int64_t> mine;
  for (const KeptCopy& k : kept) mine.push_back(k.step);
  std::sort(mine.begin(), mine.end());
  mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
  std::vector<int64_t> gone;
  for (int64_t step : mine) {
    if (std::find(common.begin(), common.end(), step) != common.end()) continue;
    const Status s = jd.DeleteKeptShare(step);
    if (s.ok()) {
      gone.push_back(step);
    } else if (s.code() != StatusCode::kNotFound && s.code() != StatusCode::kFailedPrecondition) {
      return s;
    }
  }
  return gone;
}

SingleSource ChooseSingleSource(JobDir& jd, std::optional<int64_t> step) {
  Result<std::vector<ListedCheckpoint>> listed = jd.List(0);
  if (!listed.ok()) return SingleSource::kOwn;
  bool any = false;
  for (const ListedCheckpoint& c : listed.value()) {
    if (c.location.keep) continue;
    any = true;
    if (c.state == ListedCheckpoint::State::kCommitted && (!step || c.step == *step)) {
      return SingleSource::kOwn;
    }
  }
  return any ? SingleSource::kReshardElseOwn : SingleSource::kReshard;
}

namespace {

// Every rank's error line of this round, joined (`code`), when any failed.
Status Together(const dist::Gather& gather, const Status& mine, StatusCode code) {
  std::optional<std::string> line;
  if (!mine.ok()) line = mine.message().empty() ? mine.ToString() : mine.message();
  NONSTOP_ASSIGN_OR_RETURN(std::vector<dist::Fields> every, dist::GatherFields(gather, {line}));
  std::vector<std::optional<dist::RankError>> errors;
  for (const dist::Fields& f : every) {
    errors.push_back(f[0] ? std::optional<dist::RankError>(dist::RankError{code, *f[0]})
                          : std::nullopt);
  }
  return dist::JoinErrors(errors);
}

std::string Joined(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace

LocalSteps ListLocalSteps(const std::string& dir, int rank, int world,
                          std::optional<int64_t> step, Env* env) {
  LocalSteps out;
  Result<std::unique_ptr<JobDir>> jd = JobDir::OpenForRead(dir, env);
  Status s = jd.status().code() == StatusCode::kNotFound ? Status::OK() : jd.status();
  if (jd.ok()) {
    Result<bool> foreign = jd.value()->NeedsSetAside(world);
    Result<std::vector<int64_t>> steps =
        foreign.ok() ? PlannedSteps(*jd.value(), rank, step) : foreign.status();
    s = steps.status();
    if (steps.ok()) {
      out.foreign = foreign.value();
      out.steps = std::move(steps).value();
    }
  }
  if (!s.ok()) out.error = s.message().empty() ? s.ToString() : s.message();
  return out;
}

Result<std::optional<int64_t>> AgreeOnStep(const std::string& dir, int rank, int world,
                                           std::optional<int64_t> step,
                                           const dist::Gather& gather, Env* env) {
  // A directory of another program, a file or a larger world's: that line.
  const Result<bool> ours = CheckJobDirectory(
      dir, rank, world > 1 ? std::optional<int>(world) : std::nullopt, false, env);
  LocalSteps mine;
  if (!ours.ok()) {
    mine.error = ours.status().message();
  } else if (ours.value()) {
    mine = ListLocalSteps(dir, rank, world, step, env);
  }
  NONSTOP_ASSIGN_OR_RETURN(
      std::vector<std::vector<int64_t>> every,
      dist::GatherPlannedSteps(gather, dir, mine.error, mine.foreign && world > 1, mine.steps));
  const std::vector<int64_t> order = dist::CommonSteps(every);
  if (!order.empty()) return std::optional<int64_t>(order.front());
  NONSTOP_RETURN_IF_ERROR(dist::NoCommonStep(dir, rank, step, every));
  return std::optional<int64_t>();
}

Result<std::vector<int64_t>> TidyKeptTogether(const std::string& dir, int rank, int world,
                                              const dist::Gather& gather, Env* env) {
  std::unique_ptr<JobDir> jd;
  std::vector<int64_t> mine;
  Status s = JobDir::OpenForRead(dir, env).status();
  if (s.code() == StatusCode::kNotFound) {
    s = Status::OK();  // no directory: nothing kept
  } else if (s.ok()) {
    // The writer's open first redoes this rank's interrupted copies.
    Result<std::unique_ptr<JobDir>> w = JobDir::OpenForWrite(dir, rank, world, env);
    Result<std::vector<KeptCopy>> kept =
        w.ok() ? w.value()->KeptCopies(rank) : Result<std::vector<KeptCopy>>(w.status());
    s = kept.status();
    if (kept.ok()) {
      jd = std::move(w).value();
      for (const KeptCopy& k : kept.value()) mine.push_back(k.step);
    }
  }
  NONSTOP_RETURN_IF_ERROR(Together(gather, s, StatusCode::kIOError));
  std::sort(mine.begin(), mine.end());
  mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
  NONSTOP_ASSIGN_OR_RETURN(std::vector<dist::Fields> every,
                           dist::GatherFields(gather, {dist::StepsText(mine)}));
  std::vector<std::vector<int64_t>> all;
  for (const dist::Fields& f : every) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<int64_t> steps, dist::StepsOf(f[0].value_or("")));
    all.push_back(std::move(steps));
  }
  Result<std::vector<int64_t>> gone =
      jd ? TidyKeptShares(*jd, rank, dist::CommonSteps(all)) : std::vector<int64_t>{};
  jd.reset();  // the lock, released before the engine takes it
  NONSTOP_RETURN_IF_ERROR(Together(gather, gone.status(), StatusCode::kIOError));
  return gone;
}

Result<std::vector<int>> SetAsideTogether(const std::string& dir, int rank, int world,
                                          const dist::Gather& gather, Env* env) {
  bool need = false;
  Status s;
  {
    Result<std::unique_ptr<JobDir>> r = JobDir::OpenForRead(dir, env);  // no lock taken
    if (r.ok()) {
      Result<bool> n = r.value()->NeedsSetAside(world);
      s = n.status();
      need = n.ok() && n.value();
    } else if (r.status().code() != StatusCode::kNotFound) {  // no directory: nothing to move
      s = r.status();
    }
  }
  NONSTOP_RETURN_IF_ERROR(Together(gather, s, StatusCode::kFailedPrecondition));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<dist::Fields> every,
                           dist::GatherFields(gather, {need ? "1" : "0"}));
  std::vector<int> moved;
  if (std::none_of(every.begin(), every.end(), [](const dist::Fields& f) { return f[0] == "1"; })) {
    return moved;
  }
  for (int turn = 0; turn < world; ++turn) {
    s = Status::OK();
    if (turn == rank) {
      Result<std::unique_ptr<JobDir>> w = JobDir::OpenForWrite(dir, rank, world, env);
      Result<std::vector<int>> m = w.ok() ? w.value()->SetAside(world) : w.status();
      s = m.status();
      if (m.ok()) moved = m.value();
    }
    NONSTOP_RETURN_IF_ERROR(Together(gather, s, StatusCode::kFailedPrecondition));
  }
  return moved;
}

std::string SetAsideWarning(const std::string& dir, int world, const std::vector<int>& moved) {
  if (moved.empty()) return "";
  std::string worlds, dirs;
  for (int w : moved) {
    worlds += (worlds.empty() ? "" : ", ") + std::to_string(w);
    dirs += (dirs.empty() ? "" : ", ") + Joined(dir, JobDirNames::World(w));
  }
  return "nonstop: " + dir + " holds a checkpoint of world size " + worlds +
         "; this job has world size " + std::to_string(world) + ": its rank files are moved to " +
         dirs + " and restore() reshards them";
}

}  // namespace nonstop
