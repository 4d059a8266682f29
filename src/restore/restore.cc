// The one restore path (include/nonstop/restore.h).
#include "nonstop/restore.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "nonstop/env.h"
#include "nonstop/plan.h"

namespace nonstop {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A buffer aligned for any medium (O_DIRECT included): from the heap, or,
// with a copy engine (device destinations), its staging memory (AllocHost:
// pinned where a GPU is present, page-aligned).
class Buffer {
 public:
  explicit Buffer(size_t n, CopyEngine* host = nullptr)
      : n_((n + kStoreAlign - 1) / kStoreAlign * kStoreAlign), host_(host) {
    if (host_ != nullptr) {
      bool pinned = false;
      p_ = host_->AllocHost(n_, &pinned);
      if (p_ != nullptr && reinterpret_cast<uintptr_t>(p_) % kStoreAlign != 0) {
        host_->FreeHost(p_, n_);
        p_ = nullptr;
      }
    } else if (posix_memalign(&p_, kStoreAlign, n_) != 0) {
      p_ = nullptr;
    }
  }
  ~Buffer() {
    if (host_ != nullptr) {
      if (p_ != nullptr) host_->FreeHost(p_, n_);
    } else {
      std::free(p_);
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() { return static_cast<uint8_t*>(p_); }
  bool ok() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  size_t n_;
  CopyEngine* host_;
};

// A staging buffer and the device copies still reading out of it. It is
// read into again only after those completed; the destructor waits for
// them (a failed restore leaves no copy in flight), then frees the buffer.
struct Staged {
  std::unique_ptr<Buffer> buf;
  std::vector<std::unique_ptr<CopyCompletion>> copies;
  Staged() = default;
  Staged(Staged&&) = default;
  Staged& operator=(Staged&&) = delete;
  ~Staged() {
    for (auto& c : copies) {
      if (c) {
        Status s = c->Wait();
        (void)s;
      }
    }
  }
};

// One read: whole crc chunks [first_chunk, end_chunk) = bytes [begin, end).
struct Piece {
  uint64_t first_chunk = 0, end_chunk = 0;
  uint64_t begin = 0, end = 0;
};

std::string Describe(const CheckpointInfo& info) {
  return "checkpoint #" + std::to_string(info.counter) + " (step " + std::to_string(info.step) + ")";
}

class Reading {
 public:
  Reading(SlotFile& file, const CheckpointInfo& info, const std::vector<void*>& dst,
          const RestoreOptions& opts)
      : file_(file), info_(info), dst_(dst), opts_(opts) {}

  Status Check() {
    const uint64_t cb = info_.crc_chunk_bytes;
    if (dst_.size() != info_.tensors.size()) {
      return Status::InvalidArgument("restore of " + Describe(info_) + " got " +
                                     std::to_string(dst_.size()) + " destinations for " +
                                     std::to_string(info_.tensors.size()) + " tensors");
    }
    // Device destinations: each one the copy engine can copy into.
    const std::vector<Device>& devs = opts_.dst_devices;
    if (!devs.empty() && devs.size() != dst_.size()) {
      return Status::InvalidArgument("restore of " + Describe(info_) + " got " +
                                     std::to_string(devs.size()) + " destination devices for " +
                                     std::to_string(dst_.size()) + " destinations");
    }
    for (size_t i = 0; i < devs.size(); ++i) {
      if (dst_[i] == nullptr || devs[i].kind == DeviceKind::kHost) continue;
      if (opts_.copy == nullptr || !opts_.copy->CanCopyToDevice(devs[i])) {
        return Status::InvalidArgument(
            "restore of " + Describe(info_) + ": tensor '" + info_.tensors[i].spec.name +
            "' goes to device memory, and " +
            (opts_.copy == nullptr ? std::string("no copy engine was given")
                                   : opts_.copy->Describe() + " cannot copy into it"));
      }
      on_device_ = true;
    }
    if (cb == 0 || info_.chunk_crcs.size() != (info_.data_bytes + cb - 1) / cb) {
      return Status::Corruption(Describe(info_) + " has no valid chunk checksums");
    }
    // The table parser checked these; a CheckpointInfo built by hand may not be.
    for (const TensorEntry& te : info_.tensors) {
      if (te.data_offset > info_.data_bytes || te.spec.nbytes > info_.data_bytes - te.data_offset) {
        return Status::Corruption("tensor '" + te.spec.name + "' of " + Describe(info_) +
                                  " lies outside its data region");
      }
    }
    order_.resize(info_.tensors.size());
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
      return info_.tensors[a].data_offset < info_.tensors[b].data_offset;
    });
    // Destinations are disjoint, and tensors in the file do not overlap
    // (SlotLayout::Plan): a hostile table with overlapping tensors is refused,
    // so no byte of a destination is written twice from different places.
    uint64_t prev_end = 0;
    for (size_t k = 0; k < order_.size(); ++k) {
      const TensorEntry& te = info_.tensors[order_[k]];
      if (te.spec.nbytes == 0) continue;
      if (te.data_offset < prev_end) {
        return Status::Corruption("tensors of " + Describe(info_) + " overlap in its data region ('" +
                                  te.spec.name + "')");
      }
      prev_end = te.data_offset + te.spec.nbytes;
    }
    // A partial read (data_begin/data_end): every kept tensor lies inside it.
    const uint64_t range_end = std::min(opts_.data_end, info_.data_bytes);
    if (opts_.data_begin > range_end) {
      return Status::InvalidArgument("restore of " + Describe(info_) + ": empty data range");
    }
    if (opts_.data_begin > 0 || range_end < info_.data_bytes) {
      for (size_t i = 0; i < dst_.size(); ++i) {
        const TensorEntry& te = info_.tensors[i];
        if (dst_[i] != nullptr && te.spec.nbytes != 0 &&
            (te.data_offset < opts_.data_begin || te.data_offset + te.spec.nbytes > range_end)) {
          return Status::InvalidArgument("restore of " + Describe(info_) + ": tensor '" +
                                         te.spec.name + "' lies outside the range read");
        }
      }
    }
    const uint64_t first = opts_.data_begin / cb;
    const uint64_t chunks = std::min<uint64_t>(info_.chunk_crcs.size(), (range_end + cb - 1) / cb);
    const uint64_t per = std::max<uint64_t>(1, opts_.piece_bytes / cb);
    for (uint64_t c = first; c < chunks; c += per) {
      Piece p;
      p.first_chunk = c;
      p.end_chunk = std::min(chunks, c + per);
      p.begin = c * cb;
      p.end = std::min(info_.data_bytes, p.end_chunk * cb);
      pieces_.push_back(p);
    }
    return Status::OK();
  }

