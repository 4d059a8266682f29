// The io_uring medium: O_DIRECT writes and reads split into 1 MiB pieces with
// up to 16 pieces in flight per calling thread.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "media/fd_medium.h"

#ifdef NONSTOP_HAVE_URING
#include <liburing.h>
#endif

namespace nonstop::media {

#ifndef NONSTOP_HAVE_URING

Result<std::unique_ptr<MediumBase>> OpenUringMedium(int, const std::string&,
                                                    const MediumOptions&) {
  return Status::Unavailable(
      "io_uring not built in (liburing was missing at build time); use medium='direct'");
}

#else  // NONSTOP_HAVE_URING

namespace {

constexpr unsigned kQueueDepth = 16;              // pieces in flight per thread
constexpr unsigned kRingEntries = 2 * kQueueDepth;  // so io_uring_get_sqe never runs dry
constexpr size_t kPieceBytes = size_t{1} << 20;

// One ring per calling thread, shared by every UringMedium that thread uses.
//
// Why not a ring per medium guarded by a mutex: the writer pool calls Write on
// one medium from p threads at once, and a shared ring would serialize their
// submissions and completions (or need a completion dispatcher thread). A
// small pool of rings with a mutex each still contends when threads outnumber
// rings. With a ring per thread no lock is taken on the I/O path, each Write
// waits only for its own completions, and because a ring is not tied to a
// file (we pass the fd in each SQE and register none), one thread's ring
// serves any number of media, so a medium's lifetime never has to be tracked
// by rings. The cost is one ring (a few pages of shared memory and one fd) per
// thread that ever writes, which is bounded by the long-lived writer pool.
// Every Transfer reaps all of its completions before it returns, so a ring
// never holds requests that point into a caller's buffer between calls.
class ThreadRing {
 public:
  ThreadRing() = default;
  ~ThreadRing() {
    if (ready_) io_uring_queue_exit(&ring_);
  }
  ThreadRing(const ThreadRing&) = delete;
  ThreadRing& operator=(const ThreadRing&) = delete;

  // 0 or a positive errno.
  int Init() {
    int rc = io_uring_queue_init(kRingEntries, &ring_, 0);
    if (rc < 0) return -rc;
    ready_ = true;
    return 0;
  }
  io_uring* ring() { return &ring_; }

 private:
  io_uring ring_{};
  bool ready_ = false;
};

thread_local std::unique_ptr<ThreadRing> tl_ring;

// The calling thread's ring, created on first use; null with *err set when
// the kernel refuses io_uring (disabled by sysctl or a seccomp filter).
ThreadRing* AcquireRing(int* err) {
  if (!tl_ring) {
    auto r = std::make_unique<ThreadRing>();
    if (int e = r->Init(); e != 0) {
      *err = e;
      return nullptr;
    }
    tl_ring = std::move(r);
  }
  return tl_ring.get();
}

// A queue of O_DIRECT reads in flight together (Medium::OpenReadQueue), on a
// ring of its own: one thread uses it at a time, and it reaps its own
// completions only. Every read is submitted as soon as it is queued; a short
// transfer is resubmitted for the rest inside Next, so a read comes back
// whole or failed.
class UringReadQueue final : public ReadQueue {
 public:
  UringReadQueue(Medium& m, std::string path, int fd, size_t alignment, unsigned depth)
      : m_(m), path_(std::move(path)), fd_(fd), alignment_(alignment), depth_(depth),
        slots_(depth) {
    for (unsigned i = depth; i > 0; --i) free_.push_back(i - 1);
  }
  ~UringReadQueue() override {
    if (!ready_) return;
    // The reads in flight write into the caller's buffers: wait for each.
    while (outstanding_ > 0) {
      io_uring_cqe* cqe = nullptr;
      const int w = io_uring_wait_cqe(&ring_, &cqe);
      if (w == -EINTR) continue;
      if (w < 0) break;
      const uint64_t slot = io_uring_cqe_get_data64(cqe);
      io_uring_cqe_seen(&ring_, cqe);
      if (slot != kNop) --outstanding_;
    }
    io_uring_queue_exit(&ring_);
  }
  UringReadQueue(const UringReadQueue&) = delete;
  UringReadQueue& operator=(const UringReadQueue&) = delete;

  // 0 or a positive errno.
  int Init() {
    const int rc = io_uring_queue_init(std::max(2u, depth_), &ring_, 0);
    if (rc < 0) return -rc;
    ready_ = true;
    return 0;
  }

  Status Submit(uint64_t offset, void* buf, size_t n, uint64_t tag) override {
    if (free_.empty()) {
      return Status::FailedPrecondition("io_uring read queue of " + path_ + " is full (" +
                                        std::to_string(depth_) + ")");
    }
    NONSTOP_RETURN_IF_ERROR(CheckAligned("read", path_, offset, buf, n, alignment_));
    NONSTOP_RETURN_IF_ERROR(CheckReadRange(path_, offset, n, m_.Size()));
    if (n > kMaxRead) {
      return Status::InvalidArgument("io_uring read of " + path_ + ": " + std::to_string(n) +
                                     " bytes in one read (at most " + std::to_string(kMaxRead) +
                                     ")");
    }
    const unsigned slot = free_.back();
    slots_[slot] = Slot{offset, static_cast<char*>(buf), n, tag};
    NONSTOP_RETURN_IF_ERROR(Start(slot));
    free_.pop_back();
    ++outstanding_;
    return Status::OK();
  }

