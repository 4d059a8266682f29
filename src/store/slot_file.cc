// SlotFile: layout planning, the commit protocol and the recovery scan.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "nonstop/store.h"
#include "store/format.h"

namespace nonstop {
namespace {

using format::AlignUp;

// A heap buffer aligned for O_DIRECT.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n) : n_(AlignUp(n == 0 ? 1 : n, kStoreAlign)) {
    if (posix_memalign(&p_, kStoreAlign, n_) != 0) p_ = nullptr;
    if (p_ != nullptr) std::memset(p_, 0, n_);
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data() { return static_cast<uint8_t*>(p_); }
  size_t size() const { return n_; }
  bool ok() const { return p_ != nullptr; }

 private:
  void* p_ = nullptr;
  size_t n_;
};

// Through the page cache, writes zeros over [from, to) of a range just
// allocated, so that no extent of the file is left unwritten: on Linux (ext4)
// a page whose writeback into an unwritten extent failed stays cached with
// its block mapped, and a later checkpoint's rewrite of it reaches the disk
// while the extent stays unwritten and reads back as zeros, though every
// fsync returned 0 (FORMAT.md "After a failed fsync"). O_DIRECT writes keep
// no such page, and skip the cost. Neither does a file in memory (tmpfs,
// /dev/shm: Medium::InMemory): nothing is written back, and its pages read
// as zeros until written; there the zeros cost a pass over the whole file
// (a 1.38B model's memory segment, 50 GB) for nothing.
Status WriteExtents(Medium& m, uint64_t from, uint64_t to) {
  if (m.kind() == MediumKind::kDirect || m.kind() == MediumKind::kUring || m.InMemory() ||
      from >= to) {
    return Status::OK();
  }
  AlignedBuffer zeros(std::min<uint64_t>(to - from, uint64_t{1} << 20));
  if (!zeros.ok()) return Status::Internal("out of memory writing the slot file's zeros");
  for (uint64_t off = from; off < to;) {
    const uint64_t n = std::min<uint64_t>(zeros.size(), to - off);
    NONSTOP_RETURN_IF_ERROR(m.Write(off, zeros.data(), n).Annotate("writing the slots' zeros"));
    off += n;
  }
  return Status::OK();
}

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

std::string Describe(const format::Record& r) {
  return "checkpoint #" + std::to_string(r.counter) + " (step " + std::to_string(r.step) +
         ", slot " + std::to_string(r.slot) + ")";
}

// What a commit record (and the file header) says of its checkpoint; the
// table adds chunk crcs, tensors and metadata.
CheckpointInfo RecordInfo(const format::Record& r, const format::FileHeader& h) {
  CheckpointInfo info;
  info.counter = r.counter;
  info.step = r.step;
  info.sequence = r.sequence;
  info.slot = r.slot;
  info.rank = h.rank;
  info.world_size = h.world_size;
  info.commit_unix_ns = r.commit_unix_ns;
  info.data_offset = r.data_offset;
  info.data_bytes = r.data_bytes;
  info.table_bytes = r.table_bytes;
  return info;
}

}  // namespace

std::string SlotFileName(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d.nsck", rank);
  return buf;
}

int CheckpointInfo::FindTensor(const std::string& name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].spec.name == name) return static_cast<int>(i);
  }
  return -1;
}

