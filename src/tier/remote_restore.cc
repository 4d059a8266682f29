// The restore plan of a rank with a remote tier (tier/remote_restore.h).
#include "tier/remote_restore.h"

#include <algorithm>
#include <memory>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "jobdir/planned_steps.h"
#include "jobdir/remote_layout.h"
#include "nonstop/jobdir.h"
#include "tier/remote_tier.h"

namespace nonstop::tier {

namespace {

// The planner's order of `cands` (no verifier: the caller verifies).
Result<std::vector<size_t>> Order(const std::vector<PlanCandidate>& cands,
                                  const LineageRecord& lineage, std::optional<int64_t> step,
                                  const std::vector<uint64_t>& exclude) {
  PlanRequest req;
  req.step = step;
  req.exclude = exclude;
  req.verify = false;
  NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, lineage, req));
  return std::move(plan.order);
}

bool IsLocal(const PlanCandidate& c) { return c.tier == nonstop::Tier::kDisk || c.tier == nonstop::Tier::kKeep; }

// Marks damaged the local candidates of the job directory newer than the
// checkpoint of this rank that verifies (JobDir::Select): a damaged local
// newest restores its remote copy, not an older local one.
void RefuseUnverified(JobDir& jd, uint32_t rank, std::optional<int64_t> step,
                      std::vector<PlanCandidate>& cands) {
  SelectOptions o;
  o.step = step;
  std::optional<uint64_t> good;
  Result<Selection> sel = jd.Select(static_cast<int>(rank), o);
  if (sel.ok() && sel.value().chosen) good = sel.value().chosen->info.counter;
  for (PlanCandidate& c : cands) {
    if (IsLocal(c) && c.committed && (!good || c.counter > *good)) {
      c.committed = false;
      c.damage = "fails to verify";
    }
  }
}

}  // namespace

Result<RestorePlan> PlanRemoteRestore(Env* env, const RestorePlanRequest& r) {
  std::vector<PlanCandidate> cands;
  LineageRecord lineage;
  std::unique_ptr<JobDir> jd;
  if (!r.job_dir.empty()) {
    Result<std::unique_ptr<JobDir>> opened = JobDir::OpenForRead(r.job_dir, env);
    if (opened.ok()) {
      Result<std::vector<ListedCheckpoint>> rows = opened.value()->List(static_cast<int>(r.rank));
      Result<LineageRecord> lin = opened.value()->ReadLineage(static_cast<int>(r.rank));
      if (rows.ok() && lin.ok()) {
        jd = std::move(opened).value();
        lineage = std::move(lin).value();
        for (const ListedCheckpoint& c : rows.value()) {
          if (c.counter == 0) continue;
          cands.push_back(ListedCandidate(c));
        }
      }
    }
  }
  for (const PlanCandidate& c : r.extra_local) cands.push_back(c);
  for (size_t i = 0; i < cands.size(); ++i) cands[i].handle = i;

  RestorePlan out;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<size_t> local, Order(cands, lineage, std::nullopt, {}));
  if (!local.empty()) out.local_newest = cands[local.front()].step;
  if (r.step) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<size_t> at, Order(cands, lineage, r.step, {}));
    out.local_has_step = !at.empty();
  }

  std::set<uint64_t> remote_counters;
  if (r.remote) {
    for (const auto& [step, counter] : *r.remote) {
      PlanCandidate p;
      p.tier = nonstop::Tier::kRemote;
      p.where = r.remote_where + "/" + remote::StepDir(step);
      p.step = step;
      p.counter = counter;
      p.handle = cands.size();
      cands.push_back(std::move(p));
      remote_counters.insert(counter);
    }
  }
  std::vector<size_t> order;
  for (bool verified = false;;) {
    NONSTOP_ASSIGN_OR_RETURN(order, Order(cands, lineage, r.step, r.exclude));
    if (order.empty() || verified || jd == nullptr) break;
    const PlanCandidate& head = cands[order.front()];
    if (head.tier == nonstop::Tier::kRemote || remote_counters.count(head.counter) == 0) break;
    // The remote holds this checkpoint too: the local copy must verify to
    // be read first.
    verified = true;
    RefuseUnverified(*jd, r.rank, r.step, cands);
  }
  std::unordered_set<int64_t> seen;
  for (size_t i : order) {
    const PlanCandidate& c = cands[i];
    if (!seen.insert(c.step).second) continue;
    out.order.push_back({c.step, c.counter, c.tier == nonstop::Tier::kRemote});
  }
  return out;
}