  Status Run(RestoreStats* stats) {
    const auto t0 = Clock::now();
    const int threads = std::max(1, std::min<int>(opts_.threads, static_cast<int>(pieces_.size())));
    const uint64_t buf_bytes =
        std::min<uint64_t>(info_.data_bytes,
                           std::max<uint64_t>(1, opts_.piece_bytes / info_.crc_chunk_bytes) *
                               info_.crc_chunk_bytes);
    total_bytes_ = 0;
    for (const Piece& p : pieces_) total_bytes_ += p.end - p.begin;
    std::vector<std::thread> pool;
    pool.reserve(threads);
    // The O_DIRECT reads in flight, shared out among the threads (each keeps
    // its share queued while it checks and copies what has arrived).
    const unsigned depth =
        opts_.direct_medium == nullptr
            ? 0
            : std::max(1u, (std::max(1u, opts_.queue_depth) + static_cast<unsigned>(threads) - 1) /
                               static_cast<unsigned>(threads));
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([this, buf_bytes, depth] { Work(buf_bytes, depth); });
    }
    // The calling thread reports progress (a Python callback needs it).
    {
      const int n = static_cast<int>(pool.size());
      std::unique_lock<std::mutex> l(mu_);
      while (finished_ < n) {
        if (!opts_.progress) {
          cv_.wait(l, [&] { return finished_ == n; });
          break;
        }
        cv_.wait_for(l, std::chrono::duration<double>(opts_.progress_interval_s));
        if (finished_ == n) break;
        const uint64_t done = done_bytes_.load();
        l.unlock();
        const bool go_on = opts_.progress(done, total_bytes_);
        l.lock();
        if (!go_on && error_.ok()) {
          error_ = Status::Aborted("restore of " + Describe(info_) + " cancelled");
          stop_.store(true);
        }
      }
    }
    for (auto& th : pool) th.join();
    if (error_.ok() && opts_.progress) opts_.progress(total_bytes_, total_bytes_);
    if (stats != nullptr) {
      stats->data_bytes = done_bytes_.load();
      stats->tensor_bytes = tensor_bytes_.load();
      stats->direct_bytes = direct_bytes_.load();
      stats->pieces = pieces_.size();
      stats->odirect_bytes = odirect_bytes_.load();
      stats->retried_pieces = retried_pieces_.load();
      stats->seconds = Since(t0);
      stats->threads = threads;
      stats->h2d_bytes = h2d_bytes_.load();
      stats->h2d_wait_s = static_cast<double>(h2d_wait_ns_.load()) / 1e9;
    }
    return error_;
  }

