// The on-disk store: one slot file per rank, a superblock ring of commit
// records, and slots that each hold one checkpoint (data region + tensor
// table). docs/FORMAT.md gives the byte layout. The store knows nothing of
// threads beyond being safe for concurrent WriteData calls on disjoint ranges;
// the engine decides which slot to use and when to commit.
//
// Invariants kept here (DESIGN.md):
//   1. Commit() makes data and table durable before the record.
//   3. Scan() returns the newest committed checkpoint whose checksums verify,
//      else an older one, and says what it skipped and why.
//   4. Commit() refuses a counter lower than the newest committed one.
//   5. Everything needed to read a slot is in its own table.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "nonstop/crc32c.h"  // Crc32c (base), which store users have always had from here
#include "nonstop/medium.h"
#include "nonstop/status.h"
#include "nonstop/types.h"

namespace nonstop {

inline constexpr uint64_t kStoreAlign = 4096;          // slot, table, record, large-tensor alignment
inline constexpr uint64_t kLargeTensorBytes = 64 << 10;  // tensors >= this are 4 KiB-aligned
inline constexpr uint32_t kRingRecords = 16;            // superblock records, one 4 KiB block each

// File name of rank r's slot file inside a job directory: "rank-00003.nsck".
std::string SlotFileName(int rank);

// A tensor placed in a slot's data region.
struct TensorEntry {
  TensorSpec spec;
  uint64_t data_offset = 0;  // bytes from the start of the slot's data region
};

// Where each tensor goes: tensors of >= kLargeTensorBytes first, each 4 KiB
// aligned and contiguous; smaller ones packed (8-byte aligned) after them.
struct SlotLayout {
  std::vector<TensorEntry> tensors;  // same order as the specs given to Plan
  uint64_t data_bytes = 0;           // multiple of kStoreAlign

  // Fails on duplicate or empty names, nbytes not matching shape * dtype size,
  // or unknown dtypes.
  static Result<SlotLayout> Plan(const std::vector<TensorSpec>& specs);
};

struct StoreGeometry {
  uint32_t slots = 3;          // N+1 for N in flight (+1 in distributed mode)
  uint64_t slot_bytes = 0;     // capacity of one slot: data + table, multiple of kStoreAlign
  uint32_t rank = 0;
  uint32_t world_size = 1;

  // Slot capacity for a layout: its data plus room for its tensor table and
  // `meta_reserve` bytes of metadata JSON.
  static uint64_t SlotBytesFor(const SlotLayout& layout, uint64_t meta_reserve = 1 << 20);
};

// Everything one committed checkpoint says about itself.
struct CheckpointInfo {
  uint64_t counter = 0;        // global checkpoint counter (orders checkpoints)
  int64_t step = 0;            // training step
  uint64_t sequence = 0;       // commit sequence in this file's ring
  uint32_t slot = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t commit_unix_ns = 0;
  uint64_t data_offset = 0;    // absolute file offset of the data region
  uint64_t data_bytes = 0;
  uint32_t crc_chunk_bytes = 0;
  std::vector<uint32_t> chunk_crcs;  // crc32c of each crc_chunk_bytes piece of the data region
  std::vector<TensorEntry> tensors;
  std::string meta_json;       // opaque to the store
  uint64_t table_bytes = 0;

