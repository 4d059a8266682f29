// Store tests: layout, commit/scan round trip, fallback, bit flips, parsers.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <mutex>
#include <random>

#include "nonstop/store.h"
#include "store/format.h"

namespace nonstop {
namespace {

// A plain in-memory medium (no crash semantics; the fault medium has those).
class MemMedium : public Medium {
 public:
  explicit MemMedium(std::shared_ptr<std::vector<uint8_t>> bytes) : b_(std::move(bytes)) {}
  Status Write(uint64_t off, const void* buf, size_t n) override {
    std::lock_guard<std::mutex> l(mu_);
    if (off + n > b_->size()) return Status::IOError("write past end");
    std::memcpy(b_->data() + off, buf, n);
    return Status::OK();
  }
  Status Read(uint64_t off, void* buf, size_t n) override {
    std::lock_guard<std::mutex> l(mu_);
    if (off + n > b_->size()) return Status::Corruption("read past end");
    std::memcpy(buf, b_->data() + off, n);
    return Status::OK();
  }
  Status Sync() override { return Status::OK(); }
  Status Resize(uint64_t size) override {
    b_->resize(size);
    return Status::OK();
  }
  uint64_t Size() const override { return b_->size(); }
  size_t Alignment() const override { return 1; }
  MediumKind kind() const override { return MediumKind::kBuffered; }
  std::string Describe() const override { return "memory"; }

 private:
  std::mutex mu_;
  std::shared_ptr<std::vector<uint8_t>> b_;
};

TensorSpec Spec(std::string name, DType dt, std::vector<int64_t> shape) {
  TensorSpec s;
  s.name = std::move(name);
  s.dtype = dt;
  s.shape = std::move(shape);
  s.nbytes = NumElements(s.shape) * DTypeSize(dt);
  return s;
}

// Fills the data region of `layout` for `step` deterministically.
std::vector<uint8_t> MakeData(const SlotLayout& layout, int64_t step) {
  std::vector<uint8_t> d(layout.data_bytes, 0);
  std::mt19937_64 rng(static_cast<uint64_t>(step) * 7919 + 1);
  for (const auto& te : layout.tensors) {
    for (uint64_t i = 0; i < te.spec.nbytes; ++i) d[te.data_offset + i] = static_cast<uint8_t>(rng());
  }
  return d;
}

constexpr uint32_t kChunk = 4096;

std::vector<uint32_t> Crcs(const std::vector<uint8_t>& d) {
  std::vector<uint32_t> c;
  for (size_t off = 0; off < d.size(); off += kChunk) {
    c.push_back(Crc32c(d.data() + off, std::min<size_t>(kChunk, d.size() - off)));
  }
  return c;
}

struct Fixture {
  std::shared_ptr<std::vector<uint8_t>> disk = std::make_shared<std::vector<uint8_t>>();
  SlotLayout layout;
  std::unique_ptr<SlotFile> file;