Result<SlotLayout> SlotLayout::Plan(const std::vector<TensorSpec>& specs) {
  SlotLayout layout;
  layout.tensors.resize(specs.size());
  std::vector<std::string> names;
  names.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    if (std::string why = format::TensorNameProblem(s.name); !why.empty()) {
      return Status::InvalidArgument("tensor " + std::to_string(i) + " ('" +
                                     format::Printable(s.name) + "'): " + why +
                                     "; a name is 1 to 4096 bytes of UTF-8 without control "
                                     "characters");
    }
    if (DTypeSize(s.dtype) == 0) {
      return Status::InvalidArgument("tensor '" + s.name + "': unknown dtype");
    }
    if (s.shape.size() > format::kMaxDims) {
      return Status::InvalidArgument("tensor '" + s.name + "': more than 64 dimensions");
    }
    for (int64_t d : s.shape) {
      if (d < 0) return Status::InvalidArgument("tensor '" + s.name + "': negative dimension");
    }
    if (NumElements(s.shape) * DTypeSize(s.dtype) != s.nbytes) {
      return Status::InvalidArgument("tensor '" + s.name + "': nbytes " +
                                     std::to_string(s.nbytes) + " does not match shape and dtype " +
                                     std::string(DTypeName(s.dtype)));
    }
    layout.tensors[i].spec = s;
    names.push_back(s.name);
  }
  std::sort(names.begin(), names.end());
  auto dup = std::adjacent_find(names.begin(), names.end());
  if (dup != names.end()) return Status::InvalidArgument("duplicate tensor name '" + *dup + "'");

  // Large tensors first, each 4 KiB aligned, then small ones packed at 8 bytes.
  uint64_t off = 0;
  for (auto& te : layout.tensors) {
    if (te.spec.nbytes >= kLargeTensorBytes) {
      off = AlignUp(off, kStoreAlign);
      te.data_offset = off;
      off += te.spec.nbytes;
    }
  }
  off = AlignUp(off, kStoreAlign);
  for (auto& te : layout.tensors) {
    if (te.spec.nbytes < kLargeTensorBytes) {
      off = AlignUp(off, 8);
      te.data_offset = off;
      off += te.spec.nbytes;
    }
  }
  layout.data_bytes = AlignUp(off, kStoreAlign);
  return layout;
}

uint64_t StoreGeometry::SlotBytesFor(const SlotLayout& layout, uint64_t meta_reserve) {
  uint64_t table = format::kTableHeaderBytes + meta_reserve;
  for (const auto& te : layout.tensors) {
    table += 29 + te.spec.name.size() + 8 * (te.spec.shape.size() + te.spec.global.global_shape.size());
  }
  table += layout.data_bytes / kStoreAlign * 4 + 4;  // chunk crcs at the smallest chunk size
  return layout.data_bytes + AlignUp(table, kStoreAlign);
}

struct SlotFile::Impl {
  format::FileHeader header;
  std::mutex mu;  // serialises Commit and Scan; guards the two fields below
  uint64_t next_sequence = 0;
  uint64_t newest_counter = 0;

  // Reads the whole ring; fills records (index -> parsed or error).
  // Entries past the end of a truncated file are Corruption; the buffer
  // never exceeds the file's size.
  Status ReadRing(Medium& m, std::vector<Result<format::Record>>* out) {
    const uint64_t n = header.ring_records;
    const uint64_t size = m.Size();
    const uint64_t present =
        size <= header.ring_offset
            ? 0
            : std::min<uint64_t>(n, (size - header.ring_offset) / format::kRecordBytes);
    AlignedBuffer buf(present * format::kRecordBytes);
    if (!buf.ok()) return Status::Internal("out of memory reading the superblock ring");
    if (present > 0) {
      NONSTOP_RETURN_IF_ERROR(
          m.Read(header.ring_offset, buf.data(), present * format::kRecordBytes)
              .Annotate("reading the superblock ring"));
    }
    out->clear();
    for (uint64_t i = 0; i < n; ++i) {
      if (i >= present) {
        out->push_back(Status::Corruption("superblock record lies past the end of the file "
                                          "(truncated)"));
        continue;
      }
      out->push_back(format::ParseRecord(
          std::span<const uint8_t>(buf.data() + i * format::kRecordBytes, format::kRecordBytes)));
    }
    return Status::OK();
  }
};

SlotFile::SlotFile(std::unique_ptr<Medium> medium, const StoreGeometry& g)
    : impl_(std::make_unique<Impl>()), medium_(std::move(medium)), geometry_(g) {}
SlotFile::~SlotFile() = default;

uint64_t SlotFile::SlotOffset(uint32_t slot) const {
  return impl_->header.slots_offset + uint64_t{slot} * impl_->header.slot_bytes;
}

uint64_t SlotFile::newest_committed_counter() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->newest_counter;
}

