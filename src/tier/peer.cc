// The peer tier (peer.h): replicas of partners' newest memory checkpoints,
// over the engine's own TCP protocol (peer_wire.h).
#include "tier/peer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "base/crc32c_combine.h"
#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "jobdir/manifest.h"
#include "jobdir/records.h"
#include "media/map_read.h"
#include "nonstop/jobdir.h"
#include "nonstop/plan.h"
#include "store/format.h"
#include "tier/peer_wire.h"
#include "tier/uploader.h"

namespace nonstop::peer {
namespace {

namespace w = wire;

constexpr char kReplicaMid[] = "-replica-world-";
constexpr char kRankMid[] = "-rank-";
// The name of builds before wire version 4 (no world size): refused.
constexpr char kLegacyMid[] = "-replica-rank-";
constexpr char kTmpSuffix[] = ".tmp";
constexpr double kStaleTmpS = 60;

// Outcomes in a REPLY to a PUSH.
enum : uint32_t { kGo = 1, kStoredReply = 2, kHeldReply = 3, kBudgetReply = 4 };

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t NsAfter(double seconds) {
  return SteadyNs() + static_cast<int64_t>(std::max(0.0, seconds) * 1e9);
}

uint64_t NowUnixNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// The file a one-slot copy of checkpoint `t` takes: header, ring and one slot
// (an upper bound, as the memory tier counts it).
uint64_t ReplicaFileBytes(const format::Table& t) {
  SlotLayout layout;
  layout.tensors = t.tensors;
  layout.data_bytes = t.data_bytes;
  return 4 * kStoreAlign * (kRingRecords + 2) +
         StoreGeometry::SlotBytesFor(layout, format::AlignUp(t.meta_json.size() + 1, kStoreAlign));
}

std::string_view View(const std::vector<uint8_t>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size()};
}

Result<format::Table> ParseWireTable(std::string_view bytes, const std::string& from) {
  Result<format::Table> t = format::ParseTable(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
  if (!t.ok()) return t.status().Annotate("peer " + from + ": tensor table");
  return t;
}

// Checks a data region arriving in order against its chunk crc32c values.
class ChunkChecker {
 public:
  ChunkChecker(uint64_t data_bytes, uint32_t chunk_bytes, const std::vector<uint32_t>& crcs,
               uint64_t counter, int64_t step)
      : data_bytes_(data_bytes), cb_(chunk_bytes), crcs_(crcs), counter_(counter), step_(step) {}
  // The next `n` bytes; Corruption naming the chunk whose crc does not match.
  // With `crc_of_n`, also the crc32c of the n bytes (combined from the
  // pieces' crcs: the bytes are read once for both).
  Status Next(const char* p, size_t n, const std::string& where, uint32_t* crc_of_n = nullptr) {
    if (n > data_bytes_ - got_) {
      return Status::Corruption(where + ": more data than the table's " +
                                std::to_string(data_bytes_) + " bytes");
    }
    uint32_t all = 0;
    for (size_t i = 0; i < n;) {
      const uint64_t take = std::min<uint64_t>(n - i, cb_ - got_ % cb_);
      if (crc_of_n != nullptr) {
        const uint32_t piece = Crc32c(p + i, take);
        crc_ = Crc32cCombine(crc_, piece, take);
        all = Crc32cCombine(all, piece, take);
      } else {
        crc_ = Crc32c(p + i, take, crc_);
      }
      got_ += take;
      i += take;
      if (got_ % cb_ == 0 || got_ == data_bytes_) {
        const uint64_t idx = (got_ - 1) / cb_;
        if (idx >= crcs_.size() || crc_ != crcs_[idx]) {
          return Status::Corruption(where + ": data chunk " + std::to_string(idx) +
                                    " of checkpoint #" + std::to_string(counter_) + " (step " +
                                    std::to_string(step_) + ") has a checksum mismatch");
        }
        crc_ = 0;
      }
    }
    if (crc_of_n != nullptr) *crc_of_n = all;
    return Status::OK();
  }
  uint64_t got() const { return got_; }

 private:
  uint64_t data_bytes_;
  uint64_t cb_;
  const std::vector<uint32_t>& crcs_;
  uint64_t counter_;
  int64_t step_;
  uint64_t got_ = 0;
  uint32_t crc_ = 0;
};

// Writes one checkpoint, arriving in order, into a one-slot slot file under
// a temp name, checking every crc chunk against the table as it completes;
// Finish commits it and renames it over the final name. Destroyed before
// Finish, it removes the temp file.
class ReplicaWriter {
 public:
  static Result<std::unique_ptr<ReplicaWriter>> Begin(Directory* dir, const std::string& tmp,
                                                      const format::Table& t) {
    std::unique_ptr<ReplicaWriter> w(new ReplicaWriter(dir, tmp, t));
    Status gone = dir->Unlink(tmp);  // a temp of a transfer that died
    if (!gone.ok() && gone.code() != StatusCode::kNotFound) return gone;
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m,
                             dir->CreateFile(tmp, MediumKind::kBuffered, MediumOptions{}));
    w->created_ = true;
    w->layout_.tensors = t.tensors;
    w->layout_.data_bytes = t.data_bytes;
    StoreGeometry g;
    g.slots = 1;
    g.rank = t.rank;
    g.world_size = t.world_size;
    g.slot_bytes =
        StoreGeometry::SlotBytesFor(w->layout_, format::AlignUp(t.meta_json.size() + 1, kStoreAlign));
    NONSTOP_ASSIGN_OR_RETURN(w->file_, SlotFile::Create(std::move(m), g));
    return w;
  }

  ~ReplicaWriter() {
    if (!done_ && created_) {
      file_.reset();
      (void)dir_->Unlink(tmp_);  // best effort: the next transfer removes it
    }
  }

  // The next bytes of the data as they arrive (a block of a DATA frame:
  // RecvFrame's fused pass): their chunks checked against the table, *crc
  // their crc32c. On the receiving stage, before the writing stage Writes
  // the same bytes.
  Status Check(std::string_view b, const std::string& from, uint32_t* crc) {
    return check_.Next(b.data(), b.size(), "peer " + from, crc);
  }

  // The next bytes of the data, Checked (a whole frame), into the file.
  Status Write(std::string_view b) {
    NONSTOP_RETURN_IF_ERROR(file_->WriteData(0, written_, b.data(), b.size()));
    written_ += b.size();
    return Status::OK();
  }

  Status Finish(const std::string& final_name, const std::string& from) {
    if (check_.got() != t_.data_bytes || written_ != t_.data_bytes) {
      return Status::Corruption("peer " + from + ": the data ended at " + std::to_string(written_) +
                                " of " + std::to_string(t_.data_bytes) + " bytes");
    }
    CommitRequest req;
    req.slot = 0;
    req.counter = t_.counter;
    req.step = t_.step;
    req.layout = &layout_;
    req.crc_chunk_bytes = t_.crc_chunk_bytes;
    req.chunk_crcs = t_.chunk_crcs;
    req.meta_json = t_.meta_json;
    NONSTOP_RETURN_IF_ERROR(file_->Commit(req).status());  // data, table, record: durable
    file_.reset();
    NONSTOP_RETURN_IF_ERROR(dir_->Rename(tmp_, final_name));
    done_ = true;
    return dir_->SyncDir();
  }

  uint64_t data_bytes() const { return written_; }

 private:
  ReplicaWriter(Directory* dir, std::string tmp, const format::Table& t)
      : dir_(dir), tmp_(std::move(tmp)), t_(t),
        check_(t_.data_bytes, t_.crc_chunk_bytes, t_.chunk_crcs, t_.counter, t_.step) {}
  Directory* dir_;
  std::string tmp_;
  format::Table t_;
  SlotLayout layout_;
  std::unique_ptr<SlotFile> file_;
  ChunkChecker check_;
  uint64_t written_ = 0;  // bytes written (Write)
  bool created_ = false, done_ = false;
};

// Two stages at once over a ring of N buffers, in order: `produce` fills
// them on a helper thread while `consume` uses the filled ones on this one
// (the next frames received while the last is checked and written; the next
// pieces read and checked while the last is sent). produce sets
// *more = false with the last buffer. The first error ends both: consume's
// (then `cancel` unblocks a produce waiting on the socket), else produce's
// after every buffer it filled before was consumed.
// A stage that waits for the other is woken only once N/2 buffers are
// ready for it (or at the end), not after every one: a frame is 256 KiB,
// and a wakeup per frame per side was thousands of futex sleeps, wakes and
// context switches per GB (docs/TIERS.md "Measured").
template <typename Buf, size_t N, typename Produce, typename Consume, typename Cancel>
Status TwoStage(std::array<Buf, N>& bufs, Produce produce, Consume consume, Cancel cancel) {
  static_assert(N >= 2);
  constexpr uint64_t kBatch = N / 2;
  Mutex mu;
  CondVar cv;
  uint64_t filled = 0, emptied = 0;  // buffers produced and consumed so far (buffer k: bufs[k % N])
  bool produced_all = false, stop = false;
  bool producer_waits = false, consumer_waits = false;
  Status produce_err;
  std::thread helper([&] {
    for (uint64_t k = 0;; ++k) {
      {
        MutexLock l(&mu);
        while (k - emptied >= N && !stop) {
          producer_waits = true;
          cv.Wait(&mu);
        }
        producer_waits = false;
        if (stop) return;
      }
      bool more = true;
      Status st = produce(bufs[k % N], &more);
      MutexLock l(&mu);
      if (!st.ok()) {
        produce_err = st;
      } else {
        filled = k + 1;
      }
      if (!st.ok() || !more) produced_all = true;
      if (consumer_waits && (produced_all || filled - emptied >= kBatch)) cv.SignalAll();
      if (produced_all) return;
    }
  });
  Status consume_err;
  for (uint64_t k = 0;; ++k) {
    {
      MutexLock l(&mu);
      while (k >= filled && !produced_all) {
        consumer_waits = true;
        cv.Wait(&mu);
      }
      consumer_waits = false;
      if (k >= filled) break;
    }
    Status st = consume(bufs[k % N]);
    MutexLock l(&mu);
    emptied = k + 1;
    if (!st.ok()) {
      consume_err = st;
      stop = true;
    }
    if (producer_waits && (stop || emptied + N - filled >= kBatch)) cv.SignalAll();
    if (stop) break;
  }
  if (!consume_err.ok()) cancel();
  helper.join();
  return consume_err.ok() ? produce_err : consume_err;
}

// The buffers (frames or pieces of w::kDataPiece) in flight between the
// two stages of a send or a receive.
constexpr size_t kStageBuffers = 4;

// Receives a data region: DATA frames, each checked as it is received
// (the chunk crcs and the tag in one pass: RecvFrame's `check`) and written
// by `writer` while the next is received, up to END. `what` names the
// transfer in errors ("a push", "a fetch"). A REPLY in the stream is the
// sender's error; any other frame is Corruption.
Status ReceiveData(w::Socket& s, ReplicaWriter& writer, const std::string& from, const char* what) {
  std::array<w::Frame, kStageBuffers> bufs;
  bool ended = false;
  const w::BlockCheck check = [&](std::string_view block, uint32_t* crc) {
    return writer.Check(block, from, crc);
  };
  Status st = TwoStage(
      bufs,
      [&](w::Frame& b, bool* more) {
        Status r = w::RecvFrame(s, &b, check);
        if (r.ok() && b.type != static_cast<uint16_t>(w::Type::kData)) *more = false;
        return r;
      },
      [&](w::Frame& b) {
        if (b.type == static_cast<uint16_t>(w::Type::kData)) return writer.Write(b.payload);
        if (b.type == static_cast<uint16_t>(w::Type::kEnd)) {
          ended = true;
          return Status::OK();
        }
        if (b.type == static_cast<uint16_t>(w::Type::kReply)) {
          uint32_t unused;
          Status r = w::DecodeReply(b.payload, &unused, from);  // the sender's own read failed
          return r.ok() ? Status::Corruption("peer " + from + ": a reply inside " + what) : r;
        }
        return Status::Corruption("peer " + from + ": frame type " + std::to_string(b.type) +
                                  " inside " + what);
      },
      // A receive blocked on the socket returns; a reply can still be sent.
      [&] { (void)::shutdown(s.fd(), SHUT_RD); });
  if (st.ok() && !ended) st = Status::Corruption("peer " + from + ": " + what + " ended without END");
  return st;
}

// Streams the data region of `info` of `file` as DATA frames (every chunk
// verified as read), then END. A read failure is sent as a REPLY carrying
// it (the receiver stops there) and returned.
// `after` (optional) runs after each DATA frame is sent with its bytes: a
// push's pace (Replicator: ReplicatorOptions::bps); its error ends the send.
// `may_map`: the file is one of this process's own replicas or segments,
// which nothing truncates (a page cut off under a mapping is SIGBUS, not an
// error); it is mapped only on tmpfs. A job directory's rank file (a disk
// another host or process may share) and any file on a disk are read.
Status SendData(w::Socket& s, SlotFile& file, const CheckpointInfo& info, uint64_t* sent,
                bool may_map, const std::function<Status(uint64_t)>& after = nullptr) {
  const uint64_t cb = info.crc_chunk_bytes;
  const auto fail = [&](const Status& r) {
    (void)w::SendFrame(s, w::Type::kReply, w::EncodeReply(r, 0));
    return r;
  };
  if (cb == 0 || info.chunk_crcs.size() != (info.data_bytes + cb - 1) / cb) {
    return fail(Status::Corruption("checkpoint #" + std::to_string(info.counter) +
                                   " has no valid chunk checksums"));
  }
  // Whole chunks per frame where they fit, each chunk checked once as it
  // passes (its crcs combined into the frame's), while the piece before is
  // sent. Where the medium is a plain file, the pieces are sent straight
  // from a read-only mapping of the data region (no copy into a buffer:
  // the check, the hash and the send read the page cache's pages); else
  // (a fault-injecting medium, a mapping refused) read into buffers.
  const uint64_t piece = cb <= w::kDataPiece ? w::kDataPiece / cb * cb : w::kDataPiece;
  if (info.data_bytes == 0) return w::SendFrame(s, w::Type::kEnd, {});
  Result<std::unique_ptr<media::ReadMapping>> mapped =
      may_map && file.medium().InMemory()
          ? media::MapForRead(file.medium(), info.data_offset, info.data_bytes)
              : Result<std::unique_ptr<media::ReadMapping>>(Status::Unavailable("not mapped"));
  const char* const view = mapped.ok() ? mapped.value()->data() : nullptr;
  struct Piece {
    std::string buf;
    const char* at = nullptr;  // the piece's bytes: in buf or in the mapping
    uint64_t len = 0;
    uint32_t crc = 0;
    crypto::Block hash{};  // the frame tag's per-byte part (w::DataFrameChecks)
  };
  std::array<Piece, kStageBuffers> bufs;
  if (view == nullptr) {
    for (Piece& p : bufs) p.buf.resize(std::min<uint64_t>(piece, info.data_bytes));
  }
  ChunkChecker check(info.data_bytes, info.crc_chunk_bytes, info.chunk_crcs, info.counter, info.step);
  const std::string where = file.medium().Describe();
  const w::BlockCheck check_block = [&](std::string_view b, uint32_t* crc) {
    return check.Next(b.data(), b.size(), where, crc);
  };
  uint64_t off = 0;
  bool read_failed = false;
  Status st = TwoStage(
      bufs,
      [&](Piece& p, bool* more) {
        p.len = std::min<uint64_t>(piece, info.data_bytes - off);
        Status r;
        if (view != nullptr) {
          p.at = view + off;
        } else {
          p.at = p.buf.data();
          r = file.medium().Read(info.data_offset + off, p.buf.data(), p.len);
        }
        // Every chunk checked and the frame's tag hashed in one pass
        // (w::DataFrameChecks: block by block while each is in cache).
        if (r.ok()) r = w::DataFrameChecks(s, std::string_view(p.at, p.len), check_block, &p.crc, &p.hash);
        if (!r.ok()) {
          read_failed = true;
          return r;
        }
        off += p.len;
        *more = off < info.data_bytes;
        return Status::OK();
      },
      [&](Piece& p) {
        NONSTOP_RETURN_IF_ERROR(w::SendDataFrame(s, std::string_view(p.at, p.len), p.crc, &p.hash));
        *sent += p.len;
        return after ? after(p.len) : Status::OK();
      },
      [] {});
  if (!st.ok()) return read_failed ? fail(st) : st;
  return w::SendFrame(s, w::Type::kEnd, {});
}

// The REPLY expected next on `s`.
Status ReadReply(w::Socket& s, uint32_t* outcome) {
  w::Frame f;
  NONSTOP_RETURN_IF_ERROR(w::RecvFrame(s, &f));
  if (f.type != static_cast<uint16_t>(w::Type::kReply)) {
    return Status::Corruption("peer " + s.peer() + ": expected a reply, got frame type " +
                              std::to_string(f.type));
  }
  return w::DecodeReply(f.payload, outcome, s.peer());
}

Result<std::pair<std::unique_ptr<SlotFile>, CheckpointInfo>> OpenNewest(Directory& dir,
                                                                        const std::string& name) {
  MediumOptions ro;
  ro.read_only = true;
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m, dir.OpenFile(name, MediumKind::kBuffered, ro));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> f, SlotFile::Open(std::move(m)));
  ScanOptions so;
  so.verify_data = false;  // every chunk is verified as it is read
  NONSTOP_ASSIGN_OR_RETURN(ScanReport rep, f->Scan(so));
  // The one chooser (src/plan) picks among the file's records. It is given
  // no lineage (the replicator and the server do not read the job
  // directory): after a rollback the segment's abandoned newest may be sent
  // until the next commit replaces it; the restart's collective choice
  // decides with the surviving ranks' lineage (docs/TIERS.md).
  std::vector<PlanCandidate> cands;
  for (size_t i = 0; i < rep.checkpoints.size(); ++i) {
    const ScannedCheckpoint& c = rep.checkpoints[i];
    cands.push_back(PlanCandidate{Tier::kMemory, name, c.info.step, c.info.counter,
                                  c.state == CheckpointState::kCommitted, c.reason, false, i});
  }
  PlanRequest req;
  req.verify = false;  // every chunk is verified as it is read
  NONSTOP_ASSIGN_OR_RETURN(Plan plan, MakePlan(cands, LineageRecord{}, req));
  if (!plan.chosen()) {
    std::string why = dir.path() + "/" + name + " holds no committed checkpoint";
    for (const std::string& s : rep.skipped) why += "; " + s;
    return Status::NotFound(why);
  }
  CheckpointInfo info = rep.checkpoints[cands[*plan.chosen()].handle].info;
  return std::make_pair(std::move(f), std::move(info));
}