  explicit Fixture(uint32_t slots = 3, uint64_t meta_reserve = 4096) {
    layout = SlotLayout::Plan({Spec("w", DType::kFloat32, {64, 1024}),
                               Spec("b", DType::kFloat32, {10}),
                               Spec("step", DType::kInt64, {})})
                 .value();
    StoreGeometry g;
    g.slots = slots;
    g.slot_bytes = StoreGeometry::SlotBytesFor(layout, meta_reserve);
    file = SlotFile::Create(std::make_unique<MemMedium>(disk), g).value();
  }
  Status Save(uint32_t slot, uint64_t counter, int64_t step) {
    auto d = MakeData(layout, step);
    NONSTOP_RETURN_IF_ERROR(file->WriteData(slot, 0, d.data(), d.size()));
    CommitRequest req;
    req.slot = slot;
    req.counter = counter;
    req.step = step;
    req.layout = &layout;
    req.crc_chunk_bytes = kChunk;
    req.chunk_crcs = Crcs(d);
    req.meta_json = "{\"step\":" + std::to_string(step) + "}";
    return file->Commit(req).status();
  }
  std::unique_ptr<SlotFile> Reopen(const SlotOpenOptions& opts = {}) {
    auto r = SlotFile::Open(std::make_unique<MemMedium>(disk), opts);
    return r.ok() ? std::move(r).value() : nullptr;
  }
  // Replaces the table of the checkpoint with ring sequence `seq` by `t`
  // (encoded as is, so it may break every rule) and makes the record's table
  // crc and its own crc match: a crafted file with valid checksums.
  void CraftTable(uint64_t seq, const format::Table& t) {
    const format::FileHeader h = format::ParseHeader({disk->data(), format::kHeaderBytes}).value();
    uint8_t* rb = disk->data() + h.ring_offset + (seq % h.ring_records) * format::kRecordBytes;
    format::Record r = format::ParseRecord({rb, format::kRecordBytes}).value();
    std::vector<uint8_t> tb = format::EncodeTable(t);
    const uint64_t padded = format::AlignUp(tb.size(), kStoreAlign);
    ASSERT_LE(r.data_bytes + padded, h.slot_bytes) << "crafted table does not fit the slot";
    std::fill(disk->begin() + r.table_offset, disk->begin() + r.table_offset + padded, 0);
    std::copy(tb.begin(), tb.end(), disk->begin() + r.table_offset);
    r.table_bytes = tb.size();
    r.table_crc = Crc32c(disk->data() + r.table_offset, padded);
    std::vector<uint8_t> enc = format::EncodeRecord(r);
    std::copy(enc.begin(), enc.end(), rb);
  }
  // The table committed for `step` (what CraftTable starts from).
  format::Table TableOf(uint64_t counter, int64_t step) {
    format::Table t;
    const format::FileHeader h = format::ParseHeader({disk->data(), format::kHeaderBytes}).value();
    t.uuid_hi = h.uuid_hi;
    t.uuid_lo = h.uuid_lo;
    t.counter = counter;
    t.step = step;
    t.crc_chunk_bytes = kChunk;
    t.data_bytes = layout.data_bytes;
    t.tensors = layout.tensors;
    t.chunk_crcs = Crcs(MakeData(layout, step));
    t.meta_json = "{\"step\":" + std::to_string(step) + "}";
    return t;
  }
};

TEST(Crc32cTest, KnownVectorAndComposition) {
  const char* s = "123456789";
  EXPECT_EQ(Crc32c(s, 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(s + 4, 5, Crc32c(s, 4)), 0xE3069283u);
  EXPECT_EQ(Crc32c(s, 0), 0u);
}

TEST(SlotLayoutTest, LargeAlignedSmallPacked) {
  auto l = SlotLayout::Plan({Spec("small1", DType::kFloat32, {3}), Spec("big", DType::kFloat32, {70000}),
                             Spec("small2", DType::kInt8, {5}), Spec("big2", DType::kBFloat16, {40000})});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->tensors[1].data_offset % kStoreAlign, 0u);
  EXPECT_EQ(l->tensors[3].data_offset % kStoreAlign, 0u);
  EXPECT_EQ(l->tensors[2].data_offset - l->tensors[0].data_offset, 16u);  // 12 bytes, 8-aligned
  EXPECT_GT(l->tensors[0].data_offset, l->tensors[3].data_offset);  // small after large
  EXPECT_EQ(l->data_bytes % kStoreAlign, 0u);
}

TEST(SlotLayoutTest, RejectsBadSpecs) {
  auto dup = SlotLayout::Plan({Spec("a", DType::kFloat32, {2}), Spec("a", DType::kFloat32, {2})});
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("duplicate tensor name 'a'"), std::string::npos);
  TensorSpec bad = Spec("x", DType::kFloat32, {4});
  bad.nbytes = 15;
  EXPECT_EQ(SlotLayout::Plan({bad}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SlotLayout::Plan({Spec("", DType::kFloat32, {1})}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(SlotFileTest, CommitScanReadRoundTrip) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  auto file = f.Reopen();
  ASSERT_NE(file, nullptr);
  auto rep = file->Scan();
  ASSERT_TRUE(rep.ok());
  ASSERT_EQ(rep->newest_valid, 0);
  const CheckpointInfo& info = rep->checkpoints[0].info;
  EXPECT_EQ(info.step, 20);
  EXPECT_EQ(info.counter, 2u);
  EXPECT_EQ(info.meta_json, "{\"step\":20}");
  auto expect = MakeData(f.layout, 20);
  int w = info.FindTensor("w");
  ASSERT_GE(w, 0);
  std::vector<uint8_t> got(info.tensors[w].spec.nbytes);
  ASSERT_TRUE(file->ReadTensor(info, w, got.data()).ok());
  EXPECT_EQ(0, std::memcmp(got.data(), expect.data() + info.tensors[w].data_offset, got.size()));
  EXPECT_EQ(file->newest_committed_counter(), 2u);
  EXPECT_TRUE(rep->skipped.empty());
}

TEST(SlotFileTest, RefusesOlderCounter) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 5, 50).ok());
  Status st = f.Save(1, 4, 40);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_NE(st.message().find("superseded"), std::string::npos);
  auto rep = f.Reopen()->Scan().value();
  EXPECT_EQ(rep.checkpoints[rep.newest_valid].info.step, 50);
}

TEST(SlotFileTest, CountersAndSequenceContinueAfterReopen) {
  Fixture f;
  for (int i = 1; i <= 20; ++i) ASSERT_TRUE(f.Save(i % 3, i, i * 10).ok());
  auto file = f.Reopen();
  EXPECT_EQ(file->newest_committed_counter(), 20u);
  auto rep = file->Scan().value();
  EXPECT_EQ(rep.checkpoints[rep.newest_valid].info.step, 200);
  // Only 3 slots: checkpoints older than the last 3 were overwritten.
  int committed = 0;
  for (auto& c : rep.checkpoints) committed += c.state == CheckpointState::kCommitted;
  EXPECT_EQ(committed, 3);
}

TEST(SlotFileTest, DamagedNewestFallsBackAndSaysWhy) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  auto file = f.Reopen();
  (*f.disk)[file->SlotOffset(1) + 100] ^= 0x10;  // inside tensor 'w' of step 20
  auto rep = file->Scan().value();
  ASSERT_GE(rep.newest_valid, 0);
  EXPECT_EQ(rep.checkpoints[rep.newest_valid].info.step, 10);
  ASSERT_EQ(rep.skipped.size(), 1u);
  EXPECT_NE(rep.skipped[0].find("tensor 'w'"), std::string::npos) << rep.skipped[0];
  EXPECT_NE(rep.skipped[0].find("step 20"), std::string::npos) << rep.skipped[0];
}

