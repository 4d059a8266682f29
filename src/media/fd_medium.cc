// The buffered and O_DIRECT media, and the file helpers every backend uses.
#include "media/fd_medium.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <vector>
#include <utility>

namespace nonstop::media {

std::string FormatBytes(uint64_t n) {
  if (n >= (1ull << 30) && n % (1ull << 30) == 0) return std::to_string(n >> 30) + " GiB";
  if (n >= (1ull << 20) && n % (1ull << 20) == 0) return std::to_string(n >> 20) + " MiB";
  if (n >= (1ull << 10) && n % (1ull << 10) == 0) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " bytes";
}

Status SetDirect(int fd, const std::string& path, bool direct) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) return Status::FromErrno("fcntl F_GETFL " + path, errno);
  const int want = direct ? (flags | O_DIRECT) : (flags & ~O_DIRECT);
  if (want == flags) return Status::OK();
  if (::fcntl(fd, F_SETFL, want) == 0) return Status::OK();
  const int err = errno;
  if (direct && err == EINVAL) {
    // Before Linux 6.6 tmpfs refused O_DIRECT with EINVAL; so do some FUSE
    // and network file systems.
    return Status::Unavailable(path +
                               ": the file system refuses O_DIRECT (tmpfs?); use medium='buffered'");
  }
  return Status::FromErrno(std::string("fcntl F_SETFL ") + (direct ? "+" : "-") + "O_DIRECT " +
                               path,
                           err);
}

bool OnMemoryFileSystem(int fd) {
  struct statfs sf;
  if (::fstatfs(fd, &sf) != 0) return false;
  return sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC;
}

Result<uint64_t> FileSize(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return Status::FromErrno("fstat " + path, errno);
  if (S_ISBLK(st.st_mode)) {
    uint64_t bytes = 0;
    if (::ioctl(fd, BLKGETSIZE64, &bytes) != 0) {
      return Status::FromErrno("BLKGETSIZE64 " + path, errno);
    }
    return bytes;
  }
  return static_cast<uint64_t>(st.st_size);
}

static std::string RangeText(const std::string& path, uint64_t offset, size_t n) {
  return path + " at " + std::to_string(offset) + " (+" + std::to_string(n) + " bytes)";
}

Status WriteFull(int fd, const std::string& path, uint64_t offset, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t w = ::pwrite(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno("write " + RangeText(path, offset + done, n - done), errno);
    }
    if (w == 0) {
      // pwrite returning 0 for a non-empty buffer would loop forever; the
      // device is refusing space without saying so.
      return Status::IOError("write " + RangeText(path, offset + done, n - done) +
                             ": wrote 0 bytes (device full?)");
    }
    done += static_cast<size_t>(w);
  }
  return Status::OK();
}

Status ReadFull(int fd, const std::string& path, uint64_t offset, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno("read " + RangeText(path, offset + done, n - done), errno);
    }
    if (r == 0) {
      return Status::Corruption("read " + RangeText(path, offset, n) + ": file ends at " +
                                std::to_string(offset + done));
    }
    done += static_cast<size_t>(r);
  }
  return Status::OK();
}

Status ResizeFile(int fd, const std::string& path, uint64_t size) {
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return Status::FromErrno("ftruncate " + path + " to " + std::to_string(size), errno);
  }
  if (size == 0) return Status::OK();
  // fallocate(2) rather than posix_fallocate(3): where the file system lacks
  // fallocate, glibc's emulation writes a byte into every block through the
  // page cache, which is slow for multi-GB files and gains nothing here.
  int rc;
  do {
    rc = ::fallocate(fd, 0, 0, static_cast<off_t>(size));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
    int err = errno;
    Status st = Status::FromErrno(
        "fallocate " + path + " to " + std::to_string(size) + " bytes", err);
    if (err == ENOSPC) {
      return Status::IOError(st.message() + "; free space or use a smaller checkpoint dir");
    }
    return st;
  }
  return Status::OK();
}

