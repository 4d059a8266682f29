// The POSIX Env: every operation relative to an open directory fd, never
// following a symlink at a name nonstop uses (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW).
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "media/media_internal.h"
#include "env/write_folder.h"
#include "nonstop/env.h"

namespace nonstop {
namespace {

constexpr int kDirFlags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;

// "DIR/NAME" for messages ("NAME" for the working directory).
std::string Join(const std::string& dir, std::string_view name) {
  if (dir == ".") return std::string(name);
  if (!dir.empty() && dir.back() == '/') return dir + std::string(name);
  return dir + "/" + std::string(name);
}

EntryType TypeOfMode(mode_t m) {
  if (S_ISREG(m)) return EntryType::kFile;
  if (S_ISDIR(m)) return EntryType::kDirectory;
  if (S_ISLNK(m)) return EntryType::kSymlink;
  return EntryType::kOther;
}

Status SymlinkRefused(const std::string& what) {
  return Status::FailedPrecondition(
      what + " is a symlink: nonstop never follows links in a checkpoint directory "
             "(remove it if you did not put it there)");
}

int RetryOpenAt(int dfd, const char* name, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::openat(dfd, name, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// fstatat without following; -1 with errno on failure.
int LStatAt(int dfd, const std::string& name, struct stat* st) {
  return ::fstatat(dfd, name.c_str(), st, AT_SYMLINK_NOFOLLOW);
}

bool IsSymlinkAt(int dfd, const std::string& name) {
  struct stat st;
  return LStatAt(dfd, name, &st) == 0 && S_ISLNK(st.st_mode);
}

class PosixFileLock final : public FileLock {
 public:
  explicit PosixFileLock(int fd) : fd_(fd) {}
  ~PosixFileLock() override { ::close(fd_); }  // releases the flock
  PosixFileLock(const PosixFileLock&) = delete;
  PosixFileLock& operator=(const PosixFileLock&) = delete;

 private:
  const int fd_;
};

class PosixDirectory final : public Directory {
 public:
  PosixDirectory(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixDirectory() override { ::close(fd_); }
  PosixDirectory(const PosixDirectory&) = delete;
  PosixDirectory& operator=(const PosixDirectory&) = delete;

  const std::string& path() const override { return path_; }

  Result<std::unique_ptr<Medium>> OpenFile(std::string_view name_v, MediumKind kind,
                                           const MediumOptions& opts) override {
    const std::string name(name_v);
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("open " + full));
    if (opts.create) {
      return Status::InvalidArgument("open " + full +
                                     ": OpenFile never creates; use Directory::CreateFile");
    }
    // The type first, so that a FIFO or device is never opened (that could
    // block); then again on the fd, in case the entry changed in between.
    struct stat st;
    if (LStatAt(fd_, name, &st) != 0) return StatError("open " + full, errno);
    NONSTOP_RETURN_IF_ERROR(CheckOpenable(full, st.st_mode));
    const int fd = RetryOpenAt(fd_, name.c_str(),
                               (opts.read_only ? O_RDONLY : O_RDWR) | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return OpenError("open " + full, name, errno);
    if (::fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || S_ISBLK(st.st_mode))) {
      ::close(fd);
      return Status::FailedPrecondition("open " + full + ": not a regular file");
    }
    return media::OpenMediumOnFd(fd, full, kind, opts);
  }

  Result<std::unique_ptr<Medium>> CreateFile(std::string_view name_v, MediumKind kind,
                                             const MediumOptions& opts) override {
    const std::string name(name_v);
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("create " + full));
    if (opts.read_only) {
      return Status::InvalidArgument("create " + full + ": a new file cannot be read-only");
    }
    const int fd =
        RetryOpenAt(fd_, name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
      const int err = errno;
      if (err == EEXIST) {
        if (IsSymlinkAt(fd_, name)) return SymlinkRefused("create " + full + ": " + full);
        return Status::FailedPrecondition("create " + full + ": already exists");
      }
      return OpenError("create " + full, name, err);
    }
    MediumOptions o = opts;
    o.create = false;
    return media::OpenMediumOnFd(fd, full, kind, o);
  }

  Result<std::unique_ptr<Directory>> OpenDir(std::string_view name_v, bool create) override {
    const std::string name(name_v);
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("open directory " + full));
    if (create) {
      if (::mkdirat(fd_, name.c_str(), 0755) == 0) {
        NONSTOP_RETURN_IF_ERROR(SyncDir());
      } else if (errno != EEXIST) {
        return Status::FromErrno("mkdir " + full, errno);
      }
    }
    const int fd = RetryOpenAt(fd_, name.c_str(), kDirFlags);
    if (fd < 0) return OpenError("open directory " + full, name, errno);
    return std::unique_ptr<Directory>(new PosixDirectory(fd, full));
  }

  Status Rename(std::string_view from_v, std::string_view to_v, Directory* to_dir) override {
    const std::string from(from_v);
    const std::string to(to_v);
    PosixDirectory* dst = this;
    if (to_dir != nullptr) {
      dst = dynamic_cast<PosixDirectory*>(to_dir);
      if (dst == nullptr) {
        return Status::InvalidArgument("rename " + Join(path_, from) +
                                       ": the target directory is not from the same Env");
      }
    }
    const std::string what = "rename " + Join(path_, from) + " to " + Join(dst->path_, to);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(from).Annotate(what));
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(to).Annotate(what));
    // rename(2) never follows a link, but a link where nonstop expects its
    // own file means someone else is in the directory: refuse, touch nothing.
    struct stat st;
    if (LStatAt(fd_, from, &st) != 0) return StatError(what, errno);
    if (S_ISLNK(st.st_mode)) return SymlinkRefused(what + ": " + Join(path_, from));
    if (LStatAt(dst->fd_, to, &st) == 0 && S_ISLNK(st.st_mode)) {
      return SymlinkRefused(what + ": " + Join(dst->path_, to));
    }
    if (::renameat(fd_, from.c_str(), dst->fd_, to.c_str()) != 0) {
      return StatError(what, errno);
    }
    return Status::OK();
  }

