// The job view (job_view.h): the tiers, read from themselves, and the job
// manifest's record of the tiers elsewhere, as one list of rows.
#include "engine/job_view.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>

#include "engine/memory_tier.h"
#include "jobdir/manifest.h"
#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "store/format.h"

namespace nonstop {
namespace {

const char* StateName(ListedCheckpoint::State s) {
  switch (s) {
    case ListedCheckpoint::State::kCommitted: return "committed";
    case ListedCheckpoint::State::kAbandoned: return "abandoned";
    case ListedCheckpoint::State::kDamaged: return "damaged";
  }
  return "damaged";
}

int TierOrder(const std::string& t) {
  if (t == "disk") return 0;
  if (t == "memory") return 1;
  if (t == "remote") return 2;
  return 3;
}

}  // namespace

std::string TierList(const ViewRow& row) {
  std::vector<std::string> names;
  for (const ViewHolder& h : row.tiers) {
    if (std::find(names.begin(), names.end(), h.tier) == names.end()) names.push_back(h.tier);
  }
  std::sort(names.begin(), names.end(),
            [](const std::string& a, const std::string& b) { return TierOrder(a) < TierOrder(b); });
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : "+") + n;
  return out;
}

std::string OneLine(std::string_view s, size_t max_bytes) {
  std::string out;
  size_t i = 0;
  for (; i < s.size() && out.size() < max_bytes; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (i < s.size()) out += "...";
  return out;
}

std::string LsText(const JobView& view, int rank, const std::string& where) {
  if (view.rows.empty()) {
    return "no checkpoint of rank " + std::to_string(rank) + " in " + where + "\n";
  }
  std::string out;
  if (!view.job.empty()) out = "job " + format::Printable(view.job) + "\n";
  char line[1024];
  std::snprintf(line, sizeof(line), "%-10s %-6s %-10s %-21s %-10s %-24s %s\n", "step", "where",
                "state", "committed (UTC)", "size", "tiers", "metrics");
  out += line;
  for (const ViewRow& r : view.rows) {
    std::string metrics;
    for (const auto& [k, v] : r.metrics) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.6g", v);
      metrics += (metrics.empty() ? "" : " ") + format::Printable(k) + "=" + buf;
    }
    std::string tiers = TierList(r);
    for (const ViewHolder& h : r.tiers) {
      if (h.tier == "peer") tiers += " peer@" + OneLine(h.where);
    }
    if (!r.reason.empty() || r.state != "committed") metrics = format::Printable(r.reason);
    if (r.state == "committed" && TierList(r) == "memory") {
      metrics = "memory only: survives a process crash, not a node loss";
    }
    std::snprintf(line, sizeof(line), "%-10lld %-6s %-10s %-21s %-10s %-24s ",
                  static_cast<long long>(r.step), r.where.c_str(), r.state.c_str(),
                  UtcTime(r.commit_unix_ns).c_str(),
                  r.state == "committed" && r.bytes ? HumanBytes(r.bytes).c_str() : "-",
                  tiers.empty() ? "-" : tiers.c_str());
    std::string row = line + metrics;
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += row + "\n";
  }
  return out;
}

