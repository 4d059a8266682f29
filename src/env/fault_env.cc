#include "env/fault_env.h"

#include <algorithm>
#include <cerrno>
#include <map>
#include <optional>
#include <random>
#include <utility>

#include "base/mutex.h"
#include "media/medium_wrapper.h"
#include "media/sticky_medium.h"

namespace nonstop {

const char* EnvOpName(EnvOp op) {
  switch (op) {
    case EnvOp::kOpenDirectory:
      return "open directory";
    case EnvOp::kOpenFile:
      return "open";
    case EnvOp::kCreateFile:
      return "create";
    case EnvOp::kOpenDir:
      return "open subdirectory";
    case EnvOp::kRename:
      return "rename";
    case EnvOp::kUnlink:
      return "remove";
    case EnvOp::kRemoveDir:
      return "remove directory";
    case EnvOp::kSyncDir:
      return "sync directory";
    case EnvOp::kList:
      return "list";
    case EnvOp::kStat:
      return "stat";
    case EnvOp::kLock:
      return "lock";
    case EnvOp::kWrite:
      return "write";
    case EnvOp::kRead:
      return "read";
    case EnvOp::kSync:
      return "sync";
    case EnvOp::kResize:
      return "resize";
    case EnvOp::kCount:
      break;
  }
  return "?";
}

namespace {

struct FileNode {
  uint64_t id = 0;
  std::shared_ptr<FaultDisk> disk;
};
struct DirNode;

struct Entry {
  EntryType type = EntryType::kOther;
  std::shared_ptr<FileNode> file;  // kFile
  std::shared_ptr<DirNode> dir;    // kDirectory
  std::string target;              // kSymlink
};
using Entries = std::map<std::string, Entry>;

// One pending directory operation: changes applied together (a rename inside
// one directory removes one name and adds another atomically). nullopt
// removes the name.
struct DirOp {
  std::vector<std::pair<std::string, std::optional<Entry>>> changes;
};

struct DirNode {
  uint64_t id = 0;
  Entries visible;             // what readers see now
  Entries durable;             // what survives a crash
  std::vector<DirOp> pending;  // visible = durable + pending, in issue order
  bool removed = false;        // rmdir'ed: nothing new can be made in it
};

void Apply(Entries& e, const DirOp& op) {
  for (const auto& [name, entry] : op.changes) {
    if (entry.has_value()) {
      e[name] = *entry;
    } else {
      e.erase(name);
    }
  }
}

std::string Join(const std::string& dir, std::string_view name) {
  if (dir.empty() || dir == ".") return std::string(name);
  if (dir.back() == '/') return dir + std::string(name);
  return dir + "/" + std::string(name);
}

Status SymlinkRefused(const std::string& what) {
  return Status::FailedPrecondition(
      what + " is a symlink: nonstop never follows links in a checkpoint directory "
             "(remove it if you did not put it there)");
}

Status Errno(const std::string& what, int err) { return Status::FromErrno(what, err); }

}  // namespace

struct FaultEnv::State {
  explicit State(FaultEnvOptions o) : opts(o) {
    root = std::make_shared<DirNode>();
    root->id = next_id++;
    dirs.push_back(root);
  }

  struct Rule {
    EnvOp op;
    uint64_t at_call;  // of op
    bool persistent;
    int err;
  };
  struct LockRec {
    uint64_t token;
    std::string holder;
  };

  const FaultEnvOptions opts;
  mutable Mutex mu;
  std::shared_ptr<DirNode> root GUARDED_BY(mu);
  uint64_t generation GUARDED_BY(mu) = 0;  // bumped by each crash
  uint64_t calls GUARDED_BY(mu) = 0;
  uint64_t per_op[static_cast<int>(EnvOp::kCount)] GUARDED_BY(mu) = {};
  uint64_t crashes GUARDED_BY(mu) = 0;
  uint64_t next_id GUARDED_BY(mu) = 1;
  std::vector<std::weak_ptr<FileNode>> files GUARDED_BY(mu);  // in id order
  std::vector<std::weak_ptr<DirNode>> dirs GUARDED_BY(mu);  // in id order
  std::vector<Rule> rules GUARDED_BY(mu);
  std::optional<uint64_t> crash_at GUARDED_BY(mu);  // a value of `calls`
  CrashMode crash_mode = CrashMode::kDropUnsynced;
  uint64_t crash_seed = 0;
  std::map<uint64_t, LockRec> locks GUARDED_BY(mu);  // by FileNode id
  uint64_t next_token GUARDED_BY(mu) = 1;

