#include "store/format.h"

#include <bit>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <string_view>
#include <limits>
#include <utility>

namespace nonstop::format {
namespace {

// Little-endian writer into a growing buffer.
class Writer {
 public:
  explicit Writer(std::vector<uint8_t>* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(v); }
  void U16(uint16_t v) { Raw(&v, 2); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I64(int64_t v) { Raw(&v, 8); }
  void Bytes(const void* p, size_t n) { Raw(p, n); }

 private:
  void Raw(const void* p, size_t n) {
    static_assert(std::endian::native == std::endian::little, "nonstop assumes little-endian");
    const auto* b = static_cast<const uint8_t*>(p);
    out_->insert(out_->end(), b, b + n);
  }
  std::vector<uint8_t>* out_;
};

// Bounds-checked little-endian reader. After any failed read ok() is false
// and every later read returns 0, so a parser can check once per section.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  uint8_t U8() { uint8_t v = 0; Raw(&v, 1); return v; }
  uint16_t U16() { uint16_t v = 0; Raw(&v, 2); return v; }
  uint32_t U32() { uint32_t v = 0; Raw(&v, 4); return v; }
  uint64_t U64() { uint64_t v = 0; Raw(&v, 8); return v; }
  int64_t I64() { int64_t v = 0; Raw(&v, 8); return v; }
  bool Bytes(void* p, size_t n) { return Raw(p, n); }
  bool Skip(size_t n) {
    if (!ok_ || n > b_.size() - pos_) return ok_ = false;
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return b_.size() - pos_; }
  bool ok() const { return ok_; }