Result<JobView> ViewJob(const std::string& dir, int rank, Env* env, const std::string& shm_dir) {
  if (env == nullptr) env = DefaultEnv();
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> jd, JobDir::OpenForRead(dir, env));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<ListedCheckpoint> listed, jd->List(rank));
  JobView view;
  for (ListedCheckpoint& c : listed) {
    if (c.rotated) continue;  // a ring record whose slot a newer checkpoint reused: gone, not damage
    ViewRow r;
    r.step = c.step;
    r.counter = c.counter;
    r.where = c.location.keep ? "keep" : "ring";
    r.path = c.location.where;
    r.state = StateName(c.state);
    r.reason = c.reason;
    r.commit_unix_ns = c.commit_unix_ns;
    r.bytes = c.data_bytes;
    r.metrics = std::move(c.metrics);
    r.unreadable = c.state == ListedCheckpoint::State::kDamaged && c.counter == 0;
    view.rows.push_back(std::move(r));
  }
  // counter -> (step, holders) of every committed checkpoint a tier holds.
  struct Held {
    int64_t step = 0;
    std::vector<ViewHolder> holders;
  };
  std::map<uint64_t, Held> held;
  for (const ViewRow& r : view.rows) {
    if (r.state != "committed") continue;
    Held& h = held[r.counter];
    h.step = r.step;
    h.holders.push_back({"disk", r.path, false});
  }
  // The memory segment, only when the planner would read it (OpenMemorySegment).
  {
    std::string why;
    Result<std::optional<MemorySegment>> seg =
        OpenMemorySegment(dir, rank, shm_dir, env, nullptr, &why);
    if (seg.ok() && seg.value().has_value()) {
      const CheckpointInfo& info = seg.value()->info;
      auto it = held.find(info.counter);
      if (it == held.end()) {  // the tiered cadence: newer than the disk's newest
        ViewRow m;
        m.step = info.step;
        m.counter = info.counter;
        m.where = "memory";
        m.path = seg.value()->path;
        m.state = "committed";
        m.commit_unix_ns = info.commit_unix_ns;
        m.bytes = info.data_bytes;
        view.rows.push_back(std::move(m));
        held[info.counter] = Held{info.step, {{"memory", seg.value()->path, false}}};
      } else if (it->second.step == info.step) {
        it->second.holders.push_back({"memory", seg.value()->path, false});
      }
    }
  }
  // The manifest: what the remote and the peer tier noted they hold.
  Result<std::optional<JobManifest>> man = ReadJobManifest(jd->dir(), rank);
  if (!man.ok()) {
    ViewRow d;
    d.step = -1;
    d.where = "manifest";
    d.path = JobDirNames::Manifest(rank);
    d.state = "damaged";
    d.reason = man.status().message() +
               " (what the remote and peer tiers hold is not known here; list them by their URL)";
    d.unreadable = true;
    view.rows.push_back(std::move(d));
  } else if (man.value()) {
    const JobManifest& m = *man.value();
    view.job = m.job;
    Result<LineageRecord> lineage = jd->ReadLineage(rank);
    const LineageRecord none;
    const LineageRecord& lin = lineage.ok() ? lineage.value() : none;
    std::map<uint64_t, size_t> added;  // counter -> index of a row added for the manifest
    for (const ManifestHolder& h : m.holders) {
      for (const ManifestHeld& e : h.held) {
        const ViewHolder vh{h.tier, h.where, true};
        auto it = held.find(e.counter);
        if (it != held.end()) {
          if (it->second.step != e.step) {
            view.notes.push_back(h.tier + " " + h.where + ": the manifest names " +
                                 DescribeCheckpoint(e.counter, e.step) + ", which " +
                                 "the local tiers hold at step " +
                                 std::to_string(it->second.step) + ": not shown");
            continue;
          }
          it->second.holders.push_back(vh);
          continue;
        }
        // Abandoned here: that row says so (a rollback is final on every
        // tier). Damaged here (its ring slot reused, a torn copy): the
        // holder's copy is its own and is listed.
        const bool abandoned = std::any_of(view.rows.begin(), view.rows.end(), [&](const ViewRow& r) {
          return r.counter == e.counter && r.state == "abandoned";
        });
        if (abandoned) continue;
        if (auto a = added.find(e.counter); a != added.end()) {
          if (view.rows[a->second].step == e.step) view.rows[a->second].tiers.push_back(vh);
          continue;
        }
        ViewRow r;
        r.step = e.step;
        r.counter = e.counter;
        r.where = h.tier;
        r.path = h.where;
        PlanCandidate pc;
        pc.counter = e.counter;
        pc.step = e.step;
        const CandidateState cs = Classify(pc, lin);
        r.state = cs.state == CandidateState::State::kAbandoned ? "abandoned" : "committed";
        r.reason = cs.reason;
        if (r.state == "committed") r.tiers.push_back(vh);
        r.commit_unix_ns = 0;
        added[e.counter] = view.rows.size();
        view.rows.push_back(std::move(r));
      }
    }
  }
  for (ViewRow& r : view.rows) {
    if (r.state != "committed") continue;
    auto it = held.find(r.counter);
    if (it != held.end() && it->second.step == r.step) {
      for (ViewHolder& h : it->second.holders) r.tiers.push_back(h);
    }
    std::stable_sort(r.tiers.begin(), r.tiers.end(), [](const ViewHolder& a, const ViewHolder& b) {
      return TierOrder(a.tier) < TierOrder(b.tier);
    });
  }
  // Newest counter first; unreadable files (counter 0) last; at one counter as added.
  std::stable_sort(view.rows.begin(), view.rows.end(), [](const ViewRow& a, const ViewRow& b) {
    return a.counter > b.counter;
  });
  return view;
}