  // Counts a call of `op` made through a handle of `gen`, and applies a
  // scheduled crash or error. OK means proceed; *injected is set to the
  // errno of an injected error (also returned as the Status).
  Status BeginLocked(EnvOp op, uint64_t gen, const std::string& what, int* injected = nullptr) REQUIRES(mu) {
    if (gen != generation) {
      return Status::IOError(what + ": device crashed (simulated power loss; " +
                             "open the directory again to see what survived)");
    }
    ++calls;
    const uint64_t n = ++per_op[static_cast<int>(op)];
    if (crash_at.has_value() && calls == *crash_at) {
      crash_at.reset();
      CrashLocked(crash_mode, crash_seed);
      return Status::IOError(what + ": device crashed (scheduled crash at call " +
                             std::to_string(calls) + ")");
    }
    for (auto it = rules.begin(); it != rules.end(); ++it) {
      const Rule r = *it;
      if (r.op != op || !(n == r.at_call || (r.persistent && n > r.at_call))) continue;
      if (!r.persistent) rules.erase(it);
      if (injected != nullptr) *injected = r.err;
      return Errno("fault-injected " + what, r.err);
    }
    return Status::OK();
  }

  void CrashLocked(CrashMode mode, uint64_t seed) REQUIRES(mu) {
    std::mt19937_64 rng(seed);
    std::vector<std::weak_ptr<DirNode>> live_dirs;
    for (auto& w : dirs) {
      std::shared_ptr<DirNode> d = w.lock();
      if (!d) continue;
      size_t keep = 0;
      if (mode == CrashMode::kTornUnsynced) keep = rng() % (d->pending.size() + 1);
      if (mode == CrashMode::kProcess) keep = d->pending.size();  // the kernel has them all
      for (size_t i = 0; i < keep; ++i) Apply(d->durable, d->pending[i]);
      d->pending.clear();
      d->visible = d->durable;
      if (mode != CrashMode::kProcess) d->removed = false;
      live_dirs.push_back(w);
    }
    dirs = std::move(live_dirs);
    std::vector<std::weak_ptr<FileNode>> live_files;
    for (auto& w : files) {
      std::shared_ptr<FileNode> f = w.lock();
      if (!f) continue;
      f->disk->Crash(mode, seed ^ (f->id * 0x9E3779B97F4A7C15ull));
      live_files.push_back(w);
    }
    files = std::move(live_files);
    locks.clear();
    ++generation;
    ++crashes;
  }

  // A change to `d`, visible now and pending until SyncDir.
  void AddOpLocked(DirNode& d, DirOp op) REQUIRES(mu) {
    Apply(d.visible, op);
    d.pending.push_back(std::move(op));
  }
  void SyncLocked(DirNode& d) REQUIRES(mu) {
    d.durable = d.visible;
    d.pending.clear();
  }

  std::shared_ptr<FileNode> NewFileLocked(MediumKind kind) REQUIRES(mu) {
    auto f = std::make_shared<FileNode>();
    f->id = next_id++;
    FaultDiskOptions o;
    o.alignment = opts.alignment;
    o.kind = kind == MediumKind::kAuto ? MediumKind::kBuffered : kind;
    o.forget_failed_syncs = true;
    o.unwritten_extents = true;
    f->disk = FaultDisk::Create(o);
    files.push_back(f);
    return f;
  }
  std::shared_ptr<DirNode> NewDirLocked() REQUIRES(mu) {
    auto d = std::make_shared<DirNode>();
    d->id = next_id++;
    dirs.push_back(d);
    return d;
  }
};

namespace {

using State = FaultEnv::State;

// A file's medium: counts each call, applies injected errors and crashes,
// refuses writes when opened read-only, then forwards to the file's FaultDisk.
class FaultEnvMedium final : public media::MediumWrapper {
 public:
  FaultEnvMedium(std::shared_ptr<State> st, std::shared_ptr<FileNode> node, uint64_t gen,
                 std::string path, bool read_only)
      : MediumWrapper(node->disk->Open()),
        st_(std::move(st)),
        node_(std::move(node)),
        gen_(gen),
        path_(std::move(path)),
        read_only_(read_only) {}

