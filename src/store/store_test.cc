// Store tests: layout, commit/scan round trip, fallback, bit flips, parsers.
#include <gtest/gtest.h>

#include <cstring>
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

  explicit Fixture(uint32_t slots = 3) {
    layout = SlotLayout::Plan({Spec("w", DType::kFloat32, {64, 1024}),
                               Spec("b", DType::kFloat32, {10}),
                               Spec("step", DType::kInt64, {})})
                 .value();
    StoreGeometry g;
    g.slots = slots;
    g.slot_bytes = StoreGeometry::SlotBytesFor(layout, 4096);
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
  std::unique_ptr<SlotFile> Reopen() {
    auto r = SlotFile::Open(std::make_unique<MemMedium>(disk));
    return r.ok() ? std::move(r).value() : nullptr;
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

// Every single-bit flip in the header, the ring records, the table or the
// data of the newest checkpoint is detected: the newest is never returned
// with wrong bytes.
TEST(SlotFileTest, EverySingleBitFlipIsDetected) {
  Fixture f;
  ASSERT_TRUE(f.Save(0, 1, 10).ok());
  ASSERT_TRUE(f.Save(1, 2, 20).ok());
  const std::vector<uint8_t> clean = *f.disk;
  auto file = f.Reopen();
  auto rep = file->Scan().value();
  const CheckpointInfo newest = rep.checkpoints[0].info;
  std::vector<std::pair<uint64_t, uint64_t>> regions = {
      {0, format::kHeaderBytes},
      {format::kHeaderBytes, format::kHeaderBytes + 2 * format::kRecordBytes},
      {newest.data_offset,
       newest.data_offset + newest.data_bytes + format::AlignUp(newest.table_bytes, kStoreAlign)}};
  std::mt19937 rng(1);
  int flips = 0;
  for (auto [lo, hi] : regions) {
    // Every byte of the header and records; a prime stride through the slot.
    for (uint64_t pos = lo; pos < hi; pos += (lo == newest.data_offset ? 61 : 1)) {
      *f.disk = clean;
      (*f.disk)[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
      ++flips;
      auto reopened = SlotFile::Open(std::make_unique<MemMedium>(f.disk));
      if (!reopened.ok()) continue;  // header damage: detected at open
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
