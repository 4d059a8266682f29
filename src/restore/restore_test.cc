// The restore path: one read per chunk into the destinations, parallel
// pieces, small tensors batched, fallback to an older checkpoint on a
// checksum failure mid-read (into the same memory), and the error when no
// checkpoint is left.
#include "nonstop/restore.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <fstream>
#include <iterator>
#include <filesystem>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/jobdir.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using testing::MakeCheckpoint;
using testing::TestCheckpoint;

class RestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("nonstop-restore-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::unique_ptr<SlotFile> NewSlotFile(JobDir& jd, uint64_t slot_bytes = testing::kTestSlotBytes) {
    auto m = jd.CreateTempSlot(MediumKind::kBuffered);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    StoreGeometry g;
    g.slots = 3;
    g.slot_bytes = slot_bytes;
    auto sf = SlotFile::Create(std::move(m).value(), g);
    EXPECT_TRUE(sf.ok()) << sf.status().ToString();
    EXPECT_TRUE(jd.PublishTempSlot().ok());
    return std::move(sf).value();
  }

  static CheckpointInfo Commit(SlotFile& f, const TestCheckpoint& c, uint64_t counter) {
    const uint32_t slot = static_cast<uint32_t>(counter % f.geometry().slots);
    EXPECT_TRUE(f.WriteData(slot, 0, c.data.data(), c.data.size()).ok());
    auto info = f.Commit(testing::MakeCommitRequest(c, slot, counter));
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    return info.value();
  }

  // Flips one byte of tensor `t`'s data in the file.
  static void FlipByte(SlotFile& f, const CheckpointInfo& info, size_t t) {
    uint8_t b = 0;
    const uint64_t at = info.data_offset + info.tensors[t].data_offset + info.tensors[t].spec.nbytes / 2;
    ASSERT_TRUE(f.medium().Read(at, &b, 1).ok());
    b ^= 0x40;
    ASSERT_TRUE(f.medium().Write(at, &b, 1).ok());
    ASSERT_TRUE(f.medium().Sync().ok());
  }

  // Commits `older` (step 6) and then step 7, the same tensors with other
  // bytes, and damages step 7's last tensor (written last: a chunk-by-chunk
  // read has written the others into the destinations when it fails).
  // Returns step 7's info.
  static CheckpointInfo CommitOlderAndDamagedNewer(SlotFile& f, const TestCheckpoint& older) {
    TestCheckpoint newer = older;
    newer.step = 7;
    for (auto& b : newer.data) b = static_cast<uint8_t>(b ^ 0x5A);
    newer.crcs = testing::ChunkCrcs(newer.data, testing::kTestCrcChunk);
    Commit(f, older, 1);
    const CheckpointInfo ni = Commit(f, newer, 2);
    FlipByte(f, ni, ni.tensors.size() - 1);
    return ni;
  }

  fs::path root_;
};

// Destinations for every tensor of `info`, filled with a marker byte.
struct Dest {
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<void*> ptrs;
  explicit Dest(const CheckpointInfo& info) {
    for (const auto& te : info.tensors) bufs.emplace_back(te.spec.nbytes, 0xEE);
    for (auto& b : bufs) ptrs.push_back(b.data());
  }
};

bool Holds(const Dest& d, const TestCheckpoint& want) {
  for (size_t i = 0; i < want.layout.tensors.size(); ++i) {
    const TensorEntry& te = want.layout.tensors[i];
    if (d.bufs[i].size() != te.spec.nbytes) return false;
    if (te.spec.nbytes && std::memcmp(d.bufs[i].data(), want.data.data() + te.data_offset,
                                      te.spec.nbytes) != 0) {
      return false;
    }
  }
  return true;
}

TEST_F(RestoreTest, ReadsEveryTensorOnceWithAnyPieceSize) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  for (int64_t step : {3, 8, 21}) {
    const TestCheckpoint c = MakeCheckpoint(step);
    const CheckpointInfo info = Commit(*f, c, static_cast<uint64_t>(step));
    for (uint64_t piece : {uint64_t{1}, uint64_t{16 << 10}, uint64_t{48 << 10}, uint64_t{8 << 20}}) {
      for (int threads : {1, 3}) {
        Dest d(info);
        RestoreOptions o;
        o.piece_bytes = piece;
        o.threads = threads;
        RestoreStats st;
        ASSERT_TRUE(ReadCheckpointInto(*f, info, d.ptrs, o, &st).ok());
        EXPECT_TRUE(Holds(d, c)) << "step " << step << " piece " << piece;
        EXPECT_EQ(st.data_bytes, info.data_bytes);  // every chunk once, no more
        uint64_t want = 0;
        for (const auto& te : info.tensors) want += te.spec.nbytes;
        EXPECT_EQ(st.tensor_bytes, want);
      }
    }
  }
}