  Status Write(uint64_t offset, const void* buf, size_t n) override {
    const std::string what = "write " + path_ + " at " + std::to_string(offset) + " (+" +
                             std::to_string(n) + " bytes)";
    if (read_only_) return ReadOnly(what);
    NONSTOP_RETURN_IF_ERROR(Begin(EnvOp::kWrite, what));
    return MediumWrapper::Write(offset, buf, n).Annotate(path_);
  }
  Status Read(uint64_t offset, void* buf, size_t n) override {
    NONSTOP_RETURN_IF_ERROR(Begin(EnvOp::kRead, "read " + path_ + " at " +
                                                    std::to_string(offset) + " (+" +
                                                    std::to_string(n) + " bytes)"));
    return MediumWrapper::Read(offset, buf, n).Annotate(path_);
  }
  Status Sync() override {
    if (read_only_) return Status::OK();
    int err = 0;
    Status st = Begin(EnvOp::kSync, "fsync " + path_, &err);
    if (err != 0) {
      // Through the disk, so that its unsynced writes are forgotten as Linux
      // forgets them.
      node_->disk->InjectError(FaultOp::kSync, 1, err);
      return MediumWrapper::Sync().Annotate(path_);
    }
    NONSTOP_RETURN_IF_ERROR(st);
    return MediumWrapper::Sync().Annotate(path_);
  }
  Status Resize(uint64_t size) override {
    const std::string what = "resize " + path_ + " to " + std::to_string(size) + " bytes";
    if (read_only_) return ReadOnly(what);
    NONSTOP_RETURN_IF_ERROR(Begin(EnvOp::kResize, what));
    return MediumWrapper::Resize(size).Annotate(path_);
  }
  std::string Describe() const override {
    return "fault-injecting file (align " + std::to_string(Alignment()) +
           (read_only_ ? "; read-only)" : ")");
  }

 private:
  Status Begin(EnvOp op, const std::string& what, int* err = nullptr) {
    MutexLock lock(&st_->mu);
    return st_->BeginLocked(op, gen_, what, err);
  }
  static Status ReadOnly(const std::string& what) {
    return Status::FailedPrecondition(what + ": the medium was opened read-only");
  }

  const std::shared_ptr<State> st_;
  const std::shared_ptr<FileNode> node_;
  const uint64_t gen_;
  const std::string path_;
  const bool read_only_;
};

class FaultFileLock final : public FileLock {
 public:
  FaultFileLock(std::shared_ptr<State> st, uint64_t key, uint64_t token, uint64_t gen)
      : st_(std::move(st)), key_(key), token_(token), gen_(gen) {}
  ~FaultFileLock() override {
    MutexLock lock(&st_->mu);
    if (st_->generation != gen_) return;  // released by the crash
    auto it = st_->locks.find(key_);
    if (it != st_->locks.end() && it->second.token == token_) st_->locks.erase(it);
  }

 private:
  const std::shared_ptr<State> st_;
  const uint64_t key_;
  const uint64_t token_;
  const uint64_t gen_;
};

class FaultDirectory final : public Directory {
 public:
  FaultDirectory(std::shared_ptr<State> st, std::shared_ptr<DirNode> node, std::string path,
                 uint64_t gen)
      : st_(std::move(st)), node_(std::move(node)), path_(std::move(path)), gen_(gen) {}

  const std::string& path() const override { return path_; }

