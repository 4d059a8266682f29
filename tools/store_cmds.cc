// `nonstop inspect`, `nonstop verify` and `nonstop export`: read-only views of
// a checkpoint directory (one rank-*.nsck slot file per rank, docs/FORMAT.md).
// Every error is one line on stderr and a non-zero exit; a damaged file is
// reported, never a reason to crash.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <new>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/export.h"
#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "nonstop/medium.h"
#include "nonstop/restore.h"
#include "nonstop/store.h"
#include "store/format.h"
#include "engine/job_view.h"  // HumanBytes, UtcTime
#include "tools/commands.h"
#include "tools/remote_cli.h"
#include "tools/store_json.h"

namespace nonstop::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Exit codes: 1 = the checkpoint is damaged / not found; 2 = bad usage or input;
// 4 = verify --step N: step N's slot was reused by a newer checkpoint (overwritten
// as the ring intends, not damage).
constexpr int kExitDamaged = 1;
constexpr int kExitUsage = 2;
constexpr int kExitOverwritten = 4;

[[noreturn]] void Fail(const std::string& cmd, const std::string& message, int code) {
  std::cerr << "nonstop " << cmd << ": " << message << "\n";
  throw CLI::RuntimeError(code);
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string CkptName(const CheckpointInfo& info) {
  return "checkpoint #" + std::to_string(info.counter) + " (step " + std::to_string(info.step) +
         ")";
}

// At most this much of a text from a file is shown (OneLine: on one line).
constexpr size_t kShownMax = 64 << 10;

std::string Plural(uint64_t n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// A damaged checkpoint whose slot a newer commit has reused is not damage but
// the N+1 slot rotation at work: the newer record that took its slot, or null.
const ScannedCheckpoint* ReusedBy(const ScanReport& r, const ScannedCheckpoint& sc) {
  if (sc.state == CheckpointState::kCommitted) return nullptr;
  const ScannedCheckpoint* by = nullptr;
  for (const ScannedCheckpoint& o : r.checkpoints) {  // newest first: keep the oldest newer one
    if (o.info.counter > sc.info.counter && o.info.slot == sc.info.slot) by = &o;
  }
  return by;
}

std::string StateText(const ScanReport& r, const ScannedCheckpoint& sc,
                      const LineageRecord& lineage) {
  if (sc.state == CheckpointState::kCommitted) {
    PlanCandidate pc;
    pc.counter = sc.info.counter;
    const CandidateState st = Classify(pc, lineage);
    return st.state == CandidateState::State::kAbandoned ? st.reason : "committed";
  }
  if (const ScannedCheckpoint* by = ReusedBy(r, sc)) {
    return "overwritten: slot " + std::to_string(sc.info.slot) + " was reused by checkpoint #" +
           std::to_string(by->info.counter);
  }
  return "damaged: " + sc.reason;
}

// The slot files of a checkpoint directory, by rank order of their names.
std::vector<fs::path> SlotFiles(const std::string& cmd, const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) Fail(cmd, dir + ": no such directory", kExitUsage);
  if (!fs::is_directory(dir, ec)) Fail(cmd, dir + " is not a directory", kExitUsage);
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank-", 0) == 0 && name.size() > 10 &&
        name.compare(name.size() - 5, 5, ".nsck") == 0) {
      files.push_back(e.path());
    }
  }
  if (ec) Fail(cmd, dir + ": " + ec.message(), kExitUsage);
  if (files.empty()) {
    Fail(cmd, dir + " is not a nonstop checkpoint directory (no rank-*.nsck files)", kExitUsage);
  }
  std::sort(files.begin(), files.end());
  return files;
}

// One slot file, opened and scanned (every checkpoint's data verified).
struct ScannedFile {
  fs::path path;
  std::unique_ptr<SlotFile> file;  // null when it could not be opened
  std::string error;               // why it could not be opened or scanned
  ScanReport report;
  LineageRecord lineage;           // the job directory's rollback record of this rank
};