  Status Unlink(std::string_view name_v) override {
    const std::string name(name_v);
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("remove " + full));
    if (::unlinkat(fd_, name.c_str(), 0) != 0) return StatError("remove " + full, errno);
    return Status::OK();
  }

  Status RemoveDir(std::string_view name_v) override {
    const std::string name(name_v);
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("remove directory " + full));
    if (::unlinkat(fd_, name.c_str(), AT_REMOVEDIR) != 0) {
      return StatError("remove directory " + full, errno);
    }
    return Status::OK();
  }

  Status SyncDir() override {
    if (::fsync(fd_) != 0) return Status::FromErrno("fsync directory " + path_, errno);
    return Status::OK();
  }

  Result<std::vector<DirEntry>> List() override {
    // fdopendir takes the fd over; give it a fresh one on the same directory.
    const int fd = RetryOpenAt(fd_, ".", kDirFlags);
    if (fd < 0) return Status::FromErrno("list " + path_, errno);
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      const int err = errno;
      ::close(fd);
      return Status::FromErrno("list " + path_, err);
    }
    std::vector<DirEntry> out;
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      DirEntry de;
      de.name = name;
      switch (e->d_type) {
        case DT_REG:
          de.type = EntryType::kFile;
          break;
        case DT_DIR:
          de.type = EntryType::kDirectory;
          break;
        case DT_LNK:
          de.type = EntryType::kSymlink;
          break;
        case DT_UNKNOWN: {
          struct stat st;
          de.type = LStatAt(fd_, name, &st) == 0 ? TypeOfMode(st.st_mode) : EntryType::kOther;
          break;
        }
        default:
          de.type = EntryType::kOther;
      }
      out.push_back(std::move(de));
      errno = 0;
    }
    const int err = errno;
    ::closedir(d);
    if (err != 0) return Status::FromErrno("list " + path_, err);
    std::sort(out.begin(), out.end(),
              [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
    return out;
  }

  Result<FileStat> Stat(std::string_view name_v) override {
    const std::string name(name_v);
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("stat " + full));
    struct stat st;
    if (LStatAt(fd_, name, &st) != 0) return StatError("stat " + full, errno);
    FileStat fs;
    fs.type = TypeOfMode(st.st_mode);
    fs.size = static_cast<uint64_t>(st.st_size);
    fs.mtime_unix_ns = static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull +
                       static_cast<uint64_t>(st.st_mtim.tv_nsec);
    return fs;
  }

  Result<uint64_t> FreeBytes() override {
    struct statvfs sv;
    if (::fstatvfs(fd_, &sv) != 0) return Status::FromErrno("statvfs " + path_, errno);
    return static_cast<uint64_t>(sv.f_bavail) * static_cast<uint64_t>(sv.f_frsize);
  }

  Result<std::unique_ptr<FileLock>> Lock(std::string_view name_v,
                                         const std::string& holder) override {
    const std::string name(name_v);
    const std::string full = Join(path_, name);
    NONSTOP_RETURN_IF_ERROR(CheckEntryName(name).Annotate("lock " + full));
    const int fd = RetryOpenAt(fd_, name.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return OpenError("lock " + full, name, errno);
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status::FailedPrecondition("lock " + full + ": not a regular file");
    }
    int rc;
    do {
      rc = ::flock(fd, LOCK_EX | LOCK_NB);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK) {
        std::string line = ReadHolderLine(fd);
        ::close(fd);
        return Status::FailedPrecondition(
            full + " is locked by " + (line.empty() ? std::string(kNoHolderLine) : line) +
            ": another nonstop job writes to this directory");
      }
      ::close(fd);
      return Status::FromErrno("flock " + full, err);
    }
    // Ours: replace the previous holder's line with ours.
    std::string line = holder;
    line.erase(std::remove(line.begin(), line.end(), '\n'), line.end());
    line += "\n";
    Status st_w = ::ftruncate(fd, 0) == 0 ? Status::OK() : Status::FromErrno("truncate " + full, errno);
    if (st_w.ok()) st_w = media::WriteFull(fd, full, 0, line.data(), line.size());
    if (!st_w.ok()) {
      ::close(fd);
      return st_w.Annotate("lock");
    }
    return std::unique_ptr<FileLock>(new PosixFileLock(fd));
  }

 private:
  static std::string ReadHolderLine(int fd) {
    char buf[512];
    ssize_t n;
    do {
      n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return "";
    std::string s(buf, static_cast<size_t>(n));
    const size_t nl = s.find('\n');
    if (nl != std::string::npos) s.resize(nl);
    // The line goes into a one-line message: no control characters.
    for (char& c : s) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    }
    return s;
  }

  Status CheckOpenable(const std::string& full, mode_t mode) const {
    if (S_ISLNK(mode)) return SymlinkRefused("open " + full + ": " + full);
    if (S_ISREG(mode) || S_ISBLK(mode)) return Status::OK();
    return Status::FailedPrecondition("open " + full + ": not a regular file");
  }

  // A failed openat: ELOOP/ENOTDIR at a symlink is the symlink refusal.
  Status OpenError(const std::string& what, const std::string& name, int err) const {
    if ((err == ELOOP || err == ENOTDIR || err == EEXIST) && IsSymlinkAt(fd_, name)) {
      return SymlinkRefused(what + ": " + Join(path_, name));
    }
    return StatError(what, err);
  }

  static Status StatError(const std::string& what, int err) {
    if (err == ENOENT) return Status::NotFound(what + ": no such file or directory");
    return Status::FromErrno(what, err);
  }

  const int fd_;
  const std::string path_;
};