  // Index of the tensor called `name`, or -1.
  int FindTensor(const std::string& name) const;
};

enum class CheckpointState { kCommitted, kDamaged };

struct ScannedCheckpoint {
  CheckpointState state = CheckpointState::kDamaged;
  CheckpointInfo info;   // fully filled when committed; record fields only when damaged
  std::string reason;    // why damaged, one line ("data chunk 12 (tensor 'w') crc mismatch")
};

struct ScanReport {
  std::vector<ScannedCheckpoint> checkpoints;  // every record that parsed, newest counter first
  std::vector<std::string> skipped;            // one line per unusable record or newer damaged ckpt
  // Index into `checkpoints` of the newest committed one, or -1 when none.
  int newest_valid = -1;
};

struct ScanOptions {
  bool verify_data = true;  // also check every data chunk crc (reads the data)
  // Verify the data of every checkpoint, not only until the newest valid one
  // is found (inspect/verify do; recovery does not need to).
  bool verify_all = false;
};

struct CommitRequest {
  uint32_t slot = 0;
  uint64_t counter = 0;
  int64_t step = 0;
  const SlotLayout* layout = nullptr;
  uint32_t crc_chunk_bytes = 0;      // multiple of kStoreAlign
  std::vector<uint32_t> chunk_crcs;  // ceil(layout->data_bytes / crc_chunk_bytes) entries
  std::string meta_json;
};

struct SlotOpenOptions {
  // The writer's open: repair what Open salvaged (see SlotFile::Open).
  // Readers leave it false; they never write.
  bool repair = false;
};

class SlotFile {
 public:
  // Lays out a new file on `medium` (header, empty ring, preallocated slots)
  // and makes it durable. Overwrites whatever the medium held.
  static Result<std::unique_ptr<SlotFile>> Create(std::unique_ptr<Medium> medium,
                                                  const StoreGeometry& geometry);
  // Opens an existing file; fails with Corruption on a bad header and
  // FailedPrecondition on a file that is not a nonstop slot file. Open, Scan
  // and the reads only read: on a medium opened with MediumOptions::read_only
  // (nonstop inspect/verify/export, nonstop.load) they work on a read-only
  // file or mount, and WriteData and Commit fail.
  //
  // A damaged header (or header copy) does not fail Open while its twin is
  // intact, and a file shorter than its geometry opens: the checkpoints whose
  // bytes are all present are found by Scan, the others are reported. What
  // was salvaged is in salvaged(). Only with opts.repair (the writer) does
  // Open write: it rewrites the damaged copy from the intact one and restores
  // the file's length, durably, before it returns.
  static Result<std::unique_ptr<SlotFile>> Open(std::unique_ptr<Medium> medium,
                                                const SlotOpenOptions& opts = {});

  // One line per damage Open found in the file header, the header copy or
  // the file's length, saying what it used instead ("file header damaged
  // (file header checksum mismatch); used the copy at offset 4096"), ending
  // in "(repaired)" when a repairing Open fixed it. Empty for a sound file.
  const std::vector<std::string>& salvaged() const { return salvaged_; }

  const StoreGeometry& geometry() const { return geometry_; }
  Medium& medium() { return *medium_; }
  // Absolute file offset of slot `slot`'s data region.
  uint64_t SlotOffset(uint32_t slot) const;

  // Writes data bytes into a slot. Safe to call concurrently for disjoint
  // ranges. Must respect medium().Alignment().
  Status WriteData(uint32_t slot, uint64_t offset_in_slot, const void* buf, size_t n);

  // Durably commits the checkpoint whose data was written to req.slot: write
  // the table beside the data; one sync makes data and table durable; write
  // the superblock record; sync. Nothing points at the data or the table
  // until the record exists, so one sync for both is as safe as two.
  // Serialised internally. Refuses (Aborted) a counter not above the newest
  // committed one, and InvalidArgument when the table does not fit the slot.
  Result<CheckpointInfo> Commit(const CommitRequest& req);

  // Reads every record and every table, newest first; verifies checksums.
  Result<ScanReport> Scan(const ScanOptions& opts = {});

  // Reads `n` bytes of the data region of `info` from `offset` (relative to
  // the data region) into `dst`, verifying the crc of every chunk touched.
  Status ReadData(const CheckpointInfo& info, uint64_t offset, void* dst, size_t n,
                  bool verify = true);
  // Reads one whole tensor.
  Status ReadTensor(const CheckpointInfo& info, int index, void* dst, bool verify = true);

  // Newest committed counter seen by Commit or Scan (0 = none).
  uint64_t newest_committed_counter() const;

  ~SlotFile();

 private:
  SlotFile(std::unique_ptr<Medium> medium, const StoreGeometry& g);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<Medium> medium_;
  StoreGeometry geometry_;
  std::vector<std::string> salvaged_;
};

// Copies committed checkpoint `info` of `src` into a new one-slot file on
// `dest` (same counter, step, tensors, metadata and checksums), verifying
// every chunk on the way, and commits it there. Used to keep a checkpoint
// forever (EngineOptions::keep_every) and by tools. The caller must keep
// `info`'s slot from being reused during the copy.
Status CopyCheckpoint(SlotFile& src, const CheckpointInfo& info, std::unique_ptr<Medium> dest);

// Copies committed checkpoint `info` of `src` into slot `slot` of `dest` (a
// free slot of a file with room for it), verifying every chunk as it is
// read, and commits it there: the record CopyCheckpoint and the tiered
// persister (a memory checkpoint to the disk) both write. The caller keeps
// both slots from being reused during the copy.
Result<CheckpointInfo> CopyCheckpointToSlot(SlotFile& src, const CheckpointInfo& info,
                                            SlotFile& dest, uint32_t slot);

}  // namespace nonstop