// The records of `s` as the planner's candidates (handle = index into the
// report); damaged ones are those the scan found damaged.
std::vector<PlanCandidate> Candidates(const ScannedFile& s) {
  std::vector<PlanCandidate> out;
  for (size_t i = 0; i < s.report.checkpoints.size(); ++i) {
    const ScannedCheckpoint& sc = s.report.checkpoints[i];
    out.push_back(PlanCandidate{Tier::kDisk, s.path.filename().string(), sc.info.step,
                                sc.info.counter, sc.state == CheckpointState::kCommitted,
                                sc.reason, ReusedBy(s.report, sc) != nullptr, i});
  }
  return out;
}

// Whether the lineage abandoned `counter` (a rollback is final).
bool Abandoned(const ScannedFile& s, uint64_t counter) {
  PlanCandidate pc;
  pc.counter = counter;
  return Classify(pc, s.lineage).state == CandidateState::State::kAbandoned;
}

// The planner's choice in `s`: the record recovery reads (the scan verified
// every record), or null.
const ScannedCheckpoint* Planned(const ScannedFile& s) {
  const std::vector<PlanCandidate> cands = Candidates(s);
  PlanRequest req;
  req.verify = false;
  Result<Plan> plan = MakePlan(cands, s.lineage, req);
  if (!plan.ok() || !plan.value().chosen()) return nullptr;
  return &s.report.checkpoints[cands[*plan.value().chosen()].handle];
}

ScannedFile ScanFile(const fs::path& path, bool verify_all) {
  ScannedFile s;
  s.path = path;
  MediumOptions read_only;
  read_only.read_only = true;  // a read-only file or mount can be inspected and exported
  auto medium = OpenMedium(path.string(), MediumKind::kBuffered, read_only);
  if (!medium.ok()) {
    s.error = medium.status().message();
    return s;
  }
  auto opened = SlotFile::Open(std::move(medium).value());
  if (!opened.ok()) {
    s.error = opened.status().message();
    return s;
  }
  s.file = std::move(opened).value();
  ScanOptions opts;
  opts.verify_all = verify_all;
  auto scan = s.file->Scan(opts);
  if (!scan.ok()) {
    s.error = scan.status().message();
    return s;
  }
  s.report = std::move(scan).value();
  Result<std::unique_ptr<JobDir>> jd = JobDir::OpenForRead(path.parent_path().string());
  Result<LineageRecord> lineage =
      jd.ok() ? jd.value()->ReadLineage(static_cast<int>(s.file->geometry().rank))
              : Result<LineageRecord>(jd.status());
  if (!lineage.ok()) {
    s.error = lineage.status().message();
    return s;
  }
  s.lineage = std::move(lineage).value();
  return s;
}

// ---------------------------------------------------------------------------
// inspect

json TensorsJson(const CheckpointInfo& info) {
  json out = json::array();
  for (const TensorEntry& te : info.tensors) {
    json t = {{"name", te.spec.name},
              {"dtype", std::string(DTypeName(te.spec.dtype))},
              {"shape", te.spec.shape},
              {"offset", te.data_offset},
              {"bytes", te.spec.nbytes}};
    if (!te.spec.global.global_shape.empty()) {
      t["global_shape"] = te.spec.global.global_shape;
      t["global_offset"] = te.spec.global.global_offset;
    }
    out.push_back(std::move(t));
  }
  return out;
}

// What each slot holds: the committed checkpoint in it, else "free".
std::vector<const ScannedCheckpoint*> SlotOwners(const ScannedFile& s) {
  std::vector<const ScannedCheckpoint*> owner(s.file->geometry().slots, nullptr);
  for (const ScannedCheckpoint& sc : s.report.checkpoints) {  // newest first
    if (sc.state == CheckpointState::kCommitted && sc.info.slot < owner.size() &&
        owner[sc.info.slot] == nullptr) {
      owner[sc.info.slot] = &sc;
    }
  }
  return owner;
}