  Result<std::unique_ptr<Medium>> OpenFile(std::string_view name, MediumKind,
                                           const MediumOptions& opts) override {
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("open " + full));
    if (opts.create) {
      return Status::InvalidArgument("open " + full +
                                     ": OpenFile never creates; use Directory::CreateFile");
    }
    std::shared_ptr<FileNode> file;
    {
      MutexLock lock(&st_->mu);
      NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kOpenFile, gen_, "open " + full));
      auto it = node_->visible.find(std::string(name));
      if (it == node_->visible.end()) {
        return Status::NotFound("open " + full + ": no such file or directory");
      }
      if (it->second.type == EntryType::kSymlink) return SymlinkRefused("open " + full + ": " + full);
      if (it->second.type != EntryType::kFile) {
        return Status::FailedPrecondition("open " + full + ": not a regular file");
      }
      file = it->second.file;
    }
    return Wrap(std::move(file), full, opts.read_only);
  }

  Result<std::unique_ptr<Medium>> CreateFile(std::string_view name, MediumKind kind,
                                             const MediumOptions& opts) override {
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("create " + full));
    if (opts.read_only) {
      return Status::InvalidArgument("create " + full + ": a new file cannot be read-only");
    }
    std::shared_ptr<FileNode> file;
    {
      MutexLock lock(&st_->mu);
      NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kCreateFile, gen_, "create " + full));
      if (node_->removed) return Status::NotFound("create " + full + ": directory was removed");
      auto it = node_->visible.find(std::string(name));
      if (it != node_->visible.end()) {
        if (it->second.type == EntryType::kSymlink) {
          return SymlinkRefused("create " + full + ": " + full);
        }
        return Status::FailedPrecondition("create " + full + ": already exists");
      }
      file = st_->NewFileLocked(kind);
      Entry e;
      e.type = EntryType::kFile;
      e.file = file;
      st_->AddOpLocked(*node_, DirOp{{{std::string(name), e}}});
    }
    return Wrap(std::move(file), full, false);
  }

  Result<std::unique_ptr<Directory>> OpenDir(std::string_view name, bool create) override {
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("open directory " + full));
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kOpenDir, gen_, "open directory " + full));
    auto it = node_->visible.find(std::string(name));
    std::shared_ptr<DirNode> d;
    if (it == node_->visible.end()) {
      if (!create) return Status::NotFound("open directory " + full + ": no such file or directory");
      if (node_->removed) return Status::NotFound("mkdir " + full + ": directory was removed");
      // mkdirat, then SyncDir of this directory (as the POSIX Env does).
      d = st_->NewDirLocked();
      Entry e;
      e.type = EntryType::kDirectory;
      e.dir = d;
      st_->AddOpLocked(*node_, DirOp{{{std::string(name), e}}});
      st_->SyncLocked(*node_);
    } else if (it->second.type == EntryType::kSymlink) {
      return SymlinkRefused("open directory " + full + ": " + full);
    } else if (it->second.type != EntryType::kDirectory) {
      return Errno("open directory " + full, ENOTDIR);
    } else {
      d = it->second.dir;
    }
    return std::unique_ptr<Directory>(new FaultDirectory(st_, d, full, gen_));
  }

  Status Rename(std::string_view from_v, std::string_view to_v, Directory* to_dir) override {
    const std::string from(from_v);
    const std::string to(to_v);
    FaultDirectory* dst = this;
    if (to_dir != nullptr) {
      dst = dynamic_cast<FaultDirectory*>(to_dir);
      if (dst == nullptr || dst->st_ != st_) {
        return Status::InvalidArgument("rename " + Join(path_, from) +
                                       ": the target directory is not from the same Env");
      }
    }
    const std::string what = "rename " + Join(path_, from) + " to " + Join(dst->path_, to);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(from).Annotate(what));
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(to).Annotate(what));
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kRename, gen_, what));
    if (dst->gen_ != gen_) return Status::IOError(what + ": device crashed");
    auto src_it = node_->visible.find(from);
    if (src_it == node_->visible.end()) {
      return Status::NotFound(what + ": no such file or directory");
    }
    const Entry moving = src_it->second;
    if (moving.type == EntryType::kSymlink) return SymlinkRefused(what + ": " + Join(path_, from));
    auto dst_it = dst->node_->visible.find(to);
    if (dst_it != dst->node_->visible.end()) {
      const Entry& old = dst_it->second;
      if (old.type == EntryType::kSymlink) return SymlinkRefused(what + ": " + Join(dst->path_, to));
      if (moving.type == EntryType::kFile && old.type == EntryType::kDirectory) {
        return Errno(what, EISDIR);
      }
      if (moving.type == EntryType::kDirectory && old.type != EntryType::kDirectory) {
        return Errno(what, ENOTDIR);
      }
      if (old.type == EntryType::kDirectory && old.dir != moving.dir && !old.dir->visible.empty()) {
        return Errno(what, ENOTEMPTY);
      }
    }
    if (dst->node_->removed) return Status::NotFound(what + ": directory was removed");
    if (moving.type == EntryType::kDirectory && Contains(*moving.dir, *dst->node_)) {
      return Errno(what, EINVAL);  // into itself
    }
    if (dst->node_ == node_) {
      if (from == to) return Status::OK();
      st_->AddOpLocked(*node_, DirOp{{{from, std::nullopt}, {to, moving}}});
    } else {
      st_->AddOpLocked(*dst->node_, DirOp{{{to, moving}}});
      st_->AddOpLocked(*node_, DirOp{{{from, std::nullopt}}});
    }
    return Status::OK();
  }

  Status Unlink(std::string_view name) override {
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("remove " + full));
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kUnlink, gen_, "remove " + full));
    auto it = node_->visible.find(std::string(name));
    if (it == node_->visible.end()) return Status::NotFound("remove " + full + ": no such file or directory");
    if (it->second.type == EntryType::kDirectory) return Errno("remove " + full, EISDIR);
    st_->AddOpLocked(*node_, DirOp{{{std::string(name), std::nullopt}}});
    return Status::OK();
  }

  Status RemoveDir(std::string_view name) override {
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("remove directory " + full));
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kRemoveDir, gen_, "remove directory " + full));
    auto it = node_->visible.find(std::string(name));
    if (it == node_->visible.end()) {
      return Status::NotFound("remove directory " + full + ": no such file or directory");
    }
    if (it->second.type != EntryType::kDirectory) return Errno("remove directory " + full, ENOTDIR);
    if (!it->second.dir->visible.empty()) return Errno("remove directory " + full, ENOTEMPTY);
    it->second.dir->removed = true;
    st_->AddOpLocked(*node_, DirOp{{{std::string(name), std::nullopt}}});
    return Status::OK();
  }

  Status SyncDir() override {
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kSyncDir, gen_, "fsync directory " + path_));
    st_->SyncLocked(*node_);
    return Status::OK();
  }

  Result<std::vector<DirEntry>> List() override {
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kList, gen_, "list " + path_));
    std::vector<DirEntry> out;
    for (const auto& [name, e] : node_->visible) out.push_back({name, e.type});
    return out;  // std::map: sorted by name
  }

  Result<FileStat> Stat(std::string_view name) override {
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("stat " + full));
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kStat, gen_, "stat " + full));
    auto it = node_->visible.find(std::string(name));
    if (it == node_->visible.end()) return Status::NotFound("stat " + full + ": no such file or directory");
    FileStat fs;
    fs.type = it->second.type;
    if (it->second.type == EntryType::kFile) fs.size = it->second.file->disk->size();
    if (it->second.type == EntryType::kSymlink) fs.size = it->second.target.size();
    return fs;
  }

  Result<std::unique_ptr<FileLock>> Lock(std::string_view name,
                                         const std::string& holder) override {
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("lock " + full));
    MutexLock lock(&st_->mu);
    NONSTOP_RETURN_IF_ERROR(st_->BeginLocked(EnvOp::kLock, gen_, "lock " + full));
    auto it = node_->visible.find(std::string(name));
    std::shared_ptr<FileNode> file;
    if (it == node_->visible.end()) {
      if (node_->removed) return Status::NotFound("lock " + full + ": directory was removed");
      file = st_->NewFileLocked(MediumKind::kBuffered);
      Entry e;
      e.type = EntryType::kFile;
      e.file = file;
      st_->AddOpLocked(*node_, DirOp{{{std::string(name), e}}});
    } else if (it->second.type == EntryType::kSymlink) {
      return SymlinkRefused("lock " + full + ": " + full);
    } else if (it->second.type != EntryType::kFile) {
      return Status::FailedPrecondition("lock " + full + ": not a regular file");
    } else {
      file = it->second.file;
    }
    auto held = st_->locks.find(file->id);
    if (held != st_->locks.end()) {
      return Status::FailedPrecondition(full + " is locked by " + held->second.holder +
                                        ": another nonstop job writes to this directory");
    }
    std::string line = holder;
    line.erase(std::remove(line.begin(), line.end(), '\n'), line.end());
    // The holder line, written as the POSIX Env writes it (not synced).
    std::unique_ptr<Medium> m = file->disk->Open();
    const std::string text = line + "\n";
    Status w = m->Resize(0);
    if (w.ok()) w = m->Write(0, text.data(), text.size());
    if (!w.ok()) return w.Annotate("lock " + full);
    const uint64_t token = st_->next_token++;
    st_->locks[file->id] = {token, line};
    return std::unique_ptr<FileLock>(new FaultFileLock(st_, file->id, token, gen_));
  }

 private:
  // True when `target` is `d` or below it.
  static bool Contains(const DirNode& d, const DirNode& target) {
    if (&d == &target) return true;
    for (const auto& [name, e] : d.visible) {
      if (e.type == EntryType::kDirectory && Contains(*e.dir, target)) return true;
    }
    return false;
  }

  Result<std::unique_ptr<Medium>> Wrap(std::shared_ptr<FileNode> file, const std::string& full,
                                       bool read_only) {
    std::unique_ptr<Medium> m(new FaultEnvMedium(st_, std::move(file), gen_, full, read_only));
    return std::unique_ptr<Medium>(new media::StickySyncMedium(full, std::move(m)));
  }

  const std::shared_ptr<State> st_;
  const std::shared_ptr<DirNode> node_;
  const std::string path_;
  const uint64_t gen_;
};