class PosixEnv final : public Env {
 private:
  // Opens `parent` following links (a home directory on another mount may be
  // one); with create, makes each missing component and fsyncs the directory
  // that holds it, so a new job directory cannot vanish in a crash.
  static Result<int> OpenParent(const std::string& parent, bool create) {
    int fd = RetryOpenAt(AT_FDCWD, parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) return fd;
    int err = errno;
    if (err != ENOENT || !create) {
      if (err == ENOENT) return Status::NotFound("open directory " + parent + ": does not exist");
      return Status::FromErrno("open directory " + parent, err);
    }
    fd = RetryOpenAt(AT_FDCWD, parent[0] == '/' ? "/" : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Status::FromErrno("open directory " + parent, errno);
    size_t i = 0;
    while (i < parent.size()) {
      size_t j = parent.find('/', i);
      if (j == std::string::npos) j = parent.size();
      const std::string c = parent.substr(i, j - i);
      i = j + 1;
      if (c.empty() || c == ".") continue;
      if (::mkdirat(fd, c.c_str(), 0755) == 0) {
        if (::fsync(fd) != 0) {
          err = errno;
          ::close(fd);
          return Status::FromErrno("fsync directory holding " + c + " of " + parent, err);
        }
      } else if (errno != EEXIST) {
        err = errno;
        ::close(fd);
        return Status::FromErrno("mkdir " + c + " in " + parent, err);
      }
      const int next = RetryOpenAt(fd, c.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      err = errno;
      ::close(fd);
      if (next < 0) return Status::FromErrno("open directory " + c + " of " + parent, err);
      fd = next;
    }
    return fd;
  }

 public:
  Result<std::unique_ptr<Directory>> OpenDirectory(const std::string& path_in,
                                                    bool create) override {
    if (path_in.empty()) return Status::InvalidArgument("open directory: empty path");
    std::string path = path_in;
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    if (path == "/" || path == ".") {
      const int fd = RetryOpenAt(AT_FDCWD, path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (fd < 0) return Status::FromErrno("open directory " + path, errno);
      return std::unique_ptr<Directory>(new PosixDirectory(fd, path));
    }
    // The parent may be reached through links (a home directory on another
    // mount); the last component, nonstop's own directory, may not be one.
    const size_t slash = path.find_last_of('/');
    const std::string parent =
        slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
    const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
    if (Status st = CheckEntryName(name); !st.ok()) {
      return Status::InvalidArgument("open directory " + path + ": " + st.message());
    }
    NONSTOP_ASSIGN_OR_RETURN(const int pfd, OpenParent(parent, create));
    PosixDirectory p(pfd, parent);
    return p.OpenDir(name, create);
  }
};

}  // namespace

Env* DefaultEnv() {
  static Env* env = new PosixEnv();
  return env;
}

Status CheckEntryName(std::string_view name) {
  auto bad = [&](const char* why) {
    std::string shown;
    for (char c : name.substr(0, 64)) {
      shown += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
    }
    return Status::InvalidArgument("bad file name '" + shown + "': " + why);
  };
  if (name.empty()) return bad("empty");
  if (name.size() > 255) return bad("longer than 255 bytes");
  if (name == "." || name == "..") return bad("'.' and '..' are not names");
  if (name.find('/') != std::string_view::npos) return bad("contains '/'");
  if (name.find('\0') != std::string_view::npos) return bad("contains a NUL byte");
  return Status::OK();
}

Status WriteFileAtomic(Directory& dir, std::string_view name, std::string_view content) {
  const std::string tmp = std::string(name) + ".tmp";
  NONSTOP_RETURN_IF_ERROR(CheckEntryName(name));
  NONSTOP_RETURN_IF_ERROR(CheckEntryName(tmp));
  if (Status st = dir.Unlink(tmp); !st.ok() && st.code() != StatusCode::kNotFound) return st;
  {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m,
                             dir.CreateFile(tmp, MediumKind::kBuffered, MediumOptions{}));
    Status st = m->Write(0, content.data(), content.size());
    if (st.ok()) st = m->Sync();
    if (!st.ok()) {
      m.reset();
      (void)dir.Unlink(tmp);
      return st;
    }
  }
  if (Status st = dir.Rename(tmp, name); !st.ok()) {
    (void)dir.Unlink(tmp);
    return st;
  }
  return dir.SyncDir();
}

Status RemoveTree(Directory& dir, std::string_view name, int max_depth) {
  NONSTOP_ASSIGN_OR_RETURN(const FileStat st, dir.Stat(name));
  // A file, a symlink (the link itself, never what it names) or anything else.
  if (st.type != EntryType::kDirectory) return dir.Unlink(name);
  if (max_depth <= 0) {
    return Status::FailedPrecondition("remove " + Join(dir.path(), name) +
                                      ": deeper than nonstop ever nests; removed nothing below");
  }
  {
    // O_NOFOLLOW: a directory swapped for a link after the Stat is refused.
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> sub, dir.OpenDir(name, false));
    NONSTOP_ASSIGN_OR_RETURN(const std::vector<DirEntry> entries, sub->List());
    for (const DirEntry& e : entries) {
      Status s = RemoveTree(*sub, e.name, max_depth - 1);
      if (!s.ok() && s.code() != StatusCode::kNotFound) return s;
    }
  }
  return dir.RemoveDir(name);
}