json InspectJson(const ScannedFile& s) {
  json f = {{"file", s.path.filename().string()}};
  if (s.file == nullptr || !s.error.empty()) {
    f["error"] = s.error;
    return f;
  }
  f["salvaged"] = s.file->salvaged();
  const StoreGeometry& g = s.file->geometry();
  f["rank"] = g.rank;
  f["world_size"] = g.world_size;
  f["slot_count"] = g.slots;
  f["slot_bytes"] = g.slot_bytes;
  f["medium_bytes"] = s.file->medium().Size();
  json ckpts = json::array();
  const ScannedCheckpoint* newest = Planned(s);
  for (size_t i = 0; i < s.report.checkpoints.size(); ++i) {
    const ScannedCheckpoint& sc = s.report.checkpoints[i];
    const CheckpointInfo& in = sc.info;
    json c = {{"counter", in.counter},
              {"step", in.step},
              {"slot", in.slot},
              {"sequence", in.sequence},
              {"state", sc.state == CheckpointState::kCommitted
                            ? (Abandoned(s, in.counter) ? "abandoned" : "committed")
                        : ReusedBy(s.report, sc) ? "overwritten"
                                                 : "damaged"},
              {"newest_valid", &sc == newest},
              {"data_bytes", in.data_bytes},
              {"table_bytes", in.table_bytes},
              {"commit_unix_ns", in.commit_unix_ns},
              {"crc_chunk_bytes", in.crc_chunk_bytes},
              {"chunks", in.chunk_crcs.size()}};
    if (sc.state == CheckpointState::kDamaged || Abandoned(s, in.counter)) {
      c["reason"] = StateText(s.report, sc, s.lineage);
    }
    c["meta"] = MetaJson(in.meta_json);
    c["tensors"] = TensorsJson(in);
    ckpts.push_back(std::move(c));
  }
  f["checkpoints"] = std::move(ckpts);
  json slots = json::array();
  auto owner = SlotOwners(s);
  for (size_t i = 0; i < owner.size(); ++i) {
    json sl = {{"slot", i}, {"state", owner[i] ? "committed" : "free"}};
    if (owner[i]) {
      sl["counter"] = owner[i]->info.counter;
      sl["step"] = owner[i]->info.step;
    }
    slots.push_back(std::move(sl));
  }
  f["slots"] = std::move(slots);
  f["skipped"] = s.report.skipped;
  return f;
}

// The summary of one checkpoint for `inspect`: tensors and bytes per state
// key (the part of a name before its first '/'), tensors per dtype, and the
// metadata's size per top-level entry (RNG records as sizes, never their
// bytes; `--json` has everything).
void PrintSummary(const CheckpointInfo& in) {
  std::vector<std::string> order;
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_state;
  std::map<std::string, uint64_t> by_dtype;
  for (const TensorEntry& te : in.tensors) {
    const std::string key = te.spec.name.substr(0, te.spec.name.find('/'));
    auto [it, added] = by_state.try_emplace(key, 0, 0);
    if (added) order.push_back(key);
    it->second.first += 1;
    it->second.second += te.spec.nbytes;
    by_dtype[std::string(DTypeName(te.spec.dtype))] += 1;
  }
  constexpr size_t kMaxItems = 12;  // a hostile file may name thousands of states
  if (!order.empty()) {
    std::cout << "    tensors by state:";
    for (size_t i = 0; i < order.size() && i < kMaxItems; ++i) {
      const auto& [n, b] = by_state[order[i]];
      std::cout << (i ? ", " : " ") << OneLine(order[i].substr(0, 64)) << " " << n << " ("
                << HumanBytes(b) << ")";
    }
    if (order.size() > kMaxItems) std::cout << ", ... (" << order.size() << " in all)";
    std::cout << "\n    dtypes:";
    size_t i = 0;
    for (const auto& [d, n] : by_dtype) std::cout << (i++ ? ", " : " ") << d << " " << n;
    std::cout << "\n";
  }
  if (in.meta_json.empty()) return;
  std::cout << "    meta: " << HumanBytes(in.meta_json.size());
  const json meta = MetaJson(in.meta_json);  // bounded: size and depth
  if (!meta.is_object()) {
    std::cout << " (not a JSON object)\n";
    return;
  }
  if (auto f = meta.find("format"); f != meta.end() && f->is_string()) {
    std::cout << ", format " << OneLine(f->get<std::string>().substr(0, 40));
  }
  size_t shown = 0;
  for (const auto& [k, v] : meta.items()) {
    if (k == "format" || k == "step" || k == "rank" || k == "world_size") continue;
    if (shown++ >= kMaxItems) {
      std::cout << ", ...";
      break;
    }
    std::cout << (shown == 1 ? ": " : ", ") << OneLine(k.substr(0, 64)) << " "
              << HumanBytes(DumpJson(v).size());
    if (k == "metrics" && DumpJson(v).size() <= 200) {
      std::cout << " " << OneLine(DumpJson(v), kShownMax);
    } else if (k == "rng" && v.is_object()) {  // each generator's record, by size
      std::cout << " (";
      size_t j = 0;
      for (const auto& [g, r] : v.items()) {
        if (j == kMaxItems) {
          std::cout << ", ...";
          break;
        }
        std::cout << (j++ ? ", " : "") << OneLine(g.substr(0, 32)) << " "
                  << HumanBytes(DumpJson(r).size());
      }
      std::cout << ")";
    }
  }
  std::cout << "\n";
}