// Test helpers on the file by path (test code; nonstop's own file work goes
// through the Env): whether the file system takes O_DIRECT, and dropping a
// file's pages from the page cache so that a read of it is cold.
bool DirectWorks(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}
void DropCache(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::fdatasync(fd), 0);
  EXPECT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
}

// A cold checkpoint is read with O_DIRECT (a second medium on the same file,
// opened through the job directory), every chunk verified; an O_DIRECT read
// that does not verify is read again buffered, so it never fails a restore
// that the slot file's own bytes pass (here the O_DIRECT medium is a copy of
// the file with one byte changed).
TEST_F(RestoreTest, ColdPiecesAreReadWithODirectAndAFailedOneIsReadAgainBuffered) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const fs::path slot = root_ / JobDirNames::Slot(0);
  if (!DirectWorks(slot)) GTEST_SKIP() << "the file system of " << root_ << " refuses O_DIRECT";
  const TestCheckpoint c = MakeCheckpoint(5);
  const CheckpointInfo info = Commit(*f, c, 5);
  auto reader = JobDir::OpenForRead(root_.string()).value();
  Dest d(info);
  RestoreOptions o;
  o.direct = true;
  o.threads = 2;
  o.piece_bytes = 16 << 10;
  auto r = RestoreFromJobDir(*reader, 0, {}, [&](const Selected&) -> Result<std::vector<void*>> {
    DropCache(slot);  // after the selection read the table, before the data is read
    return d.ptrs;
  }, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(Holds(d, c));
  EXPECT_EQ(r->stats.data_bytes, info.data_bytes);
  EXPECT_GT(r->stats.odirect_bytes, 0u);
  EXPECT_EQ(r->stats.retried_pieces, 0u);

  // The O_DIRECT medium is another file whose bytes differ in one tensor.
  std::string bytes;
  {
    std::ifstream in(slot, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[info.data_offset + info.tensors[0].data_offset + info.tensors[0].spec.nbytes / 2] ^= 0x40;
  {
    std::ofstream out(root_ / "other", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  auto dir = DefaultEnv()->OpenDirectory(root_.string(), false).value();
  MediumOptions ro;
  ro.read_only = true;
  auto other = dir->OpenFile("other", MediumKind::kDirect, ro);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  DropCache(slot);
  DropCache(root_ / "other");
  Dest d2(info);
  RestoreOptions o2 = o;
  o2.direct_medium = other.value().get();
  RestoreStats st;
  ASSERT_TRUE(ReadCheckpointInto(*f, info, d2.ptrs, o2, &st).ok());
  EXPECT_TRUE(Holds(d2, c));
  EXPECT_GE(st.retried_pieces, 1u);
  EXPECT_GT(st.odirect_bytes, 0u);
  EXPECT_EQ(st.data_bytes, info.data_bytes);
}

// A medium that hands out its inner medium's read queue (the real io_uring
// one) behind a tap: it records how many reads were in flight at once, and
// can fail the result of the n-th read or damage its bytes once it arrived.
class TapMedium final : public Medium {
 public:
  explicit TapMedium(Medium& in) : in_(in) {}
  Status Write(uint64_t o, const void* b, size_t n) override { return in_.Write(o, b, n); }
  Status Read(uint64_t o, void* b, size_t n) override { return in_.Read(o, b, n); }
  Status Sync() override { return in_.Sync(); }
  Status Resize(uint64_t n) override { return in_.Resize(n); }
  uint64_t Size() const override { return in_.Size(); }
  size_t Alignment() const override { return in_.Alignment(); }
  MediumKind kind() const override { return in_.kind(); }
  std::string Describe() const override { return "tap on " + in_.Describe(); }
  std::unique_ptr<ReadQueue> OpenReadQueue(unsigned depth) override;

  int fail_nth = -1, damage_nth = -1;  // 0-based over every read submitted
  std::atomic<int> submitted{0};
  std::atomic<unsigned> max_outstanding{0};

 private:
  Medium& in_;
};

class TapQueue final : public ReadQueue {
 public:
  TapQueue(std::unique_ptr<ReadQueue> in, TapMedium& m) : in_(std::move(in)), m_(m) {}
  Status Submit(uint64_t offset, void* buf, size_t n, uint64_t tag) override {
    NONSTOP_RETURN_IF_ERROR(in_->Submit(offset, buf, n, tag));
    reads_[tag] = Read{m_.submitted++, static_cast<uint8_t*>(buf), n};
    unsigned cur = m_.max_outstanding.load();
    while (cur < in_->outstanding() && !m_.max_outstanding.compare_exchange_weak(cur, in_->outstanding())) {
    }
    return Status::OK();
  }
  Result<ReadDone> Next() override {
    NONSTOP_ASSIGN_OR_RETURN(ReadDone d, in_->Next());
    const Read r = reads_.at(d.tag);
    if (d.status.ok() && r.nth == m_.fail_nth) d.status = Status::IOError("injected read error");
    if (d.status.ok() && r.nth == m_.damage_nth) r.buf[r.n / 2] ^= 0x40;
    return d;
  }
  unsigned depth() const override { return in_->depth(); }
  unsigned outstanding() const override { return in_->outstanding(); }

 private:
  struct Read {
    int nth;
    uint8_t* buf;
    size_t n;
  };
  std::unique_ptr<ReadQueue> in_;
  TapMedium& m_;
  std::map<uint64_t, Read> reads_;
};

std::unique_ptr<ReadQueue> TapMedium::OpenReadQueue(unsigned depth) {
  return std::make_unique<TapQueue>(in_.OpenReadQueue(depth), *this);
}

// The deep queue: with a cold file, one thread keeps its whole share of
// O_DIRECT reads (io_uring) in flight, the data arrives bit-exact, every
// chunk once, including a last piece shorter than the others; a read that
// fails and one whose bytes are damaged are each read again buffered.
TEST_F(RestoreTest, ADeepQueueOfODirectReadsIsBitExactAndFailedReadsAreReadAgainBuffered) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const fs::path slot = root_ / JobDirNames::Slot(0);
  if (!DirectWorks(slot)) GTEST_SKIP() << "the file system of " << root_ << " refuses O_DIRECT";
  auto dir = DefaultEnv()->OpenDirectory(root_.string(), false).value();
  MediumOptions ro;
  ro.read_only = true;
  auto uring = dir->OpenFile(JobDirNames::Slot(0), MediumKind::kUring, ro);
  if (!uring.ok()) GTEST_SKIP() << "io_uring: " << uring.status().ToString();
  bool short_last = false;
  for (int64_t step : {4, 9, 14, 23}) {
    const TestCheckpoint c = MakeCheckpoint(step);
    const CheckpointInfo info = Commit(*f, c, static_cast<uint64_t>(step));
    const uint64_t piece = 2 * testing::kTestCrcChunk;
    short_last = short_last || info.data_bytes % piece != 0;
    for (int faults = 0; faults < 2; ++faults) {
      TapMedium tap(*uring.value());
      if (faults) {
        tap.fail_nth = 1;
        tap.damage_nth = 3;
      }
      RestoreOptions o;
      o.threads = 1;
      o.piece_bytes = piece;
      o.queue_depth = 4;
      o.direct_medium = &tap;
      DropCache(slot);
      Dest d(info);
      RestoreStats st;
      Status s = ReadCheckpointInto(*f, info, d.ptrs, o, &st);
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_TRUE(Holds(d, c)) << "step " << step << " faults " << faults;
      EXPECT_EQ(st.data_bytes, info.data_bytes);
      const uint64_t pieces = (info.data_bytes + piece - 1) / piece;
      EXPECT_EQ(st.pieces, pieces);
      // Every piece was cold: each went into the queue, up to 4 at once.
      EXPECT_EQ(tap.submitted.load(), static_cast<int>(pieces)) << "step " << step;
      EXPECT_EQ(tap.max_outstanding.load(), std::min<unsigned>(4, pieces)) << "step " << step;
      // The 2nd read failed and the 4th was damaged (where there are so many).
      auto len = [&](uint64_t k) { return k < pieces ? std::min(piece, info.data_bytes - k * piece) : 0; };
      const uint64_t retried = faults ? (pieces > 1) + (pieces > 3) : 0;
      const uint64_t retried_bytes = faults ? len(1) + len(3) : 0;
      EXPECT_EQ(st.retried_pieces, retried) << "step " << step;
      EXPECT_EQ(st.odirect_bytes, info.data_bytes - retried_bytes) << "step " << step;
    }
  }
  EXPECT_TRUE(short_last) << "no checkpoint had a short last piece";
}

// A chunk damaged in the file itself fails its O_DIRECT read and its
// buffered read again: the restore falls back to the older checkpoint, into
// the same memory, as with buffered reads.
TEST_F(RestoreTest, ADamagedChunkReadColdThroughTheQueueFallsBackToTheOlderCheckpoint) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const fs::path slot = root_ / JobDirNames::Slot(0);
  if (!DirectWorks(slot)) GTEST_SKIP() << "the file system of " << root_ << " refuses O_DIRECT";
  const TestCheckpoint older = MakeCheckpoint(6);
  const CheckpointInfo ni = CommitOlderAndDamagedNewer(*f, older);
  auto reader = JobDir::OpenForRead(root_.string()).value();
  Dest d(ni);
  std::vector<int64_t> prepared;
  RestoreOptions o;
  o.direct = true;
  o.threads = 2;
  o.piece_bytes = 1;
  o.queue_depth = 8;
  auto r = RestoreFromJobDir(*reader, 0, {}, [&](const Selected& s) -> Result<std::vector<void*>> {
    prepared.push_back(s.info.step);
    DropCache(slot);
    return d.ptrs;
  }, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->chosen.has_value());
  EXPECT_EQ(r->chosen->info.step, 6);
  EXPECT_EQ(prepared, (std::vector<int64_t>{7, 6}));
  EXPECT_TRUE(Holds(d, older));
  EXPECT_GT(r->stats.odirect_bytes, 0u);
  ASSERT_FALSE(r->skipped.empty());
  EXPECT_NE(r->skipped[0].find("checksum mismatch"), std::string::npos) << r->skipped[0];
}

// A window of the data region (nonstop export's bounded reads): only its
// chunks are read, the tensors inside it arrive whole, and a kept tensor
// outside it is refused before anything is read.
TEST_F(RestoreTest, ReadsOnlyTheRangeAskedFor) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const TestCheckpoint c = MakeCheckpoint(5);
  const CheckpointInfo info = Commit(*f, c, 5);
  ASSERT_GE(info.tensors.size(), 2u);
  const TensorEntry& last = info.tensors.back();
  RestoreOptions o;
  o.piece_bytes = 1;
  o.data_begin = last.data_offset;
  o.data_end = last.data_offset + last.spec.nbytes;
  Dest d(info);
  for (size_t i = 0; i + 1 < info.tensors.size(); ++i) d.ptrs[i] = nullptr;
  RestoreStats st;
  ASSERT_TRUE(ReadCheckpointInto(*f, info, d.ptrs, o, &st).ok());
  EXPECT_EQ(0, std::memcmp(d.bufs.back().data(), c.data.data() + last.data_offset,
                           last.spec.nbytes));
  EXPECT_LT(st.data_bytes, info.data_bytes);
  const uint64_t cb = info.crc_chunk_bytes;
  EXPECT_LE(st.data_bytes, (last.spec.nbytes / cb + 2) * cb);
  // The first tensor kept, but outside the range: refused, nothing written.
  Dest all(info);
  Status s = ReadCheckpointInto(*f, info, all.ptrs, o);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(all.bufs[0], std::vector<uint8_t>(all.bufs[0].size(), 0xEE));
}

TEST_F(RestoreTest, ManySmallTensorsAreBatched) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 3000; ++i) {
    TensorSpec s;
    s.name = "block." + std::to_string(i) + ".ln.weight";
    s.dtype = DType::kFloat32;
    s.shape = {1 + i % 37};
    s.nbytes = static_cast<uint64_t>(s.shape[0]) * 4;
    specs.push_back(s);
  }
  TestCheckpoint c;
  c.step = 5;
  c.layout = SlotLayout::Plan(specs).value();
  c.data.assign(c.layout.data_bytes, 0);
  for (size_t i = 0; i < c.layout.tensors.size(); ++i) {
    testing::FillTensor(5, i, c.data.data() + c.layout.tensors[i].data_offset,
                        c.layout.tensors[i].spec.nbytes);
  }
  c.crcs = testing::ChunkCrcs(c.data, testing::kTestCrcChunk);
  c.meta_json = "{}";
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd, c.layout.data_bytes + (1 << 20));
  const CheckpointInfo info = Commit(*f, c, 1);
  Dest d(info);
  RestoreStats st;
  ASSERT_TRUE(ReadCheckpointInto(*f, info, d.ptrs, {}, &st).ok());
  EXPECT_TRUE(Holds(d, c));
  EXPECT_EQ(st.pieces, 1u);  // 3000 tensors, one read
}