// Five decimal digits of `name` at `at` into `v`; false otherwise.
bool Digits5(const std::string& name, size_t at, uint32_t* v) {
  if (name.size() < at + 5) return false;
  uint32_t r = 0;
  for (size_t i = at; i < at + 5; ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    r = r * 10 + static_cast<uint32_t>(name[i] - '0');
  }
  *v = r;
  return true;
}

// Whether `name` is a replica name of job key `key` (the world size and
// source rank it says into `world`, `rank`); temp files, other jobs' and
// other files: false.
bool ParseReplica(const std::string& name, const std::string& key, uint32_t* world,
                  uint32_t* rank) {
  const std::string head = key + kReplicaMid;
  const size_t mid = head.size() + 5;
  const size_t size = mid + sizeof(kRankMid) - 1 + 5 + 5;
  return name.size() == size && name.compare(0, head.size(), head) == 0 &&
         Digits5(name, head.size(), world) &&
         name.compare(mid, sizeof(kRankMid) - 1, kRankMid) == 0 &&
         Digits5(name, mid + sizeof(kRankMid) - 1, rank) &&
         name.compare(name.size() - 5, 5, ".nsck") == 0;
}

// Whether `name` is a replica of job key `key` named without its world size
// (a build before wire version 4), or its temp file.
bool LegacyReplica(std::string name, const std::string& key) {
  if (name.size() > 4 && name.compare(name.size() - 4, 4, kTmpSuffix) == 0) {
    name.resize(name.size() - 4);
  }
  const std::string head = key + kLegacyMid;
  uint32_t r = 0;
  return name.size() == head.size() + 5 + 5 && name.compare(0, head.size(), head) == 0 &&
         Digits5(name, head.size(), &r) && name.compare(name.size() - 5, 5, ".nsck") == 0;
}

// The largest world size a replica name spells (five digits).
constexpr uint32_t kMaxNamedWorld = 99999;

// A (world size, source rank) as one key.
uint64_t WorldRank(uint32_t world, uint32_t rank) { return (uint64_t{world} << 32) | rank; }

// What a listing found, by source rank; the names into `names` when given.
std::vector<HeldReplica> BySourceRank(std::vector<std::pair<HeldReplica, std::string>> out,
                                      std::vector<std::string>* names) {
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return std::pair(a.first.source_rank, a.first.world_size) <
           std::pair(b.first.source_rank, b.first.world_size);
  });
  std::vector<HeldReplica> held;
  for (auto& [h, n] : out) {
    held.push_back(h);
    if (names != nullptr) names->push_back(std::move(n));
  }
  return held;
}

// The complete replicas of job key `key` in `dir`, by source rank (names
// in `names` when given).
Result<std::vector<HeldReplica>> ListReplicasIn(Directory& dir, const std::string& key,
                                                std::vector<std::string>* names = nullptr) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, dir.List());
  std::vector<std::pair<HeldReplica, std::string>> out;
  for (const DirEntry& e : entries) {
    uint32_t world = 0, r = 0;
    if (!ParseReplica(e.name, key, &world, &r)) continue;
    Result<FileStat> st = dir.Stat(e.name);
    if (!st.ok() || st.value().type != EntryType::kFile) continue;
    auto got = OpenNewest(dir, e.name);
    if (!got.ok()) continue;  // not a complete replica: never listed
    const CheckpointInfo& info = got.value().second;
    if (info.rank != r || info.world_size != world) continue;  // not what its name says
    out.emplace_back(HeldReplica{r, world, info.step, info.counter, st.value().size}, e.name);
  }
  return BySourceRank(std::move(out), names);
}

// The newest committed checkpoint of each of `segments` in `dir` (gone,
// not a file or holding none: left out), by source rank (names in `names`
// when given).
Result<std::vector<HeldReplica>> ListSegmentsIn(Directory& dir,
                                                const std::vector<std::string>& segments,
                                                std::vector<std::string>* names = nullptr) {
  std::vector<std::pair<HeldReplica, std::string>> out;
  std::set<std::string> seen;
  for (const std::string& name : segments) {
    if (!seen.insert(name).second) continue;
    Result<FileStat> st = dir.Stat(name);
    if (!st.ok() || st.value().type != EntryType::kFile) continue;  // gone, or not a file
    auto got = OpenNewest(dir, name);
    if (!got.ok()) continue;  // holds no committed checkpoint: never listed
    const CheckpointInfo& info = got.value().second;
    out.emplace_back(
        HeldReplica{info.rank, info.world_size, info.step, info.counter, st.value().size}, name);
  }
  return BySourceRank(std::move(out), names);
}