void PrintInspect(const ScannedFile& s, bool full) {
  const std::string name = s.path.filename().string();
  if (s.file == nullptr || !s.error.empty()) {
    std::cout << name << ": unreadable: " << s.error << "\n";
    return;
  }
  const StoreGeometry& g = s.file->geometry();
  std::cout << name << ": rank " << g.rank << " of " << g.world_size << ", " << g.slots
            << " slots of " << HumanBytes(g.slot_bytes) << ", "
            << HumanBytes(s.file->medium().Size()) << "\n";
  for (const std::string& note : s.file->salvaged()) std::cout << "  salvaged: " << note << "\n";
  std::cout << "  checkpoints (newest first):\n";
  const ScannedCheckpoint* newest = Planned(s);
  if (s.report.checkpoints.empty()) std::cout << "    none committed yet\n";
  for (size_t i = 0; i < s.report.checkpoints.size(); ++i) {
    const ScannedCheckpoint& sc = s.report.checkpoints[i];
    const CheckpointInfo& in = sc.info;
    char line[160];
    std::snprintf(line, sizeof(line), "    #%-6llu step %-8lld slot %-3u %10s  %s",
                  static_cast<unsigned long long>(in.counter), static_cast<long long>(in.step),
                  in.slot, HumanBytes(in.data_bytes + in.table_bytes).c_str(),
                  UtcTime(in.commit_unix_ns).c_str());
    std::cout << line << "  " << StateText(s.report, sc, s.lineage)
              << (&sc == newest ? " (newest)" : "") << "\n";
  }
  for (const std::string& sk : s.report.skipped) {
    if (sk.rfind("ring entry", 0) == 0) std::cout << "    " << sk << "\n";
  }
  std::cout << "  slots:\n";
  auto owner = SlotOwners(s);
  for (size_t i = 0; i < owner.size(); ++i) {
    std::cout << "    slot " << i << ": ";
    if (owner[i]) {
      std::cout << CkptName(owner[i]->info) << ", committed\n";
    } else {
      std::cout << "free\n";
    }
  }
  for (const ScannedCheckpoint& sc : s.report.checkpoints) {
    const CheckpointInfo& in = sc.info;
    if ((in.tensors.empty() && in.meta_json.empty()) || ReusedBy(s.report, sc)) continue;
    std::cout << "  " << CkptName(in) << ": " << Plural(in.tensors.size(), "tensor") << ", "
              << HumanBytes(in.data_bytes) << " data, " << Plural(in.chunk_crcs.size(), "chunk")
              << " of "
              << HumanBytes(in.crc_chunk_bytes) << "\n";
    PrintSummary(in);
    if (!full) continue;
    char line[96];
    std::snprintf(line, sizeof(line), "    %-10s %-20s %12s %12s  %s", "dtype", "shape", "offset",
                  "bytes", "name");
    std::cout << line << "\n";
    for (const TensorEntry& te : in.tensors) {
      std::snprintf(line, sizeof(line), "    %-10s %-20s %12llu %12llu  ",
                    std::string(DTypeName(te.spec.dtype)).c_str(), ShapeText(te.spec.shape).c_str(),
                    static_cast<unsigned long long>(te.data_offset),
                    static_cast<unsigned long long>(te.spec.nbytes));
      std::cout << line << OneLine(te.spec.name, kShownMax) << "\n";
    }
  }
}