TEST_F(RestoreTest, RefusesBadDestinationsAndOverlappingTensors) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const TestCheckpoint c = MakeCheckpoint(4);
  CheckpointInfo info = Commit(*f, c, 1);
  std::vector<void*> too_few(info.tensors.size() + 1, nullptr);
  EXPECT_EQ(ReadCheckpointInto(*f, info, too_few).code(), StatusCode::kInvalidArgument);
  // A hand-made table whose two tensors share bytes, or one past the region.
  CheckpointInfo bad = info;
  bad.tensors.push_back(bad.tensors[0]);
  bad.tensors.back().spec.name = "twin";
  std::vector<void*> none(bad.tensors.size(), nullptr);
  if (bad.tensors[0].spec.nbytes > 0) {
    EXPECT_EQ(ReadCheckpointInto(*f, bad, none).code(), StatusCode::kCorruption);
  }
  bad = info;
  bad.tensors[0].data_offset = bad.data_bytes;
  bad.tensors[0].spec.nbytes = 8;
  std::vector<void*> none2(bad.tensors.size(), nullptr);
  EXPECT_EQ(ReadCheckpointInto(*f, bad, none2).code(), StatusCode::kCorruption);
  // nullptr destinations: verified, nothing written.
  std::vector<void*> skip(info.tensors.size(), nullptr);
  RestoreStats st;
  EXPECT_TRUE(ReadCheckpointInto(*f, info, skip, {}, &st).ok());
  EXPECT_EQ(st.tensor_bytes, 0u);
  EXPECT_EQ(st.data_bytes, info.data_bytes);
}