// A rank file of a job directory served (PeerServerOptions::job_dir).
struct DiskFile {
  HeldReplica held;
  std::string sub;   // "" (the job directory) or "world-W"
  std::string name;  // "rank-RRRRR.nsck"
};

// The rank files of `d` (sub: its name in the job directory, for the
// result) whose newest committed checkpoint is of the rank their name says
// (and, in world-W, of world size W): regular files only, never followed.
void RankFilesIn(Directory& d, const std::string& sub, std::optional<int> world,
                 std::vector<DiskFile>* out) {
  Result<std::vector<DirEntry>> entries = d.List();
  if (!entries.ok()) return;
  for (const DirEntry& e : entries.value()) {
    const std::optional<int> r = JobDirNames::ParseSlot(e.name);
    if (!r) continue;
    Result<FileStat> st = d.Stat(e.name);
    if (!st.ok() || st.value().type != EntryType::kFile) continue;
    auto got = OpenNewest(d, e.name);
    if (!got.ok()) continue;  // holds no committed checkpoint: never listed
    const CheckpointInfo& info = got.value().second;
    if (info.rank != static_cast<uint32_t>(*r) ||
        (world && info.world_size != static_cast<uint32_t>(*world))) {
      continue;
    }
    out->push_back(DiskFile{HeldReplica{info.rank, info.world_size, info.step, info.counter,
                                        st.value().size},
                            sub, e.name});
  }
}

// The rank files of the job directory at `job_dir`: its own and those of
// each set-aside world-W (a link there refused), by world size then rank.
Result<std::vector<DiskFile>> ListJobDirFiles(Env* env, const std::string& job_dir) {
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(job_dir, false);
  if (!d.ok() && d.status().code() == StatusCode::kNotFound) return std::vector<DiskFile>{};
  NONSTOP_RETURN_IF_ERROR(d.status());
  std::vector<DiskFile> out;
  RankFilesIn(*d.value(), "", std::nullopt, &out);
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, d.value()->List());
  for (const DirEntry& e : entries) {
    const std::optional<int> w = JobDirNames::ParseWorld(e.name);
    if (!w) continue;
    Result<FileStat> st = d.value()->Stat(e.name);
    if (!st.ok() || st.value().type != EntryType::kDirectory) continue;  // a link: refused
    Result<std::unique_ptr<Directory>> sub = d.value()->OpenDir(e.name, false);
    if (sub.ok()) RankFilesIn(*sub.value(), e.name, w, &out);
  }
  std::sort(out.begin(), out.end(), [](const DiskFile& a, const DiskFile& b) {
    return std::tuple(a.held.world_size, a.held.source_rank, a.sub) <
           std::tuple(b.held.world_size, b.held.source_rank, b.sub);
  });
  return out;
}

}  // namespace

std::string Endpoint::ToString() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

Result<Endpoint> ParseEndpoint(const std::string& text) {
  const auto bad = [&] {
    return Status::InvalidArgument("peer endpoint '" + text + "' is not host:port");
  };
  Endpoint ep;
  std::string port;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') return bad();
    ep.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos || text.find(':') != colon) return bad();
    ep.host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (ep.host.empty() || port.empty() || port.size() > 5) return bad();
  unsigned long v = 0;
  for (char c : port) {
    if (c < '0' || c > '9') return bad();
    v = v * 10 + static_cast<unsigned long>(c - '0');
  }
  if (v == 0 || v > 65535) return bad();
  ep.port = static_cast<uint16_t>(v);
  return ep;
}

std::string JobKey(const std::string& job) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char c : job) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char b[17];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(h));
  return b;
}

std::string ReplicaName(const std::string& job, uint32_t world_size, uint32_t source_rank) {
  char b[64];
  std::snprintf(b, sizeof(b), "%s%05u%s%05u.nsck", kReplicaMid, world_size, kRankMid, source_rank);
  return JobKey(job) + b;
}

std::string SharedReshardDir(const std::string& job) { return JobKey(job) + "-reshard-host"; }

std::string PeerMemoryDir(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* env = std::getenv("NONSTOP_SHM_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  return "/dev/shm/nonstop";
}

std::string PeerStepDir(const std::string& local_dir, int64_t step) {
  return local_dir + "/peer/step-" + std::to_string(step);
}

// ---------------------------------------------------------------- server

struct PeerServer::Impl {
  PeerServerOptions o;
  Env* env = nullptr;
  std::string key;  // JobKey(o.job)
  std::unique_ptr<Directory> dir;
  w::Socket listener;
  uint16_t port = 0;
  int wake[2] = {-1, -1};  // a byte here ends the accept loop
  std::thread acceptor;

  struct Conn {
    w::Socket sock;
    std::thread thread;
    std::atomic<bool> done{false};
    // In its handshake (pending) until it completes or fails; the acceptor
    // shuts the socket down at `deadline_ns` (steady clock) while pending.
    std::atomic<bool> pending{true};
    std::atomic<int64_t> deadline_ns{0};
    std::atomic<bool> timed_out{false};
  };

  mutable Mutex mu;
  bool stop GUARDED_BY(mu) = false;
  std::list<std::unique_ptr<Conn>> conns GUARDED_BY(mu);
  std::set<uint64_t> busy GUARDED_BY(mu);  // WorldRank of the replicas being received
  uint64_t reserved GUARDED_BY(mu) = 0;    // file bytes of the transfers in progress
  PeerServerStats stats GUARDED_BY(mu);

  void Error(const Status& s) EXCLUDES(mu) {
    MutexLock l(&mu);
    stats.last_error = s.ToString();
  }
  bool Stopping() const EXCLUDES(mu) {
    MutexLock l(&mu);
    return stop;
  }

  void AcceptLoop();
  // Ends the handshakes past their deadline; the poll timeout (ms) until the next one.
  int EnforceDeadlines() EXCLUDES(mu);
  double HandshakeTimeoutS() const {
    return o.handshake_timeout_s > 0 ? o.handshake_timeout_s : o.io_timeout_s;
  }
  void Serve(Conn* c);
  // One request; false: close the connection.
  bool Handle(w::Socket& s, w::Frame& f);
  bool HandlePush(w::Socket& s, std::string_view payload);
  bool HandleFetch(w::Socket& s, std::string_view payload, Source source);
  bool HandleList(w::Socket& s, std::string_view payload, Source source);
  Result<std::vector<HeldReplica>> List();
  Result<std::vector<HeldReplica>> ListOwn();
  Result<std::vector<HeldReplica>> ListDisk();
  // This job's replica files here (complete and not), bytes; the temp files
  // of transfers in progress are counted by `reserved` instead.
  uint64_t UsedBytes() EXCLUDES(mu);
  void SweepStaleTemps();
  // The replicas of world sizes other than `world` go once the job
  // directory records an agreed checkpoint of `world` (PeerServer::Start).
  void DropOtherWorlds(uint32_t world) EXCLUDES(mu);
};

Result<bool> AgreedInWorld(Env* env, const std::string& job_dir, uint32_t world_size) {
  if (job_dir.empty() || world_size == 0) return false;
  if (env == nullptr) env = DefaultEnv();
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(job_dir, false);
  if (!d.ok() && d.status().code() == StatusCode::kNotFound) return false;
  NONSTOP_RETURN_IF_ERROR(d.status());
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DirEntry> entries, d.value()->List());
  for (const DirEntry& e : entries) {
    if (!e.name.starts_with("agreed-rank-") || !e.name.ends_with(".json")) continue;
    Result<std::string> text = ReadSmallFile(*d.value(), e.name, 64 << 10);
    if (!text.ok()) continue;
    Result<AgreedRecord> rec = jobdir_internal::DecodeAgreed(text.value(), e.name);
    if (rec.ok() && rec.value().world_size == static_cast<int>(world_size) &&
        rec.value().counter >= 0) {
      return true;
    }
  }
  return false;
}

Result<std::unique_ptr<PeerServer>> PeerServer::Start(const PeerServerOptions& o) {
  if (o.job.empty() || o.job.size() > kMaxJobBytes) {
    return Status::InvalidArgument("peer server: job name must have 1 to " +
                                   std::to_string(kMaxJobBytes) + " bytes");
  }
  NONSTOP_RETURN_IF_ERROR(w::CheckSecret(o.secret));
  for (const std::string& seg : o.segments) {
    if (seg.empty() || seg == "." || seg == ".." || seg.find('/') != std::string::npos ||
        seg.size() > 255) {
      return Status::InvalidArgument("peer server: own segment '" + seg.substr(0, 64) +
                                     "' is not an entry name of the memory directory");
    }
  }
  std::unique_ptr<PeerServer> s(new PeerServer());
  s->impl_ = std::make_unique<Impl>();
  Impl& m = *s->impl_;
  m.o = o;
  m.env = o.env != nullptr ? o.env : DefaultEnv();
  m.key = JobKey(o.job);
  const std::string where = PeerMemoryDir(o.dir);
  NONSTOP_ASSIGN_OR_RETURN(m.dir, m.env->OpenDirectory(where, /*create=*/true));
  if (m.o.budget_bytes == 0 && m.o.budget_share > 0) {
    Result<uint64_t> free_bytes = m.dir->FreeBytes();
    if (free_bytes.ok()) {
      m.o.budget_bytes = std::max<uint64_t>(
          1, static_cast<uint64_t>(static_cast<double>(free_bytes.value()) *
                                   kDefaultBudgetFraction / m.o.budget_share));
    }
  }
  m.SweepStaleTemps();
  m.DropOtherWorlds(o.world_size);
  NONSTOP_ASSIGN_OR_RETURN(m.listener, w::Listen(o.bind_host, o.port, &m.port));
  if (::pipe2(m.wake, O_CLOEXEC) != 0) return Status::FromErrno("peer server: pipe", errno);
  m.acceptor = std::thread([p = &m] { p->AcceptLoop(); });
  return s;
}

PeerServer::~PeerServer() { Close(); }

uint16_t PeerServer::port() const { return impl_->port; }

std::string PeerServer::endpoint() const {
  return Endpoint{impl_->o.bind_host, impl_->port}.ToString();
}

Result<std::vector<HeldReplica>> PeerServer::List() { return impl_->List(); }

Result<std::vector<HeldReplica>> PeerServer::ListOwn() { return impl_->ListOwn(); }

Result<std::vector<HeldReplica>> PeerServer::ListDisk() { return impl_->ListDisk(); }

PeerServerStats PeerServer::stats() const {
  PeerServerStats st;
  {
    MutexLock l(&impl_->mu);
    st = impl_->stats;
  }
  st.budget_bytes = impl_->o.budget_bytes;
  Result<std::vector<HeldReplica>> held = impl_->List();
  if (held.ok()) {
    st.held = held.value().size();
    st.held_bytes = 0;
    for (const HeldReplica& h : held.value()) st.held_bytes += h.bytes;
  }
  return st;
}