void RunInspect(const std::string& dir, bool as_json, bool full) {
  json all = {{"dir", dir}, {"files", json::array()}};
  for (const fs::path& p : SlotFiles("inspect", dir)) {
    ScannedFile s = ScanFile(p, /*verify_all=*/true);
    if (as_json) {
      all["files"].push_back(InspectJson(s));
    } else {
      PrintInspect(s, full);
    }
  }
  if (as_json) std::cout << DumpJson(all, 2) << "\n";
}

// ---------------------------------------------------------------------------
// verify and export: pick one checkpoint per rank.

// The checkpoint of `s` that verify/export look at: the newest record (or the
// newest at `step`), committed or damaged, that no rollback abandoned. Null
// when there is none.
const ScannedCheckpoint* Target(const ScannedFile& s, std::optional<int64_t> step) {
  for (const ScannedCheckpoint& sc : s.report.checkpoints) {  // newest first
    if ((!step || sc.info.step == *step) && !Abandoned(s, sc.info.counter)) return &sc;
  }
  return nullptr;
}

// The newest record at `step` a rollback abandoned, or null.
const ScannedCheckpoint* AbandonedAt(const ScannedFile& s, int64_t step) {
  for (const ScannedCheckpoint& sc : s.report.checkpoints) {
    if (sc.info.step == step && Abandoned(s, sc.info.counter)) return &sc;
  }
  return nullptr;
}

std::string StepsText(const ScannedFile& s) {
  std::set<int64_t> steps;
  for (const auto& sc : s.report.checkpoints) steps.insert(sc.info.step);
  std::string t;
  for (int64_t v : steps) t += (t.empty() ? "" : ", ") + std::to_string(v);
  return t.empty() ? "none" : t;
}

