// Byte-level encoding of the slot file: file header, superblock records and
// tensor tables (docs/FORMAT.md). Every parser is bounds-checked and returns
// Corruption on anything malformed: these functions are the fuzz targets.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/status.h"
#include "nonstop/store.h"

namespace nonstop::format {

inline constexpr char kFileMagic[8] = {'N', 'O', 'N', 'S', 'T', 'O', 'P', '\0'};
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint32_t kHeaderBytes = 4096;
inline constexpr uint32_t kRecordBytes = 4096;
inline constexpr uint32_t kRecordMagic = 0x4352534E;  // "NSRC"
inline constexpr uint32_t kTableMagic = 0x4254534E;   // "NSTB"
inline constexpr uint32_t kHeaderCrcOffset = 88;
inline constexpr uint32_t kRecordCrcOffset = 104;
inline constexpr uint32_t kTableHeaderBytes = 96;
inline constexpr uint32_t kMaxNameBytes = 4096;
inline constexpr uint32_t kMaxDims = 64;
// Files written by this version keep a second copy of the file header in
// block 1 (offset 4096) and start the ring at 8192; files whose ring starts
// at 4096 (written before) have no copy. A header is the copy's twin only
// when it says ring_offset >= kHeaderCopyOffset + kHeaderBytes.
inline constexpr uint64_t kHeaderCopyOffset = kHeaderBytes;
inline constexpr uint64_t kRingOffset = kHeaderCopyOffset + kHeaderBytes;
// The smallest tensor entry: name_len, a 1-byte name, dtype, ndim, offset,
// nbytes, gdim, global_offset.
inline constexpr uint64_t kMinEntryBytes = 2 + 1 + 1 + 1 + 8 + 8 + 1 + 8;
// The metadata JSON of one checkpoint, at most (the writer refuses more).
inline constexpr uint64_t kMaxMetaBytes = 64ull << 20;

struct FileHeader {
  uint64_t uuid_hi = 0, uuid_lo = 0;
  uint32_t rank = 0, world_size = 1;
  uint32_t ring_records = kRingRecords;
  uint64_t ring_offset = kHeaderBytes;
  uint32_t slot_count = 0;
  uint64_t slots_offset = 0;
  uint64_t slot_bytes = 0;
  uint64_t created_unix_ns = 0;
};

struct Record {
  uint64_t uuid_hi = 0, uuid_lo = 0;
  uint64_t sequence = 0;
  uint64_t counter = 0;
  int64_t step = 0;
  uint32_t slot = 0;
  uint32_t flags = 0;
  uint64_t data_offset = 0, data_bytes = 0;
  uint64_t table_offset = 0, table_bytes = 0;
  uint32_t table_crc = 0;
  uint64_t commit_unix_ns = 0;
};

struct Table {
  uint64_t uuid_hi = 0, uuid_lo = 0;
  uint64_t counter = 0;
  int64_t step = 0;
  uint32_t rank = 0, world_size = 1;
  uint32_t crc_chunk_bytes = 0;
  uint64_t data_bytes = 0;
  std::vector<TensorEntry> tensors;
  std::vector<uint32_t> chunk_crcs;
  std::string meta_json;
};

// Encodes into exactly kHeaderBytes / kRecordBytes bytes (zero padded).
std::vector<uint8_t> EncodeHeader(const FileHeader& h);
std::vector<uint8_t> EncodeRecord(const Record& r);
// Encodes the table; its length is the table's byte count (unpadded).
std::vector<uint8_t> EncodeTable(const Table& t);

Result<FileHeader> ParseHeader(std::span<const uint8_t> bytes);
// True when a header block's crc matches its bytes (whatever they say).
bool HeaderCrcOk(std::span<const uint8_t> bytes);
// An all-zero block is an empty ring entry: NotFound, not Corruption.
Result<Record> ParseRecord(std::span<const uint8_t> bytes);
Result<Table> ParseTable(std::span<const uint8_t> bytes);
// Reads only the fixed table header (counter, step) without checking the crc;
// used to explain why an old record's slot no longer matches.
Result<Table> PeekTableHeader(std::span<const uint8_t> bytes);

// True when `s` is well-formed UTF-8 (no overlong forms, no surrogates,
// nothing above U+10FFFF).
bool IsValidUtf8(std::string_view s);
// Why `name` cannot be a tensor name, or "" when it can: 1 to kMaxNameBytes
// bytes of valid UTF-8 without control characters (U+0000-U+001F, U+007F,
// U+0080-U+009F). The writer (SlotLayout::Plan) and the reader (ParseTable)
// apply the same rule.
std::string TensorNameProblem(std::string_view name);
// `s` made safe for a one-line message: printable ASCII and valid UTF-8 kept,
// control characters and invalid bytes as \xNN, cut to about 80 bytes.
std::string Printable(std::string_view s);

inline uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace nonstop::format