TEST(SlotFileTest, ReusedSlotIsReportedAsReused) {
  Fixture f(2);
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  ASSERT_TRUE(f.Save(0, 3, 30).ok());
  auto rep = f.Reopen()->Scan({.verify_data = true, .verify_all = true}).value();
  ASSERT_EQ(rep.checkpoints.size(), 3u);
  EXPECT_EQ(rep.checkpoints[2].state, CheckpointState::kDamaged);
  EXPECT_NE(rep.checkpoints[2].reason.find("reused by checkpoint #3"), std::string::npos)
      << rep.checkpoints[2].reason;
}

// Every single-bit flip in the ring records, the table or the data of the
// newest checkpoint is detected: the newest is never returned with wrong
// bytes. (The header block and its copy: EveryHeaderByteFlip... below.)
TEST(SlotFileTest, EverySingleBitFlipIsDetected) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  const std::vector<uint8_t> clean = *f.disk;
  auto file = f.Reopen();
  auto rep = file->Scan().value();
  const CheckpointInfo newest = rep.checkpoints[0].info;
  std::vector<std::pair<uint64_t, uint64_t>> regions = {
      {format::kRingOffset, format::kRingOffset + 2 * format::kRecordBytes},
      {newest.data_offset,
       newest.data_offset + newest.data_bytes + format::AlignUp(newest.table_bytes, kStoreAlign)}};
  std::mt19937 rng(1);
  int flips = 0;
  for (auto [lo, hi] : regions) {
    // Every byte of the records; a prime stride through the slot.
    for (uint64_t pos = lo; pos < hi; pos += (lo == newest.data_offset ? 61 : 1)) {
      *f.disk = clean;
      (*f.disk)[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
      ++flips;
      auto reopened = SlotFile::Open(std::make_unique<MemMedium>(f.disk));
      ASSERT_TRUE(reopened.ok()) << "flip at " << pos << ": " << reopened.status().ToString();
      auto r = (*reopened)->Scan({.verify_data = true, .verify_all = true});
      if (!r.ok() || r->newest_valid < 0) continue;
      bool reported = !r->skipped.empty();
      for (auto& c : r->checkpoints) reported |= c.state == CheckpointState::kDamaged;
      if (r->checkpoints.size() != 2) reported = true;
      // Detected = the scan names the damage (the newest may still be intact
      // when the flip hit the older checkpoint's record).
      if (!reported) ADD_FAILURE() << "bit flip at offset " << pos << " not detected";
    }
  }
  EXPECT_GT(flips, 1000);
}