void RunVerify(const std::string& dir, std::optional<int64_t> step) {
  std::vector<ScannedFile> files;
  for (const fs::path& p : SlotFiles("verify", dir)) files.push_back(ScanFile(p, true));
  // Without --step: the newest step any rank has; every rank must have it.
  if (!step) {
    for (const ScannedFile& s : files) {
      const ScannedCheckpoint* t =
          s.file != nullptr && s.error.empty() ? Target(s, std::nullopt) : nullptr;
      if (t != nullptr) step = std::max(step.value_or(t->info.step), t->info.step);
    }
  }
  uint64_t tensors = 0, bytes = 0, chunks = 0;
  std::string salvaged;  // the first damage recovery worked around
  for (const ScannedFile& s : files) {
    const std::string name = (fs::path(dir) / s.path.filename()).string();
    if (s.file == nullptr || !s.error.empty()) Fail("verify", name + ": " + s.error, kExitDamaged);
    if (salvaged.empty() && !s.file->salvaged().empty()) {
      salvaged = name + ": " + s.file->salvaged()[0];
    }
    // A damaged ring entry may have been the newest commit record.
    for (const std::string& sk : s.report.skipped) {
      if (sk.rfind("ring entry", 0) == 0) {
        Fail("verify", name + ": " + sk + " (a commit record torn by a crash, or corruption)",
             kExitDamaged);
      }
    }
    if (s.report.checkpoints.empty()) {
      Fail("verify", name + ": no checkpoint has been committed", kExitDamaged);
    }
    const ScannedCheckpoint* t = Target(s, step);
    if (t == nullptr) {
      if (const ScannedCheckpoint* a = AbandonedAt(s, *step)) {
        Fail("verify", name + ": " + CkptName(a->info) + " is " +
             StateText(s.report, *a, s.lineage) + "; load() refuses it too", kExitDamaged);
      }
      Fail("verify", name + ": no checkpoint at step " + std::to_string(*step) +
           " (steps here: " + StepsText(s) + ")", kExitDamaged);
    }
    if (t->state != CheckpointState::kCommitted) {
      std::string fallback;
      const ScannedCheckpoint* used = Planned(s);
      if (t == Target(s, std::nullopt) && used != nullptr) {
        fallback = "; recovery would fall back to " + CkptName(used->info);
      }
      Fail("verify", name + ": " + CkptName(t->info) + " is " + StateText(s.report, *t, s.lineage) + fallback,
           ReusedBy(s.report, *t) != nullptr ? kExitOverwritten : kExitDamaged);
    }
    tensors += t->info.tensors.size();
    bytes += t->info.data_bytes;
    chunks += t->info.chunk_crcs.size();
  }
  // The checkpoint is intact, the file is not: damage, named with what was
  // used instead (a writer opening the directory repairs it).
  if (!salvaged.empty()) {
    Fail("verify", salvaged + "; step " + std::to_string(*step) + " verified with it on " +
                       Plural(files.size(), "rank") + " (a writer opening the directory repairs it)",
         kExitDamaged);
  }
  std::cout << "OK: step " << *step << " verified on " << Plural(files.size(), "rank") << ": "
            << Plural(tensors, "tensor") << ", " << HumanBytes(bytes) << ", "
            << Plural(chunks, "data chunk checksum") << ", tables and commit records\n";
}

// The export's progress on stderr, drawn as python/nonstop/_progress.py draws
// its tqdm bar: `progress` 1 always, 0 never, -1 (default) when stderr is a
// terminal and the export is 256 MiB or more; NONSTOP_PROGRESS=1/0 decides
// the default. One line, redrawn per window and cleared at the end.
class ExportProgress {
 public:
  ExportProgress(int progress, uint64_t total) : total_(total) {
    const char* env = std::getenv("NONSTOP_PROGRESS");
    if (progress < 0 && env != nullptr &&
        (std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0)) {
      progress = env[0] == '1' ? 1 : 0;
    }
    on_ = progress == 1 || (progress < 0 && ::isatty(2) && total >= (256ull << 20));
  }
  ~ExportProgress() {
    if (on_ && drawn_) std::fprintf(stderr, "\r%*s\r", 72, "");
  }
  void Update(uint64_t done) {
    if (!on_) return;
    const double pct =
        total_ ? 100.0 * static_cast<double>(done) / static_cast<double>(total_) : 100.0;
    std::fprintf(stderr, "\rnonstop export: %3.0f%% %s / %s", pct, HumanBytes(done).c_str(),
                 HumanBytes(total_).c_str());
    std::fflush(stderr);
    drawn_ = true;
  }

 private:
  uint64_t total_;
  bool on_ = false;
  bool drawn_ = false;
};

// A multi-rank job's directory is exported consolidated, by Python (the
// reassembly of python/nonstop/_dcp.py): replaces this process with
// `PY -m nonstop._export DIR -o OUT [...]` (tools/remote_cli.h's PackagePython).
[[noreturn]] void RunExportConsolidated(const std::string& dir, std::optional<int64_t> step,
                                        const std::string& out,
                                        const std::vector<std::string>& include,
                                        const std::string& strip, int progress) {
  const std::string python = PackagePython();
  std::vector<std::string> argv = {python, "-m", "nonstop._export", dir, "-o", out};
  if (step) {
    argv.push_back("--step");
    argv.push_back(std::to_string(*step));
  }
  for (const std::string& glob : include) {
    argv.push_back("--include");
    argv.push_back(glob);
  }
  if (!strip.empty()) argv.push_back("--strip=" + strip);
  if (progress >= 0) argv.push_back(progress ? "--progress" : "--no-progress");
  ExecArgv(argv);
  Fail("export", "cannot run " + python + " to export a multi-rank directory: " +
                     std::strerror(errno) + " (set NONSTOP_PYTHON to a python with nonstop and torch)",
       kExitUsage);
}