void PeerServer::Close() {
  Impl& m = *impl_;
  std::list<std::unique_ptr<Impl::Conn>> conns;
  {
    MutexLock l(&m.mu);
    if (m.stop) return;
    m.stop = true;
    for (auto& c : m.conns) c->sock.Shutdown();
    conns.swap(m.conns);
  }
  if (m.wake[1] >= 0) {
    const char b = 1;
    (void)!::write(m.wake[1], &b, 1);
  }
  if (m.acceptor.joinable()) m.acceptor.join();
  {
    // Connections the acceptor added before it saw the stop.
    MutexLock l(&m.mu);
    for (auto& c : m.conns) c->sock.Shutdown();
    conns.splice(conns.end(), m.conns);
  }
  for (auto& c : conns) {
    if (c->thread.joinable()) c->thread.join();
  }
  m.listener.Close();
  for (int& fd : m.wake) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

void PeerServer::Impl::SweepStaleTemps() {
  Result<std::vector<DirEntry>> entries = dir->List();
  if (!entries.ok()) return;
  const uint64_t now = NowUnixNs();
  uint64_t legacy = 0;
  for (const DirEntry& e : entries.value()) {
    const std::string& n = e.name;
    if (LegacyReplica(n, key)) {
      // A replica named without its world size (a build before wire
      // version 4): which world it belongs to only its header says, and the
      // name let rank r of one world overwrite rank r of another. Refused:
      // removed (it is neither listed nor served), and said.
      if (dir->Unlink(n).ok()) ++legacy;
      continue;
    }
    if (n.size() <= 4 || n.compare(n.size() - 4, 4, kTmpSuffix) != 0) continue;
    uint32_t world = 0, r = 0;
    if (!ParseReplica(n.substr(0, n.size() - 4), key, &world, &r)) continue;
    Result<FileStat> st = dir->Stat(n);
    if (!st.ok() || st.value().type != EntryType::kFile) continue;
    const uint64_t t = st.value().mtime_unix_ns;
    if (now > t && static_cast<double>(now - t) / 1e9 >= kStaleTmpS) (void)dir->Unlink(n);
  }
  if (legacy > 0) {
    MutexLock l(&mu);
    stats.last_error = "peer server: removed " + std::to_string(legacy) + " replica file(s) of " +
                       "this job in " + dir->path() + " named without a world size (an older " +
                       "build's: a replica is named by its world size and rank since wire " +
                       "version 4)";
  }
}

void PeerServer::Impl::DropOtherWorlds(uint32_t world) {
  if (world == 0 || o.job_dir.empty()) return;
  Result<std::vector<DirEntry>> entries = dir->List();
  if (!entries.ok()) return;
  std::vector<std::string> old;
  for (const DirEntry& e : entries.value()) {
    std::string n = e.name;
    if (n.size() > 4 && n.compare(n.size() - 4, 4, kTmpSuffix) == 0) n.resize(n.size() - 4);
    uint32_t w = 0, r = 0;
    if (ParseReplica(n, key, &w, &r) && w != world) old.push_back(e.name);
  }
  if (old.empty()) return;
  Result<bool> agreed = AgreedInWorld(env, o.job_dir, world);
  if (!agreed.ok() || !agreed.value()) return;  // not yet (or unknown): the old world may need them
  uint64_t removed = 0;
  for (const std::string& n : old) {
    uint32_t w = 0, r = 0;
    const std::string base = n.ends_with(kTmpSuffix) ? n.substr(0, n.size() - 4) : n;
    (void)ParseReplica(base, key, &w, &r);
    {
      MutexLock l(&mu);
      if (busy.count(WorldRank(w, r)) != 0) continue;  // being received now
    }
    if (dir->Unlink(n).ok()) ++removed;
  }
  MutexLock l(&mu);
  stats.old_world_removed += removed;
}

uint64_t PeerServer::Impl::UsedBytes() {
  std::set<uint64_t> in_progress;
  uint64_t used = 0;
  {
    MutexLock l(&mu);
    in_progress = busy;
    used = reserved;
  }
  Result<std::vector<DirEntry>> entries = dir->List();
  if (!entries.ok()) return used;
  for (const DirEntry& e : entries.value()) {
    std::string n = e.name;
    const bool tmp = n.size() > 4 && n.compare(n.size() - 4, 4, kTmpSuffix) == 0;
    if (tmp) n = n.substr(0, n.size() - 4);
    uint32_t world = 0, r = 0;
    if (!ParseReplica(n, key, &world, &r) || (tmp && in_progress.count(WorldRank(world, r)) != 0)) {
      continue;
    }
    Result<FileStat> st = dir->Stat(e.name);
    if (st.ok() && st.value().type == EntryType::kFile) used += st.value().size;
  }
  return used;
}

Result<std::vector<HeldReplica>> PeerServer::Impl::List() { return ListReplicasIn(*dir, key); }

Result<std::vector<HeldReplica>> PeerServer::Impl::ListOwn() {
  return ListSegmentsIn(*dir, o.segments);
}

Result<std::vector<HeldReplica>> PeerServer::Impl::ListDisk() {
  if (o.job_dir.empty()) return std::vector<HeldReplica>{};
  NONSTOP_ASSIGN_OR_RETURN(std::vector<DiskFile> files, ListJobDirFiles(env, o.job_dir));
  std::vector<HeldReplica> out;
  for (DiskFile& f : files) out.push_back(f.held);
  return out;
}

int PeerServer::Impl::EnforceDeadlines() {
  const int64_t now = SteadyNs();
  int64_t next = now + 1'000'000'000;
  MutexLock l(&mu);
  for (auto& c : conns) {
    if (!c->pending.load()) continue;
    const int64_t d = c->deadline_ns.load();
    if (d == 0) continue;
    if (d <= now) {
      if (!c->timed_out.exchange(true)) c->sock.Shutdown();  // its thread counts it
    } else {
      next = std::min(next, d);
    }
  }
  return static_cast<int>(std::max<int64_t>(1, (next - now + 999'999) / 1'000'000));
}

void PeerServer::Impl::AcceptLoop() {
  int wait_ms = 1000;
  for (;;) {
    pollfd pfd[2] = {{listener.fd(), POLLIN, 0}, {wake[0], POLLIN, 0}};
    const int rc = ::poll(pfd, 2, wait_ms);
    if (Stopping()) return;
    wait_ms = EnforceDeadlines();
    {
      // Reap finished connections.
      MutexLock l(&mu);
      for (auto it = conns.begin(); it != conns.end();) {
        if ((*it)->done.load()) {
          if ((*it)->thread.joinable()) (*it)->thread.join();
          it = conns.erase(it);
        } else {
          ++it;
        }
      }
    }
    if (rc <= 0 || (pfd[0].revents & POLLIN) == 0) continue;
    sockaddr_storage sa{};
    socklen_t len = sizeof(sa);
    const int fd = ::accept4(listener.fd(), reinterpret_cast<sockaddr*>(&sa), &len, SOCK_CLOEXEC);
    if (fd < 0) continue;
    char host[INET6_ADDRSTRLEN] = "?";
    uint16_t port = 0;
    if (sa.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&sa);
      ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
      port = ntohs(a->sin_port);
    } else if (sa.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&sa);
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
      port = ntohs(a->sin6_port);
    }
    auto c = std::make_unique<Conn>();
    c->sock = w::Socket(fd, Endpoint{host, port}.ToString());
    const int one = 1;
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (!c->sock.SetTimeout(o.io_timeout_s).ok()) continue;
    // The first byte of its HELLO within io_timeout_s (Serve moves the
    // deadline to handshake_timeout_s after it when it comes).
    c->deadline_ns.store(NsAfter(o.io_timeout_s));
    MutexLock l(&mu);
    if (stop || static_cast<int>(conns.size()) >= o.max_connections) continue;  // closed
    int pending = 0;
    for (const auto& x : conns) pending += x->pending.load() ? 1 : 0;
    if (pending >= std::max(1, o.max_pending_handshakes)) {
      ++stats.handshakes_refused;
      stats.last_error = "peer " + c->sock.peer() + ": closed at accept, " +
                         std::to_string(pending) + " connections are in their handshake";
      continue;  // closed
    }
    Conn* p = c.get();
    conns.push_back(std::move(c));
    p->thread = std::thread([this, p] { Serve(p); });
  }
}

void PeerServer::Impl::Serve(Conn* c) {
  w::Frame f;
  // The handshake first, bounded in total (PeerServerOptions): until it
  // completes, only its tiny frames are read (peer_wire.h), so nothing big is
  // allocated for a stranger. Its clock starts at the HELLO's first byte, so
  // a client that a loaded host descheduled between connect and send is
  // still served; the acceptor ends a handshake past its deadline.
  Status hs;
  for (;;) {
    if (c->sock.WaitReadable(0.5)) break;  // a byte, the peer's close, or the deadline's shutdown
    if (Stopping()) {
      hs = Status::Aborted("peer server: stopping");
      break;
    }
  }
  if (hs.ok() && !c->timed_out.load()) c->deadline_ns.store(NsAfter(HandshakeTimeoutS()));
  if (hs.ok()) hs = c->sock.SetTimeout(HandshakeTimeoutS());
  if (hs.ok()) hs = w::ServerHandshake(c->sock, o.job, o.secret);
  c->pending.store(false);
  // Ran out of time whichever clock saw it first: the acceptor's shutdown at
  // the deadline, or this socket's own receive timeout (armed after the
  // deadline was set, so it fires past it), which on a loaded host can beat
  // a descheduled acceptor. Decided by the clock, not by the race.
  if (!hs.ok() && c->deadline_ns.load() != 0 && SteadyNs() >= c->deadline_ns.load()) {
    c->timed_out.store(true);
  }
  if (hs.ok() && c->timed_out.load()) {
    hs = Status::IOError("peer " + c->sock.peer() + ": the handshake completed past its deadline");
  }
  if (hs.ok()) hs = c->sock.SetTimeout(o.io_timeout_s);
  if (!hs.ok()) {
    // A stranger's client also leaves on its own, when this side's proof
    // does not hold for it: every handshake that does not complete counts,
    // as an auth failure, or as a timeout when it ran out of time.
    MutexLock l(&mu);
    if (!stop) {
      if (c->timed_out.load()) {
        ++stats.handshake_timeouts;
        stats.last_error = "peer " + c->sock.peer() + ": the handshake did not complete in time (" +
                           std::to_string(o.io_timeout_s) + " s to the first byte, then " +
                           std::to_string(HandshakeTimeoutS()) + " s)";
      } else {
        ++stats.auth_failures;
        if (hs.code() == StatusCode::kCorruption) ++stats.refused_frames;
        stats.last_error = hs.ToString();
      }
    }
    l.Unlock();
    c->sock.Shutdown();
    c->done.store(true);
    return;
  }
  for (;;) {
    // Idle between requests: wait for the next without a timeout, but see a stop.
    while (!c->sock.WaitReadable(0.5)) {
      if (Stopping()) break;
    }
    if (Stopping()) break;
    Status s = w::RecvFrame(c->sock, &f);
    if (!s.ok()) {
      if (s.code() == StatusCode::kCorruption) {
        MutexLock l(&mu);
        ++stats.refused_frames;
        stats.last_error = s.ToString();
      }
      break;  // a cut, a timeout or a hostile frame: the connection ends
    }
    if (!Handle(c->sock, f)) break;
  }
  if (c->sock.session() != nullptr && c->sock.session()->mac_failed) {
    MutexLock l(&mu);
    ++stats.auth_failures;
  }
  c->sock.Shutdown();
  c->done.store(true);
}

bool PeerServer::Impl::Handle(w::Socket& s, w::Frame& f) {
  const auto refuse = [&](const std::string& why) {
    Status st = Status::Corruption("peer " + s.peer() + ": " + why);
    {
      MutexLock l(&mu);
      ++stats.refused_frames;
      stats.last_error = st.ToString();
    }
    (void)w::SendFrame(s, w::Type::kReply, w::EncodeReply(st, 0));
    return false;
  };
  switch (static_cast<w::Type>(f.type)) {
    case w::Type::kPush: return HandlePush(s, f.payload);
    case w::Type::kFetch: return HandleFetch(s, f.payload, Source::kReplica);
    case w::Type::kFetchOwn: return HandleFetch(s, f.payload, Source::kSegment);
    case w::Type::kFetchDisk: return HandleFetch(s, f.payload, Source::kDisk);
    case w::Type::kList:
    case w::Type::kListOwn:
    case w::Type::kListDisk: {
      const Source src = f.type == static_cast<uint16_t>(w::Type::kList)      ? Source::kReplica
                         : f.type == static_cast<uint16_t>(w::Type::kListOwn) ? Source::kSegment
                                                                              : Source::kDisk;
      w::In in(f.payload);
      (void)in.Str16(kMaxJobBytes);
      if (!in.done()) {
        return refuse(src == Source::kReplica   ? "malformed LIST"
                      : src == Source::kSegment ? "malformed LIST_OWN"
                                                : "malformed LIST_DISK");
      }
      return HandleList(s, f.payload, src);
    }
    default:
      return refuse("unexpected frame type " + std::to_string(f.type) + " for a request");
  }
}

bool PeerServer::Impl::HandleList(w::Socket& s, std::string_view payload, Source source) {
  w::In in(payload);
  const std::string job = in.Str16(kMaxJobBytes);
  if (job != o.job) {
    (void)w::SendFrame(s, w::Type::kReply,
                       w::EncodeReply(Status::FailedPrecondition(
                                          "this server holds replicas of another job"),
                                      0));
    return true;
  }
  Result<std::vector<HeldReplica>> held = source == Source::kReplica   ? List()
                                          : source == Source::kSegment ? ListOwn()
                                                                       : ListDisk();
  if (!held.ok()) {
    (void)w::SendFrame(s, w::Type::kReply, w::EncodeReply(held.status(), 0));
    return true;
  }
  w::Out out;
  const size_t n = std::min<size_t>(held.value().size(), w::kMaxListed);
  out.U32(static_cast<uint32_t>(n));
  for (size_t i = 0; i < n; ++i) {
    const HeldReplica& h = held.value()[i];
    out.U32(h.source_rank).U32(h.world_size).I64(h.step).U64(h.counter).U64(h.bytes);
  }
  return w::SendFrame(s, w::Type::kListing, out.str()).ok();
}

bool PeerServer::Impl::HandlePush(w::Socket& s, std::string_view payload) {
  const std::string from = s.peer();
  w::In in(payload);
  const std::string job = in.Str16(kMaxJobBytes);
  const std::string_view table_bytes = in.Rest();
  const auto reply = [&](const Status& st, uint32_t outcome) {
    return w::SendFrame(s, w::Type::kReply, w::EncodeReply(st, outcome)).ok();
  };
  const auto failed = [&](const Status& st) {
    {
      MutexLock l(&mu);
      ++stats.push_failures;
      stats.last_error = st.ToString();
    }
    return reply(st, 0);
  };
  if (!in.ok()) return failed(Status::Corruption("peer " + from + ": malformed PUSH")) && false;
  if (job != o.job) {
    return failed(Status::FailedPrecondition("peer " + from + " pushes job '" + job.substr(0, 64) +
                                             "', this server holds '" + o.job.substr(0, 64) + "'"));
  }
  Result<format::Table> parsed = ParseWireTable(table_bytes, from);
  if (!parsed.ok()) return failed(parsed.status());
  const format::Table& t = parsed.value();
  const uint32_t src = t.rank;
  if (t.world_size == 0 || t.world_size > kMaxNamedWorld || src >= t.world_size) {
    return failed(Status::Corruption("peer " + from + " pushes rank " + std::to_string(src) +
                                     " of world size " + std::to_string(t.world_size)));
  }
  const uint64_t slot = WorldRank(t.world_size, src);
  const std::string name = ReplicaName(o.job, t.world_size, src);
  const uint64_t need = ReplicaFileBytes(t);
  {
    // A link or folder planted at the name: removed as itself, never followed.
    Result<FileStat> cur = dir->Stat(name);
    if (cur.ok() && cur.value().type != EntryType::kFile) {
      Status rm = RemoveTree(*dir, name);
      if (!rm.ok()) return failed(rm.Annotate("peer replica " + dir->path() + "/" + name));
    }
  }

  // The one held now: the same checkpoint is not sent again.
  {
    auto held = OpenNewest(*dir, name);
    if (held.ok() && held.value().second.counter == t.counter && held.value().second.step == t.step &&
        held.value().second.chunk_crcs == t.chunk_crcs) {
      {
        MutexLock l(&mu);
        ++stats.replicas_already_held;
      }
      return reply(Status::OK(), kHeldReply);
    }
  }
  // Replicas of old worlds go once this world agreed on a checkpoint of its
  // own (Start's comment); then the budget: this job's replicas here, the
  // transfers in progress and this one.
  DropOtherWorlds(t.world_size);
  const uint64_t used = UsedBytes();
  Result<uint64_t> free_bytes = dir->FreeBytes();
  std::string over;
  if (o.budget_bytes > 0 && used + need > o.budget_bytes) {
    over = "replica of rank " + std::to_string(src) + " (" + std::to_string(need >> 20) +
           " MiB) does not fit the peer budget of " + std::to_string(o.budget_bytes >> 20) +
           " MiB (" + std::to_string(used >> 20) + " MiB held)";
  } else if (free_bytes.ok() && need > free_bytes.value()) {
    over = "replica of rank " + std::to_string(src) + " (" + std::to_string(need >> 20) +
           " MiB) does not fit into " + std::to_string(free_bytes.value() >> 20) + " MiB free in " +
           dir->path();
  }
  {
    MutexLock l(&mu);
    if (over.empty() && busy.count(slot) != 0) {
      ++stats.push_failures;
      stats.last_error = "a push of rank " + std::to_string(src) + " of world size " +
                         std::to_string(t.world_size) + " is already in progress";
      return reply(Status::Aborted(stats.last_error), 0);
    }
    if (!over.empty()) {
      ++stats.replica_skipped_budget;
      stats.last_error = over;
    } else {
      busy.insert(slot);
      reserved += need;
    }
  }
  if (!over.empty()) return reply(Status::OK(), kBudgetReply);
  // Writing a replica yields the CPU to this host's training: this
  // connection's thread (and the receive helper it starts) from now on.
  thread_local bool niced = false;
  if (!niced) {
    tier::LowerThreadPriority(o.nice);
    niced = true;
  }
  const auto release = [&] {
    MutexLock l(&mu);
    busy.erase(slot);
    reserved -= need;
  };

  Result<std::unique_ptr<ReplicaWriter>> wr = ReplicaWriter::Begin(dir.get(), name + kTmpSuffix, t);
  if (!wr.ok()) {
    release();
    return failed(wr.status().Annotate("peer replica " + dir->path() + "/" + name));
  }
  bool keep = reply(Status::OK(), kGo);
  Status st = keep ? Status::OK() : Status::IOError("peer " + from + ": reply failed");
  if (keep) st = ReceiveData(s, *wr.value(), from, "a push");
  if (st.ok()) st = wr.value()->Finish(name, from);
  const uint64_t bytes = wr.value()->data_bytes();
  wr.value().reset();  // an unfinished temp file goes now
  release();
  if (!st.ok()) {
    {
      MutexLock l(&mu);
      ++stats.push_failures;
      if (st.code() == StatusCode::kCorruption) ++stats.refused_frames;
      stats.last_error = st.ToString();
    }
    // The stream is out of step now: say why and close.
    (void)reply(st, 0);
    return false;
  }
  {
    MutexLock l(&mu);
    ++stats.replicas_received;
    stats.bytes_received += bytes;
  }
  return reply(Status::OK(), kStoredReply);
}

bool PeerServer::Impl::HandleFetch(w::Socket& s, std::string_view payload, Source source) {
  const std::string from = s.peer();
  w::In in(payload);
  const std::string job = in.Str16(kMaxJobBytes);
  const uint32_t world = in.U32();
  const uint32_t src = in.U32();
  const uint8_t has_step = in.U8();
  const int64_t step = in.I64();
  const auto reply = [&](const Status& st) {
    if (!st.ok()) Error(st);
    return w::SendFrame(s, w::Type::kReply, w::EncodeReply(st, 0)).ok();
  };
  const char* what = source == Source::kReplica   ? "replica"
                     : source == Source::kSegment ? "own segment"
                                                  : "rank file";
  if (!in.done() || has_step > 1 || world == 0 || src >= world) {
    {
      MutexLock l(&mu);
      ++stats.refused_frames;
    }
    (void)reply(Status::Corruption("peer " + from + ": malformed " +
                                   (source == Source::kReplica   ? "FETCH"
                                    : source == Source::kSegment ? "FETCH_OWN"
                                                                 : "FETCH_DISK")));
    return false;
  }
  if (job != o.job) {
    return reply(Status::FailedPrecondition("this server holds replicas of another job"));
  }
  const std::string of = std::string(what) + " of rank " + std::to_string(src) +
                         " of world size " + std::to_string(world);
  std::string name = ReplicaName(o.job, world, src);
  std::string where = dir->path();
  Result<std::pair<std::unique_ptr<SlotFile>, CheckpointInfo>> got =
      Status::NotFound("no " + of + " at " + where);
  if (source == Source::kSegment) {
    // The segment served that holds rank `src` of `world` (only the names it
    // was given, regular files, never followed).
    for (const std::string& seg : o.segments) {
      Result<FileStat> st = dir->Stat(seg);
      if (!st.ok() || st.value().type != EntryType::kFile) continue;
      auto g = OpenNewest(*dir, seg);
      if (!g.ok() || g.value().second.rank != src || g.value().second.world_size != world) continue;
      name = seg;
      got = std::move(g);
      break;
    }
  } else if (source == Source::kDisk) {
    // The job directory's rank file of rank `src` of `world`: its own
    // "rank-RRRRR.nsck" or the set-aside "world-W/rank-RRRRR.nsck", names
    // built here from the numbers (nothing else of the job directory, and
    // nothing outside it, is ever opened), regular files, never followed.
    where = o.job_dir;
    Result<std::unique_ptr<Directory>> jd =
        o.job_dir.empty() ? Result<std::unique_ptr<Directory>>(Status::NotFound("no job directory"))
                          : env->OpenDirectory(o.job_dir, false);
    if (jd.ok()) {
      name = JobDirNames::Slot(static_cast<int>(src));
      for (const std::string& sub : {std::string(), JobDirNames::World(static_cast<int>(world))}) {
        std::unique_ptr<Directory> d;
        if (!sub.empty()) {
          Result<FileStat> st = jd.value()->Stat(sub);
          if (!st.ok() || st.value().type != EntryType::kDirectory) continue;
          Result<std::unique_ptr<Directory>> sd = jd.value()->OpenDir(sub, false);
          if (!sd.ok()) continue;
          d = std::move(sd).value();
        }
        Directory& in_dir = sub.empty() ? *jd.value() : *d;
        Result<FileStat> st = in_dir.Stat(name);
        if (!st.ok() || st.value().type != EntryType::kFile) continue;
        auto g = OpenNewest(in_dir, name);
        if (!g.ok() || g.value().second.rank != src || g.value().second.world_size != world) continue;
        if (has_step != 0 && g.value().second.step != step) continue;
        if (!sub.empty()) name = sub + "/" + name;
        got = std::move(g);
        break;
      }
    }
  } else {
    got = OpenNewest(*dir, name);
  }
  if (!got.ok()) {
    const StatusCode c = got.status().code();
    return reply(c == StatusCode::kNotFound ? Status::NotFound("no " + of + " at " + where)
                                            : got.status().Annotate(of));
  }
  SlotFile& file = *got.value().first;
  const CheckpointInfo& info = got.value().second;
  if (info.rank != src || info.world_size != world) {
    return reply(Status::Corruption(where + "/" + name + " holds rank " +
                                    std::to_string(info.rank) + " of world size " +
                                    std::to_string(info.world_size)));
  }
  if (has_step != 0 && info.step != step) {
    return reply(Status::NotFound("the " + of + " holds step " + std::to_string(info.step) +
                                  ", not " + std::to_string(step)));
  }
  const std::vector<uint8_t> table = w::EncodeCheckpointTable(info);
  if (!w::SendFrame(s, w::Type::kTable, View(table)).ok()) return false;
  uint64_t sent = 0;
  Status st = SendData(s, file, info, &sent, /*may_map=*/source != Source::kDisk);
  if (!st.ok()) {
    Error(st);
    return false;
  }
  MutexLock l(&mu);
  ++stats.fetches_served;
  stats.bytes_served += sent;
  return true;
}

// ---------------------------------------------------------------- client

namespace {

Status SendPush(w::Socket& s, const std::string& job, SlotFile& file, const CheckpointInfo& info,
                PushOutcome* outcome, const std::function<Status(uint64_t)>& after = nullptr) {
  w::Out head;
  head.Str16(job);
  const std::vector<uint8_t> table = w::EncodeCheckpointTable(info);
  NONSTOP_RETURN_IF_ERROR(w::SendFrame(s, w::Type::kPush, head.str(), View(table)));
  uint32_t o = 0;
  NONSTOP_RETURN_IF_ERROR(ReadReply(s, &o));
  if (o == kHeldReply) {
    *outcome = PushOutcome::kAlreadyHeld;
    return Status::OK();
  }
  if (o == kBudgetReply) {
    *outcome = PushOutcome::kSkippedBudget;
    return Status::OK();
  }
  if (o != kGo) return Status::Corruption("peer " + s.peer() + ": unexpected reply to a push");
  uint64_t sent = 0;
  Status st = SendData(s, file, info, &sent, /*may_map=*/true, after);
  if (!st.ok()) {
    // The server may have said why it stopped reading (a damaged chunk it saw).
    if (st.code() == StatusCode::kIOError && s.WaitReadable(0.2)) {
      Status why = ReadReply(s, &o);
      if (!why.ok()) return why;
    }
    return st;
  }
  NONSTOP_RETURN_IF_ERROR(ReadReply(s, &o));
  if (o != kStoredReply) return Status::Corruption("peer " + s.peer() + ": unexpected reply to a push");
  *outcome = PushOutcome::kStored;
  return Status::OK();
}

Status CheckJob(const std::string& job) {
  if (job.empty() || job.size() > kMaxJobBytes) {
    return Status::InvalidArgument("peer tier: job name must have 1 to " +
                                   std::to_string(kMaxJobBytes) + " bytes");
  }
  return Status::OK();
}

// How long a client waits before its one new try of a handshake the server
// cut (peer.h PeerServerOptions: a deadline, or too many handshakes at once).
constexpr double kHandshakeRetryS = 1;

// A connection to the server at `endpoint` that completed the handshake
// (peer_wire.h): every frame on it carries a MAC. With `retry`, a handshake
// cut or timed out on a connection that was made (the server's bounds under
// load: its deadline, its cap on handshakes at once) is tried once more on
// a new connection: the lists and fetches of a restart, whose fallback (the
// disk, the object store) costs far more. A server that cannot be reached
// is not tried again (the fallback is the faster way then), a refusal or a
// proof that does not hold never is, and a push is not (the replicator
// tries again with the newest checkpoint after ReplicatorOptions::retry_s).
Result<w::Socket> Dial(const std::string& endpoint, const std::string& job,
                       const std::string& secret, double connect_timeout_s, double io_timeout_s,
                       bool retry = false) {
  NONSTOP_RETURN_IF_ERROR(CheckJob(job));
  NONSTOP_RETURN_IF_ERROR(w::CheckSecret(secret));
  for (int attempt = 0;; ++attempt) {
    NONSTOP_ASSIGN_OR_RETURN(w::Socket s, w::Connect(endpoint, connect_timeout_s, io_timeout_s));
    Status hs = w::ClientHandshake(s, job, secret);
    if (hs.ok()) return s;
    if (!retry || attempt > 0 || hs.code() != StatusCode::kIOError) return hs;
    s.Close();
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(kHandshakeRetryS * 1e6)));
  }
}

}  // namespace