// The logical block size of the block device holding a file, from sysfs
// (reading the device node itself would need permission to open it).
static size_t SysfsLogicalBlockSize(dev_t dev) {
  const std::string base = "/sys/dev/block/" + std::to_string(major(dev)) + ":" +
                           std::to_string(minor(dev));
  // A partition has no queue/ of its own; its parent disk's is one level up.
  for (const char* rel : {"/queue/logical_block_size", "/../queue/logical_block_size"}) {
    std::ifstream in(base + rel);
    size_t v = 0;
    if (in >> v && v > 0 && (v & (v - 1)) == 0) return v;
  }
  return 0;
}

size_t DirectAlignment(int fd, const std::string& path, std::string* source) {
#ifdef STATX_DIOALIGN
  struct statx stx = {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) && stx.stx_dio_offset_align > 0) {
    *source = "statx";
    return std::max<size_t>(stx.stx_dio_mem_align, stx.stx_dio_offset_align);
  }
#endif
  struct stat st;
  if (::fstat(fd, &st) == 0) {
    if (S_ISBLK(st.st_mode)) {
      int bs = 0;
      if (::ioctl(fd, BLKSSZGET, &bs) == 0 && bs > 0) {
        *source = "BLKSSZGET";
        return static_cast<size_t>(bs);
      }
    } else if (size_t bs = SysfsLogicalBlockSize(st.st_dev); bs > 0) {
      *source = "device block size";
      return bs;
    }
  }
  (void)path;
  *source = "default";
  return 4096;
}

Status CheckAligned(const char* op, const std::string& path, uint64_t offset, const void* buf,
                    size_t n, size_t align) {
  if (align <= 1) return Status::OK();
  const uint64_t a = align;
  if (offset % a == 0 && n % a == 0 && reinterpret_cast<uintptr_t>(buf) % a == 0) {
    return Status::OK();
  }
  return Status::InvalidArgument(std::string(op) + " " + RangeText(path, offset, n) +
                                 ": offset, length and buffer address must be multiples of " +
                                 std::to_string(align) +
                                 " for O_DIRECT (use an aligned staging buffer)");
}

Status CheckReadRange(const std::string& path, uint64_t offset, size_t n, uint64_t size) {
  if (offset <= size && n <= size - offset) return Status::OK();
  return Status::Corruption("read " + RangeText(path, offset, n) + ": past the end (size " +
                            std::to_string(size) + ")");
}

void DirtyRange::Add(uint64_t offset, uint64_t n) {
  if (n == 0) return;
  MutexLock lock(&mu_);
  begin_ = std::min(begin_, offset);
  end_ = std::max(end_, offset + n);
}

bool DirtyRange::Take(uint64_t* begin, uint64_t* end) {
  MutexLock lock(&mu_);
  if (begin_ >= end_) return false;
  *begin = begin_;
  *end = end_;
  begin_ = UINT64_MAX;
  end_ = 0;
  return true;
}

FdMedium::FdMedium(MediumKind kind, std::string path, FdFile file)
    : kind_(kind),
      path_(std::move(path)),
      fd_(file.fd),
      alignment_(file.alignment),
      alignment_source_(std::move(file.alignment_source)),
      in_memory_(OnMemoryFileSystem(file.fd)),
      size_(file.size) {}

FdMedium::~FdMedium() { ::close(fd_); }

Status FdMedium::Write(uint64_t offset, const void* buf, size_t n) {
  NONSTOP_RETURN_IF_ERROR(CheckAligned("write", path_, offset, buf, n, alignment_));
  NONSTOP_RETURN_IF_ERROR(WriteFull(fd_, path_, offset, buf, n));
  RaiseTo(size_, offset + n);
  return Status::OK();
}

Status FdMedium::Read(uint64_t offset, void* buf, size_t n) {
  NONSTOP_RETURN_IF_ERROR(CheckAligned("read", path_, offset, buf, n, alignment_));
  NONSTOP_RETURN_IF_ERROR(CheckReadRange(path_, offset, n, Size()));
  return ReadFull(fd_, path_, offset, buf, n);
}

namespace {

class FdMapping final : public ReadMapping {
 public:
  FdMapping(void* base, size_t len, size_t skip, size_t n) : base_(base), len_(len), skip_(skip), n_(n) {}
  ~FdMapping() override { ::munmap(base_, len_); }
  const char* data() const override { return static_cast<const char*>(base_) + skip_; }
  size_t size() const override { return n_; }

