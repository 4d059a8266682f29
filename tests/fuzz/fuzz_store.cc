// libFuzzer target for the store: the file header, superblock record and
// tensor table parsers, and a full SlotFile::Open + Scan + ReadTensor over a
// slot file held in memory. A damaged or hostile file must give an error,
// never a crash, an out-of-range read or a huge allocation.
//
// The first input byte picks what the rest is fed to. Checksums would stop a
// fuzzer at the first field, so some modes first make the header, record and
// table checksums consistent with the fuzzed bytes; the parsers' later checks
// are then reached.
//
//   0  ParseHeader(rest)                 3  ParseRecord(rest, padded, crc fixed)
//   1  ParseHeader(rest, padded, crc fixed)  4  ParseTable(rest), PeekTableHeader(rest)
//   2  ParseRecord(rest)                 5  the rest is a whole slot file (crcs fixed)
//   6  the rest is patches applied to a valid slot file (crcs fixed or not)
//   7  the rest is a crafted tensor table (entries and metadata as given,
//      table header, chunk crcs, table crc and record crc all made valid)
//      in a valid slot file: every entry rule is reached and every tensor the
//      table lets through is allocated and read
//   8  the rest is checkpoint metadata for the command line's JSON path
//      (tools/store_json.h: depth and size bound, parse, dump)
//   9  the job directory's own files (src/jobdir/records.h, names.cc): the
//      rest is a lineage record, an agreed record, any JSON, or a directory
//      entry name, by its first byte; what decodes is encoded and decoded
//      again
//
// Memory bound (`make test-fuzz` runs with -malloc_limit_mb=16
// -rss_limit_mb=2048): inputs are at most 64 KiB and the files built from
// them under 1 MiB, and no allocation the store or the CLI's JSON path makes
// for a file may exceed the file's own size (tables, ring, tensors) or 8 MiB
// (a read buffer), so any single allocation over 16 MiB is a bug and fails
// the run.
//
// With NONSTOP_FUZZ_SEEDS=DIR set, LLVMFuzzerInitialize writes a seed corpus
// of valid inputs for every mode into DIR.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "nonstop/store.h"
#include "store/format.h"
#include "store_test_util.h"
#include "jobdir/records.h"
#include "nonstop/jobdir.h"
#include "tools/store_json.h"

namespace nonstop {
namespace {

// A slot file held in memory.
class MemMedium : public Medium {
 public:
  explicit MemMedium(std::vector<uint8_t> bytes) : b_(std::move(bytes)) {}
  Status Write(uint64_t off, const void* buf, size_t n) override {
    if (off > b_.size() || n > b_.size() - off) return Status::IOError("write past the end");
    std::memcpy(b_.data() + off, buf, n);
    return Status::OK();
  }
  Status Read(uint64_t off, void* buf, size_t n) override {
    if (off > b_.size() || n > b_.size() - off) return Status::Corruption("read past the end");
    if (n > 0) std::memcpy(buf, b_.data() + off, n);
    return Status::OK();
  }
  Status Sync() override { return Status::OK(); }
  Status Resize(uint64_t size) override {
    if (size > (64u << 20)) return Status::IOError("too large for the fuzzer");
    b_.resize(size);
    return Status::OK();
  }
  uint64_t Size() const override { return b_.size(); }
  size_t Alignment() const override { return 1; }
  MediumKind kind() const override { return MediumKind::kBuffered; }
  std::string Describe() const override { return "memory"; }
  std::vector<uint8_t>& bytes() { return b_; }