TEST_F(RestoreTest, ChecksumFailureMidReadFallsBackIntoTheSameMemory) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  // Same tensor set for both steps: the older one is read into the same buffers.
  const TestCheckpoint older = MakeCheckpoint(6);
  const CheckpointInfo ni = CommitOlderAndDamagedNewer(*f, older);

  auto reader = JobDir::OpenForRead(root_.string()).value();
  Dest d(ni);
  std::vector<int64_t> prepared;
  RestoreOptions o;
  o.threads = 1;
  o.piece_bytes = 1;  // chunk by chunk, in order: the newer one is partly written
  auto r = RestoreFromJobDir(*reader, 0, {}, [&](const Selected& s) -> Result<std::vector<void*>> {
    prepared.push_back(s.info.step);
    return d.ptrs;
  }, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->chosen.has_value());
  EXPECT_EQ(r->chosen->info.step, 6);
  EXPECT_EQ(r->attempts, 2);
  EXPECT_EQ(prepared, (std::vector<int64_t>{7, 6}));
  EXPECT_TRUE(Holds(d, older));
  ASSERT_FALSE(r->skipped.empty());
  EXPECT_NE(r->skipped[0].find("checksum mismatch"), std::string::npos) << r->skipped[0];

  // Both damaged: the error says the destinations were partly overwritten.
  const CheckpointInfo oi = r->chosen->info;
  FlipByte(*f, oi, 0);
  auto bad = RestoreFromJobDir(*reader, 0, {}, [&](const Selected&) -> Result<std::vector<void*>> {
    return d.ptrs;
  }, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("partly overwritten"), std::string::npos)
      << bad.status().message();
  EXPECT_EQ(bad.status().message().find('\n'), std::string::npos);
}