std::vector<AgreedStep> CommonRestoreSteps(const std::vector<std::vector<RestoreSource>>& every) {
  std::vector<AgreedStep> out;
  if (every.empty()) return out;
  std::vector<std::unordered_map<int64_t, bool>> held(every.size());  // step -> remote
  for (size_t r = 0; r < every.size(); ++r) {
    for (const RestoreSource& s : every[r]) held[r].emplace(s.step, s.remote);
  }
  std::unordered_set<int64_t> seen;
  for (const RestoreSource& s : every[0]) {
    if (!seen.insert(s.step).second) continue;  // a step twice in rank 0's plan: once
    bool common = true, all_local = true;
    for (const auto& h : held) {
      auto it = h.find(s.step);
      if (it == h.end()) {
        common = false;
        break;
      }
      all_local = all_local && !it->second;
    }
    if (common) out.push_back({s.step, all_local});
  }
  return out;
}

}  // namespace nonstop::tier

namespace nonstop::tier {

namespace {

std::string FirstLine(const std::string& s) {
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace

namespace {

// "rank 1: E; rank 3: F" of the ranks that failed; empty when none did.
std::string FailedRanks(const DistTried& t) {
  std::string out;
  for (size_t r = 0; r < t.errors.size(); ++r) {
    if (t.errors[r].empty()) continue;
    out += (out.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + t.errors[r]);
  }
  return out;
}

}  // namespace

Result<std::optional<int64_t>> NextDistRemoteStep(const std::string& url,
                                                  const std::vector<std::vector<RestoreSource>>& plans,
                                                  const std::vector<DistTried>& tried,
                                                  std::string* warning) {
  if (warning != nullptr && !tried.empty() && !FailedRanks(tried.back()).empty()) {
    *warning = "remote step " + std::to_string(tried.back().step) + " fails on " +
               FailedRanks(tried.back()) + "; falling back";
  }
  std::unordered_set<int64_t> done;
  for (const DistTried& t : tried) done.insert(t.step);
  for (const AgreedStep& a : CommonRestoreSteps(plans)) {
    if (done.count(a.step) != 0) continue;
    if (a.all_local) return std::optional<int64_t>();  // every rank's local copy: recover reads it
    return std::optional<int64_t>(a.step);
  }
  bool local = false;
  for (const auto& plan : plans) {
    for (const RestoreSource& s : plan) local = local || !s.remote;
  }
  for (const DistTried& t : tried) {
    if (!FailedRanks(t).empty() && !local) {
      return Status::Corruption("no remote checkpoint in " + url + " verifies on every rank: " +
                                FailedRanks(t));
    }
  }
  return std::optional<int64_t>();
}

Result<std::vector<std::pair<int64_t, remote::Doc>>> RemoteCandidates(
    Env* env, RemoteTier* tier, std::optional<int64_t> step, std::vector<std::string>* damaged) {
  NONSTOP_ASSIGN_OR_RETURN(auto listed, tier->CommittedSteps(damaged));
  RestorePlanRequest req;
  req.step = step;
  req.remote.emplace();
  std::unordered_map<int64_t, remote::Doc> marker;
  for (const auto& [s, doc] : listed) {
    req.remote->emplace_back(s, doc.counter.value_or(0));
    marker.emplace(s, doc);
  }
  NONSTOP_ASSIGN_OR_RETURN(RestorePlan plan, PlanRemoteRestore(env, req));
  std::vector<std::pair<int64_t, remote::Doc>> out;
  for (const RestoreSource& s : plan.order) out.emplace_back(s.step, marker.at(s.step));
  if (out.empty()) {
    return Status::NotFound("no committed remote checkpoint" +
                            (step ? " at step " + std::to_string(*step) : std::string()) + " in " +
                            tier->where());
  }
  return out;
}

Result<int> ExportRemote(Env* env, RemoteTier* tier, std::optional<int64_t> step,
                         const std::string& fetch_dir,
                         const std::function<int(int64_t, const std::string&)>& run,
                         const std::function<void(const std::string&)>& note) {
  std::vector<std::string> damaged;
  NONSTOP_ASSIGN_OR_RETURN(auto candidates, RemoteCandidates(env, tier, step, &damaged));
  for (const std::string& d : damaged) note("remote: " + d + "; skipped");
  std::string first;
  for (const auto& [s, marker] : candidates) {
    Result<std::string> dir = tier->FetchAll(s, fetch_dir);
    int rc = 0;
    std::string why;
    if (!dir.ok()) {
      if (dir.status().code() != StatusCode::kCorruption) return dir.status();
      why = "remote step " + std::to_string(s) + ": " + dir.status().message();
    } else {
      rc = run(s, dir.value());
      // downloaded intact by its manifest but damaged inside (the file's
      // own chunk crc32c): as a load does, the next older step
      if (rc != 1 || step) return rc;
      why = "remote step " + std::to_string(s) + " is damaged";
    }
    if (first.empty()) first = dir.ok() ? "step " + std::to_string(s) + " is damaged" : dir.status().message();
    note(why + "; trying an older one");
    if (Result<std::unique_ptr<Directory>> d = env->OpenDirectory(fetch_dir, false); d.ok()) {
      if (Result<std::unique_ptr<Directory>> local = d.value()->OpenDir(kLocalDir, false); local.ok()) {
        (void)RemoveTree(*local.value(), remote::StepDir(s));
      }
    }
  }
  return Status::Corruption("no remote checkpoint in " + tier->where() +
                            " downloads intact: " + first);
}

Result<std::string> UnlistedRemote(const std::string& url, const std::string& why,
                                   const std::string& job_dir, std::optional<int64_t> local_newest,
                                   bool step_asked, bool waiting_helps) {
  const std::string msg = "the remote tier " + url + " cannot be listed (" + FirstLine(why) + ")";
  if (local_newest && !step_asked) {
    return msg + "; restoring the newest local checkpoint (step " + std::to_string(*local_newest) +
           ")";
  }
  if (!waiting_helps) {  // a missing bucket, refused credentials: say what to fix
    return Status::IOError(msg + "; " + job_dir +
                           " holds no local checkpoint to restore instead: fix the remote (or "
                           "drop remote=)");
  }
  return Status::IOError(msg + " and " + job_dir +
                         " holds no local checkpoint to restore instead; restore() again once "
                         "the store is reachable (or drop remote=)");
}

Status RestoreFromRemote(Env* env, RemoteTier* tier, const RemoteRestoreRequest& request,
                         const ReadFetched& read, RemoteRestoreResult* result) {
  RemoteRestoreResult& out = *result;
  RestorePlanRequest req = request.plan;
  req.remote.reset();
  req.remote_where = tier->where();
  NONSTOP_ASSIGN_OR_RETURN(RestorePlan local, PlanRemoteRestore(env, req));
  if (!request.load && req.step && local.local_has_step) return Status::OK();  // the local path reads it

  std::vector<std::string> damaged;
  Result<std::vector<std::pair<int64_t, remote::Doc>>> listed = tier->CommittedSteps(&damaged);
  for (const std::string& d : damaged) out.warnings.push_back("remote: " + d + "; skipped");
  if (!listed.ok()) {
    if (request.load) return listed.status();
    const bool helps = !request.waiting_helps || request.waiting_helps(listed.status());
    NONSTOP_ASSIGN_OR_RETURN(std::string warning,
                             UnlistedRemote(tier->where(), listed.status().message(), req.job_dir,
                                            local.local_newest, req.step.has_value(), helps));
    out.warnings.push_back(std::move(warning));
    return Status::OK();
  }
  req.remote.emplace();
  for (const auto& [step, marker] : listed.value()) {
    if (request.world && std::max<uint32_t>(marker.world_size, 1) != *request.world) continue;  // resharded, not restored
    req.remote->emplace_back(step, marker.counter.value_or(0));
  }

  std::string first_error;
  for (bool tried = false;; tried = true) {
    NONSTOP_ASSIGN_OR_RETURN(RestorePlan plan, PlanRemoteRestore(env, req));
    if (plan.order.empty()) {
      if (request.load && !tried) {
        return Status::NotFound(
            "no committed remote checkpoint" +
            (req.step ? " at step " + std::to_string(*req.step) : std::string()) + " in " +
            tier->where());
      }
      break;
    }
    const RestoreSource& head = plan.order.front();
    if (!head.remote) return Status::OK();  // the local path reads (and verifies) it
    Result<std::string> dir = tier->Fetch(head.step, req.rank, request.fetch_dir);
    Status s = dir.ok() ? read(head.step, dir.value()) : dir.status();
    if (dir.ok() && s.code() == StatusCode::kAborted) return s;
    if (s.ok()) {
      out.read = head;
      return Status::OK();
    }
    if (first_error.empty()) first_error = FirstLine(s.message());
    out.warnings.push_back("remote step " + std::to_string(head.step) + ": " + s.message() +
                           "; falling back");
    req.exclude.push_back(head.counter);
  }
  if (!first_error.empty() && !local.local_newest) {
    return Status::Corruption("no remote checkpoint in " + tier->where() +
                              " verifies: " + first_error);
  }
  return Status::OK();
}

namespace {

// A plan's order as the text the ranks gather ("STEP COUNTER r|l" lines), and back.
std::string OrderText(const std::vector<RestoreSource>& order) {
  std::string out;
  for (const RestoreSource& s : order) {
    out += std::to_string(s.step) + " " + std::to_string(s.counter) + (s.remote ? " r\n" : " l\n");
  }
  return out;
}

Result<std::vector<RestoreSource>> OrderOf(const std::string& text) {
  std::vector<RestoreSource> out;
  std::istringstream in(text);
  RestoreSource s;
  std::string where;
  while (in >> s.step >> s.counter >> where) {
    if (where != "r" && where != "l") break;
    s.remote = where == "r";
    out.push_back(s);
  }
  if (!(in >> std::ws).eof()) {
    return Status::Corruption("a rank's restore plan does not parse: " + FirstLine(text));
  }
  return out;
}

}  // namespace

Status RestoreFromRemoteDist(Env* env, RemoteTier* tier, const RemoteRestoreRequest& request,
                             const Gather& gather, const ReadFetched& read,
                             RemoteRestoreResult* result) {
  RemoteRestoreResult& out = *result;
  RestorePlanRequest req = request.plan;
  req.remote.reset();
  req.remote_where = tier->where();
  std::string mine;  // rank 0's listing: "+" and its steps, or "-" and why it failed
  if (req.rank == 0) {
    std::vector<std::string> damaged;
    Result<std::vector<std::pair<int64_t, remote::Doc>>> listed = tier->CommittedSteps(&damaged);
    for (const std::string& d : damaged) out.warnings.push_back("remote: " + d + "; skipped");
    mine = "-" + listed.status().message();
    if (listed.ok()) {
      std::vector<RestoreSource> steps;
      for (const auto& [step, marker] : listed.value()) {
        if (request.world && std::max<uint32_t>(marker.world_size, 1) != *request.world) continue;  // resharded
        steps.push_back({step, marker.counter.value_or(0), true});
      }
      mine = "+" + OrderText(steps);
    }
  }
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> lists, gather(mine));
  if (lists.empty() || lists[0].empty()) {
    return Status::Corruption("rank 0's listing of " + tier->where() + " did not arrive");
  }
  const bool listed = lists[0][0] == '+';
  if (listed) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<RestoreSource> steps, OrderOf(lists[0].substr(1)));
    req.remote.emplace();
    for (const RestoreSource& s : steps) req.remote->emplace_back(s.step, s.counter);
  }
  NONSTOP_ASSIGN_OR_RETURN(RestorePlan own, PlanRemoteRestore(env, req));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> texts, gather(OrderText(own.order)));
  std::vector<std::vector<RestoreSource>> plans;
  for (const std::string& t : texts) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<RestoreSource> order, OrderOf(t));
    plans.push_back(std::move(order));
  }
  if (!listed) {  // every rank says so; a step they all hold locally is resumed
    const std::vector<AgreedStep> common = CommonRestoreSteps(plans);
    NONSTOP_ASSIGN_OR_RETURN(
        std::string warning,
        UnlistedRemote(tier->where(), lists[0].substr(1), req.job_dir,
                       common.empty() ? std::nullopt : std::optional<int64_t>(common[0].step),
                       false, true));
    out.warnings.push_back(std::move(warning));
    return Status::OK();
  }
  std::vector<DistTried> tried;
  while (true) {
    std::string warning;
    Result<std::optional<int64_t>> next = NextDistRemoteStep(tier->where(), plans, tried, &warning);
    if (!warning.empty()) out.warnings.push_back(std::move(warning));
    if (!next.ok()) return next.status();
    if (!next.value()) return Status::OK();  // the local path restores
    const int64_t step = *next.value();
    Result<std::string> dir = tier->Fetch(step, req.rank, request.fetch_dir);
    Status s = dir.ok() ? read(step, dir.value()) : dir.status();
    if (dir.ok() && s.code() == StatusCode::kAborted) return s;
    NONSTOP_ASSIGN_OR_RETURN(
        std::vector<std::string> errors,
        gather(s.ok() ? "" : s.message().empty() ? s.ToString() : s.message()));
    if (std::all_of(errors.begin(), errors.end(), [](const std::string& e) { return e.empty(); })) {
      out.read = RestoreSource{step, 0, true};
      for (const RestoreSource& o : own.order) {
        if (o.step == step) out.read->counter = o.counter;
      }
      return Status::OK();
    }
    tried.push_back({step, std::move(errors)});
  }
}

}  // namespace nonstop::tier