Result<std::unique_ptr<SlotFile>> SlotFile::Create(std::unique_ptr<Medium> medium,
                                                   const StoreGeometry& g) {
  if (g.slots == 0 || g.slot_bytes == 0 || g.slot_bytes % kStoreAlign != 0) {
    return Status::InvalidArgument("slot geometry needs >= 1 slot of a positive multiple of 4096 bytes");
  }
  if (g.world_size == 0 || g.rank >= g.world_size) {
    return Status::InvalidArgument("rank " + std::to_string(g.rank) + " is outside world size " +
                                   std::to_string(g.world_size));
  }
  std::unique_ptr<SlotFile> f(new SlotFile(std::move(medium), g));
  format::FileHeader& h = f->impl_->header;
  std::random_device rd;
  h.uuid_hi = (uint64_t{rd()} << 32) | rd();
  h.uuid_lo = (uint64_t{rd()} << 32) | rd();
  h.rank = g.rank;
  h.world_size = g.world_size;
  h.ring_records = kRingRecords;
  h.ring_offset = format::kRingOffset;  // block 1 holds the header copy
  h.slot_count = g.slots;
  h.slots_offset = h.ring_offset + uint64_t{kRingRecords} * format::kRecordBytes;
  h.slot_bytes = g.slot_bytes;
  h.created_unix_ns = NowNs();
  Medium& m = *f->medium_;
  const uint64_t file_end = h.slots_offset + uint64_t{g.slots} * g.slot_bytes;
  NONSTOP_RETURN_IF_ERROR(m.Resize(file_end).Annotate("preallocating the slot file"));
  AlignedBuffer ring(uint64_t{kRingRecords} * format::kRecordBytes);  // zeroed: an empty ring
  if (!ring.ok()) return Status::Internal("out of memory creating the slot file");
  NONSTOP_RETURN_IF_ERROR(m.Write(h.ring_offset, ring.data(), ring.size()));
  NONSTOP_RETURN_IF_ERROR(WriteExtents(m, h.slots_offset, file_end));
  std::vector<uint8_t> hb = format::EncodeHeader(h);
  AlignedBuffer hbuf(hb.size());
  std::memcpy(hbuf.data(), hb.data(), hb.size());
  NONSTOP_RETURN_IF_ERROR(m.Write(0, hbuf.data(), hbuf.size()));
  NONSTOP_RETURN_IF_ERROR(m.Write(format::kHeaderCopyOffset, hbuf.data(), hbuf.size()));
  NONSTOP_RETURN_IF_ERROR(m.Sync());
  return f;
}