// Invariant 10: no single damaged byte of the file header block or of its
// copy (padding included) makes a checkpoint unrecoverable. Every one of the
// 8192 positions is damaged in turn: Open succeeds, says which copy it used,
// and every checkpoint is recovered with its bytes.
TEST(SlotFileTest, EveryHeaderByteDamagedStillRecoversEveryCheckpoint) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  const std::vector<uint8_t> clean = *f.disk;
  const std::vector<uint8_t> want = MakeData(f.layout, 20);
  std::mt19937 rng(2);
  for (uint64_t pos = 0; pos < format::kHeaderCopyOffset + format::kHeaderBytes; ++pos) {
    *f.disk = clean;
    (*f.disk)[pos] ^= static_cast<uint8_t>(1 + rng() % 255);  // a whole byte, never unchanged
    auto file = SlotFile::Open(std::make_unique<MemMedium>(f.disk));
    ASSERT_TRUE(file.ok()) << "byte " << pos << ": " << file.status().ToString();
    ASSERT_EQ((*file)->salvaged().size(), 1u) << "byte " << pos;
    const std::string& note = (*file)->salvaged()[0];
    if (pos < format::kHeaderBytes) {
      ASSERT_EQ(note.rfind("file header damaged", 0), 0u) << note;
      ASSERT_NE(note.find("used the copy at offset 4096"), std::string::npos) << note;
    } else {
      ASSERT_EQ(note.rfind("header copy at offset 4096", 0), 0u) << note;
    }
    auto rep = (*file)->Scan();
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    ASSERT_EQ(rep->newest_valid, 0) << "byte " << pos;
    ASSERT_EQ(rep->checkpoints.size(), 2u);
    ASSERT_EQ(rep->checkpoints[1].state, CheckpointState::kCommitted) << "byte " << pos;
    const CheckpointInfo& info = rep->checkpoints[0].info;
    ASSERT_EQ(info.step, 20);
    if (pos % 64 == 0) {  // the bytes themselves, on a sample
      std::vector<uint8_t> got(info.data_bytes);
      ASSERT_TRUE((*file)->ReadData(info, 0, got.data(), got.size()).ok());
      ASSERT_EQ(got, want);
    }
  }
}

// The writer's Open rewrites the damaged block from its intact twin,
// durably; the reader's Open never writes.
TEST(SlotFileTest, WriterRepairsADamagedHeaderReaderDoesNot) {
  for (uint64_t pos : {uint64_t{3}, uint64_t{88}, uint64_t{2000}, uint64_t{4096 + 17},
                       uint64_t{8191}}) {
    SCOPED_TRACE(pos);
    Fixture f;
    ASSERT_TRUE(f.Save(0, 1, 10).ok());
    const std::vector<uint8_t> clean = *f.disk;
    (*f.disk)[pos] ^= 0x5A;
    const std::vector<uint8_t> damaged = *f.disk;
    auto reader = f.Reopen();
    ASSERT_NE(reader, nullptr);
    EXPECT_EQ(reader->salvaged().size(), 1u);
    EXPECT_TRUE(*f.disk == damaged);  // the reader wrote nothing
    auto writer = f.Reopen({.repair = true});
    ASSERT_NE(writer, nullptr);
    ASSERT_EQ(writer->salvaged().size(), 1u);
    EXPECT_NE(writer->salvaged()[0].find("(repaired)"), std::string::npos);
    EXPECT_TRUE(*f.disk == clean);
    f.file = std::move(writer);
    ASSERT_TRUE(f.Save(1, 2, 20).ok());
    auto again = f.Reopen();
    ASSERT_NE(again, nullptr);
    EXPECT_TRUE(again->salvaged().empty());
    EXPECT_EQ(again->Scan().value().checkpoints[0].info.step, 20);
  }
}