 private:
  void Fail(Status s) {
    std::lock_guard<std::mutex> l(mu_);
    if (error_.ok()) error_ = std::move(s);
    stop_.store(true);
  }

  // The single tensor holding all of [begin, end), or -1.
  int Covering(uint64_t begin, uint64_t end) const {
    // First tensor (by offset) whose start is > begin; the one before may cover.
    auto it = std::upper_bound(order_.begin(), order_.end(), begin, [&](uint64_t v, size_t i) {
      return v < info_.tensors[i].data_offset;
    });
    if (it == order_.begin()) return -1;
    const size_t i = *(it - 1);
    const TensorEntry& te = info_.tensors[i];
    if (te.data_offset <= begin && te.data_offset + te.spec.nbytes >= end) return static_cast<int>(i);
    return -1;
  }

  Status Verify(const Piece& p, const uint8_t* bytes) {
    const uint64_t cb = info_.crc_chunk_bytes;
    for (uint64_t c = p.first_chunk; c < p.end_chunk; ++c) {
      const uint64_t b = c * cb, e = std::min(info_.data_bytes, b + cb);
      if (Crc32c(bytes + (b - p.begin), e - b) != info_.chunk_crcs[c]) {
        std::string which;
        for (const TensorEntry& te : info_.tensors) {
          if (te.data_offset < e && te.data_offset + te.spec.nbytes > b) {
            which = " (tensor '" + te.spec.name + "')";
            break;
          }
        }
        return Status::Corruption("data chunk " + std::to_string(c) + which + " of " +
                                  Describe(info_) + " has a checksum mismatch");
      }
    }
    return Status::OK();
  }

  // Whether piece `p` is read with O_DIRECT: there is such a medium, the
  // piece's offset suits it and its rounded-up length stays inside the file,
  // and the page cache does not hold it already (a warm file reads faster
  // buffered; a medium that cannot tell counts as cold).
  bool UseDirect(const Piece& p) {
    Medium* d = opts_.direct_medium;
    if (d == nullptr) return false;
    const uint64_t a = d->Alignment();
    const uint64_t at = info_.data_offset + p.begin, len = p.end - p.begin;
    if (a <= 1 || a > kStoreAlign || (a & (a - 1)) != 0 || at % a != 0) return false;
    if (at + (len + a - 1) / a * a > d->Size()) return false;
    Result<uint64_t> cached = file_.medium().CachedBytes(at, len);
    return !(cached.ok() && cached.value() >= len);
  }

  bool OnDevice(size_t i) const {
    return !opts_.dst_devices.empty() && opts_.dst_devices[i].kind != DeviceKind::kHost;
  }

  // Where an O_DIRECT read of piece `p` (`rlen` bytes, the medium's
  // alignment `a`) may land straight in its tensor: the tensor's memory, or
  // null (then it goes through a bounce buffer and is copied out; always for
  // a tensor in device memory).
  uint8_t* StraightInto(const Piece& p, uint64_t rlen, uint64_t a) const {
    const int cover = Covering(p.begin, p.end);
    if (cover < 0 || dst_[cover] == nullptr || OnDevice(cover) || rlen != p.end - p.begin) {
      return nullptr;
    }
    uint8_t* out = static_cast<uint8_t*>(dst_[cover]) + (p.begin - info_.tensors[cover].data_offset);
    return reinterpret_cast<uintptr_t>(out) % a == 0 ? out : nullptr;
  }

  // Waits for the device copies out of a staging buffer (before it is read
  // into again, or at the end).
  Status WaitCopies(Staged& s) {
    if (s.copies.empty()) return Status::OK();
    const auto w0 = Clock::now();
    Status st;
    for (auto& c : s.copies) {
      Status cs = c->Wait();
      if (st.ok() && !cs.ok()) st = cs.Annotate("copying " + Describe(info_) + " to the device");
    }
    s.copies.clear();
    h2d_wait_ns_ += static_cast<uint64_t>(Since(w0) * 1e9);
    return st;
  }