Result<PushOutcome> PushCheckpoint(const std::string& endpoint, const std::string& job,
                                   const std::string& secret, SlotFile& file,
                                   const CheckpointInfo& info, const PushOptions& o) {
  NONSTOP_ASSIGN_OR_RETURN(w::Socket s,
                           Dial(endpoint, job, secret, o.connect_timeout_s, o.io_timeout_s));
  PushOutcome out = PushOutcome::kStored;
  NONSTOP_RETURN_IF_ERROR(SendPush(s, job, file, info, &out));
  return out;
}

namespace {

// Opens the slot file at `path` read-only: its newest committed checkpoint.
Result<std::pair<std::unique_ptr<SlotFile>, CheckpointInfo>> OpenNewestAt(const std::string& path,
                                                                          Env* env) {
  const size_t slash = path.rfind('/');
  const std::string dir_path = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, env->OpenDirectory(dir_path, false));
  return OpenNewest(*d, name);
}

}  // namespace

Result<PushOutcome> PushNewest(const std::string& endpoint, const std::string& job,
                               const std::string& secret, const std::string& slot_path,
                               const PushOptions& o, Env* env, CheckpointInfo* pushed) {
  if (env == nullptr) env = DefaultEnv();
  NONSTOP_ASSIGN_OR_RETURN(auto got, OpenNewestAt(slot_path, env));
  if (pushed != nullptr) *pushed = got.second;
  return PushCheckpoint(endpoint, job, secret, *got.first, got.second, o);
}