 private:
  std::vector<uint8_t> b_;
};

uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Stores the crc of a block, computed with the crc field itself skipped.
void FixBlockCrc(uint8_t* b, size_t n, size_t crc_at) {
  uint32_t c = Crc32c(b, crc_at);
  c = Crc32c(b + crc_at + 4, n - crc_at - 4, c);
  std::memcpy(b + crc_at, &c, 4);
}

// Makes the header, every ring record and the table crc each record holds
// agree with the bytes of `img`, wherever they are in bounds.
void FixFileCrcs(std::vector<uint8_t>& img) {
  if (img.size() < format::kHeaderBytes) return;
  FixBlockCrc(img.data(), format::kHeaderBytes, format::kHeaderCrcOffset);
  auto h = format::ParseHeader({img.data(), format::kHeaderBytes});
  if (!h.ok()) return;
  for (uint32_t i = 0; i < h->ring_records; ++i) {
    const uint64_t off = h->ring_offset + uint64_t{i} * format::kRecordBytes;
    if (off + format::kRecordBytes > img.size()) break;
    uint8_t* rec = img.data() + off;
    if (std::all_of(rec, rec + format::kRecordBytes, [](uint8_t c) { return c == 0; })) continue;
    // table_offset at 72, table_bytes at 80, table_crc at 88 (docs/FORMAT.md).
    const uint64_t t_off = Load64(rec + 72), t_bytes = Load64(rec + 80);
    const uint64_t padded = format::AlignUp(t_bytes, kStoreAlign);
    if (t_bytes > 0 && t_off <= img.size() && padded <= img.size() - t_off) {
      const uint32_t c = Crc32c(img.data() + t_off, padded);
      std::memcpy(rec + 88, &c, 4);
    }
    FixBlockCrc(rec, format::kRecordBytes, format::kRecordCrcOffset);
  }
}

// Opens, scans (verifying everything) and reads every tensor of every
// checkpoint whose table parsed.
void OpenScanRead(std::vector<uint8_t> img) {
  auto opened = SlotFile::Open(std::make_unique<MemMedium>(std::move(img)));
  if (!opened.ok()) return;
  SlotFile& f = **opened;
  ScanOptions opts;
  opts.verify_all = true;
  auto scan = f.Scan(opts);
  if (!scan.ok()) return;
  std::vector<uint8_t> buf;
  for (const ScannedCheckpoint& sc : scan->checkpoints) {
    const CheckpointInfo& info = sc.info;
    // The command line's JSON of this checkpoint (inspect --json).
    nlohmann::json names = nlohmann::json::array();
    for (const TensorEntry& te : info.tensors) names.push_back(te.spec.name);
    nlohmann::json j = {{"meta", cli::MetaJson(info.meta_json)}, {"tensors", names},
                        {"reason", sc.reason}};
    (void)cli::DumpJson(j, 2);
    for (size_t i = 0; i < info.tensors.size(); ++i) {
      buf.resize(info.tensors[i].spec.nbytes);
      (void)f.ReadTensor(info, static_cast<int>(i), buf.data(), /*verify=*/true);
      (void)f.ReadTensor(info, static_cast<int>(i), buf.data(), /*verify=*/false);
    }
    (void)f.ReadTensor(info, -1, nullptr);
    (void)f.ReadTensor(info, static_cast<int>(info.tensors.size()), nullptr);
    if (info.data_bytes > 0) {
      buf.resize(std::min<uint64_t>(info.data_bytes, 4096));
      (void)f.ReadData(info, info.data_bytes - buf.size(), buf.data(), buf.size());
      (void)f.ReadData(info, info.data_bytes, buf.data(), 1);
    }
  }
}

// A valid slot file, small so each run is fast: four checkpoints of three
// small tensors committed in turn to three 8 KiB slots (the first overwritten).
const std::vector<uint8_t>& BaseImage() {
  static const std::vector<uint8_t> image = [] {
    auto medium = std::make_unique<MemMedium>(std::vector<uint8_t>());
    MemMedium* raw = medium.get();
    StoreGeometry g;
    g.slots = 3;
    g.slot_bytes = 2 * kStoreAlign;
    auto f = SlotFile::Create(std::move(medium), g).value();
    for (uint64_t c = 1; c <= 4; ++c) {
      std::vector<TensorSpec> specs = {{"w", DType::kFloat32, {4, 8}, 128, {}},
                                       {"b", DType::kBFloat16, {8}, 16, {{16}, 8}},
                                       {"step", DType::kInt64, {}, 8, {}}};
      SlotLayout layout = SlotLayout::Plan(specs).value();
      std::vector<uint8_t> data(layout.data_bytes, 0);
      for (size_t i = 0; i < 152; ++i) data[i] = static_cast<uint8_t>(i * c + 1);
      (void)f->WriteData(static_cast<uint32_t>(c % 3), 0, data.data(), data.size());
      CommitRequest req;
      req.slot = static_cast<uint32_t>(c % 3);
      req.counter = c;
      req.step = static_cast<int64_t>(c) * 10;
      req.layout = &layout;
      req.crc_chunk_bytes = kStoreAlign;
      req.chunk_crcs = testing::ChunkCrcs(data, kStoreAlign);
      req.meta_json = "{\"step\": " + std::to_string(req.step) + "}";
      (void)f->Commit(req);
    }
    return raw->bytes();
  }();
  return image;
}

// A small valid slot file built by hand: 2 ring records, 1 slot of 8 KiB
// holding one checkpoint of two tiny tensors. Small enough for mode 5.
std::vector<uint8_t> TinyImage() {
  format::FileHeader h;
  h.uuid_hi = 1;
  h.uuid_lo = 2;
  h.ring_records = 2;
  h.ring_offset = format::kHeaderBytes;
  h.slot_count = 1;
  h.slots_offset = h.ring_offset + 2 * format::kRecordBytes;
  h.slot_bytes = 2 * kStoreAlign;
  std::vector<uint8_t> img(h.slots_offset + h.slot_bytes, 0);
  auto hb = format::EncodeHeader(h);
  std::copy(hb.begin(), hb.end(), img.begin());
  format::Table t;
  t.uuid_hi = 1;
  t.uuid_lo = 2;
  t.counter = 7;
  t.step = 70;
  t.crc_chunk_bytes = kStoreAlign;
  t.data_bytes = kStoreAlign;
  TensorEntry a, b;
  a.spec = {"w", DType::kFloat32, {2, 3}, 24, {}};
  b.spec = {"step", DType::kInt64, {}, 8, {{10}, 0}};
  b.data_offset = 24;
  t.tensors = {a, b};
  uint8_t* data = img.data() + h.slots_offset;
  for (int i = 0; i < 32; ++i) data[i] = static_cast<uint8_t>(i * 7);
  t.chunk_crcs = {Crc32c(data, kStoreAlign)};
  t.meta_json = "{\"step\": 70}";
  auto tb = format::EncodeTable(t);
  std::copy(tb.begin(), tb.end(), img.begin() + h.slots_offset + kStoreAlign);
  format::Record r;
  r.uuid_hi = 1;
  r.uuid_lo = 2;
  r.counter = 7;
  r.step = 70;
  r.data_offset = h.slots_offset;
  r.data_bytes = kStoreAlign;
  r.table_offset = h.slots_offset + kStoreAlign;
  r.table_bytes = tb.size();
  r.table_crc = Crc32c(img.data() + r.table_offset, kStoreAlign);
  auto rb = format::EncodeRecord(r);
  std::copy(rb.begin(), rb.end(), img.begin() + h.ring_offset);
  return img;
}

void WriteSeed(const std::string& dir, const std::string& name, uint8_t mode,
               const std::vector<uint8_t>& body) {
  const std::string path = dir + "/seed-" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return;
  std::fputc(mode, f);
  std::fwrite(body.data(), 1, body.size(), f);
  std::fclose(f);
}

std::vector<uint8_t> CraftedTableSeed();  // below, beside mode 7

void WriteSeeds(const std::string& dir) {
  const std::vector<uint8_t>& base = BaseImage();
  std::vector<uint8_t> header(base.begin(), base.begin() + format::kHeaderBytes);
  WriteSeed(dir, "header", 0, header);
  WriteSeed(dir, "header-fixed", 1, header);
  auto h = format::ParseHeader({base.data(), format::kHeaderBytes}).value();
  std::vector<uint8_t> record(base.begin() + h.ring_offset,
                              base.begin() + h.ring_offset + format::kRecordBytes);
  WriteSeed(dir, "record", 2, record);
  WriteSeed(dir, "record-fixed", 3, record);
  auto rec = format::ParseRecord(record).value();
  std::vector<uint8_t> table(base.begin() + rec.table_offset,
                             base.begin() + rec.table_offset + rec.table_bytes);
  WriteSeed(dir, "table", 4, table);
  WriteSeed(dir, "tiny-file", 5, TinyImage());
  // Patch seeds: [u32 offset][u8 len][len bytes]..., first byte 1 = fix crcs.
  std::vector<uint8_t> patch = {1};
  const uint32_t off = static_cast<uint32_t>(rec.table_offset + 40);
  patch.insert(patch.end(), reinterpret_cast<const uint8_t*>(&off),
               reinterpret_cast<const uint8_t*>(&off) + 4);
  patch.push_back(4);
  patch.insert(patch.end(), {1, 0, 0, 0});
  WriteSeed(dir, "patch-table", 6, patch);
  WriteSeed(dir, "patch-none", 6, {0});
  WriteSeed(dir, "crafted-table", 7, CraftedTableSeed());
  const std::string meta = "{\"step\": 70, \"sched\": {\"lr\": [0.1, 0.01]}, \"s\": \"\\u00e9\\\"\"}";
  WriteSeed(dir, "cli-json", 8, std::vector<uint8_t>(meta.begin(), meta.end()));
  {
    LineageRecord lin;
    lin.abandoned = {{3, 5}, {9, 9}};
    lin.restored_counter = 2;
    lin.abandoned_through = 9;
    std::string l = std::string(1, '\0') + jobdir_internal::EncodeLineage(lin, 0);
    WriteSeed(dir, "jobdir-lineage", 9, std::vector<uint8_t>(l.begin(), l.end()));
    AgreedRecord ag;
    ag.step = 40;
    ag.counter = 4;
    ag.world_size = 2;
    ag.resharded_from = "world-4";
    ag.resharded_from_world = 4;
    std::string a = std::string(1, '\1') + jobdir_internal::EncodeAgreed(ag);
    WriteSeed(dir, "jobdir-agreed", 9, std::vector<uint8_t>(a.begin(), a.end()));
    const std::string name = std::string(1, '\3') + "rank-00003.nsck";
    WriteSeed(dir, "jobdir-name", 9, std::vector<uint8_t>(name.begin(), name.end()));
  }
}

// Mode 6: applies patches to the valid base image, so deep states (several
// checkpoints, reused slots, fallbacks) are one small mutation away.
void PatchBase(std::span<const uint8_t> in) {
  std::vector<uint8_t> img = BaseImage();
  if (in.empty()) return;
  const bool fix = in[0] & 1;
  size_t p = 1;
  while (p + 5 <= in.size()) {
    // Offsets wrap, so a patch can land anywhere in the image.
    const uint64_t off = Load32(&in[p]) % (img.size() + 1);
    const size_t len = in[p + 4];
    p += 5;
    const size_t n = std::min({len, in.size() - p, static_cast<size_t>(img.size() - off)});
    std::memcpy(img.data() + off, &in[p], n);
    p += n;
  }
  if (fix) FixFileCrcs(img);
  OpenScanRead(std::move(img));
}

// Mode 7: [u16 n_tensors][u16 entries_len][entries][metadata...]. The table
// header is made to agree with the record and the data region (a 16 KiB data
// region of a one-slot file), so only the entries and the metadata are
// hostile, with valid checksums everywhere.
std::vector<uint8_t> CraftedTableImage(std::span<const uint8_t> in) {
  if (in.size() < 4) return {};
  uint16_t n_tensors, entries_len;
  std::memcpy(&n_tensors, in.data(), 2);
  std::memcpy(&entries_len, in.data() + 2, 2);
  in = in.subspan(4);
  const size_t e_len = std::min<size_t>(entries_len, in.size());
  std::span<const uint8_t> entries = in.first(e_len), meta = in.subspan(e_len);
  constexpr uint64_t kData = 4 * kStoreAlign, kSlot = kData + 80 * 1024;
  format::FileHeader h;
  h.uuid_hi = 5;
  h.uuid_lo = 6;
  h.ring_records = 2;
  h.ring_offset = format::kRingOffset;
  h.slot_count = 1;
  h.slots_offset = h.ring_offset + 2 * format::kRecordBytes;
  h.slot_bytes = kSlot;
  std::vector<uint8_t> img(h.slots_offset + h.slot_bytes, 0);
  const auto hb = format::EncodeHeader(h);
  std::copy(hb.begin(), hb.end(), img.begin());
  std::copy(hb.begin(), hb.end(), img.begin() + format::kHeaderCopyOffset);
  uint8_t* data = img.data() + h.slots_offset;
  for (uint64_t i = 0; i < kData; ++i) data[i] = static_cast<uint8_t>(i * 13 + 5);
  // The table, byte by byte as docs/FORMAT.md lays it out.
  std::vector<uint8_t> t(format::kTableHeaderBytes, 0);
  auto put = [&](size_t at, uint64_t v, size_t n) { std::memcpy(t.data() + at, &v, n); };
  put(0, format::kTableMagic, 4);
  put(4, 1, 2);
  put(6, format::kTableHeaderBytes, 2);
  put(8, h.uuid_hi, 8);
  put(16, h.uuid_lo, 8);
  put(24, 9, 8);        // counter
  put(32, 90, 8);       // step
  put(40, 0, 4);        // rank
  put(44, 1, 4);        // world size
  put(48, n_tensors, 4);
  put(52, kStoreAlign, 4);
  put(56, kData / kStoreAlign, 8);
  put(64, kData, 8);
  put(72, entries.size(), 8);
  put(80, meta.size(), 8);
  t.insert(t.end(), entries.begin(), entries.end());
  for (uint64_t c = 0; c < kData / kStoreAlign; ++c) {
    const uint32_t crc = Crc32c(data + c * kStoreAlign, kStoreAlign);
    t.insert(t.end(), reinterpret_cast<const uint8_t*>(&crc),
             reinterpret_cast<const uint8_t*>(&crc) + 4);
  }
  t.insert(t.end(), meta.begin(), meta.end());
  const uint64_t padded = format::AlignUp(t.size(), kStoreAlign);
  if (kData + padded > kSlot) return {};
  std::copy(t.begin(), t.end(), img.begin() + h.slots_offset + kData);
  format::Record r;
  r.uuid_hi = h.uuid_hi;
  r.uuid_lo = h.uuid_lo;
  r.counter = 9;
  r.step = 90;
  r.data_offset = h.slots_offset;
  r.data_bytes = kData;
  r.table_offset = h.slots_offset + kData;
  r.table_bytes = t.size();
  r.table_crc = Crc32c(img.data() + r.table_offset, padded);
  const auto rb = format::EncodeRecord(r);
  std::copy(rb.begin(), rb.end(), img.begin() + h.ring_offset);
  return img;
}

// Mode 8: what `nonstop inspect --json` does with a checkpoint's metadata and
// names (tools/store_json.h).
void CliJson(std::span<const uint8_t> in) {
  const std::string_view text(reinterpret_cast<const char*>(in.data()), in.size());
  (void)cli::JsonNestingDepth(text);
  nlohmann::json j = {{"meta", cli::MetaJson(text)}, {"name", std::string(text)}};
  (void)cli::DumpJson(j, 2);
  (void)cli::DumpJson(j);
}

// Mode 9: the job directory's records and names.
void JobDirFiles(std::span<const uint8_t> in) {
  if (in.empty()) return;
  const std::string_view text(reinterpret_cast<const char*>(in.data()) + 1, in.size() - 1);
  namespace ji = jobdir_internal;
  switch (in[0] % 4) {
    case 0: {
      auto rec = ji::DecodeLineage(text, "fuzz lineage");
      if (rec.ok()) (void)ji::DecodeLineage(ji::EncodeLineage(*rec, 0), "re-encoded lineage");
      break;
    }
    case 1: {
      auto rec = ji::DecodeAgreed(text, "fuzz agreed");
      if (rec.ok()) (void)ji::DecodeAgreed(ji::EncodeAgreed(*rec), "re-encoded agreed");
      break;
    }
    case 2: {
      auto j = ji::ParseJson(text, "fuzz json");
      if (j.ok()) {
        uint64_t u;
        int64_t i;
        double d;
        (void)j->AsUint64(&u);
        (void)j->AsInt64(&i);
        (void)j->AsDouble(&d);
        (void)j->Get("step");
      }
      (void)ji::JsonString(text);
      break;
    }
    default:
      (void)JobDirNames::ParseSlot(text);
      (void)JobDirNames::ParseKeepStep(text);
      (void)JobDirNames::ParseWorld(text);
      break;
  }
}

// A valid seed for mode 7: the entries of a real table.
std::vector<uint8_t> CraftedTableSeed() {
  TensorEntry a, b;
  a.spec = {"w", DType::kFloat32, {2, 3}, 24, {}};
  b.spec = {"step", DType::kInt64, {}, 8, {{10}, 0}};
  b.data_offset = 24;
  format::Table t;
  t.crc_chunk_bytes = kStoreAlign;
  t.tensors = {a, b};
  t.meta_json = "{\"step\": 90, \"lr\": [0.1, {\"x\": null}]}";
  std::vector<uint8_t> tb = format::EncodeTable(t);
  // Entries start at 96 and end where the (empty) chunk crcs begin.
  const size_t e_len = tb.size() - format::kTableHeaderBytes - t.meta_json.size();
  std::vector<uint8_t> seed = {2, 0, static_cast<uint8_t>(e_len & 0xFF),
                               static_cast<uint8_t>(e_len >> 8)};
  seed.insert(seed.end(), tb.begin() + format::kTableHeaderBytes, tb.end());
  return seed;
}

}  // namespace
}  // namespace nonstop

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* dir = std::getenv("NONSTOP_FUZZ_SEEDS")) nonstop::WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace nonstop;  // NOLINT(build/namespaces)
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::span<const uint8_t> rest(data + 1, size - 1);
  switch (mode % 10) {
    case 0:
      (void)format::ParseHeader(rest);
      break;
    case 1: {
      std::vector<uint8_t> b(rest.begin(), rest.end());
      b.resize(format::kHeaderBytes, 0);
      FixBlockCrc(b.data(), b.size(), format::kHeaderCrcOffset);
      (void)format::ParseHeader(b);
      break;
    }
    case 2:
      (void)format::ParseRecord(rest);
      break;
    case 3: {
      std::vector<uint8_t> b(rest.begin(), rest.end());
      b.resize(format::kRecordBytes, 0);
      FixBlockCrc(b.data(), b.size(), format::kRecordCrcOffset);
      (void)format::ParseRecord(b);
      break;
    }
    case 4:
      (void)format::ParseTable(rest);
      (void)format::PeekTableHeader(rest);
      break;
    case 5: {
      std::vector<uint8_t> img(rest.begin(), rest.end());
      FixFileCrcs(img);
      OpenScanRead(std::move(img));
      break;
    }
    case 6:
      PatchBase(rest);
      break;
    case 7: {
      std::vector<uint8_t> img = CraftedTableImage(rest);
      if (!img.empty()) OpenScanRead(std::move(img));
      break;
    }
    case 8:
      CliJson(rest);
      break;
    default:
      JobDirFiles(rest);
      break;
  }
  return 0;
}