TEST_F(RestoreTest, PrepareCorruptionFallsBackAndOtherErrorsStop) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  Commit(*f, MakeCheckpoint(1), 1);
  Commit(*f, MakeCheckpoint(2), 2);
  auto reader = JobDir::OpenForRead(root_.string()).value();
  std::vector<std::unique_ptr<Dest>> keep;
  auto r = RestoreFromJobDir(*reader, 0, {}, [&](const Selected& s) -> Result<std::vector<void*>> {
    if (s.info.step == 2) return Status::Corruption("metadata malformed");
    keep.push_back(std::make_unique<Dest>(s.info));
    return keep.back()->ptrs;
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->chosen->info.step, 1);
  EXPECT_TRUE(Holds(*keep.back(), MakeCheckpoint(1)));
  auto stop = RestoreFromJobDir(*reader, 0, {}, [&](const Selected&) -> Result<std::vector<void*>> {
    return Status::FailedPrecondition("shape differs");
  });
  ASSERT_FALSE(stop.ok());
  EXPECT_EQ(stop.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(stop.status().message().find("overwritten"), std::string::npos);
}

// One slot file outside a job directory (a memory segment): the planner
// orders its checkpoints with the lineage; a checksum failure mid-read falls
// back into the same memory, an abandoned counter is never read, and with
// none left nothing is chosen and `skipped` says why.
TEST_F(RestoreTest, OneSlotFileFallsBackPastDamageAndHonoursTheLineage) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const TestCheckpoint older = MakeCheckpoint(6);
  const CheckpointInfo ni = CommitOlderAndDamagedNewer(*f, older);
  auto report = f->Scan(ScanOptions{false, false});
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  Dest d(ni);
  std::vector<int64_t> prepared;
  auto prep = [&](const Selected& s) -> Result<RestoreDestinations> {
    prepared.push_back(s.info.step);
    EXPECT_EQ(s.location.where, "seg");
    return RestoreDestinations{d.ptrs, {}};
  };
  RestoreOptions o;
  o.threads = 1;
  o.piece_bytes = 1;  // chunk by chunk: the newer one is partly written when it fails
  auto r = RestoreFromSlotFile(*f, "seg", *report, LineageRecord{}, {}, prep, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->chosen.has_value());
  EXPECT_EQ(r->chosen->info.step, 6);
  EXPECT_EQ(r->attempts, 2);
  EXPECT_EQ(prepared, (std::vector<int64_t>{7, 6}));
  EXPECT_TRUE(Holds(d, older));
  ASSERT_EQ(r->skipped.size(), 1u);
  EXPECT_NE(r->skipped[0].find("seg: checkpoint #2 (step 7)"), std::string::npos) << r->skipped[0];
  EXPECT_NE(r->skipped[0].find("checksum mismatch"), std::string::npos) << r->skipped[0];

  // Counter 1 abandoned by a rollback, counter 2 excluded: nothing is read.
  LineageRecord l;
  l.abandoned = {{1, 1}};
  l.abandoned_through = 1;
  prepared.clear();
  r = RestoreFromSlotFile(*f, "seg", *report, l, {2}, prep, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->chosen.has_value());
  EXPECT_TRUE(prepared.empty());
  EXPECT_EQ(r->attempts, 0);
  ASSERT_FALSE(r->skipped.empty());

  // A prepare error other than Corruption stops it.
  auto stop = RestoreFromSlotFile(*f, "seg", *report, LineageRecord{}, {},
                                  [](const Selected&) -> Result<RestoreDestinations> {
                                    return Status::FailedPrecondition("shape differs");
                                  });
  ASSERT_FALSE(stop.ok());
  EXPECT_EQ(stop.status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(RestoreTest, EmptyDirectoryIsAFreshStart) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto r = RestoreFromJobDir(*jd, 0, {}, [](const Selected&) -> Result<std::vector<void*>> {
    return std::vector<void*>{};
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->chosen.has_value());
}

// A copy engine whose "device" is host memory and whose host-to-device
// copies are lazy, like a DMA that has not run yet: a copy moves its bytes
// only when it is waited for. A staging buffer read into again before its
// copies completed therefore shows (its bytes changed since the copy was
// issued: `changed_under_copy`, and the destination gets the new bytes).
class LazyDeviceEngine : public CopyEngine {
 public:
  class Lazy : public CopyCompletion {
   public:
    Lazy(LazyDeviceEngine* e, const void* src, void* dst, size_t n)
        : e_(e), src_(src), dst_(dst), n_(n),
          at_issue_(static_cast<const uint8_t*>(src), static_cast<const uint8_t*>(src) + n) {}
    ~Lazy() override {
      if (!done_) e_->never_waited++;
    }
    Status Wait() override {
      if (!done_) {
        if (std::memcmp(src_, at_issue_.data(), n_) != 0) e_->changed_under_copy++;
        std::memcpy(dst_, src_, n_);
        done_ = true;
        e_->outstanding--;
      }
      return e_->fail ? Status::IOError("lazy fake: the copy failed") : Status::OK();
    }
    bool Ready() override { return done_; }

   private:
    LazyDeviceEngine* e_;
    const void* src_;
    void* dst_;
    size_t n_;
    std::vector<uint8_t> at_issue_;
    bool done_ = false;
  };

  std::unique_ptr<CopyCompletion> Copy(const void*, const Device&, void*, size_t) override {
    return MakeDoneCopy(Status::Unavailable("not used by the restore"));
  }
  void* AllocHost(size_t bytes, bool* pinned) override {
    if (pinned != nullptr) *pinned = true;
    staging_allocs++;
    return std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  }
  void FreeHost(void* p, size_t) override { std::free(p); }
  std::string Describe() const override { return "lazy fake device engine"; }
  bool CanCopyToDevice(const Device& d) const override { return d.kind == DeviceKind::kCuda; }
  std::unique_ptr<CopyCompletion> CopyToDevice(const void* src, void* dst, const Device& d,
                                               size_t bytes) override {
    EXPECT_EQ(d.kind, DeviceKind::kCuda);
    const int now = ++outstanding;
    for (int m = max_outstanding.load(); now > m && !max_outstanding.compare_exchange_weak(m, now);) {
    }
    copies++;
    return std::make_unique<Lazy>(this, src, dst, bytes);
  }

  std::atomic<int> outstanding{0}, max_outstanding{0}, changed_under_copy{0}, never_waited{0};
  std::atomic<int> copies{0}, staging_allocs{0};
  std::atomic<bool> fail{false};
};

// Every other tensor of `info` on the "device" (its destination written only
// by CopyToDevice); the bytes expected there.
std::vector<Device> EveryOtherOnDevice(const CheckpointInfo& info, uint64_t* device_bytes) {
  std::vector<Device> devs(info.tensors.size());
  *device_bytes = 0;
  for (size_t i = 0; i < devs.size(); i += 2) {
    devs[i] = Device{DeviceKind::kCuda, 0, 0};
    *device_bytes += info.tensors[i].spec.nbytes;
  }
  return devs;
}

// Two 160 KiB tensors: ten 16 KiB crc chunks each, so a piece of one chunk
// lies inside one tensor and carries one copy.
TestCheckpoint TwoBigTensors(int64_t step) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 2; ++i) {
    TensorSpec s;
    s.name = "layer" + std::to_string(i) + ".weight";
    s.dtype = DType::kFloat32;
    s.shape = {40960};
    s.nbytes = 40960 * 4;
    specs.push_back(s);
  }
  TestCheckpoint c;
  c.step = step;
  c.layout = SlotLayout::Plan(specs).value();
  c.data.assign(c.layout.data_bytes, 0);
  for (size_t i = 0; i < c.layout.tensors.size(); ++i) {
    testing::FillTensor(step, i, c.data.data() + c.layout.tensors[i].data_offset,
                        c.layout.tensors[i].spec.nbytes);
  }
  c.crcs = testing::ChunkCrcs(c.data, testing::kTestCrcChunk);
  c.meta_json = "{}";
  return c;
}