  // Piece `p` has arrived at `at` (its tensor's memory when `in_tensor`,
  // else a bounce buffer): verifies its chunks, then copies every
  // overlapping tensor's part out of the buffer: memcpy into host memory,
  // CopyToDevice into device memory (its completion kept in `staged`, whose
  // buffer `at` is, until it is waited for).
  Status Finish(const Piece& p, const uint8_t* at, bool in_tensor, Staged* staged) {
    NONSTOP_RETURN_IF_ERROR(Verify(p, at));
    const uint64_t len = p.end - p.begin;
    if (in_tensor) {
      direct_bytes_ += len;
      tensor_bytes_ += len;
      return Status::OK();
    }
    auto it = std::upper_bound(order_.begin(), order_.end(), p.begin, [&](uint64_t v, size_t i) {
      return v < info_.tensors[i].data_offset;
    });
    if (it != order_.begin()) --it;
    uint64_t copied = 0;
    for (; it != order_.end(); ++it) {
      const TensorEntry& te = info_.tensors[*it];
      if (te.data_offset >= p.end) break;
      const uint64_t lo = std::max(te.data_offset, p.begin);
      const uint64_t hi = std::min(te.data_offset + te.spec.nbytes, p.end);
      if (lo >= hi || dst_[*it] == nullptr) continue;
      uint8_t* to = static_cast<uint8_t*>(dst_[*it]) + (lo - te.data_offset);
      if (OnDevice(*it)) {
        if (staged == nullptr) return Status::Internal("a device copy out of an unstaged buffer");
        staged->copies.push_back(
            opts_.copy->CopyToDevice(at + (lo - p.begin), to, opts_.dst_devices[*it], hi - lo));
        h2d_bytes_ += hi - lo;
      } else {
        std::memcpy(to, at + (lo - p.begin), hi - lo);
      }
      copied += hi - lo;
    }
    tensor_bytes_ += copied;
    return Status::OK();
  }

  // Reads piece `p` through `m` in one call (buffered: the slot file's own
  // medium) and verifies it; counts it only when it succeeded. `s`'s buffer
  // is the bounce buffer; its earlier copies are waited for first.
  Status ReadPieceVia(Medium& m, const Piece& p, Staged& s) {
    const uint64_t len = p.end - p.begin;
    const uint64_t a = std::max<uint64_t>(1, m.Alignment());
    const uint64_t rlen = (len + a - 1) / a * a;  // what the medium reads (its alignment)
    if (uint8_t* out = StraightInto(p, rlen, a)) {
      NONSTOP_RETURN_IF_ERROR(m.Read(info_.data_offset + p.begin, out, len));
      return Finish(p, out, true, nullptr);
    }
    NONSTOP_RETURN_IF_ERROR(WaitCopies(s));
    NONSTOP_RETURN_IF_ERROR(m.Read(info_.data_offset + p.begin, s.buf->data(), rlen));
    return Finish(p, s.buf->data(), false, &s);
  }

  // One reader thread (Pump, then the count of finished threads). Pieces are taken in file order from the shared
  // counter. A cold piece (UseDirect) goes into this thread's O_DIRECT read
  // queue, which keeps up to `depth` reads in flight while the thread
  // verifies and copies the ones that have arrived; any other piece is read
  // buffered at once. An O_DIRECT read that fails or does not verify is read
  // again buffered before it can fail the restore.
  void Work(uint64_t buf_bytes, unsigned depth) {
    Status s = Pump(buf_bytes, depth);  // its queue, and every read in it, is gone after
    if (!s.ok()) Fail(std::move(s));
    std::lock_guard<std::mutex> l(mu_);
    ++finished_;
    cv_.notify_all();
  }