  Result<ReadDone> Next() override {
    if (outstanding_ == 0) return Status::FailedPrecondition("no read is outstanding");
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      const int w = io_uring_wait_cqe(&ring_, &cqe);
      if (w == -EINTR) continue;
      if (w < 0) return Status::FromErrno("io_uring wait for a read of " + path_, -w);
      const uint64_t data = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data == kNop) continue;
      const unsigned slot = static_cast<unsigned>(data);
      Slot& s = slots_[slot];
      Status st;
      if (res == -EINTR || res == -EAGAIN) {
        st = Start(slot);
        if (st.ok()) continue;
      } else if (res < 0) {
        st = Status::FromErrno("io_uring read " + path_ + " at " + std::to_string(s.offset) +
                                   " (+" + std::to_string(s.len) + " bytes)",
                               -res);
      } else if (res == 0) {
        st = Status::Corruption("io_uring read " + path_ + " at " + std::to_string(s.offset) +
                                ": end of file");
      } else if (static_cast<size_t>(res) < s.len) {
        // A short read: continue where it stopped.
        s.offset += static_cast<uint64_t>(res);
        s.p += res;
        s.len -= static_cast<size_t>(res);
        st = Start(slot);
        if (st.ok()) continue;
      }
      free_.push_back(slot);
      --outstanding_;
      return ReadDone{s.tag, std::move(st)};
    }
  }

  unsigned depth() const override { return depth_; }
  unsigned outstanding() const override { return outstanding_; }

 private:
  static constexpr uint64_t kNop = UINT64_MAX;
  static constexpr size_t kMaxRead = size_t{1} << 30;  // a read's length is 32 bits in the SQE
  struct Slot {
    uint64_t offset = 0;
    char* p = nullptr;
    size_t len = 0;
    uint64_t tag = 0;
  };

  // Queues and submits the (rest of the) read of `slot`. If the kernel
  // refuses the submission, the entry is turned into a no-op, so that it can
  // never reach the kernel later pointing at the caller's buffer.
  Status Start(unsigned slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // never null: entries >= depth, each submitted
    if (sqe == nullptr) return Status::Internal("io_uring read queue of " + path_ + " has no entry");
    const Slot& s = slots_[slot];
    io_uring_prep_read(sqe, fd_, s.p, static_cast<unsigned>(s.len), s.offset);
    io_uring_sqe_set_data64(sqe, slot);
    for (;;) {
      const int rc = io_uring_submit(&ring_);
      if (rc >= 1) return Status::OK();
      if (rc == -EINTR) continue;
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kNop);
      return Status::FromErrno("io_uring_enter for a read of " + path_, rc < 0 ? -rc : EAGAIN);
    }
  }

  Medium& m_;
  const std::string path_;
  const int fd_;
  const size_t alignment_;
  const unsigned depth_;
  io_uring ring_{};
  bool ready_ = false;
  std::vector<Slot> slots_;
  std::vector<unsigned> free_;
  unsigned outstanding_ = 0;
};

class UringMedium final : public FdMedium {
 public:
  using FdMedium::FdMedium;

  Status Write(uint64_t offset, const void* buf, size_t n) override {
    NONSTOP_RETURN_IF_ERROR(CheckAligned("write", path_, offset, buf, n, alignment_));
    // io_uring_prep_write takes a non-const pointer; the kernel only reads it.
    NONSTOP_RETURN_IF_ERROR(
        Transfer(/*write=*/true, offset, static_cast<char*>(const_cast<void*>(buf)), n));
    RaiseTo(size_, offset + n);
    return Status::OK();
  }

  Status Read(uint64_t offset, void* buf, size_t n) override {
    NONSTOP_RETURN_IF_ERROR(CheckAligned("read", path_, offset, buf, n, alignment_));
    NONSTOP_RETURN_IF_ERROR(CheckReadRange(path_, offset, n, Size()));
    return Transfer(/*write=*/false, offset, static_cast<char*>(buf), n);
  }

  std::unique_ptr<ReadQueue> OpenReadQueue(unsigned depth) override {
    auto q = std::make_unique<UringReadQueue>(*this, path_, fd_, alignment_,
                                              std::max(1u, depth));
    if (q->Init() != 0) return Medium::OpenReadQueue(depth);  // reads one at a time
    return q;
  }

 protected:
  std::string Name() const override { return "io_uring+O_DIRECT"; }
  std::vector<std::string> Details() const override {
    std::vector<std::string> d = {"qd " + std::to_string(kQueueDepth),
                                  FormatBytes(kPieceBytes) + " pieces"};
    for (std::string& s : FdMedium::Details()) d.push_back(std::move(s));
    return d;
  }