// A file cut short anywhere past its header: every checkpoint whose record,
// table and data are all still there is recovered; the others are reported,
// and nothing is read or allocated past the end.
TEST(SlotFileTest, TruncatedTailKeepsEveryCheckpointWhoseBytesArePresent) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  const std::vector<uint8_t> clean = *f.disk;
  auto rep0 = f.Reopen()->Scan().value();
  // Where each checkpoint's bytes end, and where its record ends.
  std::map<int64_t, uint64_t> bytes_end, record_end;
  for (const auto& c : rep0.checkpoints) {
    bytes_end[c.info.step] =
        c.info.data_offset + c.info.data_bytes + format::AlignUp(c.info.table_bytes, kStoreAlign);
    record_end[c.info.step] = format::kRingOffset + (c.info.sequence + 1) * format::kRecordBytes;
  }
  std::vector<uint64_t> cuts;
  for (uint64_t b = format::kHeaderBytes; b <= clean.size(); b += kStoreAlign) {
    for (uint64_t c : {b - 1, b, b + 1}) {
      if (c >= format::kHeaderBytes && c < clean.size()) cuts.push_back(c);
    }
  }
  for (uint64_t cut : cuts) {
    SCOPED_TRACE(cut);
    f.disk->assign(clean.begin(), clean.begin() + static_cast<std::ptrdiff_t>(cut));
    auto file = f.Reopen();
    ASSERT_NE(file, nullptr);
    ASSERT_FALSE(file->salvaged().empty());
    auto rep = file->Scan({.verify_data = true, .verify_all = true});
    ASSERT_TRUE(rep.ok()) << rep.status().ToString();
    std::set<int64_t> committed;
    for (const auto& c : rep->checkpoints) {
      if (c.state == CheckpointState::kCommitted) committed.insert(c.info.step);
    }
    for (int64_t step : {10, 20}) {
      const bool present = cut >= bytes_end[step] && cut >= record_end[step];
      EXPECT_EQ(committed.count(step), present ? 1u : 0u) << "step " << step;
    }
    if (rep->newest_valid >= 0) {
      const CheckpointInfo& info = rep->checkpoints[rep->newest_valid].info;
      std::vector<uint8_t> got(info.data_bytes);
      ASSERT_TRUE(file->ReadData(info, 0, got.data(), got.size()).ok());
      EXPECT_EQ(got, MakeData(f.layout, info.step));
    }
  }
  // One byte short: the writer restores the length and carries on.
  f.disk->assign(clean.begin(), clean.end() - 1);
  auto writer = f.Reopen({.repair = true});
  ASSERT_NE(writer, nullptr);
  EXPECT_EQ(f.disk->size(), clean.size());
  f.file = std::move(writer);
  ASSERT_TRUE(f.Save(2, 3, 30).ok());
  auto again = f.Reopen();
  EXPECT_TRUE(again->salvaged().empty());
  auto rep = again->Scan({.verify_data = true, .verify_all = true}).value();
  ASSERT_EQ(rep.checkpoints.size(), 3u);
  for (const auto& c : rep.checkpoints) EXPECT_EQ(c.state, CheckpointState::kCommitted);
  // Shorter than its header: not a slot file at all.
  f.disk->assign(clean.begin(), clean.begin() + 4095);
  EXPECT_EQ(f.Reopen(), nullptr);
}