Result<std::unique_ptr<SlotFile>> SlotFile::Open(std::unique_ptr<Medium> medium,
                                                 const SlotOpenOptions& opts) {
  const uint64_t size = medium->Size();
  if (size < format::kHeaderBytes) {
    return Status::FailedPrecondition("not a nonstop slot file (shorter than its header)");
  }
  // The header (block 0) and, where the file has one, its copy (block 1).
  const bool copy_present = size >= format::kHeaderCopyOffset + format::kHeaderBytes;
  AlignedBuffer hbuf(2 * format::kHeaderBytes);
  if (!hbuf.ok()) return Status::Internal("out of memory opening the slot file");
  NONSTOP_RETURN_IF_ERROR(medium->Read(0, hbuf.data(), format::kHeaderBytes)
                              .Annotate("reading the file header"));
  if (copy_present) {
    NONSTOP_RETURN_IF_ERROR(medium->Read(format::kHeaderCopyOffset,
                                         hbuf.data() + format::kHeaderBytes, format::kHeaderBytes)
                                .Annotate("reading the file header copy"));
  }
  const std::span<const uint8_t> pb(hbuf.data(), format::kHeaderBytes);
  const std::span<const uint8_t> cb(hbuf.data() + format::kHeaderBytes, format::kHeaderBytes);
  Result<format::FileHeader> primary = format::ParseHeader(pb);
  Result<format::FileHeader> copy =
      copy_present ? format::ParseHeader(cb) : Status::NotFound("no header copy");
  // A block parses as the copy only when it describes a file that has one
  // (in older files block 1 is ring entry 0).
  const bool copy_ok = copy.ok() && copy->ring_offset >= format::kRingOffset;
  const std::string copy_at = "the copy at offset " + std::to_string(format::kHeaderCopyOffset);
  format::FileHeader h;
  std::vector<std::string> notes;
  bool fix_primary = false, fix_copy = false;
  if (primary.ok()) {
    h = *primary;
    if (h.ring_offset >= format::kRingOffset) {  // this file keeps a copy
      if (!copy_present) {
        notes.push_back("header copy at offset 4096 is missing (the file is truncated); used "
                        "the header at offset 0");
        fix_copy = true;
      } else if (!copy_ok) {
        notes.push_back("header copy at offset 4096 is damaged (" +
                        (copy.ok() ? std::string("describes no copy") : copy.status().message()) +
                        "); used the header at offset 0");
        fix_copy = true;
      } else if (std::memcmp(pb.data(), cb.data(), format::kHeaderBytes) != 0) {
        notes.push_back("header copy at offset 4096 differs from the header; used the header at "
                        "offset 0");
        fix_copy = true;
      }
    }
  } else if (!format::HeaderCrcOk(pb) && copy_ok) {
    // The header's own checksum fails and the copy is intact: a damaged
    // header, not a foreign file or a newer version (those have a good crc).
    h = *copy;
    notes.push_back("file header damaged (" + primary.status().message() + "); used " + copy_at);
    fix_primary = true;
  } else {
    return primary.status();
  }
  const uint64_t end = h.slots_offset + uint64_t{h.slot_count} * h.slot_bytes;
  const bool truncated = size < end;
  if (truncated) {
    notes.push_back("slot file is truncated: " + std::to_string(size) +
                    " bytes, its header describes " + std::to_string(end) +
                    "; checkpoints whose bytes are missing are reported damaged");
  }
  if (opts.repair && !notes.empty()) {
    // The header never changes after Create, so rewriting the damaged block
    // from the intact one restores the file exactly.
    if (truncated) {
      NONSTOP_RETURN_IF_ERROR(medium->Resize(end).Annotate("restoring the truncated slot file's length"));
      NONSTOP_RETURN_IF_ERROR(WriteExtents(*medium, size, end));
    }
    std::vector<uint8_t> hb = format::EncodeHeader(h);
    AlignedBuffer good(hb.size());
    if (!good.ok()) return Status::Internal("out of memory repairing the file header");
    std::memcpy(good.data(), hb.data(), hb.size());
    if (fix_primary) {
      NONSTOP_RETURN_IF_ERROR(
          medium->Write(0, good.data(), good.size()).Annotate("repairing the file header"));
    }
    if (fix_copy) {
      NONSTOP_RETURN_IF_ERROR(medium->Write(format::kHeaderCopyOffset, good.data(), good.size())
                                  .Annotate("repairing the file header copy"));
    }
    NONSTOP_RETURN_IF_ERROR(medium->Sync().Annotate("syncing the repaired file header"));
    for (std::string& n : notes) n += " (repaired)";
  }
  StoreGeometry g;
  g.slots = h.slot_count;
  g.slot_bytes = h.slot_bytes;
  g.rank = h.rank;
  g.world_size = h.world_size;
  std::unique_ptr<SlotFile> f(new SlotFile(std::move(medium), g));
  f->impl_->header = h;
  f->salvaged_ = std::move(notes);
  // Learn the ring position and newest counter so commits continue above them.
  std::vector<Result<format::Record>> ring;
  NONSTOP_RETURN_IF_ERROR(f->impl_->ReadRing(*f->medium_, &ring));
  for (auto& r : ring) {
    if (!r.ok() || r->uuid_hi != h.uuid_hi || r->uuid_lo != h.uuid_lo) continue;
    f->impl_->next_sequence = std::max(f->impl_->next_sequence, r->sequence + 1);
    f->impl_->newest_counter = std::max(f->impl_->newest_counter, r->counter);
  }
  return f;
}

Status SlotFile::WriteData(uint32_t slot, uint64_t offset_in_slot, const void* buf, size_t n) {
  if (slot >= geometry_.slots || offset_in_slot > geometry_.slot_bytes ||
      n > geometry_.slot_bytes - offset_in_slot) {
    return Status::InvalidArgument("write of " + std::to_string(n) + " bytes at " +
                                   std::to_string(offset_in_slot) + " is outside slot " +
                                   std::to_string(slot));
  }
  return medium_->Write(SlotOffset(slot) + offset_in_slot, buf, n);
}