  Status Pump(uint64_t buf_bytes, unsigned depth) {
    // With device destinations every buffer is the copy engine's staging
    // memory, and the buffered reads rotate over `ring` buffers, so that the
    // copies out of one run while the next are read.
    CopyEngine* host = on_device_ ? opts_.copy : nullptr;
    const unsigned ring = on_device_ ? std::max(2u, opts_.device_buffers) : 1;
    // Declared before the queue, so freed after it: its destructor waits for
    // the reads still in flight into them (and into tensors); each Staged
    // waits for its device copies before its buffer is freed.
    std::vector<Staged> scratch(ring);
    for (Staged& s : scratch) {
      s.buf = std::make_unique<Buffer>(buf_bytes, host);
      if (!s.buf->ok()) return Status::Internal("out of memory for a restore buffer");
    }
    unsigned next_scratch = 0;
    std::vector<Staged> bufs;
    std::deque<unsigned> free_bufs;  // oldest first: its copies are the likeliest done
    std::vector<size_t> flight_piece;  // by buffer: the piece its read is for
    std::vector<uint8_t*> flight_at;   // and where it lands
    std::unique_ptr<ReadQueue> q;
    uint64_t a = 1;
    if (depth > 0 && opts_.direct_medium != nullptr) {
      q = opts_.direct_medium->OpenReadQueue(depth);
      a = std::max<uint64_t>(1, opts_.direct_medium->Alignment());
      bufs.resize(q->depth());
      for (unsigned i = 0; i < q->depth(); ++i) {
        bufs[i].buf = std::make_unique<Buffer>(buf_bytes, host);
        if (!bufs[i].buf->ok()) return Status::Internal("out of memory for a restore buffer");
        free_bufs.push_back(i);
      }
      flight_piece.resize(q->depth());
      flight_at.resize(q->depth());
    }
    bool more = true;
    for (;;) {
      while (more && !stop_.load() && (q == nullptr || !free_bufs.empty())) {
        const size_t k = next_.fetch_add(1);
        if (k >= pieces_.size()) {
          more = false;
          break;
        }
        const Piece& p = pieces_[k];
        const uint64_t len = p.end - p.begin;
        if (q != nullptr && UseDirect(p)) {
          const unsigned b = free_bufs.front();
          NONSTOP_RETURN_IF_ERROR(WaitCopies(bufs[b]));  // read into again only after
          const uint64_t rlen = (len + a - 1) / a * a;
          uint8_t* at = StraightInto(p, rlen, a);
          if (at == nullptr) at = bufs[b].buf->data();
          if (q->Submit(info_.data_offset + p.begin, at, rlen, b).ok()) {
            free_bufs.pop_front();
            flight_piece[b] = k;
            flight_at[b] = at;
            continue;
          }
          ++retried_pieces_;  // not started: read buffered below
        }
        Staged& s = scratch[next_scratch];
        next_scratch = (next_scratch + 1) % ring;
        Status st = ReadPieceVia(file_.medium(), p, s);
        if (!st.ok()) return st;
        done_bytes_ += len;
      }
      if (q == nullptr || q->outstanding() == 0) {
        if (!more || stop_.load()) break;
        continue;
      }
      Result<ReadDone> got = q->Next();
      if (!got.ok()) return got.status();
      const unsigned b = static_cast<unsigned>(got->tag);
      const Piece& p = pieces_[flight_piece[b]];
      Status st = got->status;
      const bool in_tensor = flight_at[b] != bufs[b].buf->data();
      if (st.ok()) st = Finish(p, flight_at[b], in_tensor, in_tensor ? nullptr : &bufs[b]);
      if (st.ok()) {
        odirect_bytes_ += p.end - p.begin;
      } else {
        // Failed or not verified: read again buffered, so that only the
        // slot file's own bytes can fail the restore.
        ++retried_pieces_;
        st = ReadPieceVia(file_.medium(), p, bufs[b]);
      }
      free_bufs.push_back(b);
      if (!st.ok()) return st;
      done_bytes_ += p.end - p.begin;
    }
    // Every device copy done (and its error seen) before the read counts as done.
    for (Staged& s : scratch) NONSTOP_RETURN_IF_ERROR(WaitCopies(s));
    for (Staged& s : bufs) NONSTOP_RETURN_IF_ERROR(WaitCopies(s));
    return Status::OK();
  }

  SlotFile& file_;
  const CheckpointInfo& info_;
  const std::vector<void*>& dst_;
  const RestoreOptions& opts_;
  std::vector<size_t> order_;  // tensor indices by data offset
  std::vector<Piece> pieces_;
  uint64_t total_bytes_ = 0;  // of the pieces
  std::atomic<size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> done_bytes_{0}, tensor_bytes_{0}, direct_bytes_{0};
  std::atomic<uint64_t> odirect_bytes_{0}, retried_pieces_{0};
  std::atomic<uint64_t> h2d_bytes_{0}, h2d_wait_ns_{0};
  bool on_device_ = false;  // some destination is in device memory (Check)
  std::mutex mu_;
  std::condition_variable cv_;
  int finished_ = 0;
  Status error_;
};

