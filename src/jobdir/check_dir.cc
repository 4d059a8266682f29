// What a job directory holds, checked before a job opens or creates it
// (check_dir.h): the Python front end's check_directory and readers.
#include "jobdir/check_dir.h"

#include <algorithm>
#include <memory>
#include <string_view>
#include <utility>

#include "jobdir/records.h"

namespace nonstop {

namespace {

bool IsNotFound(const Status& s) { return s.code() == StatusCode::kNotFound; }

// The names in `path` (NotFound when it is missing or no directory) and
// whether it is a file; for RankFiles and CheckDirectory.
Result<std::vector<std::string>> ListJobDir(Env* env, const std::string& path, bool* is_file) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.find_last_of('/');
  if (p != "/" && p != "." && slash + 1 < p.size()) {
    Result<std::unique_ptr<Directory>> parent = env->OpenDirectory(
        slash == std::string::npos ? "." : (slash == 0 ? "/" : p.substr(0, slash)), false);
    Result<FileStat> st = parent.ok() ? (*parent)->Stat(p.substr(slash + 1))
                                      : Result<FileStat>(parent.status());
    if (!st.ok() && IsNotFound(st.status())) {
      return Status::NotFound("checkpoint directory " + path + " does not exist");
    }
    *is_file = st.ok() && st->type == EntryType::kFile;
    if (*is_file) return Status::NotFound("checkpoint directory " + path + " does not exist");
  }
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(path, false);
  if (!d.ok()) {
    if (IsNotFound(d.status())) {
      return Status::NotFound("checkpoint directory " + path + " does not exist");
    }
    return d.status().Annotate("cannot open checkpoint directory " + path);
  }
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, (*d)->List());
  std::vector<std::string> names;
  for (DirEntry& e : entries) names.push_back(std::move(e.name));
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<int> SlotRanks(const std::vector<std::string>& names) {
  std::vector<int> ranks;
  for (const std::string& n : names) {
    if (std::optional<int> r = JobDirNames::ParseSlot(n)) ranks.push_back(*r);
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

}  // namespace

Result<std::vector<int>> RankFiles(const std::string& path, Env* env) {
  bool is_file = false;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> names,
                           ListJobDir(env ? env : DefaultEnv(), path, &is_file));
  std::vector<int> ranks = SlotRanks(names);
  if (ranks.empty()) return Status::NotFound("no nonstop checkpoint in " + path);
  return ranks;
}

Result<bool> CheckJobDirectory(const std::string& path, int rank, std::optional<int> world_size,
                               bool must_exist, Env* env) {
  bool is_file = false;
  Result<std::vector<std::string>> names = ListJobDir(env ? env : DefaultEnv(), path, &is_file);
  if (is_file) {
    return Status::FailedPrecondition(path + " is a file, not a checkpoint directory");
  }
  if (!names.ok()) {
    if (IsNotFound(names.status()) && !must_exist) return false;
    return names.status();
  }
  const std::vector<int> ranks = SlotRanks(*names);
  if (ranks.empty()) {
    // world-W/: rank files of another world size, set aside for resharding;
    // a rank's records and temp files ("rank-R.nsck.tmp": a slot file being
    // created, "manifest-rank-R.json.tmp": a record being written; a kill
    // may leave one, and set-aside leaves a temp name behind); keep/;
    // remote/, peer/: the tiers' own.
    std::vector<std::string> others;
    for (const std::string& n : *names) {
      if (n.empty() || n[0] == '.' || JobDirNames::IsRankFile(n) || JobDirNames::ParseWorld(n) ||
          n == JobDirNames::KeepRoot() || n == "remote" || n == "peer") {
        continue;
      }
      others.push_back(n);
    }
    if (!others.empty()) {
      std::string shown;
      for (size_t i = 0; i < others.size() && i < 3; ++i) shown += (i ? ", " : "") + others[i];
      if (others.size() > 3) shown += ", ...";
      return Status::FailedPrecondition(path + " is not a nonstop checkpoint directory (it holds " +
                                        shown + "); use an empty or new directory");
    }
    if (must_exist) {
      return Status::NotFound("no nonstop checkpoint in " + path + " (directory is empty)");
    }
    return false;
  }
  if (world_size && ranks.back() >= *world_size) {
    return Status::FailedPrecondition(
        path + " was written by a job of world size " + std::to_string(ranks.back() + 1) +
        " or more; this job has world size " + std::to_string(*world_size) +
        ": use the same world size or a new directory");
  }
  if (!std::binary_search(ranks.begin(), ranks.end(), rank)) {
    if (must_exist) {
      return Status::NotFound("no nonstop checkpoint for rank " + std::to_string(rank) + " in " +
                              path);
    }
    return false;
  }
  return true;
}

std::string LightningMarkerJson(int64_t step) {
  return std::string("{\"format\": \"") + kLightningMarkerFormat +
         "\", \"dir\": \"nonstop\", \"step\": " + std::to_string(step) +
         ", \"global_step\": " + std::to_string(step + 1) + "}";
}

std::optional<LightningMarker> ReadLightningMarker(const std::string& path, Env* env) {
  const size_t slash = path.find_last_of('/');
  const std::string parent =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  Result<std::unique_ptr<Directory>> d = (env ? env : DefaultEnv())->OpenDirectory(parent, false);
  if (!d.ok()) return std::nullopt;
  Result<std::string> text = ReadSmallFile(**d, path.substr(slash + 1), 1 << 16);
  if (!text.ok()) return std::nullopt;
  Result<jobdir_internal::Json> j = jobdir_internal::ParseJson(*text, path);
  if (!j.ok()) return std::nullopt;
  const jobdir_internal::Json* format = j->Get("format");
  const jobdir_internal::Json* dir = j->Get("dir");
  const jobdir_internal::Json* step = j->Get("step");
  using Type = jobdir_internal::Json::Type;
  LightningMarker m;
  if (!format || format->type != Type::kString || format->text != kLightningMarkerFormat ||
      !dir || dir->type != Type::kString || !CheckEntryName(dir->text).ok() || !step ||
      !step->AsInt64(&m.step) || m.step < 0) {
    return std::nullopt;
  }
  m.dir = dir->text;
  m.nonstop_dir = (parent == "/" ? "" : parent) + "/" + m.dir;
  return m;
}

}  // namespace nonstop