Result<CheckpointInfo> SlotFile::Commit(const CommitRequest& req) {
  if (req.layout == nullptr) return Status::InvalidArgument("commit without a layout");
  if (req.slot >= geometry_.slots) return Status::InvalidArgument("commit to a slot that does not exist");
  const SlotLayout& layout = *req.layout;
  if (req.crc_chunk_bytes == 0 || req.crc_chunk_bytes % kStoreAlign != 0) {
    return Status::InvalidArgument("crc chunk size must be a positive multiple of 4096");
  }
  uint64_t n_chunks = (layout.data_bytes + req.crc_chunk_bytes - 1) / req.crc_chunk_bytes;
  if (req.chunk_crcs.size() != n_chunks) {
    return Status::InvalidArgument("commit has " + std::to_string(req.chunk_crcs.size()) +
                                   " chunk checksums, the layout needs " + std::to_string(n_chunks));
  }
  if (req.meta_json.size() > format::kMaxMetaBytes) {
    return Status::InvalidArgument("checkpoint metadata of " + std::to_string(req.meta_json.size()) +
                                   " bytes is larger than the limit of " +
                                   std::to_string(format::kMaxMetaBytes));
  }
  if (!format::IsValidUtf8(req.meta_json)) {
    return Status::InvalidArgument("checkpoint metadata is not valid UTF-8");
  }
  Impl& I = *impl_;
  format::Table t;
  t.uuid_hi = I.header.uuid_hi;
  t.uuid_lo = I.header.uuid_lo;
  t.counter = req.counter;
  t.step = req.step;
  t.rank = I.header.rank;
  t.world_size = I.header.world_size;
  t.crc_chunk_bytes = req.crc_chunk_bytes;
  t.data_bytes = layout.data_bytes;
  t.tensors = layout.tensors;
  t.chunk_crcs = req.chunk_crcs;
  t.meta_json = req.meta_json;
  std::vector<uint8_t> table = format::EncodeTable(t);
  const uint64_t table_padded = AlignUp(table.size(), kStoreAlign);
  if (layout.data_bytes + table_padded > geometry_.slot_bytes) {
    return Status::InvalidArgument("checkpoint needs " +
                                   std::to_string(layout.data_bytes + table_padded) +
                                   " bytes but a slot holds " + std::to_string(geometry_.slot_bytes) +
                                   "; the state grew: re-create the slot file");
  }
  AlignedBuffer tbuf(table_padded);
  if (!tbuf.ok()) return Status::Internal("out of memory building the tensor table");
  std::memcpy(tbuf.data(), table.data(), table.size());

  std::lock_guard<std::mutex> l(I.mu);
  if (req.counter <= I.newest_counter) {
    return Status::Aborted("checkpoint #" + std::to_string(req.counter) +
                           " superseded by committed checkpoint #" + std::to_string(I.newest_counter));
  }
  const uint64_t data_offset = SlotOffset(req.slot);
  const uint64_t table_offset = data_offset + layout.data_bytes;
  // 1. table next to the data; 2. one sync makes both durable; 3. the record; 4. sync.
  NONSTOP_RETURN_IF_ERROR(medium_->Write(table_offset, tbuf.data(), table_padded)
                              .Annotate("writing the tensor table"));
  NONSTOP_RETURN_IF_ERROR(medium_->Sync().Annotate("syncing checkpoint data"));
  format::Record rec;
  rec.uuid_hi = I.header.uuid_hi;
  rec.uuid_lo = I.header.uuid_lo;
  rec.sequence = I.next_sequence;
  rec.counter = req.counter;
  rec.step = req.step;
  rec.slot = req.slot;
  rec.data_offset = data_offset;
  rec.data_bytes = layout.data_bytes;
  rec.table_offset = table_offset;
  rec.table_bytes = table.size();
  rec.table_crc = Crc32c(tbuf.data(), table_padded);  // padding included
  rec.commit_unix_ns = NowNs();
  std::vector<uint8_t> rb = format::EncodeRecord(rec);
  AlignedBuffer rbuf(rb.size());
  std::memcpy(rbuf.data(), rb.data(), rb.size());
  const uint64_t rec_off =
      I.header.ring_offset + (rec.sequence % I.header.ring_records) * format::kRecordBytes;
  // The sequence advances even if the write fails: the ring entry is now in an
  // unknown state and must not be reused as if it held its old record.
  I.next_sequence++;
  NONSTOP_RETURN_IF_ERROR(medium_->Write(rec_off, rbuf.data(), rbuf.size())
                              .Annotate("writing the superblock record"));
  NONSTOP_RETURN_IF_ERROR(medium_->Sync().Annotate("syncing the superblock record"));
  I.newest_counter = req.counter;

  CheckpointInfo info = RecordInfo(rec, I.header);
  info.crc_chunk_bytes = req.crc_chunk_bytes;
  info.chunk_crcs = req.chunk_crcs;
  info.tensors = layout.tensors;
  info.meta_json = req.meta_json;
  return info;
}