namespace {

Result<std::vector<HeldReplica>> ListAt(const std::string& endpoint, const std::string& job,
                                        const std::string& secret, double timeout_s,
                                        Source source) {
  NONSTOP_ASSIGN_OR_RETURN(w::Socket s,
                           Dial(endpoint, job, secret, timeout_s, timeout_s, /*retry=*/true));
  w::Out req;
  req.Str16(job);
  NONSTOP_RETURN_IF_ERROR(w::SendFrame(s,
                                       source == Source::kReplica   ? w::Type::kList
                                       : source == Source::kSegment ? w::Type::kListOwn
                                                                    : w::Type::kListDisk,
                                       req.str()));
  w::Frame f;
  NONSTOP_RETURN_IF_ERROR(w::RecvFrame(s, &f));
  if (f.type == static_cast<uint16_t>(w::Type::kReply)) {
    uint32_t unused;
    NONSTOP_RETURN_IF_ERROR(w::DecodeReply(f.payload, &unused, endpoint));
    return Status::Corruption("peer " + endpoint + ": an OK reply to a list");
  }
  if (f.type != static_cast<uint16_t>(w::Type::kListing)) {
    return Status::Corruption("peer " + endpoint + ": unexpected answer to a list");
  }
  w::In in(f.payload);
  const uint32_t n = in.U32();
  if (!in.ok() || n > w::kMaxListed || f.payload.size() != 4 + uint64_t{n} * 32) {
    return Status::Corruption("peer " + endpoint + ": malformed list");
  }
  std::vector<HeldReplica> out(n);
  for (HeldReplica& h : out) {
    h.source_rank = in.U32();
    h.world_size = in.U32();
    h.step = in.I64();
    h.counter = in.U64();
    h.bytes = in.U64();
  }
  return out;
}

// A fetch (of `source`) written to local_dir/sub1[/sub2]/rank-RRRRR.nsck;
// sub2 "": none, "*": "step-N" of the checkpoint sent. Returns the
// directory it is in.
Result<std::string> FetchTo(const std::string& endpoint, const std::string& job,
                            const std::string& secret, uint32_t world_size, uint32_t source_rank,
                            std::optional<int64_t> step, Source source, const std::string& local_dir,
                            const std::string& sub1, const std::string& sub2, Env* env,
                            double timeout_s) {
  if (env == nullptr) env = DefaultEnv();
  for (const std::string& sub : {sub1, sub2}) {
    if (sub == "." || sub == ".." || sub.find('/') != std::string::npos) {
      return Status::InvalidArgument("peer fetch: '" + sub + "' is not a directory entry name");
    }
  }
  if (sub1.empty()) return Status::InvalidArgument("peer fetch: no directory to fetch into");
  if (world_size == 0 || source_rank >= world_size) {
    return Status::InvalidArgument("peer fetch: rank " + std::to_string(source_rank) +
                                   " of world size " + std::to_string(world_size));
  }
  NONSTOP_ASSIGN_OR_RETURN(w::Socket s,
                           Dial(endpoint, job, secret, std::min(timeout_s, 10.0), timeout_s,
                                /*retry=*/true));
  w::Out req;
  req.Str16(job).U32(world_size).U32(source_rank).U8(step ? 1 : 0).I64(step.value_or(0));
  NONSTOP_RETURN_IF_ERROR(w::SendFrame(s,
                                       source == Source::kReplica   ? w::Type::kFetch
                                       : source == Source::kSegment ? w::Type::kFetchOwn
                                                                    : w::Type::kFetchDisk,
                                       req.str()));
  w::Frame f;
  NONSTOP_RETURN_IF_ERROR(w::RecvFrame(s, &f));
  if (f.type == static_cast<uint16_t>(w::Type::kReply)) {
    uint32_t unused;
    NONSTOP_RETURN_IF_ERROR(w::DecodeReply(f.payload, &unused, endpoint));
    return Status::Corruption("peer " + endpoint + ": an OK reply to a fetch");
  }
  if (f.type != static_cast<uint16_t>(w::Type::kTable)) {
    return Status::Corruption("peer " + endpoint + ": unexpected answer to a fetch");
  }
  NONSTOP_ASSIGN_OR_RETURN(format::Table t, ParseWireTable(f.payload, endpoint));
  if (t.rank != source_rank || t.world_size != world_size || (step && t.step != *step)) {
    return Status::Corruption("peer " + endpoint + " sent rank " + std::to_string(t.rank) +
                              " of world size " + std::to_string(t.world_size) + " step " +
                              std::to_string(t.step) + " for rank " + std::to_string(source_rank) +
                              " of world size " + std::to_string(world_size));
  }
  // local_dir/sub1[/sub2]: every file created O_EXCL|O_NOFOLLOW relative to it.
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> base, env->OpenDirectory(local_dir, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> dir, base->OpenDir(sub1, true));
  std::string where = local_dir + "/" + sub1;
  if (!sub2.empty()) {
    const std::string name2 = sub2 == "*" ? "step-" + std::to_string(t.step) : sub2;
    NONSTOP_ASSIGN_OR_RETURN(dir, dir->OpenDir(name2, true));
    where += "/" + name2;
  }
  const std::string dest = SlotFileName(static_cast<int>(source_rank));
  Result<FileStat> st = dir->Stat(dest);
  if (st.ok() && st.value().type != EntryType::kFile) {
    NONSTOP_RETURN_IF_ERROR(RemoveTree(*dir, dest));  // a link or folder planted there
  } else if (!st.ok() && st.status().code() != StatusCode::kNotFound) {
    return st.status();
  }
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<ReplicaWriter> wr,
                           ReplicaWriter::Begin(dir.get(), dest + ".fetch", t));
  NONSTOP_RETURN_IF_ERROR(ReceiveData(s, *wr, endpoint, "a fetch"));
  NONSTOP_RETURN_IF_ERROR(wr->Finish(dest, endpoint));
  return where;
}

}  // namespace