// Restore into device memory (docs/CUDA.md "Restore into CUDA tensors"):
// pieces with device bytes go through the copy engine's staging buffers,
// are verified, then copied; a buffer is read into again only after its
// copies completed; reads overlap earlier pieces' copies; every copy is
// waited for before the read returns; host tensors beside them as before.
TEST_F(RestoreTest, DeviceDestinationsGoThroughStagingCopiesOverlappingTheReads) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const TestCheckpoint c = MakeCheckpoint(8);
  const CheckpointInfo info = Commit(*f, c, 8);
  for (uint64_t piece : {uint64_t{16 << 10}, uint64_t{48 << 10}, uint64_t{8 << 20}}) {
    for (int threads : {1, 3}) {
      LazyDeviceEngine e;
      Dest d(info);
      RestoreOptions o;
      o.piece_bytes = piece;
      o.threads = threads;
      uint64_t device_bytes = 0;
      o.dst_devices = EveryOtherOnDevice(info, &device_bytes);
      o.copy = &e;
      RestoreStats st;
      ASSERT_TRUE(ReadCheckpointInto(*f, info, d.ptrs, o, &st).ok());
      const std::string at = "piece " + std::to_string(piece) + " threads " + std::to_string(threads);
      EXPECT_TRUE(Holds(d, c)) << at;
      EXPECT_EQ(st.h2d_bytes, device_bytes) << at;
      EXPECT_EQ(e.outstanding.load(), 0) << at << ": a copy was still in flight at the return";
      EXPECT_EQ(e.never_waited.load(), 0) << at;
      EXPECT_EQ(e.changed_under_copy.load(), 0) << at << ": a buffer was read into under a copy";
      EXPECT_GT(e.staging_allocs.load(), 0) << at << ": device pieces staged in the engine's memory";
    }
  }
  // One chunk per piece, one thread, every byte on the device, one copy per
  // piece: a copy is issued while the earlier pieces' copies have not
  // completed (the reads overlap the copies), and yet no buffer is read into
  // under a copy.
  const TestCheckpoint big = TwoBigTensors(9);
  const CheckpointInfo bi = Commit(*f, big, 9);
  LazyDeviceEngine e;
  Dest d(bi);
  RestoreOptions o;
  o.piece_bytes = 16 << 10;
  o.threads = 1;
  o.dst_devices.assign(bi.tensors.size(), Device{DeviceKind::kCuda, 0, 0});
  o.copy = &e;
  RestoreStats st;
  ASSERT_TRUE(ReadCheckpointInto(*f, bi, d.ptrs, o, &st).ok());
  EXPECT_TRUE(Holds(d, big));
  EXPECT_EQ(e.copies.load(), 20);
  EXPECT_GE(e.max_outstanding.load(), 2) << "each piece's copies were waited before the next read";
  EXPECT_EQ(e.changed_under_copy.load(), 0);
  EXPECT_EQ(st.h2d_bytes, 2u * 40960 * 4);
}