// Verifies one record's table and (optionally) data. Fills `info`; returns
// the reason it is unusable, or OK.
// `ring` holds every parsed record, to tell a reused slot from a damaged table.
static Status CheckRecord(Medium& m, const format::FileHeader& h, const format::Record& r,
                          const std::vector<format::Record>& ring, bool verify_data,
                          CheckpointInfo* info, SlotFile* f) {
  *info = RecordInfo(r, h);
  if (r.uuid_hi != h.uuid_hi || r.uuid_lo != h.uuid_lo) {
    return Status::Corruption("record belongs to another slot file (uuid mismatch)");
  }
  const uint64_t slot_off = h.slots_offset + uint64_t{r.slot} * h.slot_bytes;
  if (r.slot >= h.slot_count || r.data_offset != slot_off || r.data_bytes % kStoreAlign != 0 ||
      r.data_bytes > h.slot_bytes || r.table_offset != slot_off + r.data_bytes ||
      r.table_bytes < format::kTableHeaderBytes || r.table_bytes > h.slot_bytes ||
      AlignUp(r.table_bytes, kStoreAlign) > h.slot_bytes - r.data_bytes) {
    return Status::Corruption("record points outside its slot");
  }
  // Nothing is allocated for bytes the file does not hold.
  if (r.table_offset + AlignUp(r.table_bytes, kStoreAlign) > m.Size()) {
    return Status::Corruption("slot " + std::to_string(r.slot) +
                              " lies past the end of the file (truncated)");
  }
  AlignedBuffer tbuf(r.table_bytes);
  if (!tbuf.ok()) return Status::Internal("out of memory reading a tensor table");
  NONSTOP_RETURN_IF_ERROR(m.Read(r.table_offset, tbuf.data(), tbuf.size()));
  std::span<const uint8_t> tb(tbuf.data(), r.table_bytes);
  if (Crc32c(tbuf.data(), tbuf.size()) != r.table_crc) {
    // The slot was reused when its table now belongs to a later checkpoint of
    // this slot: one with a record here, or one newer than every record (a
    // commit under way). It was reused too when a newer record of the ring
    // points into the same slot, whatever lies at this table's offset now (a
    // newer checkpoint with another data size puts its data there), as
    // `nonstop inspect` says. Anything else is a damaged table, not a reuse.
    auto peek = format::PeekTableHeader(tb);
    uint64_t reused_by = 0;
    if (peek.ok() && peek->counter > r.counter && peek->uuid_hi == h.uuid_hi &&
        peek->uuid_lo == h.uuid_lo) {
      uint64_t newest = 0;
      for (const format::Record& o : ring) {
        newest = std::max(newest, o.counter);
        if (o.counter == peek->counter && o.slot == r.slot) reused_by = peek->counter;
      }
      if (peek->counter > newest && peek->counter - newest <= h.slot_count) {
        reused_by = peek->counter;
      }
    }
    if (reused_by == 0) {
      for (const format::Record& o : ring) {  // the oldest newer record in this slot
        if (o.counter > r.counter && o.slot == r.slot && o.uuid_hi == h.uuid_hi &&
            o.uuid_lo == h.uuid_lo && (reused_by == 0 || o.counter < reused_by)) {
          reused_by = o.counter;
        }
      }
    }
    if (reused_by != 0) {
      return Status::Corruption("slot " + std::to_string(r.slot) + " was reused by checkpoint #" +
                                std::to_string(reused_by));
    }
    return Status::Corruption("tensor table checksum mismatch");
  }
  NONSTOP_ASSIGN_OR_RETURN(format::Table t, format::ParseTable(tb));
  if (t.counter != r.counter || t.step != r.step || t.data_bytes != r.data_bytes ||
      t.uuid_hi != h.uuid_hi || t.uuid_lo != h.uuid_lo) {
    return Status::Corruption("tensor table does not match its record");
  }
  info->crc_chunk_bytes = t.crc_chunk_bytes;
  info->chunk_crcs = std::move(t.chunk_crcs);
  info->tensors = std::move(t.tensors);
  info->meta_json = std::move(t.meta_json);
  info->rank = t.rank;
  info->world_size = t.world_size;
  if (verify_data && info->data_bytes > 0) {
    return f->ReadData(*info, 0, nullptr, info->data_bytes, /*verify=*/true);
  }
  return Status::OK();
}