Status WriteFolder(Directory& dir, std::string_view name,
                   const std::vector<std::pair<std::string, std::string>>& files) {
  const std::string tmp = std::string(name) + ".tmp";
  NONSTOP_RETURN_IF_ERROR(CheckEntryName(name));
  NONSTOP_RETURN_IF_ERROR(CheckEntryName(tmp));
  if (Status s = RemoveTree(dir, tmp); !s.ok() && s.code() != StatusCode::kNotFound) return s;
  {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> sub, dir.OpenDir(tmp, true));
    for (const auto& [file, content] : files) {
      NONSTOP_RETURN_IF_ERROR(WriteFileAtomic(*sub, file, content));
    }
  }
  if (Status s = RemoveTree(dir, name); !s.ok() && s.code() != StatusCode::kNotFound) return s;
  NONSTOP_RETURN_IF_ERROR(dir.Rename(tmp, name));
  return dir.SyncDir();
}

Result<std::string> ReadSmallFile(Directory& dir, std::string_view name, uint64_t max_bytes) {
  MediumOptions ro;
  ro.read_only = true;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m,
                           dir.OpenFile(name, MediumKind::kBuffered, ro));
  const uint64_t size = m->Size();
  if (size > max_bytes) {
    return Status::Corruption(Join(dir.path(), name) + " is " +
                              std::to_string(size) + " bytes, more than the " +
                              std::to_string(max_bytes) + " it may have");
  }
  std::string out(static_cast<size_t>(size), '\0');
  if (size > 0) NONSTOP_RETURN_IF_ERROR(m->Read(0, out.data(), out.size()));
  return out;
}

}  // namespace nonstop