// A device destination the engine cannot copy into is refused before any
// read; a failed copy fails the read, with no copy left in flight.
TEST_F(RestoreTest, DeviceDestinationsRefusedWithoutAnEngineAndFailedCopiesFail) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const TestCheckpoint c = MakeCheckpoint(5);
  const CheckpointInfo info = Commit(*f, c, 5);
  uint64_t device_bytes = 0;
  RestoreOptions o;
  o.dst_devices = EveryOtherOnDevice(info, &device_bytes);
  Dest d(info);
  Status s = ReadCheckpointInto(*f, info, d.ptrs, o);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(d.bufs[1], std::vector<uint8_t>(d.bufs[1].size(), 0xEE));
  // Small pieces (a failed copy seen when its buffer is reused) and one
  // piece for the whole checkpoint (seen only by the final wait).
  for (uint64_t piece : {uint64_t{16 << 10}, uint64_t{8 << 20}}) {
    LazyDeviceEngine e;
    e.fail = true;
    o.copy = &e;
    o.piece_bytes = piece;
    s = ReadCheckpointInto(*f, info, d.ptrs, o);
    EXPECT_EQ(s.code(), StatusCode::kIOError) << "piece " << piece << ": " << s.ToString();
    EXPECT_EQ(e.outstanding.load(), 0);
    EXPECT_EQ(e.never_waited.load(), 0);
  }
}