 private:
  bool Raw(void* p, size_t n) {
    if (!ok_ || n > b_.size() - pos_) {
      ok_ = false;
      return false;
    }
    std::memcpy(p, b_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
  bool ok_ = true;
};

bool AllZero(std::span<const uint8_t> b) {
  for (uint8_t c : b) {
    if (c != 0) return false;
  }
  return true;
}

// crc32c of a whole block, skipping the 4-byte crc field at `crc_at`, so a
// flip anywhere in the block (padding included) is detected.
uint32_t BlockCrc(std::span<const uint8_t> b, size_t crc_at) {
  uint32_t c = Crc32c(b.data(), crc_at);
  return Crc32c(b.data() + crc_at + 4, b.size() - crc_at - 4, c);
}

// Pads an encoded block to `size` bytes and stores its BlockCrc in the crc
// field at `crc_at` (the encoder wrote 0 there).
std::vector<uint8_t> Seal(std::vector<uint8_t> out, size_t size, size_t crc_at) {
  out.resize(size, 0);
  const uint32_t crc = BlockCrc(out, crc_at);
  std::memcpy(out.data() + crc_at, &crc, 4);
  return out;
}

// a*b without overflow; false on overflow.
bool MulOk(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

Status ParseTableFixed(Reader& r, Table* t, uint32_t* n_tensors, uint64_t* n_chunks,
                       uint64_t* entries_bytes, uint64_t* meta_bytes) {
  uint32_t magic = r.U32();
  uint16_t version = r.U16();
  uint16_t header_bytes = r.U16();
  t->uuid_hi = r.U64();
  t->uuid_lo = r.U64();
  t->counter = r.U64();
  t->step = r.I64();
  t->rank = r.U32();
  t->world_size = r.U32();
  *n_tensors = r.U32();
  t->crc_chunk_bytes = r.U32();
  *n_chunks = r.U64();
  t->data_bytes = r.U64();
  *entries_bytes = r.U64();
  *meta_bytes = r.U64();
  r.U64();  // reserved
  if (!r.ok()) return Status::Corruption("tensor table truncated in its header");
  if (magic != kTableMagic) return Status::Corruption("tensor table has a bad magic number");
  if (version != 1) {
    return Status::Corruption("tensor table version " + std::to_string(version) + " unsupported");
  }
  if (header_bytes != kTableHeaderBytes) return Status::Corruption("tensor table header size");
  return Status::OK();
}

// Length of the UTF-8 sequence starting at s[i] when it is well formed, else 0.
size_t Utf8SeqLen(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  uint32_t cp = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (n > s.size() - i) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
      (cp >= 0xD800 && cp <= 0xDFFF)) {
    return 0;
  }
  return n;
}

// The code point of a well-formed sequence of `n` bytes at s[i].
uint32_t Utf8CodePoint(std::string_view s, size_t i, size_t n) {
  static constexpr uint8_t kLead[] = {0, 0x7F, 0x1F, 0x0F, 0x07};
  uint32_t cp = static_cast<uint8_t>(s[i]) & kLead[n];
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return cp;
}

bool IsControl(uint32_t cp) { return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F); }

}  // namespace

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8SeqLen(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string TensorNameProblem(std::string_view name) {
  if (name.empty()) return "empty name";
  if (name.size() > kMaxNameBytes) {
    return "name of " + std::to_string(name.size()) + " bytes (at most " +
           std::to_string(kMaxNameBytes) + ")";
  }
  for (size_t i = 0; i < name.size();) {
    const size_t n = Utf8SeqLen(name, i);
    if (n == 0) return "name is not valid UTF-8 (byte " + std::to_string(i) + ")";
    if (IsControl(Utf8CodePoint(name, i, n))) {
      return "name holds a control character (byte " + std::to_string(i) + ")";
    }
    i += n;
  }
  return "";
}

std::string Printable(std::string_view s) {
  constexpr size_t kShown = 80;
  std::string out;
  size_t i = 0;
  for (; i < s.size() && out.size() < kShown;) {
    const size_t n = Utf8SeqLen(s, i);
    if (n == 0 || IsControl(Utf8CodePoint(s, i, n)) || s[i] == '\\') {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\x%02X", static_cast<uint8_t>(s[i]));
      out += esc;
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  if (i < s.size()) out += "...";
  return out;
}

bool HeaderCrcOk(std::span<const uint8_t> bytes) {
  if (bytes.size() != kHeaderBytes) return false;
  uint32_t crc;
  std::memcpy(&crc, bytes.data() + kHeaderCrcOffset, 4);
  return crc == BlockCrc(bytes, kHeaderCrcOffset);
}

std::vector<uint8_t> EncodeHeader(const FileHeader& h) {
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes);
  Writer w(&out);
  w.Bytes(kFileMagic, 8);
  w.U32(kFormatVersion);
  w.U32(kHeaderBytes);
  w.U64(h.uuid_hi);
  w.U64(h.uuid_lo);
  w.U32(h.rank);
  w.U32(h.world_size);
  w.U32(h.ring_records);
  w.U32(kRecordBytes);
  w.U64(h.ring_offset);
  w.U32(h.slot_count);
  w.U32(static_cast<uint32_t>(kStoreAlign));
  w.U64(h.slots_offset);
  w.U64(h.slot_bytes);
  w.U64(h.created_unix_ns);
  w.U32(0);  // crc, at kHeaderCrcOffset
  return Seal(std::move(out), kHeaderBytes, kHeaderCrcOffset);
}

Result<FileHeader> ParseHeader(std::span<const uint8_t> bytes) {
  Reader r(bytes);
  char magic[8];
  r.Bytes(magic, 8);
  uint32_t version = r.U32();
  uint32_t header_bytes = r.U32();
  FileHeader h;
  h.uuid_hi = r.U64();
  h.uuid_lo = r.U64();
  h.rank = r.U32();
  h.world_size = r.U32();
  h.ring_records = r.U32();
  uint32_t record_bytes = r.U32();
  h.ring_offset = r.U64();
  h.slot_count = r.U32();
  uint32_t align = r.U32();
  h.slots_offset = r.U64();
  h.slot_bytes = r.U64();
  h.created_unix_ns = r.U64();
  size_t crc_end = r.pos();
  uint32_t crc = r.U32();
  if (!r.ok()) return Status::Corruption("file header truncated");
  if (std::memcmp(magic, kFileMagic, 8) != 0) {
    return Status::FailedPrecondition("not a nonstop slot file (bad magic)");
  }
  if (bytes.size() != kHeaderBytes || crc_end != kHeaderCrcOffset ||
      crc != BlockCrc(bytes, kHeaderCrcOffset)) {
    return Status::Corruption("file header checksum mismatch");
  }
  if (version != kFormatVersion) {
    return Status::FailedPrecondition("slot file format version " + std::to_string(version) +
                                      " is not supported by this nonstop (reads version " +
                                      std::to_string(kFormatVersion) + ")");
  }
  uint64_t ring_end = 0, slots_total = 0, file_end = 0;
  if (header_bytes != kHeaderBytes || record_bytes != kRecordBytes || align != kStoreAlign ||
      h.ring_records == 0 || h.ring_records > 4096 || h.ring_offset < kHeaderBytes ||
      h.ring_offset % kStoreAlign != 0 || h.slot_count == 0 || h.slot_count > (1u << 20) ||
      h.slot_bytes == 0 || h.slot_bytes % kStoreAlign != 0 || h.slots_offset % kStoreAlign != 0 ||
      h.world_size == 0 || h.rank >= h.world_size ||
      !MulOk(h.ring_records, kRecordBytes, &ring_end) ||
      __builtin_add_overflow(ring_end, h.ring_offset, &ring_end) || h.slots_offset < ring_end ||
      !MulOk(h.slot_count, h.slot_bytes, &slots_total) ||
      __builtin_add_overflow(slots_total, h.slots_offset, &file_end)) {
    return Status::Corruption("file header fields are inconsistent");
  }
  return h;
}

std::vector<uint8_t> EncodeRecord(const Record& rec) {
  std::vector<uint8_t> out;
  out.reserve(kRecordBytes);
  Writer w(&out);
  w.U32(kRecordMagic);
  w.U16(1);
  w.U16(static_cast<uint16_t>(kRecordCrcOffset + 4));
  w.U64(rec.uuid_hi);
  w.U64(rec.uuid_lo);
  w.U64(rec.sequence);
  w.U64(rec.counter);
  w.I64(rec.step);
  w.U32(rec.slot);
  w.U32(rec.flags);
  w.U64(rec.data_offset);
  w.U64(rec.data_bytes);
  w.U64(rec.table_offset);
  w.U64(rec.table_bytes);
  w.U32(rec.table_crc);
  w.U32(0);
  w.U64(rec.commit_unix_ns);
  w.U32(0);  // crc, at kRecordCrcOffset
  return Seal(std::move(out), kRecordBytes, kRecordCrcOffset);
}

Result<Record> ParseRecord(std::span<const uint8_t> bytes) {
  if (AllZero(bytes)) return Status::NotFound("empty ring entry");
  Reader r(bytes);
  uint32_t magic = r.U32();
  uint16_t version = r.U16();
  uint16_t used = r.U16();
  Record rec;
  rec.uuid_hi = r.U64();
  rec.uuid_lo = r.U64();
  rec.sequence = r.U64();
  rec.counter = r.U64();
  rec.step = r.I64();
  rec.slot = r.U32();
  rec.flags = r.U32();
  rec.data_offset = r.U64();
  rec.data_bytes = r.U64();
  rec.table_offset = r.U64();
  rec.table_bytes = r.U64();
  rec.table_crc = r.U32();
  r.U32();
  rec.commit_unix_ns = r.U64();
  size_t crc_end = r.pos();
  uint32_t crc = r.U32();
  if (!r.ok()) return Status::Corruption("superblock record truncated");
  if (magic != kRecordMagic) return Status::Corruption("superblock record has a bad magic (torn write?)");
  if (bytes.size() != kRecordBytes || crc_end != kRecordCrcOffset ||
      crc != BlockCrc(bytes, kRecordCrcOffset)) {
    return Status::Corruption("superblock record checksum mismatch (torn write?)");
  }
  if (version != 1 || used != kRecordCrcOffset + 4) {
    return Status::Corruption("superblock record version " + std::to_string(version) + " unsupported");
  }
  return rec;
}

std::vector<uint8_t> EncodeTable(const Table& t) {
  std::vector<uint8_t> entries;
  Writer e(&entries);
  for (const TensorEntry& te : t.tensors) {
    const TensorSpec& s = te.spec;
    e.U16(static_cast<uint16_t>(s.name.size()));
    e.Bytes(s.name.data(), s.name.size());
    e.U8(static_cast<uint8_t>(s.dtype));
    e.U8(static_cast<uint8_t>(s.shape.size()));
    for (int64_t d : s.shape) e.I64(d);
    e.U64(te.data_offset);
    e.U64(s.nbytes);
    e.U8(static_cast<uint8_t>(s.global.global_shape.size()));
    for (int64_t d : s.global.global_shape) e.I64(d);
    e.U64(s.global.global_offset);
  }
  std::vector<uint8_t> out;
  Writer w(&out);
  w.U32(kTableMagic);
  w.U16(1);
  w.U16(static_cast<uint16_t>(kTableHeaderBytes));
  w.U64(t.uuid_hi);
  w.U64(t.uuid_lo);
  w.U64(t.counter);
  w.I64(t.step);
  w.U32(t.rank);
  w.U32(t.world_size);
  w.U32(static_cast<uint32_t>(t.tensors.size()));
  w.U32(t.crc_chunk_bytes);
  w.U64(t.chunk_crcs.size());
  w.U64(t.data_bytes);
  w.U64(entries.size());
  w.U64(t.meta_json.size());
  w.U64(0);
  w.Bytes(entries.data(), entries.size());
  for (uint32_t c : t.chunk_crcs) w.U32(c);
  w.Bytes(t.meta_json.data(), t.meta_json.size());
  return out;
}

Result<Table> PeekTableHeader(std::span<const uint8_t> bytes) {
  Reader r(bytes);
  Table t;
  uint32_t n_tensors;
  uint64_t n_chunks, entries_bytes, meta_bytes;
  NONSTOP_RETURN_IF_ERROR(ParseTableFixed(r, &t, &n_tensors, &n_chunks, &entries_bytes, &meta_bytes));
  return t;
}

Result<Table> ParseTable(std::span<const uint8_t> bytes) {
  Reader r(bytes);
  Table t;
  uint32_t n_tensors;
  uint64_t n_chunks, entries_bytes, meta_bytes;
  NONSTOP_RETURN_IF_ERROR(ParseTableFixed(r, &t, &n_tensors, &n_chunks, &entries_bytes, &meta_bytes));
  if (t.world_size == 0 || t.rank >= t.world_size) {
    return Status::Corruption("tensor table has rank " + std::to_string(t.rank) + " of world size " +
                              std::to_string(t.world_size));
  }
  if (t.crc_chunk_bytes == 0 || t.crc_chunk_bytes % kStoreAlign != 0) {
    return Status::Corruption("tensor table crc chunk size " + std::to_string(t.crc_chunk_bytes) +
                              " is not a positive multiple of 4096");
  }
  if (t.data_bytes % kStoreAlign != 0) {
    return Status::Corruption("tensor table data region of " + std::to_string(t.data_bytes) +
                              " bytes is not a multiple of 4096");
  }
  uint64_t expect_chunks = (t.data_bytes + t.crc_chunk_bytes - 1) / t.crc_chunk_bytes;
  if (n_chunks != expect_chunks) return Status::Corruption("tensor table chunk count mismatch");
  // Each section must fit in what is left; check before allocating anything.
  uint64_t crc_bytes = 0;
  if (entries_bytes > r.remaining() || !MulOk(n_chunks, 4, &crc_bytes) ||
      crc_bytes > r.remaining() - entries_bytes ||
      meta_bytes != r.remaining() - entries_bytes - crc_bytes) {
    return Status::Corruption("tensor table section sizes do not add up");
  }
  if (meta_bytes > kMaxMetaBytes) {
    return Status::Corruption("tensor table metadata of " + std::to_string(meta_bytes) +
                              " bytes is larger than the limit of " + std::to_string(kMaxMetaBytes));
  }
  // Every entry takes at least kMinEntryBytes, so the count is bounded by the
  // table's own size (itself bounded by the slot and the file).
  if (n_tensors > entries_bytes / kMinEntryBytes) {
    return Status::Corruption("tensor table claims " + std::to_string(n_tensors) +
                              " tensors in " + std::to_string(entries_bytes) + " bytes of entries");
  }
  std::span<const uint8_t> eb = bytes.subspan(r.pos(), entries_bytes);
  r.Skip(entries_bytes);
  Reader er(eb);
  t.tensors.reserve(n_tensors);
  for (uint32_t i = 0; i < n_tensors; ++i) {
    TensorEntry te;
    TensorSpec& s = te.spec;
    const std::string at = "tensor table entry " + std::to_string(i);
    uint16_t name_len = er.U16();
    if (!er.ok() || name_len == 0 || name_len > kMaxNameBytes || name_len > er.remaining()) {
      return Status::Corruption(at + ": bad name length");
    }
    s.name.resize(name_len);
    er.Bytes(s.name.data(), name_len);
    const std::string what = at + " ('" + Printable(s.name) + "')";
    if (std::string why = TensorNameProblem(s.name); !why.empty()) {
      return Status::Corruption(what + ": " + why);
    }
    uint8_t dtype = er.U8();
    uint8_t ndim = er.U8();
    if (!er.ok()) return Status::Corruption(what + ": truncated");
    if (dtype >= kNumDTypes) {
      return Status::Corruption(what + ": unknown dtype " + std::to_string(dtype));
    }
    if (ndim > kMaxDims) {
      return Status::Corruption(what + ": " + std::to_string(ndim) + " dimensions (at most 64)");
    }
    s.dtype = static_cast<DType>(dtype);
    s.shape.resize(ndim);
    uint64_t numel = 1;
    for (auto& d : s.shape) {
      d = er.I64();
      if (d < 0 || !MulOk(numel, static_cast<uint64_t>(d), &numel)) {
        return Status::Corruption(what + ": bad shape");
      }
    }
    te.data_offset = er.U64();
    s.nbytes = er.U64();
    uint8_t gdim = er.U8();
    if (!er.ok() || gdim > kMaxDims) return Status::Corruption(what + ": truncated");
    s.global.global_shape.resize(gdim);
    uint64_t gnumel = 1;
    for (auto& d : s.global.global_shape) {
      d = er.I64();
      if (d < 0 || !MulOk(gnumel, static_cast<uint64_t>(d), &gnumel)) {
        return Status::Corruption(what + ": bad global shape");
      }
    }
    s.global.global_offset = er.U64();
    if (!er.ok()) return Status::Corruption(what + ": truncated");
    uint64_t expect_bytes = 0, end = 0;
    if (!MulOk(numel, DTypeSize(s.dtype), &expect_bytes) || expect_bytes != s.nbytes) {
      return Status::Corruption(what + ": " + std::to_string(s.nbytes) +
                                " bytes do not match its shape and dtype");
    }
    if (__builtin_add_overflow(te.data_offset, s.nbytes, &end) || end > t.data_bytes) {
      return Status::Corruption(what + ": bytes [" + std::to_string(te.data_offset) + ", +" +
                                std::to_string(s.nbytes) + ") lie outside the data region of " +
                                std::to_string(t.data_bytes) + " bytes");
    }
    const uint64_t align = s.nbytes >= kLargeTensorBytes ? kStoreAlign : 8;
    if (te.data_offset % align != 0) {
      return Status::Corruption(what + ": offset " + std::to_string(te.data_offset) +
                                " is not a multiple of " + std::to_string(align));
    }
    if (gdim > 0 && (s.global.global_offset > gnumel || numel > gnumel - s.global.global_offset)) {
      return Status::Corruption(what + ": bad global range");
    }
    t.tensors.push_back(std::move(te));
  }
  if (er.remaining() != 0) return Status::Corruption("tensor table has trailing entry bytes");
  // No two tensors share a byte, so their sizes add up to at most data_bytes
  // (a reader allocating every tensor allocates at most the data region).
  std::vector<uint32_t> order(t.tensors.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return t.tensors[a].data_offset < t.tensors[b].data_offset;
  });
  const TensorEntry* prev = nullptr;
  uint32_t prev_i = 0;
  for (uint32_t i : order) {
    const TensorEntry& te = t.tensors[i];
    if (te.spec.nbytes == 0) continue;
    if (prev != nullptr && te.data_offset < prev->data_offset + prev->spec.nbytes) {
      const uint32_t lo = std::min(i, prev_i), hi = std::max(i, prev_i);
      return Status::Corruption("tensor table entry " + std::to_string(hi) + " ('" +
                                Printable(t.tensors[hi].spec.name) + "') overlaps entry " +
                                std::to_string(lo) + " ('" + Printable(t.tensors[lo].spec.name) +
                                "') in the data region");
    }
    prev = &te;
    prev_i = i;
  }
  std::vector<uint32_t> by_name(order.size());
  for (uint32_t i = 0; i < by_name.size(); ++i) by_name[i] = i;
  std::sort(by_name.begin(), by_name.end(), [&](uint32_t a, uint32_t b) {
    return t.tensors[a].spec.name < t.tensors[b].spec.name;
  });
  for (size_t k = 1; k < by_name.size(); ++k) {
    const uint32_t a = by_name[k - 1], b = by_name[k];
    if (t.tensors[a].spec.name == t.tensors[b].spec.name) {
      return Status::Corruption("tensor table entry " + std::to_string(std::max(a, b)) + " ('" +
                                Printable(t.tensors[b].spec.name) + "'): duplicate of entry " +
                                std::to_string(std::min(a, b)));
    }
  }
  t.chunk_crcs.resize(n_chunks);
  for (auto& c : t.chunk_crcs) c = r.U32();
  t.meta_json.resize(meta_bytes);
  r.Bytes(t.meta_json.data(), meta_bytes);
  if (!r.ok()) return Status::Corruption("tensor table truncated");
  if (!IsValidUtf8(t.meta_json)) return Status::Corruption("tensor table metadata is not valid UTF-8");
  return t;
}

}  // namespace nonstop::format