Result<std::vector<HeldReplica>> ListReplicas(const std::string& endpoint, const std::string& job,
                                              const std::string& secret, double timeout_s) {
  return ListAt(endpoint, job, secret, timeout_s, Source::kReplica);
}

Result<std::vector<HeldReplica>> ListOwnSegments(const std::string& endpoint,
                                                 const std::string& job,
                                                 const std::string& secret, double timeout_s) {
  return ListAt(endpoint, job, secret, timeout_s, Source::kSegment);
}

Result<std::vector<HeldReplica>> ListDiskFiles(const std::string& endpoint, const std::string& job,
                                               const std::string& secret, double timeout_s) {
  return ListAt(endpoint, job, secret, timeout_s, Source::kDisk);
}

Result<std::string> FetchReplica(const std::string& endpoint, const std::string& job,
                                 const std::string& secret, uint32_t world_size,
                                 uint32_t source_rank, std::optional<int64_t> step,
                                 const std::string& local_dir, Env* env, double timeout_s) {
  return FetchTo(endpoint, job, secret, world_size, source_rank, step, Source::kReplica, local_dir,
                 "peer", "*", env, timeout_s);
}

Result<std::string> FetchInto(const std::string& endpoint, const std::string& job,
                              const std::string& secret, uint32_t world_size,
                              uint32_t source_rank, std::optional<int64_t> step, Source source,
                              const std::string& local_dir, const std::string& sub, Env* env,
                              double timeout_s) {
  NONSTOP_ASSIGN_OR_RETURN(std::string d, FetchTo(endpoint, job, secret, world_size, source_rank,
                                                  step, source, local_dir, sub, "", env, timeout_s));
  return d + "/" + SlotFileName(static_cast<int>(source_rank));
}

namespace {

// Whether `dir`/`rel...`/`name` is a complete copy of exactly this
// checkpoint (any counter when `counter` is nullopt).
bool IsCopyOf(Directory& dir, const std::vector<std::string>& rel, const std::string& name,
              uint32_t world_size, uint32_t source_rank, int64_t step,
              std::optional<uint64_t> counter) {
  std::unique_ptr<Directory> sub;
  Directory* at = &dir;
  for (const std::string& r : rel) {
    Result<std::unique_ptr<Directory>> next = at->OpenDir(r, false);
    if (!next.ok()) return false;
    sub = std::move(next).value();
    at = sub.get();
  }
  Result<FileStat> st = at->Stat(name);
  if (!st.ok() || st.value().type != EntryType::kFile) return false;
  auto got = OpenNewest(*at, name);
  if (!got.ok()) return false;
  const CheckpointInfo& i = got.value().second;
  return i.world_size == world_size && i.rank == source_rank && i.step == step &&
         (!counter || i.counter == *counter);
}

// The holder line of lock file `lock` in `dir` (who took it last: the rank
// that fetched the copy beside it), or "another rank of this host".
std::string LockHolder(Directory& dir, const std::string& lock) {
  const std::string unknown = "another rank of this host";
  MediumOptions ro;
  ro.read_only = true;
  Result<std::unique_ptr<Medium>> m = dir.OpenFile(lock, MediumKind::kBuffered, ro);
  if (!m.ok()) return unknown;
  std::string line(std::min<uint64_t>(m.value()->Size(), 256), '\0');
  if (line.empty() || !m.value()->Read(0, line.data(), line.size()).ok()) return unknown;
  line.resize(std::min(line.find('\n'), line.size()));
  return line.empty() ? unknown : line;
}

}  // namespace

Result<SharedCopy> OncePerHost(const OncePerHostCopy& c, const CopyFetch& fetch) {
  Env* env = c.env != nullptr ? c.env : DefaultEnv();
  NONSTOP_RETURN_IF_ERROR(CheckJob(c.job));
  const std::string shared = SharedReshardDir(c.job);
  const std::string name = SlotFileName(static_cast<int>(c.source_rank));
  const std::string lock = "rank-" + name.substr(5, 5) + ".lock";
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> base, env->OpenDirectory(c.mem_dir, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> top, base->OpenDir(shared, true));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d, top->OpenDir(c.sub, true));
  const auto is_copy = [&] {
    return IsCopyOf(*d, c.rel, name, c.world_size, c.source_rank, c.step, c.counter);
  };
  std::string path = c.mem_dir + "/" + shared + "/" + c.sub + "/";
  for (const std::string& r : c.rel) path += r + "/";
  path += name;
  const auto t0 = std::chrono::steady_clock::now();
  std::string by;  // the lock file's holder line, as the last refusal named it
  while (true) {
    if (is_copy()) return SharedCopy{path, false, by.empty() ? LockHolder(*d, lock) : by};
    Result<std::unique_ptr<FileLock>> l = d->Lock(lock, c.holder);
    if (l.ok()) {
      // Another rank may have finished between the look and the lock.
      if (is_copy()) return SharedCopy{path, false, by.empty() ? "another rank of this host" : by};
      NONSTOP_ASSIGN_OR_RETURN(std::string got, fetch(c.mem_dir + "/" + shared, c.sub));
      if (!is_copy()) {
        (void)d->Unlink(name);
        return Status::NotFound(c.what + ": rank " + std::to_string(c.source_rank) +
                                " of world size " + std::to_string(c.world_size) + " step " +
                                std::to_string(c.step) +
                                (c.counter ? " is not of counter " + std::to_string(*c.counter)
                                           : " is not what was fetched") +
                                " there");
      }
      return SharedCopy{got, true, c.holder};
    }
    // Held: another rank of this host fetches it (its line names it).
    // Anything else (a link planted at the lock's name): fetched alone.
    const std::string& msg = l.status().message();
    const size_t at = msg.find(" is locked by ");
    if (l.status().code() != StatusCode::kFailedPrecondition || at == std::string::npos) break;
    // The holder's line, unless the refusal fell between its flock and its
    // write (then the line is read from the lock file once the copy is there).
    std::string line = msg.substr(at + 14, msg.find(": another nonstop", at) - (at + 14));
    if (line != kNoHolderLine) by = std::move(line);
    if (Since(t0) >= c.wait_s) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Waited long enough (or no lock to take): fetched into this rank's own
  // directory instead.
  NONSTOP_ASSIGN_OR_RETURN(std::string got, fetch(c.fallback_dir, c.sub));
  return SharedCopy{got, true, c.holder};
}

Result<SharedCopy> FetchOncePerHost(const std::string& endpoint, const std::string& job,
                                    const std::string& secret, uint32_t world_size,
                                    uint32_t source_rank, int64_t step, uint64_t counter,
                                    Source source, const std::string& mem_dir,
                                    const std::string& fallback_dir, const std::string& holder,
                                    Env* env, double timeout_s, double wait_s) {
  OncePerHostCopy c;
  c.job = job;
  c.sub = "w" + std::to_string(world_size) + "-s" + std::to_string(step) + "-c" +
          std::to_string(counter);
  c.world_size = world_size;
  c.source_rank = source_rank;
  c.step = step;
  c.counter = counter;
  c.mem_dir = mem_dir;
  c.fallback_dir = fallback_dir;
  c.holder = holder;
  c.what = "peer " + endpoint;
  c.env = env;
  c.wait_s = wait_s;
  return OncePerHost(c, [&](const std::string& parent, const std::string& sub) {
    return FetchInto(endpoint, job, secret, world_size, source_rank, step, source, parent, sub,
                     env, timeout_s);
  });
}

// ---------------------------------------------------------------- replicator

struct Replicator::Impl {
  ReplicatorOptions o;
  Env* env = nullptr;
  std::thread thread;

  struct Partner {
    std::string endpoint;
    w::Socket sock;              // the connection, kept between pushes (loop thread)
    uint64_t held_counter = 0;   // the checkpoint it holds (or refused for its budget)
    std::chrono::steady_clock::time_point retry_at{};
  };
  std::vector<Partner> partners;  // loop thread only, but for Close's Shutdown (under mu)

  mutable Mutex mu;
  CondVar cv;
  bool stop GUARDED_BY(mu) = false;
  uint64_t requested GUARDED_BY(mu) = 0;  // rounds asked for (Notify, Drain)
  uint64_t completed GUARDED_BY(mu) = 0;  // the newest round finished
  ReplicatorStats stats GUARDED_BY(mu);
  uint64_t seen_unsent GUARDED_BY(mu) = 0;  // a counter seen and not yet on every partner
  uint64_t seen_cadence = 0;                // loop thread: the last counter the cadence skipped
  // Loop thread: the newest checkpoint seen and its commit time, and the
  // interval between commits they give (ReplicatorOptions::spread_s).
  uint64_t pace_counter = 0, pace_commit_ns = 0;
  double commit_interval_s = 0;

  void Loop();
  void Round();
  uint64_t Pace(const CheckpointInfo& info);
};

Result<std::unique_ptr<Replicator>> Replicator::Start(const ReplicatorOptions& o) {
  NONSTOP_RETURN_IF_ERROR(CheckJob(o.job));
  NONSTOP_RETURN_IF_ERROR(w::CheckSecret(o.secret));
  for (const std::string& p : o.partners) NONSTOP_RETURN_IF_ERROR(ParseEndpoint(p).status());
  if (o.segment.empty()) return Status::InvalidArgument("peer replicator: no memory segment");
  std::unique_ptr<Replicator> r(new Replicator());
  r->impl_ = std::make_unique<Impl>();
  Impl& m = *r->impl_;
  m.o = o;
  m.env = o.env != nullptr ? o.env : DefaultEnv();
  for (const std::string& p : o.partners) m.partners.push_back(Impl::Partner{p, {}, 0, {}});
  m.thread = std::thread([p = &m] { p->Loop(); });
  return r;
}

Replicator::~Replicator() { Close(); }

void Replicator::Notify() {
  MutexLock l(&impl_->mu);
  ++impl_->requested;
  impl_->cv.SignalAll();
}

bool Replicator::Drain(double timeout_s) {
  Impl& m = *impl_;
  MutexLock l(&m.mu);
  const uint64_t want = ++m.requested;
  m.cv.SignalAll();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(static_cast<int64_t>(std::max(0.0, timeout_s) * 1e6));
  while (m.completed < want && !m.stop) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    (void)m.cv.WaitFor(&m.mu, deadline - now);
  }
  return m.completed >= want;
}

ReplicatorStats Replicator::stats() const {
  MutexLock l(&impl_->mu);
  return impl_->stats;
}

void Replicator::Close() {
  Impl& m = *impl_;
  {
    MutexLock l(&m.mu);
    if (m.stop) return;
    m.stop = true;
    for (Impl::Partner& p : m.partners) p.sock.Shutdown();  // cut a push in progress
    m.cv.SignalAll();
  }
  if (m.thread.joinable()) m.thread.join();
}

void Replicator::Impl::Loop() {
  // Replication yields the CPU to training (ReplicatorOptions::nice); the
  // push's helper threads inherit it.
  tier::LowerThreadPriority(o.nice);
  MutexLock l(&mu);
  for (;;) {
    if (stop) break;
    if (completed >= requested) {
      (void)cv.WaitFor(&mu, std::chrono::microseconds(static_cast<int64_t>(o.poll_s * 1e6)));
      if (stop) break;
    }
    const uint64_t round = requested;
    l.Unlock();
    Round();
    l.Lock();
    completed = std::max(completed, round);
    cv.SignalAll();
  }
  completed = requested;
  cv.SignalAll();
}