namespace {

// "7, 8, 9 in the ring; 2, 4 kept" of the committed checkpoints; "none".
std::string StepsText(const std::vector<ViewRow>& rows) {
  std::string out;
  for (const char* where : {"ring", "keep"}) {
    std::vector<int64_t> steps;
    for (const ViewRow& r : rows) {
      if (r.state == "committed" && r.where == where) steps.push_back(r.step);
    }
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
    if (steps.empty()) continue;
    std::string part;
    for (int64_t s : steps) part += (part.empty() ? "" : ", ") + std::to_string(s);
    out += (out.empty() ? "" : "; ") + part + (where == std::string("ring") ? " in the ring" : " kept");
  }
  return out.empty() ? "none" : out;
}

std::string Have(const std::string& dir, int rank, Env* env, std::vector<ViewRow>* rows) {
  Result<JobView> v = ViewJob(dir, rank, env);
  if (!v.ok()) {  // listing failed too: say so instead
    const std::string& m = v.status().message();
    return "cannot list them: " + m.substr(0, m.find('\n'));
  }
  if (rows != nullptr) *rows = v.value().rows;
  return StepsText(v.value().rows);
}

}  // namespace

Status StepNotFound(const std::string& dir, int rank, int64_t step, Env* env) {
  const std::string have = Have(dir, rank, env, nullptr);
  std::string gone;  // as `nonstop inspect` says it: the ring reused its slot
  if (Result<std::unique_ptr<JobDir>> jd = JobDir::OpenForRead(dir, env); jd.ok()) {
    if (Result<std::vector<ListedCheckpoint>> rows = jd.value()->List(rank); rows.ok()) {
      for (const ListedCheckpoint& c : rows.value()) {
        if (c.rotated && c.step == step && gone.empty()) gone = c.reason;
      }
    }
  }
  const std::string head =
      "no committed checkpoint at step " + std::to_string(step) + " in " + dir;
  if (!gone.empty()) {
    return Status::NotFound(head + ": it was overwritten (" + gone + "; committed steps: " + have +
                            ")");
  }
  return Status::NotFound(head + " (committed steps: " + have + ")");
}

Status NotKept(const std::string& dir, int64_t step, const Status& original, Env* env) {
  if (original.code() != StatusCode::kNotFound) return original;
  std::vector<ViewRow> rows;
  const std::string have = Have(dir, 0, env, &rows);
  for (const ViewRow& r : rows) {
    if (r.step == step && r.where == "ring") {
      return Status::NotFound("step " + std::to_string(step) + " of " + dir +
                              " is in the ring (the slot file), which nonstop reuses itself; only "
                              "kept copies (keep/) are deleted (committed steps: " + have + ")");
    }
  }
  return original;
}

}  // namespace nonstop