Result<ScanReport> SlotFile::Scan(const ScanOptions& opts) {
  Impl& I = *impl_;
  std::lock_guard<std::mutex> l(I.mu);
  std::vector<Result<format::Record>> ring;
  NONSTOP_RETURN_IF_ERROR(I.ReadRing(*medium_, &ring));
  ScanReport report;
  std::vector<format::Record> records;
  for (size_t i = 0; i < ring.size(); ++i) {
    if (ring[i].ok()) {
      records.push_back(ring[i].value());
    } else if (ring[i].status().code() != StatusCode::kNotFound) {
      report.skipped.push_back("ring entry " + std::to_string(i) + ": " + ring[i].status().message());
    }
  }
  std::sort(records.begin(), records.end(),
            [](const auto& a, const auto& b) { return a.counter > b.counter; });
  for (const format::Record& r : records) {
    if (r.uuid_hi == I.header.uuid_hi && r.uuid_lo == I.header.uuid_lo) {
      I.next_sequence = std::max(I.next_sequence, r.sequence + 1);
      I.newest_counter = std::max(I.newest_counter, r.counter);
    }
    ScannedCheckpoint sc;
    bool verify = opts.verify_data && (report.newest_valid < 0 || opts.verify_all);
    Status st = CheckRecord(*medium_, I.header, r, records, verify, &sc.info, this);
    if (st.ok()) {
      sc.state = CheckpointState::kCommitted;
      if (report.newest_valid < 0) report.newest_valid = static_cast<int>(report.checkpoints.size());
    } else {
      sc.state = CheckpointState::kDamaged;
      sc.reason = st.message();
      if (report.newest_valid < 0) report.skipped.push_back(Describe(r) + ": " + st.message());
    }
    report.checkpoints.push_back(std::move(sc));
  }
  return report;
}

Status SlotFile::ReadData(const CheckpointInfo& info, uint64_t offset, void* dst, size_t n,
                          bool verify) {
  if (offset > info.data_bytes || n > info.data_bytes - offset) {
    return Status::InvalidArgument("read outside the checkpoint's data region");
  }
  if (n == 0) return Status::OK();
  const uint64_t cb = info.crc_chunk_bytes;
  if (cb == 0 || info.chunk_crcs.size() != (info.data_bytes + cb - 1) / cb) {
    return Status::Corruption("checkpoint has no valid chunk checksums");
  }
  auto* out = static_cast<uint8_t*>(dst);
  // Reads whole chunks (aligned for O_DIRECT), checks each, copies the part asked for.
  constexpr uint64_t kPiece = 8 << 20;
  AlignedBuffer buf(std::min<uint64_t>({cb, kPiece, info.data_bytes}));
  if (!buf.ok()) return Status::Internal("out of memory reading checkpoint data");
  const uint64_t first = offset / cb, last = (offset + n - 1) / cb;
  for (uint64_t c = first; c <= last; ++c) {
    const uint64_t c_begin = c * cb, c_end = std::min(c_begin + cb, info.data_bytes);
    uint32_t crc = 0;
    for (uint64_t p = c_begin; p < c_end; p += buf.size()) {
      const uint64_t len = std::min<uint64_t>(buf.size(), c_end - p);
      NONSTOP_RETURN_IF_ERROR(medium_->Read(info.data_offset + p, buf.data(), len));
      if (verify) crc = Crc32c(buf.data(), len, crc);
      if (out != nullptr) {
        const uint64_t lo = std::max(p, offset), hi = std::min(p + len, offset + n);
        if (lo < hi) std::memcpy(out + (lo - offset), buf.data() + (lo - p), hi - lo);
      }
    }
    if (verify && crc != info.chunk_crcs[c]) {
      std::string which;
      for (const auto& te : info.tensors) {
        if (te.data_offset < c_end && te.data_offset + te.spec.nbytes > c_begin) {
          which = " (tensor '" + te.spec.name + "')";
          break;
        }
      }
      return Status::Corruption("data chunk " + std::to_string(c) + which + " of checkpoint #" +
                                std::to_string(info.counter) + " (step " + std::to_string(info.step) +
                                ") has a checksum mismatch");
    }
  }
  return Status::OK();
}