// "a//b/" -> {"a", "b"}; "." components are skipped.
Result<std::vector<std::string>> SplitPath(const std::string& path) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    std::string c = path.substr(i, j - i);
    if (!c.empty() && c != ".") {
      NONSTOP_RETURN_IF_ERROR(CheckEntryName(c).Annotate("open directory " + path));
      parts.push_back(std::move(c));
    }
    i = j + 1;
  }
  return parts;
}

void DumpDir(const DirNode& d, const std::string& prefix, std::vector<std::string>& out) {
  for (const auto& [name, e] : d.visible) {
    const std::string p = prefix.empty() ? name : prefix + "/" + name;
    switch (e.type) {
      case EntryType::kFile:
        out.push_back("f " + p + " " + std::to_string(e.file->disk->size()));
        break;
      case EntryType::kDirectory:
        out.push_back("d " + p);
        DumpDir(*e.dir, p, out);
        break;
      case EntryType::kSymlink:
        out.push_back("l " + p + " -> " + e.target);
        break;
      case EntryType::kOther:
        out.push_back("? " + p);
        break;
    }
  }
}

}  // namespace

std::shared_ptr<FaultEnv> FaultEnv::Create(FaultEnvOptions opts) {
  if (opts.alignment == 0) opts.alignment = 1;
  return std::shared_ptr<FaultEnv>(new FaultEnv(opts));
}