 private:
  void* base_;
  size_t len_, skip_, n_;
};

}  // namespace

Result<std::unique_ptr<ReadMapping>> FdMedium::MapForRead(uint64_t offset, uint64_t n) {
  NONSTOP_RETURN_IF_ERROR(CheckReadRange(path_, offset, n, Size()));
  if (n == 0) return Status::InvalidArgument("map of no bytes of " + path_);
  const long page_l = ::sysconf(_SC_PAGESIZE);
  const uint64_t page = page_l > 0 ? static_cast<uint64_t>(page_l) : 4096;
  const uint64_t begin = offset / page * page;
  const size_t len = static_cast<size_t>(offset + n - begin);
  void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED | MAP_POPULATE, fd_, static_cast<off_t>(begin));
  if (p == MAP_FAILED) return Status::FromErrno("mmap " + path_, errno);
  return std::unique_ptr<ReadMapping>(
      new FdMapping(p, len, static_cast<size_t>(offset - begin), static_cast<size_t>(n)));
}

Result<uint64_t> FdMedium::CachedBytes(uint64_t offset, uint64_t n) {
  if (n == 0) return uint64_t{0};
  const long page_l = ::sysconf(_SC_PAGESIZE);
  const uint64_t page = page_l > 0 ? static_cast<uint64_t>(page_l) : 4096;
  const uint64_t size = Size();
  if (offset >= size) return uint64_t{0};
  const uint64_t end = std::min(size, offset + n);
  const uint64_t begin = offset / page * page;
  const size_t len = static_cast<size_t>(end - begin);
  // A mapping only to ask; nothing is faulted in (mincore reads page tables
  // and the page cache, never the file).
  void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd_, static_cast<off_t>(begin));
  if (p == MAP_FAILED) return Status::FromErrno("mmap (to ask what is cached) " + path_, errno);
  std::vector<unsigned char> vec((len + page - 1) / page);
  const int rc = ::mincore(p, len, vec.data());
  const int err = errno;
  ::munmap(p, len);
  if (rc != 0) return Status::FromErrno("mincore " + path_, err);
  uint64_t pages = 0;
  for (unsigned char v : vec) pages += v & 1;
  return std::min<uint64_t>(n, pages * page);
}

Status FdMedium::Sync() {
  if (::fdatasync(fd_) != 0) return Status::FromErrno("fdatasync " + path_, errno);
  return Status::OK();
}

Status FdMedium::Resize(uint64_t size) {
  NONSTOP_RETURN_IF_ERROR(ResizeFile(fd_, path_, size));
  size_.store(size, std::memory_order_relaxed);
  return Status::OK();
}

std::string FdMedium::Name() const {
  return kind_ == MediumKind::kBuffered ? "buffered pwrite+fdatasync" : "O_DIRECT pwrite";
}

std::vector<std::string> FdMedium::Details() const {
  if (alignment_ <= 1) return {};
  return {"align " + std::to_string(alignment_) + " from " + alignment_source_};
}

Result<FdFile> PrepareFdFile(int fd, const std::string& path, bool direct) {
  NONSTOP_RETURN_IF_ERROR(SetDirect(fd, path, direct));
  FdFile f;
  f.fd = fd;
  NONSTOP_ASSIGN_OR_RETURN(f.size, FileSize(fd, path));
  if (direct) f.alignment = DirectAlignment(fd, path, &f.alignment_source);
  return f;
}

Result<std::unique_ptr<MediumBase>> OpenBufferedMedium(int fd, const std::string& path,
                                                       const MediumOptions&) {
  NONSTOP_ASSIGN_OR_RETURN(FdFile f, PrepareFdFile(fd, path, /*direct=*/false));
  return std::unique_ptr<MediumBase>(new FdMedium(MediumKind::kBuffered, path, std::move(f)));
}

Result<std::unique_ptr<MediumBase>> OpenDirectMedium(int fd, const std::string& path,
                                                     const MediumOptions&) {
  NONSTOP_ASSIGN_OR_RETURN(FdFile f, PrepareFdFile(fd, path, /*direct=*/true));
  return std::unique_ptr<MediumBase>(new FdMedium(MediumKind::kDirect, path, std::move(f)));
}

}  // namespace nonstop::media