Status SlotFile::ReadTensor(const CheckpointInfo& info, int index, void* dst, bool verify) {
  if (index < 0 || static_cast<size_t>(index) >= info.tensors.size()) {
    return Status::NotFound("no tensor #" + std::to_string(index) + " in checkpoint #" +
                            std::to_string(info.counter));
  }
  const TensorEntry& te = info.tensors[index];
  return ReadData(info, te.data_offset, dst, te.spec.nbytes, verify);
}

Result<CheckpointInfo> CopyCheckpointToSlot(SlotFile& src, const CheckpointInfo& info,
                                            SlotFile& dest, uint32_t slot) {
  if (info.crc_chunk_bytes == 0) return Status::InvalidArgument("checkpoint has no chunk size");
  SlotLayout layout;
  layout.tensors = info.tensors;
  layout.data_bytes = info.data_bytes;
  // Whole crc chunks at a time, so every chunk is verified as it is read.
  const uint64_t piece = std::max<uint64_t>(info.crc_chunk_bytes, 4 << 20) / info.crc_chunk_bytes *
                         info.crc_chunk_bytes;
  AlignedBuffer buf(std::min<uint64_t>(piece, std::max<uint64_t>(info.data_bytes, 1)));
  if (!buf.ok()) return Status::Internal("out of memory copying a checkpoint");
  for (uint64_t off = 0; off < info.data_bytes; off += buf.size()) {
    const uint64_t len = std::min<uint64_t>(buf.size(), info.data_bytes - off);
    NONSTOP_RETURN_IF_ERROR(src.ReadData(info, off, buf.data(), len, /*verify=*/true));
    const uint64_t padded = AlignUp(len, kStoreAlign);
    std::memset(buf.data() + len, 0, padded - len);  // the last piece's tail
    NONSTOP_RETURN_IF_ERROR(dest.WriteData(slot, off, buf.data(), padded));
  }
  CommitRequest req;
  req.slot = slot;
  req.counter = info.counter;
  req.step = info.step;
  req.layout = &layout;
  req.crc_chunk_bytes = info.crc_chunk_bytes;
  req.chunk_crcs = info.chunk_crcs;
  req.meta_json = info.meta_json;
  return dest.Commit(req);
}

Status CopyCheckpoint(SlotFile& src, const CheckpointInfo& info, std::unique_ptr<Medium> dest) {
  if (info.crc_chunk_bytes == 0) return Status::InvalidArgument("checkpoint has no chunk size");
  SlotLayout layout;
  layout.tensors = info.tensors;
  layout.data_bytes = info.data_bytes;
  StoreGeometry g;
  g.slots = 1;
  g.rank = info.rank;
  g.world_size = info.world_size;
  g.slot_bytes = StoreGeometry::SlotBytesFor(layout, AlignUp(info.meta_json.size() + 1, kStoreAlign));
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> out, SlotFile::Create(std::move(dest), g));
  return CopyCheckpointToSlot(src, info, *out, 0).status();
}

}  // namespace nonstop