FaultEnv::FaultEnv(FaultEnvOptions opts) : st_(std::make_shared<State>(opts)) {}
FaultEnv::~FaultEnv() = default;

Result<std::unique_ptr<Directory>> FaultEnv::OpenDirectory(const std::string& path,
                                                           bool create) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> parts, SplitPath(path));
  MutexLock lock(&st_->mu);
  NONSTOP_RETURN_IF_ERROR(
      st_->BeginLocked(EnvOp::kOpenDirectory, st_->generation, "open directory " + path));
  std::shared_ptr<DirNode> d = st_->root;
  std::string walked;
  for (const std::string& c : parts) {
    walked = walked.empty() ? c : walked + "/" + c;
    auto it = d->visible.find(c);
    if (it == d->visible.end()) {
      if (!create) {
        return Status::NotFound("open directory " + path + ": " + walked + " does not exist");
      }
      auto sub = st_->NewDirLocked();
      Entry e;
      e.type = EntryType::kDirectory;
      e.dir = sub;
      st_->AddOpLocked(*d, DirOp{{{c, e}}});
      st_->SyncLocked(*d);
      d = sub;
    } else if (it->second.type == EntryType::kSymlink) {
      return SymlinkRefused("open directory " + path + ": " + walked);
    } else if (it->second.type != EntryType::kDirectory) {
      return Errno("open directory " + path + ": " + walked, ENOTDIR);
    } else {
      d = it->second.dir;
    }
  }
  return std::unique_ptr<Directory>(
      new FaultDirectory(st_, d, path.empty() ? "/" : path, st_->generation));
}