// Files written before the header copy existed (ring at offset 4096) are
// still read and written.
TEST(SlotFileTest, FilesWithoutAHeaderCopyStillWork) {
  Fixture f;
  format::FileHeader h;
  h.uuid_hi = 11;
  h.uuid_lo = 12;
  h.ring_offset = format::kHeaderBytes;
  h.slot_count = 3;
  h.slots_offset = h.ring_offset + uint64_t{kRingRecords} * format::kRecordBytes;
  h.slot_bytes = f.file->geometry().slot_bytes;
  f.disk->assign(h.slots_offset + 3 * h.slot_bytes, 0);
  const std::vector<uint8_t> hb = format::EncodeHeader(h);
  std::copy(hb.begin(), hb.end(), f.disk->begin());
  f.file = f.Reopen({.repair = true});
  ASSERT_NE(f.file, nullptr);
  EXPECT_TRUE(f.file->salvaged().empty());
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  auto rep = f.Reopen()->Scan({.verify_data = true, .verify_all = true}).value();
  ASSERT_EQ(rep.newest_valid, 0);
  EXPECT_EQ(rep.checkpoints[0].info.step, 20);
  EXPECT_EQ(rep.checkpoints[1].state, CheckpointState::kCommitted);
  // Block 1 is ring entry 0 here, never taken for a header copy.
  (*f.disk)[40] ^= 1;
  auto bad = SlotFile::Open(std::make_unique<MemMedium>(f.disk));
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("file header checksum mismatch"), std::string::npos);
}

// Crafted tables with valid checksums are refused before anything is
// allocated for them, with one line naming the entry; recovery falls back
// to the previous checkpoint.
TEST(SlotFileTest, CraftedTablesWithValidChecksumsAreRefused) {
  struct Case {
    const char* what;
    std::function<void(format::Table&)> craft;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"2000 entries covering the data region",
       [](format::Table& t) {
         t.tensors.clear();
         for (int i = 0; i < 2000; ++i) {
           TensorEntry te;
           te.spec = Spec("t" + std::to_string(i), DType::kUInt8,
                          {static_cast<int64_t>(t.data_bytes)});
           t.tensors.push_back(te);
         }
       },
       "tensor table entry 1 ('t1') overlaps entry 0 ('t0') in the data region"},
      {"overlap by one byte",
       [](format::Table& t) { t.tensors[2].data_offset = t.tensors[1].data_offset + 32; },
       "overlaps entry 1 ('b')"},
      {"name not UTF-8",
       [](format::Table& t) { t.tensors[1].spec.name = "b\xff\xfe"; },
       "tensor table entry 1 ('b\\xFF\\xFE'): name is not valid UTF-8 (byte 1)"},
      {"overlong UTF-8", [](format::Table& t) { t.tensors[1].spec.name = "\xc0\xaf"; },
       "name is not valid UTF-8"},
      {"surrogate", [](format::Table& t) { t.tensors[1].spec.name = "\xed\xa0\x80"; },
       "name is not valid UTF-8"},
      {"newline in name",
       [](format::Table& t) { t.tensors[0].spec.name = "w\nrm -rf"; },
       "tensor table entry 0 ('w\\x0Arm -rf'): name holds a control character (byte 1)"},
      {"C1 control", [](format::Table& t) { t.tensors[0].spec.name = "w\xc2\x85"; },
       "name holds a control character"},
      {"dtype outside the list",
       [](format::Table& t) { t.tensors[2].spec.dtype = static_cast<DType>(200); },
       "tensor table entry 2 ('step'): unknown dtype 200"},
      {"large tensor not 4096-aligned",
       [](format::Table& t) { t.tensors[0].data_offset = 8; },
       "tensor table entry 0 ('w'): offset 8 is not a multiple of 4096"},
      {"small tensor not 8-aligned",
       [](format::Table& t) { t.tensors[1].data_offset += 4; }, "is not a multiple of 8"},
      {"past the data region",
       [](format::Table& t) { t.tensors[1].data_offset = t.data_bytes; },
       "tensor table entry 1 ('b'): bytes ["},
      {"duplicate name", [](format::Table& t) { t.tensors[2].spec.name = "b"; },
       "tensor table entry 2 ('b'): duplicate of entry 1"},
      {"metadata not UTF-8", [](format::Table& t) { t.meta_json = "{\"a\": \"\xff\"}"; },
       "tensor table metadata is not valid UTF-8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Fixture f(3, 128 << 10);
    ASSERT_TRUE(f.Save(0, 1, 10).ok());
    ASSERT_TRUE(f.Save(1, 2, 20).ok());
    format::Table t = f.TableOf(2, 20);
    c.craft(t);
    f.CraftTable(1, t);
    auto rep = f.Reopen()->Scan({.verify_data = true, .verify_all = true}).value();
    ASSERT_EQ(rep.checkpoints.size(), 2u);
    EXPECT_EQ(rep.checkpoints[0].state, CheckpointState::kDamaged);
    EXPECT_NE(rep.checkpoints[0].reason.find(c.expect), std::string::npos)
        << rep.checkpoints[0].reason;
    EXPECT_EQ(rep.checkpoints[0].reason.find('\n'), std::string::npos);
    EXPECT_TRUE(rep.checkpoints[0].info.tensors.empty());
    ASSERT_EQ(rep.newest_valid, 1);
    EXPECT_EQ(rep.checkpoints[1].info.step, 10);
  }
  // The unchanged table passes (the crafting itself is sound).
  Fixture f(3, 128 << 10);
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  f.CraftTable(0, f.TableOf(1, 10));
  EXPECT_EQ(f.Reopen()->Scan().value().newest_valid, 0);
}