void RunExport(const std::string& dir, std::optional<int64_t> step, const std::string& out,
               const std::vector<std::string>& include, const std::string& strip,
               int progress) {
  const std::vector<fs::path> paths = SlotFiles("export", dir);
  if (paths.size() != 1 || paths[0].filename() != JobDirNames::Slot(0)) {
    RunExportConsolidated(dir, step, out, include, strip, progress);  // refuses a lone rank
  }
  // The library's export (include/nonstop/export.h), as nonstop.export's:
  // the planner's choice, verified as it is read, a window at a time.
  ExportRequest req;
  req.dir = dir;
  req.step = step;
  req.include = include;
  req.strip = strip;
  SafetensorsTarget target;
  target.path = out;  // a link planted at OUT.tmp is refused, never followed
  std::unique_ptr<ExportProgress> bar;
  target.progress = [&](uint64_t done, uint64_t total) {
    if (!bar) bar = std::make_unique<ExportProgress>(progress, total);
    bar->Update(done);
    return true;
  };
  Result<ExportResult> r = ExportSafetensors(req, target);
  bar.reset();
  if (!r.ok()) {
    const StatusCode c = r.status().code();
    const bool output = c == StatusCode::kIOError &&  // the output's, not the checkpoint's
                        r.status().message().rfind("cannot export to ", 0) == 0;
    Fail("export", r.status().message(),
         c == StatusCode::kInvalidArgument || output ? kExitUsage : kExitDamaged);
  }
  if (r->world_size > 1) RunExportConsolidated(dir, step, out, include, strip, progress);
  for (const std::string& note : r->notes) std::cerr << "nonstop export: note: " << note << "\n";
  std::cout << "exported checkpoint #" << r->counter << " (step " << r->step << "): "
            << Plural(r->tensors, "tensor") << ", " << HumanBytes(r->bytes) << " to " << out
            << "\n";
}

// `export --format dcp` is Python (torch.distributed.checkpoint writes it):
// replaces this process with `PY -m nonstop._dcp DIR OUT [--step N]` (PY:
// tools/remote_cli.h's PackagePython). docs/DISTRIBUTED.md.
[[noreturn]] void RunExportDcp(const std::string& dir, std::optional<int64_t> step,
                               const std::string& out, int progress) {
  const std::string python = PackagePython();  // tools/remote_cli.h
  std::vector<std::string> argv = {python, "-m", "nonstop._dcp", dir, out};
  if (step) {
    argv.push_back("--step");
    argv.push_back(std::to_string(*step));
  }
  if (progress >= 0) argv.push_back(progress ? "--progress" : "--no-progress");
  ExecArgv(argv);
  Fail("export", "cannot run " + python + " for --format dcp: " + std::strerror(errno) +
                     " (set NONSTOP_PYTHON to a python with nonstop and torch)",
       kExitUsage);
}

// Runs a command so that nothing escapes it but its one-line error: any
// exception (a bug, or memory exhausted by a hostile input) becomes one line
// and exit code 1.
template <class F>
std::function<void()> Guarded(const char* cmd, F run) {
  return [cmd, run] {
    try {
      run();
    } catch (const CLI::Error&) {
      throw;  // Fail's exit, or CLI11's own
    } catch (const std::bad_alloc&) {
      Fail(cmd, "out of memory", kExitDamaged);
    } catch (const std::exception& e) {
      Fail(cmd, "internal error: " + format::Printable(e.what()), kExitDamaged);
    } catch (...) {
      Fail(cmd, "internal error", kExitDamaged);
    }
  };
}

}  // namespace