// Opens `where` (a slot file's path relative to the job directory, as
// CheckpointLocation names it) read-only with O_DIRECT, through the job
// directory's Directory (O_NOFOLLOW at every component).
Result<std::unique_ptr<Medium>> OpenDirect(JobDir& jd, const std::string& where) {
  Directory* d = &jd.dir();
  std::unique_ptr<Directory> sub;
  size_t from = 0;
  for (size_t slash; (slash = where.find('/', from)) != std::string::npos; from = slash + 1) {
    NONSTOP_ASSIGN_OR_RETURN(sub, d->OpenDir(where.substr(from, slash - from), false));
    d = sub.get();
  }
  MediumOptions mo;
  mo.read_only = true;
  // io_uring keeps many reads in flight per thread; plain O_DIRECT where
  // io_uring is refused (the queue then reads one piece at a time).
  Result<std::unique_ptr<Medium>> m = d->OpenFile(where.substr(from), MediumKind::kUring, mo);
  if (m.ok()) return m;
  return d->OpenFile(where.substr(from), MediumKind::kDirect, mo);
}

}  // namespace

Status ReadCheckpointInto(SlotFile& file, const CheckpointInfo& info, const std::vector<void*>& dst,
                          const RestoreOptions& opts, RestoreStats* stats) {
  Reading r(file, info, dst, opts);
  NONSTOP_RETURN_IF_ERROR(r.Check());
  if (info.data_bytes == 0 || opts.data_begin >= std::min(opts.data_end, info.data_bytes)) {
    if (stats != nullptr) *stats = RestoreStats{};
    return Status::OK();
  }
  return r.Run(stats);
}

Result<RestoreResult> RestoreFromJobDir(JobDir& jd, int rank, SelectOptions select,
                                        const RestorePrepare& prepare, const RestoreOptions& opts) {
  return RestoreFromJobDir(
      jd, rank, std::move(select),
      RestorePrepareDevices([&](const Selected& s) -> Result<RestoreDestinations> {
        Result<std::vector<void*>> got = prepare(s);
        if (!got.ok()) return got.status();
        return RestoreDestinations{std::move(got).value(), {}};
      }),
      opts);
}

Result<RestoreResult> RestoreFromJobDir(JobDir& jd, int rank, SelectOptions select,
                                        const RestorePrepareDevices& prepare,
                                        const RestoreOptions& opts) {
  const auto t0 = Clock::now();
  select.verify_data = false;  // the read below verifies every chunk, once
  RestoreResult out;
  std::vector<std::string> failed;  // one line per checkpoint that failed while read
  bool written = false;
  int superseded_retries = 0;
  const std::string overwritten =
      "; the state was partly overwritten by this restore and holds no valid checkpoint";
  for (;;) {
    Result<Selection> got = jd.Select(rank, select);
    if (!failed.empty() && (!got.ok() || !got->chosen)) {
      // Every older checkpoint is gone too: say what happened to the state.
      std::string msg = got.ok() ? "no checkpoint of rank " + std::to_string(rank) + " in " +
                                       jd.path() + " can be restored"
                                 : got.status().message();
      if (msg.find(failed.back()) == std::string::npos) msg += "; " + failed.back();
      if (written) msg += overwritten;
      const bool damage = !got.ok() && got.status().code() != StatusCode::kNotFound &&
                          got.status().code() != StatusCode::kCorruption;
      return Status(damage ? got.status().code() : StatusCode::kCorruption, msg);
    }
    NONSTOP_RETURN_IF_ERROR(got.status());
    Selection& sel = *got;
    if (!sel.chosen) {
      out.seconds = Since(t0);
      return out;  // a fresh start
    }
    Selected& s = *sel.chosen;
    const std::string where = jd.path() + "/" + s.location.where + ": " + Describe(s.info);
    Result<RestoreDestinations> dst = prepare(s);
    Status st = dst.ok() ? Status::OK() : dst.status();
    if (st.ok()) {
      ++out.attempts;
      written = true;
      RestoreOptions o = opts;
      o.dst_devices = dst->devices;
      std::unique_ptr<Medium> direct;
      if (opts.direct && opts.direct_medium == nullptr) {
        // The same file again, with O_DIRECT; where that is refused, buffered only.
        Result<std::unique_ptr<Medium>> m = OpenDirect(jd, s.location.where);
        if (m.ok()) {
          direct = std::move(m).value();
          o.direct_medium = direct.get();
        }
      }
      st = ReadCheckpointInto(*s.file, s.info, dst->ptrs, o, &out.stats);
      if (!st.ok() && !jd.writable() && superseded_retries < 3) {
        // A reader beside a live writer: the slot may have been reused
        // while it was read. Then that is no damage: select again.
        Result<bool> sup = jd.Superseded(s);
        if (sup.ok() && *sup) {
          ++superseded_retries;
          continue;
        }
      }
    }
    if (st.ok()) {
      out.skipped = std::move(failed);
      for (auto& line : sel.skipped) {
        // Lines for checkpoints excluded here are already in `failed`.
        if (line.find(": failed while it was read") == std::string::npos) {
          out.skipped.push_back(std::move(line));
        }
      }
      out.fallback = sel.fallback;
      out.chosen = std::move(s);
      out.seconds = Since(t0);
      return out;
    }
    if (st.code() != StatusCode::kCorruption) {
      std::string msg = st.Annotate(where).message();
      if (written) msg += overwritten;
      return Status(st.code(), msg);
    }
    failed.push_back(where + ": " + st.message());
    select.exclude.push_back(s.info.counter);
    if (select.step) {
      // One step asked for: no older one may stand in for it.
      std::string msg = failed.back();
      if (written) msg += overwritten;
      return Status::Corruption(msg);
    }
  }
}