// The writer refuses what the reader would refuse.
TEST(SlotLayoutTest, RefusesNamesAndMetadataTheReaderWouldRefuse) {
  for (const char* name : {"a\x01", "bad\xff", "tab\tname", "\x7f", "c1\xc2\x9f"}) {
    auto l = SlotLayout::Plan({Spec(name, DType::kFloat32, {1})});
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << name;
    EXPECT_EQ(l.status().message().find('\n'), std::string::npos);
  }
  EXPECT_TRUE(SlotLayout::Plan({Spec("layers.0.attn/q_proj.weight \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80",
                                     DType::kFloat32, {1})})
                  .ok());
  Fixture f;
  auto d = MakeData(f.layout, 1);
  CommitRequest req;
  req.slot = 0;
  req.counter = 1;
  req.layout = &f.layout;
  req.crc_chunk_bytes = kChunk;
  req.chunk_crcs = Crcs(d);
  req.meta_json = "\xff";
  EXPECT_EQ(f.file->Commit(req).status().code(), StatusCode::kInvalidArgument);
}

TEST(SlotFileTest, CopyCheckpointMakesAnIndependentCommittedFile) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 7, 70).ok());
  auto src = f.Reopen();
  CheckpointInfo info = src->Scan().value().checkpoints[0].info;
  auto kept = std::make_shared<std::vector<uint8_t>>();
  ASSERT_TRUE(CopyCheckpoint(*src, info, std::make_unique<MemMedium>(kept)).ok());
  auto copy = SlotFile::Open(std::make_unique<MemMedium>(kept)).value();
  auto rep = copy->Scan().value();
  ASSERT_EQ(rep.newest_valid, 0);
  const CheckpointInfo& got = rep.checkpoints[0].info;
  EXPECT_EQ(got.step, 70);
  EXPECT_EQ(got.counter, 7u);
  EXPECT_EQ(got.meta_json, info.meta_json);
  auto expect = MakeData(f.layout, 70);
  std::vector<uint8_t> data(got.data_bytes);
  ASSERT_TRUE(copy->ReadData(got, 0, data.data(), data.size()).ok());
  EXPECT_EQ(data, expect);
  // A damaged source is refused, not copied.
  (*f.disk)[src->SlotOffset(0) + 5] ^= 1;
  auto bad = std::make_shared<std::vector<uint8_t>>();
  Status st = CopyCheckpoint(*src, info, std::make_unique<MemMedium>(bad));
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
}

TEST(FormatTest, ParsersSurviveGarbage) {
  std::mt19937_64 rng(7);
  Fixture f;
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  auto info = f.Reopen()->Scan().value().checkpoints[0].info;
  std::vector<uint8_t> table(f.disk->begin() + info.data_offset + info.data_bytes,
                             f.disk->begin() + info.data_offset + info.data_bytes + info.table_bytes);
  ASSERT_TRUE(format::ParseTable(table).ok());
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> t = table;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) t[rng() % t.size()] = static_cast<uint8_t>(rng());
    if (rng() % 4 == 0) t.resize(rng() % t.size());
    (void)format::ParseTable(t);
    (void)format::ParseRecord(std::span<const uint8_t>(t.data(), std::min<size_t>(t.size(), 128)));
    (void)format::ParseHeader(t);
  }
}

}  // namespace
}  // namespace nonstop