 private:
  struct Piece {
    uint64_t offset;
    char* p;
    size_t len;
  };

  Status PieceError(bool write, const Piece& pc, int err) const {
    return Status::FromErrno(std::string(write ? "io_uring write " : "io_uring read ") + path_ +
                                 " at " + std::to_string(pc.offset) + " (+" +
                                 std::to_string(pc.len) + " bytes)",
                             err);
  }

  // Moves [offset, offset + n) between `buf` and the file, keeping up to
  // kQueueDepth pieces in flight. Short transfers are resubmitted for the
  // rest; the first error stops new submissions, and every request already
  // in the kernel is reaped before returning.
  Status Transfer(bool write, uint64_t offset, char* buf, size_t n) {
    if (n == 0) return Status::OK();
    int init_err = 0;
    ThreadRing* tr = AcquireRing(&init_err);
    if (tr == nullptr) return Status::FromErrno("io_uring_queue_init for " + path_, init_err);
    io_uring* ring = tr->ring();

    Piece pieces[kQueueDepth];
    unsigned free_slots[kQueueDepth];
    unsigned num_free = kQueueDepth;
    for (unsigned i = 0; i < kQueueDepth; ++i) free_slots[i] = i;
    unsigned in_flight = 0;  // queued or in the kernel, not yet reaped
    size_t next = 0;         // bytes of the request handed to pieces so far
    Status failure;

    auto queue = [&](unsigned slot) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);  // never null: entries = 2 * depth
      const Piece& pc = pieces[slot];
      if (write) {
        io_uring_prep_write(sqe, fd_, pc.p, static_cast<unsigned>(pc.len), pc.offset);
      } else {
        io_uring_prep_read(sqe, fd_, pc.p, static_cast<unsigned>(pc.len), pc.offset);
      }
      io_uring_sqe_set_data64(sqe, slot);
    };

    while (true) {
      while (failure.ok() && next < n && num_free > 0) {
        const unsigned slot = free_slots[--num_free];
        const size_t len = std::min(kPieceBytes, n - next);
        pieces[slot] = {offset + next, buf + next, len};
        queue(slot);
        ++in_flight;
        next += len;
      }
      if (in_flight == 0) break;

      int rc = io_uring_submit_and_wait(ring, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        // The kernel refused the submission itself. Reap what it did take,
        // then drop this thread's ring: its SQ still holds our unsubmitted
        // entries, which must never reach the kernel on a later call.
        if (failure.ok()) failure = Status::FromErrno("io_uring_enter for " + path_, -rc);
        unsigned taken = in_flight - io_uring_sq_ready(ring);
        while (taken > 0) {
          io_uring_cqe* cqe = nullptr;
          int w = io_uring_wait_cqe(ring, &cqe);
          if (w == -EINTR) continue;
          if (w < 0) break;
          io_uring_cqe_seen(ring, cqe);
          --taken;
        }
        tl_ring.reset();
        return failure;
      }

      io_uring_cqe* cqe = nullptr;
      while (io_uring_peek_cqe(ring, &cqe) == 0) {
        const unsigned slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
        const int res = cqe->res;
        io_uring_cqe_seen(ring, cqe);
        Piece& pc = pieces[slot];
        bool again = false;
        if (res == -EINTR || res == -EAGAIN) {
          again = true;
        } else if (res < 0) {
          if (failure.ok()) failure = PieceError(write, pc, -res);
        } else if (res == 0) {
          if (failure.ok()) {
            failure = write ? Status::IOError(PieceError(write, pc, ENOSPC).message() +
                                              " (the kernel wrote 0 bytes)")
                            : Status::Corruption("io_uring read " + path_ + " at " +
                                                 std::to_string(pc.offset) + ": end of file");
          }
        } else if (static_cast<size_t>(res) < pc.len) {
          pc.offset += static_cast<uint64_t>(res);
          pc.p += res;
          pc.len -= static_cast<size_t>(res);
          again = true;
        }
        if (again && failure.ok()) {
          queue(slot);  // stays in flight
        } else {
          free_slots[num_free++] = slot;
          --in_flight;
        }
      }
    }
    return failure;
  }
};

}  // namespace

Result<std::unique_ptr<MediumBase>> OpenUringMedium(int fd, const std::string& path,
                                                    const MediumOptions&) {
  int init_err = 0;
  if (AcquireRing(&init_err) == nullptr) {
    return Status::Unavailable(std::string("io_uring_queue_init failed: ") +
                               std::strerror(init_err) +
                               " (io_uring disabled here?); use medium='direct'");
  }
  NONSTOP_ASSIGN_OR_RETURN(FdFile f, PrepareFdFile(fd, path, /*direct=*/true));
  return std::unique_ptr<MediumBase>(new UringMedium(MediumKind::kUring, path, std::move(f)));
}

#endif  // NONSTOP_HAVE_URING

}  // namespace nonstop::media