Result<RestoreResult> RestoreFromSlotFile(SlotFile& file, const std::string& where,
                                          const ScanReport& report, const LineageRecord& lineage,
                                          const std::vector<uint64_t>& exclude,
                                          const RestorePrepareDevices& prepare,
                                          const RestoreOptions& opts) {
  const auto t0 = Clock::now();
  std::vector<PlanCandidate> cands;
  for (size_t i = 0; i < report.checkpoints.size(); ++i) {
    const ScannedCheckpoint& c = report.checkpoints[i];
    cands.push_back(PlanCandidate{Tier::kMemory, where, c.info.step, c.info.counter,
                                  c.state == CheckpointState::kCommitted, c.reason, false, i});
  }
  PlanRequest req;
  req.exclude = exclude;
  RestoreResult out;
  // Verifying a candidate is reading it into the destinations prepare gives.
  auto read = [&](const PlanCandidate& pc) -> Status {
    Selected s;
    s.info = report.checkpoints[pc.handle].info;
    s.location.where = where;
    NONSTOP_ASSIGN_OR_RETURN(RestoreDestinations dst, prepare(s));
    ++out.attempts;
    RestoreOptions o = opts;
    o.dst_devices = std::move(dst.devices);
    o.direct_medium = nullptr;  // the segment lives in memory (a tmpfs)
    return ReadCheckpointInto(file, s.info, dst.ptrs, o, &out.stats);
  };
  NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, lineage, req, read));
  out.skipped = report.skipped;
  out.skipped.insert(out.skipped.end(), plan.skipped.begin(), plan.skipped.end());
  out.fallback = plan.fallback;
  if (plan.chosen()) {
    Selected s;
    s.info = report.checkpoints[cands[*plan.chosen()].handle].info;
    s.location.where = where;
    out.chosen = std::move(s);
  } else if (out.skipped.empty()) {
    out.skipped.push_back("no valid checkpoint in " + where);
  }
  out.seconds = Since(t0);
  return out;
}

RestoreOptions RestoreOptionsFromEnv() {
  RestoreOptions o;
  // The value of `name` when it is a whole number, else nullopt.
  auto number = [](const char* name) -> std::optional<long long> {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    errno = 0;
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || errno != 0) return std::nullopt;
    return n;
  };
  if (auto t = number("NONSTOP_RESTORE_THREADS")) {
    o.threads = static_cast<int>(std::clamp<long long>(*t, 1, 1 << 16));
  }
  const char* direct = std::getenv("NONSTOP_RESTORE_DIRECT");
  o.direct = direct == nullptr || std::string_view(direct) != "0";
  if (auto q = number("NONSTOP_RESTORE_QUEUE"); q && *q >= 1 && *q <= 1024) {
    o.queue_depth = static_cast<unsigned>(*q);
  }
  return o;
}

}  // namespace nonstop