// RestoreFromJobDir with device destinations from prepare: the newest
// checkpoint fails its checksum mid-read (some of its bytes already copied to
// the device), the older one is read into the same memory; O_DIRECT reads
// (the queue's buffers) where the file system allows them.
TEST_F(RestoreTest, DeviceDestinationsFallBackToTheOlderCheckpoint) {
  auto jd = JobDir::OpenForWrite(root_.string()).value();
  auto f = NewSlotFile(*jd);
  const fs::path slot = root_ / JobDirNames::Slot(0);
  const TestCheckpoint older = MakeCheckpoint(6);
  const CheckpointInfo ni = CommitOlderAndDamagedNewer(*f, older);
  auto reader = JobDir::OpenForRead(root_.string()).value();
  for (bool direct : {false, true}) {
    if (direct && !DirectWorks(slot)) continue;
    LazyDeviceEngine e;
    Dest d(ni);
    RestoreOptions o;
    o.direct = direct;
    o.threads = 2;
    o.piece_bytes = 16 << 10;
    o.copy = &e;
    std::vector<int64_t> prepared;
    auto r = RestoreFromJobDir(*reader, 0, {},
                               RestorePrepareDevices([&](const Selected& s)
                                                         -> Result<RestoreDestinations> {
                                 prepared.push_back(s.info.step);
                                 if (direct) DropCache(slot);
                                 uint64_t n = 0;
                                 return RestoreDestinations{d.ptrs, EveryOtherOnDevice(s.info, &n)};
                               }),
                               o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(r->chosen.has_value());
    EXPECT_EQ(r->chosen->info.step, 6);
    EXPECT_EQ(prepared, (std::vector<int64_t>{7, 6}));
    EXPECT_TRUE(Holds(d, older)) << "direct " << direct;
    EXPECT_GT(r->stats.h2d_bytes, 0u);
    EXPECT_EQ(e.outstanding.load(), 0);
    EXPECT_EQ(e.changed_under_copy.load(), 0);
    if (direct) {
      EXPECT_GT(r->stats.odirect_bytes, 0u);
    }
  }
}

// RestoreOptionsFromEnv: the Python front end's NONSTOP_RESTORE_* settings.
TEST(RestoreOptionsFromEnvTest, ThreadsDirectAndQueueFromTheEnvironment) {
  const char* names[] = {"NONSTOP_RESTORE_THREADS", "NONSTOP_RESTORE_DIRECT",
                         "NONSTOP_RESTORE_QUEUE"};
  for (const char* n : names) ::unsetenv(n);
  const RestoreOptions defaults;
  RestoreOptions o = RestoreOptionsFromEnv();
  EXPECT_EQ(o.threads, 4);
  EXPECT_TRUE(o.direct);
  EXPECT_EQ(o.queue_depth, defaults.queue_depth);
  ::setenv("NONSTOP_RESTORE_THREADS", "7", 1);
  ::setenv("NONSTOP_RESTORE_DIRECT", "0", 1);
  ::setenv("NONSTOP_RESTORE_QUEUE", "3", 1);
  o = RestoreOptionsFromEnv();
  EXPECT_EQ(o.threads, 7);
  EXPECT_FALSE(o.direct);
  EXPECT_EQ(o.queue_depth, 3u);
  // Below 1: one thread; not a number: the defaults; any DIRECT but "0": on.
  ::setenv("NONSTOP_RESTORE_THREADS", "-2", 1);
  ::setenv("NONSTOP_RESTORE_DIRECT", "1", 1);
  ::setenv("NONSTOP_RESTORE_QUEUE", "5000", 1);
  o = RestoreOptionsFromEnv();
  EXPECT_EQ(o.threads, 1);
  EXPECT_TRUE(o.direct);
  EXPECT_EQ(o.queue_depth, defaults.queue_depth);
  ::setenv("NONSTOP_RESTORE_THREADS", "four", 1);
  ::setenv("NONSTOP_RESTORE_QUEUE", "2x", 1);
  o = RestoreOptionsFromEnv();
  EXPECT_EQ(o.threads, 4);
  EXPECT_EQ(o.queue_depth, defaults.queue_depth);
  for (const char* n : names) ::unsetenv(n);
}

}  // namespace
}  // namespace nonstop