namespace {

struct StoreArgs {
  std::string dir;
  bool json = false;
  bool full = false;
  std::optional<int64_t> step;
  std::string out;
  std::string format = "safetensors";
  std::vector<std::string> include;
  std::string strip;
  bool progress = false;     // export --progress
  bool no_progress = false;  // export --no-progress
};

// The arguments of `nonstop CMD URL ...` for python -m nonstop._remote_cli
// (tools/remote_cli.h RemoteCall).
std::vector<std::string> RemoteArgs(const std::string& cmd, const StoreArgs& a) {
  std::vector<std::string> v =
      RemoteCall(cmd, a.dir, a.step ? std::to_string(*a.step) : "", 0, a.json);
  if (cmd == "export") {
    v.insert(v.end(), {"-o", a.out, "--format", a.format});
    for (const std::string& glob : a.include) v.insert(v.end(), {"--include", glob});
    if (!a.strip.empty()) v.push_back("--strip=" + a.strip);
  }
  return v;
}

}  // namespace

void AddStoreCommands(CLI::App& app) {
  using Args = StoreArgs;
  auto args = std::make_shared<Args>();

  CLI::App* inspect = app.add_subcommand(
      "inspect", "Summarise every slot and checkpoint of a checkpoint directory");
  inspect->add_option("dir", args->dir, "checkpoint directory (holds rank-*.nsck)")->required();
  inspect->add_flag("--json", args->json, "print JSON instead of text (every detail)");
  inspect->add_flag("--full", args->full, "also print each checkpoint's tensor table");
  inspect->callback(Guarded("inspect", [args] {
    if (IsRemoteUrl(args->dir)) RunRemote(RemoteArgs("inspect", *args));
    RunInspect(args->dir, args->json, args->full);
  }));

  CLI::App* verify = app.add_subcommand(
      "verify", "Check every checksum of the newest (or --step) checkpoint on every rank");
  verify->add_option("dir", args->dir, "checkpoint directory (holds rank-*.nsck)")->required();
  verify->add_option("--step", args->step, "training step to verify (default: the newest)");
  verify->callback(Guarded("verify", [args] {
    if (IsRemoteUrl(args->dir)) RunRemote(RemoteArgs("verify", *args));
    RunVerify(args->dir, args->step);
  }));

  CLI::App* exp = app.add_subcommand(
      "export", "Write one checkpoint as a safetensors file (a multi-rank job consolidated)");
  exp->add_option("dir", args->dir, "checkpoint directory (holds rank-*.nsck)")->required();
  exp->add_option("--step", args->step, "training step to export (default: the newest valid)");
  exp->add_option("-o,--output", args->out, "output .safetensors file (a directory for dcp)")
      ->required();
  exp->add_option("--format", args->format,
                  "safetensors (one file) or dcp (every rank, reassembled; runs python -m "
                  "nonstop._dcp)")
      ->check(CLI::IsMember({"safetensors", "dcp"}));
  exp->add_option("--strip", args->strip,
                  "remove this prefix from the exported names that start with it ('model/': "
                  "the file loads into the model)");
  exp->add_option("--include", args->include,
                  "export only tensors whose name matches this glob ('model/*', '*.weight'); "
                  "repeatable: a tensor matching any is exported (safetensors only)");
  CLI::Option* prog = exp->add_flag(
      "--progress", args->progress,
      "draw a progress bar on stderr (default: on a terminal, for 256 MiB or more)");
  exp->add_flag("--no-progress", args->no_progress, "never draw the progress bar")
      ->excludes(prog);
  exp->callback(Guarded("export", [args] {
    if ((!args->include.empty() || !args->strip.empty()) && args->format == "dcp") {
      Fail("export", "--include/--strip are for a safetensors export; --format dcp exports every tensor",
           kExitUsage);
    }
    if (IsRemoteUrl(args->dir)) RunRemote(RemoteArgs("export", *args));
    const int progress = args->progress ? 1 : args->no_progress ? 0 : -1;
    if (args->format == "dcp") RunExportDcp(args->dir, args->step, args->out, progress);
    RunExport(args->dir, args->step, args->out, args->include, args->strip, progress);
  }));
}

}  // namespace nonstop::cli