uint64_t Replicator::Impl::Pace(const CheckpointInfo& info) {
  if (info.counter > pace_counter) {
    if (pace_counter != 0 && info.commit_unix_ns > pace_commit_ns) {
      commit_interval_s = static_cast<double>(info.commit_unix_ns - pace_commit_ns) / 1e9 /
                          static_cast<double>(info.counter - pace_counter);
    }
    pace_counter = info.counter;
    pace_commit_ns = info.commit_unix_ns;
  }
  if (o.bps > 0) return o.bps;
  if (o.spread_s <= 0) return 0;
  const double over = std::max(o.spread_s, commit_interval_s * std::max<uint32_t>(1, o.every));
  return std::max(o.spread_min_bps,
                  static_cast<uint64_t>(static_cast<double>(info.data_bytes) / over));
}

void Replicator::Impl::Round() {
  if (partners.empty()) return;
  auto got = OpenNewestAt(o.segment, env);
  if (!got.ok()) return;  // no segment (yet) or nothing committed in it: nothing to send
  SlotFile& file = *got.value().first;
  const CheckpointInfo& info = got.value().second;
  const uint64_t pace = Pace(info);
  // The cadence (ReplicatorOptions::every): a partner takes a checkpoint
  // only `every` counters after the one it holds.
  const auto due = [&](const Partner& p) {
    return p.held_counter == 0 || info.counter < p.held_counter ||
           info.counter >= p.held_counter + std::max<uint32_t>(1, o.every);
  };
  if (std::none_of(partners.begin(), partners.end(), due)) {
    const bool held_by_all = std::all_of(partners.begin(), partners.end(),
                                         [&](const Partner& p) { return p.held_counter == info.counter; });
    if (!held_by_all && seen_cadence != info.counter) {
      seen_cadence = info.counter;
      MutexLock l(&mu);
      ++stats.skipped_cadence;
    }
    return;
  }
  {
    MutexLock l(&mu);
    if (seen_unsent != 0 && seen_unsent != info.counter) ++stats.skipped;  // superseded unsent
    seen_unsent = info.counter;
  }
  bool all = true;
  std::vector<std::string> noted;  // partners that hold it now: noted in the job manifest below
  for (Partner& p : partners) {
    if (p.held_counter == info.counter) continue;
    if (!due(p)) {
      all = false;
      continue;
    }
    if (std::chrono::steady_clock::now() < p.retry_at) {
      all = false;
      continue;
    }
    {
      MutexLock l(&mu);
      if (stop) return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    PushOutcome out = PushOutcome::kStored;
    Status s;
    // A kept connection the server closed meanwhile fails at once: one new try.
    for (int attempt = 0; attempt < 2; ++attempt) {
      const bool reused = p.sock.valid();
      if (!reused) {
        Result<w::Socket> c =
            Dial(p.endpoint, o.job, o.secret, o.push.connect_timeout_s, o.push.io_timeout_s);
        if (!c.ok()) {
          s = c.status();
          break;
        }
        MutexLock l(&mu);
        if (stop) return;
        p.sock = std::move(c).value();
      }
      // The pace (ReplicatorOptions::bps): whole frames at the link's
      // speed, then a wait until their bytes at `pace` have taken their time
      // (cut short by Close).
      const auto start = std::chrono::steady_clock::now();
      uint64_t paced_bytes = 0;
      const auto after = [&](uint64_t n) -> Status {
        paced_bytes += n;
        const auto until = start + std::chrono::microseconds(static_cast<int64_t>(
                                       static_cast<double>(paced_bytes) / static_cast<double>(pace) * 1e6));
        MutexLock l(&mu);
        while (!stop && std::chrono::steady_clock::now() < until) {
          (void)cv.WaitFor(&mu, until - std::chrono::steady_clock::now());
        }
        return stop ? Status::IOError("peer replicator: closed") : Status::OK();
      };
      s = SendPush(p.sock, o.job, file, info, &out,
                   pace > 0 ? std::function<Status(uint64_t)>(after) : nullptr);
      if (s.ok()) break;
      {
        MutexLock l(&mu);
        p.sock.Close();
      }
      if (!reused || s.code() != StatusCode::kIOError) break;
    }
    const double secs = Since(t0);
    MutexLock l(&mu);
    if (!s.ok()) {
      all = false;
      ++stats.failures;
      stats.last_error = s.ToString();
      p.retry_at = std::chrono::steady_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(o.retry_s * 1e6));
      continue;
    }
    p.held_counter = info.counter;
    if (out != PushOutcome::kSkippedBudget) noted.push_back(p.endpoint);
    if (out == PushOutcome::kStored) {
      ++stats.replicated;
      stats.bytes += info.data_bytes;
      stats.send_s_total += secs;
    } else if (out == PushOutcome::kSkippedBudget) {
      ++stats.skipped_budget;
      all = false;
    }
  }
  // The job manifest (jobdir/manifest.h), off the training thread: which
  // checkpoint each partner holds now.
  for (const std::string& ep : noted) {
    if (o.job_dir.empty()) break;
    ManifestHolder h;
    h.tier = "peer";
    h.where = ep;
    h.unix_s = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    h.held.push_back(ManifestHeld{info.step, info.counter});
    Status ns = NoteHeld(o.env, o.job_dir, static_cast<int>(o.rank), "", std::move(h));
    if (!ns.ok()) {
      MutexLock l(&mu);
      stats.last_error = "noting the replica in the job manifest: " + ns.message();
    }
  }
  if (all) {
    const double now_s =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const double lag = std::max(0.0, now_s - static_cast<double>(info.commit_unix_ns) / 1e9);
    MutexLock l(&mu);
    stats.last_step = info.step;
    stats.last_counter = info.counter;
    stats.lag_s_last = lag;
    stats.lag_s_max = std::max(stats.lag_s_max, lag);
    seen_unsent = 0;
  }
}

// ---------------------------------------------------------------- partners

namespace {

// The first IPv4 address of `host` as text, with `port` (UDP); nullopt when none.
std::optional<sockaddr_in> Resolve4(const char* host, const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host, port.c_str(), &hints, &res) != 0 || res == nullptr) return std::nullopt;
  sockaddr_in a{};
  std::memcpy(&a, res->ai_addr, sizeof(a));
  ::freeaddrinfo(res);
  return a;
}

std::string Text4(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = {};
  return ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof(buf)) != nullptr ? buf : "";
}

std::string Getenv(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

std::string HostName() {
  char name[256] = {};
  return ::gethostname(name, sizeof(name) - 1) == 0 ? name : "";
}

}  // namespace

std::string LocalAddress() {
  if (const std::string a = Getenv("NONSTOP_PEER_ADDR"); !a.empty()) return a;
  if (const std::string master = Getenv("MASTER_ADDR"); !master.empty()) {
    std::string port = Getenv("MASTER_PORT");
    if (port.empty()) port = "29500";
    if (std::optional<sockaddr_in> to = Resolve4(master.c_str(), port)) {
      const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      sockaddr_in me{};
      socklen_t len = sizeof(me);
      const bool ok = fd >= 0 &&
                      ::connect(fd, reinterpret_cast<const sockaddr*>(&*to), sizeof(*to)) == 0 &&
                      ::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0;
      if (fd >= 0) ::close(fd);
      if (ok) return Text4(me);
    }
  }
  const std::string host = HostName();
  if (std::optional<sockaddr_in> a = host.empty() ? std::nullopt : Resolve4(host.c_str(), "0")) {
    return Text4(*a);
  }
  return "127.0.0.1";
}

std::string HostId(const std::string& addr) {
  if (std::string id = Getenv("NONSTOP_HOST_ID"); !id.empty()) return id;
  return HostName() + "@" + addr;
}

std::vector<std::vector<uint32_t>> ChoosePartners(const std::vector<std::string>& hosts,
                                                  int replicas) {
  std::vector<std::vector<uint32_t>> out(hosts.size());
  // Hosts in order of their first rank; each host's ranks in rank order.
  std::vector<std::string> order;
  std::map<std::string, size_t> index;
  std::vector<std::vector<uint32_t>> ranks_of;
  std::vector<size_t> host_of(hosts.size()), local(hosts.size());
  for (size_t r = 0; r < hosts.size(); ++r) {
    auto [it, added] = index.emplace(hosts[r], order.size());
    if (added) {
      order.push_back(hosts[r]);
      ranks_of.emplace_back();
    }
    host_of[r] = it->second;
    local[r] = ranks_of[it->second].size();
    ranks_of[it->second].push_back(static_cast<uint32_t>(r));
  }
  const size_t h = order.size();
  const size_t k_max = replicas <= 0 ? 0 : std::min<size_t>(static_cast<size_t>(replicas), h - 1);
  for (size_t r = 0; r < hosts.size(); ++r) {
    for (size_t k = 1; k <= k_max; ++k) {
      const std::vector<uint32_t>& g = ranks_of[(host_of[r] + k) % h];
      out[r].push_back(g[local[r] % g.size()]);
    }
  }
  return out;
}

// ---------------------------------------------------------------- this host's copies

Result<std::vector<LocalCopy>> ListLocal(const std::string& job, bool own,
                                         const std::vector<std::string>& segments,
                                         const std::string& dir, Env* env) {
  if (env == nullptr) env = DefaultEnv();
  for (const std::string& seg : segments) {
    if (seg.empty() || seg == "." || seg == ".." || seg.find('/') != std::string::npos) {
      return Status::InvalidArgument("peer: own segment '" + seg.substr(0, 64) +
                                     "' is not an entry name of the memory directory");
    }
  }
  const std::string where = PeerMemoryDir(dir);
  Result<std::unique_ptr<Directory>> d = env->OpenDirectory(where, false);
  if (!d.ok() && d.status().code() == StatusCode::kNotFound) return std::vector<LocalCopy>{};
  NONSTOP_RETURN_IF_ERROR(d.status());
  std::vector<std::string> names;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<HeldReplica> held,
                           own ? ListSegmentsIn(*d.value(), segments, &names)
                               : ListReplicasIn(*d.value(), JobKey(job), &names));
  std::vector<LocalCopy> out;
  for (size_t i = 0; i < held.size(); ++i) {
    out.push_back(LocalCopy{held[i], where + "/" + names[i]});
  }
  return out;
}

Status VerifyLocal(const std::string& path, uint32_t source_rank, int64_t step, Env* env) {
  if (env == nullptr) env = DefaultEnv();
  const size_t cut = path.rfind('/');
  if (path.empty() || path[0] != '/' || cut == std::string::npos || cut + 1 == path.size()) {
    return Status::InvalidArgument("peer: '" + path + "' is not an absolute path of a file");
  }
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Directory> d,
                           env->OpenDirectory(cut == 0 ? "/" : path.substr(0, cut), false));
  auto got = OpenNewest(*d, path.substr(cut + 1));
  NONSTOP_RETURN_IF_ERROR(got.status());
  const CheckpointInfo& info = got.value().second;
  if (info.rank != source_rank || info.step != step) {
    return Status::NotFound(path + " holds rank " + std::to_string(info.rank) + " step " +
                            std::to_string(info.step) + ", not rank " +
                            std::to_string(source_rank) + " step " + std::to_string(step));
  }
  Status st = got.value().first->ReadData(info, 0, nullptr, info.data_bytes, /*verify=*/true);
  return st.ok() ? st : st.Annotate(path);
}

}  // namespace nonstop::peer