void FaultEnv::Crash(CrashMode mode, uint64_t seed) {
  MutexLock lock(&st_->mu);
  st_->CrashLocked(mode, seed);
}

void FaultEnv::CrashOnCall(uint64_t nth_call, CrashMode mode, uint64_t seed) {
  MutexLock lock(&st_->mu);
  st_->crash_at = st_->calls + nth_call;
  st_->crash_mode = mode;
  st_->crash_seed = seed;
}

void FaultEnv::InjectError(EnvOp op, uint64_t nth_call, int err) {
  MutexLock lock(&st_->mu);
  st_->rules.push_back({op, st_->per_op[static_cast<int>(op)] + nth_call, false, err});
}

void FaultEnv::InjectErrorFrom(EnvOp op, uint64_t nth_call, int err) {
  MutexLock lock(&st_->mu);
  st_->rules.push_back({op, st_->per_op[static_cast<int>(op)] + nth_call, true, err});
}

void FaultEnv::ClearFaults() {
  MutexLock lock(&st_->mu);
  st_->rules.clear();
  st_->crash_at.reset();
}

uint64_t FaultEnv::calls() const {
  MutexLock lock(&st_->mu);
  return st_->calls;
}

uint64_t FaultEnv::calls(EnvOp op) const {
  MutexLock lock(&st_->mu);
  return st_->per_op[static_cast<int>(op)];
}

uint64_t FaultEnv::crashes() const {
  MutexLock lock(&st_->mu);
  return st_->crashes;
}

Status FaultEnv::PlantSymlink(const std::string& dir_path, const std::string& name,
                              const std::string& target) {
  NONSTOP_RETURN_IF_ERROR(CheckEntryName(name));
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> parts, SplitPath(dir_path));
  MutexLock lock(&st_->mu);
  std::shared_ptr<DirNode> d = st_->root;
  for (const std::string& c : parts) {
    auto it = d->visible.find(c);
    if (it == d->visible.end() || it->second.type != EntryType::kDirectory) {
      return Status::NotFound("plant symlink: no directory " + dir_path);
    }
    d = it->second.dir;
  }
  if (d->visible.count(name) != 0) {
    return Status::FailedPrecondition("plant symlink: " + Join(dir_path, name) + " exists");
  }
  Entry e;
  e.type = EntryType::kSymlink;
  e.target = target;
  // Durable at once, without making the directory's other pending changes so.
  d->visible[name] = e;
  d->durable[name] = e;
  return Status::OK();
}

std::string FaultEnv::Dump() const {
  MutexLock lock(&st_->mu);
  std::vector<std::string> lines;
  DumpDir(*st_->root, "", lines);
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

}  // namespace nonstop
