// The one restore path: reads a committed checkpoint straight into its
// destination memory, once, in parallel, verifying every crc chunk exactly
// once. Used by Checkpointer.restore(), nonstop.load, `nonstop export` /
// `nonstop verify` and C++ callers (docs/ARCHITECTURE.md "Restore").
//
//   ReadCheckpointInto(file, info, dst)   one checkpoint of an open slot file
//                                         (a job directory's, a keep copy, a
//                                         memory-tier segment: any slot file)
//   RestoreFromJobDir(jd, rank, ...)      selection through JobDir (lineage
//                                         honoured), then ReadCheckpointInto,
//                                         falling back to the next older
//                                         checkpoint on a checksum failure
//   RestoreFromSlotFile(file, ...)        the same over one slot file's
//                                         checkpoints (a memory segment)
//
// How it reads: the data region is cut into pieces of whole crc chunks (about
// RestoreOptions::piece_bytes each). A few threads take pieces in order and
// pread them through the slot file's Medium (the Env seam): a piece in the
// page cache buffered, any other with O_DIRECT through a second Medium on the
// same file (RestoreOptions::direct), falling back to a buffered read where
// that fails. A piece that lies inside one tensor (and fits the medium's
// alignment) is read straight into that tensor's memory and its chunks are
// checked there; any other piece (small tensors packed together, tensor
// boundaries, padding, a destination O_DIRECT cannot address) is read once
// into the thread's aligned buffer, checked, and its tensors' bytes are copied
// out. So 10,000 small tensors cost one read and one crc per chunk, not one
// per tensor.
//
// Device destinations (restore into CUDA tensors): RestoreOptions::dst_devices
// says which destinations live in device memory, and RestoreOptions::copy is
// the CopyEngine that copies into them. A piece holding bytes of such a
// destination is read into one of the thread's staging buffers (the copy
// engine's AllocHost: pinned where a GPU is present, so a copy is one DMA),
// verified, and only then handed to CopyEngine::CopyToDevice, which returns
// at once; the thread reads its next pieces into its other buffers while
// those copies run, and reads into a buffer again only after its copies
// completed. Every copy is waited for before the read returns, success or
// not, so a failed restore leaves no copy in flight.
//
// What the destination holds after a failure: the bytes of the pieces read so
// far (and of a piece whose crc failed). A checksum failure is Corruption;
// RestoreFromJobDir then reads the next older checkpoint into destinations its
// prepare callback gives again (normally the same memory), so a failure leaves
// the destinations holding a whole, verified older checkpoint, or an error
// saying they were partly overwritten.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "nonstop/copy_engine.h"
#include "nonstop/jobdir.h"
#include "nonstop/status.h"
#include "nonstop/store.h"
#include "nonstop/types.h"

namespace nonstop {

struct RestoreOptions {
  // Reader threads (>= 1). Four keep a device's queue busy with buffered
  // pread and its readahead; more only help fast NVMe arrays.
  int threads = 4;
  // Bytes per read, rounded to whole crc chunks (at least one chunk).
  uint64_t piece_bytes = 8ull << 20;
  // Called on the calling thread about every progress_interval_s with (bytes
  // done, bytes in total) while the workers read, and once at the end. May
  // return false to cancel (the read then fails with Aborted).
  std::function<bool(uint64_t done, uint64_t total)> progress;
  double progress_interval_s = 0.1;
  // Only the crc chunks overlapping bytes [data_begin, data_end) of the data
  // region are read and verified (`nonstop export` reads a big checkpoint a
  // window at a time). Every tensor with a destination must lie inside the
  // range (InvalidArgument otherwise). The default is the whole region.
  uint64_t data_begin = 0;
  uint64_t data_end = UINT64_MAX;
  // RestoreFromJobDir: also open the chosen file with O_DIRECT (through the
  // job directory's Directory, read-only) and read through it every piece
  // that is not in the page cache (Medium::CachedBytes): several reads in
  // flight at the device's pace, without readahead's limits, and no second
  // copy of the checkpoint left in the page cache. Buffered reads stay the
  // fallback: for cached pieces, where O_DIRECT is refused (some FUSE and
  // network file systems, tmpfs before Linux 6.6), and for a piece whose
  // O_DIRECT read fails or does not verify (read again buffered before it
  // counts as failed). On by default: on the quiet test machine
  // (docs/BENCHMARKS.md "Restore") the O_DIRECT queue restored a cold 1 GB
  // checkpoint 1.19x and a cold 4 GB one 1.49x faster than buffered reads
  // (per-round medians), where the page cache's readahead and eviction
  // fall behind. NONSTOP_RESTORE_DIRECT=0 turns it off from Python.
  bool direct = true;
  // O_DIRECT reads kept in flight at once, shared out among the threads
  // (each thread keeps its share queued, through Medium::OpenReadQueue:
  // io_uring where the direct medium is one, while it verifies and copies
  // the pieces that have arrived). Each costs a piece-sized bounce buffer.
  unsigned queue_depth = 16;
  // ReadCheckpointInto: that O_DIRECT medium on the same file (Alignment()
  // a power of two, at most kStoreAlign), or null for buffered reads only.
  Medium* direct_medium = nullptr;
  // ReadCheckpointInto: where each destination lives, in dst order (empty:
  // all in host memory). A destination on a device (kind != kHost) is written
  // only by `copy`->CopyToDevice (see "Device destinations" above), which
  // must CanCopyToDevice it (InvalidArgument otherwise). RestoreFromJobDir
  // takes them from its prepare callback (RestoreDestinations).
  std::vector<Device> dst_devices;
  CopyEngine* copy = nullptr;
  // Staging buffers per reader thread for pieces with device bytes (at least
  // 2: one is read into while the copies out of the others run).
  unsigned device_buffers = 3;
};

// The Python front end's restore settings as its environment sets them
// (docs/PYTHON.md): NONSTOP_RESTORE_THREADS reader threads (at least 1;
// absent or not a number: 4), NONSTOP_RESTORE_DIRECT=0 no O_DIRECT reads,
// NONSTOP_RESTORE_QUEUE O_DIRECT reads in flight (1..1024; else the default:
// for comparisons, 1 per thread is the old one-read-per-thread path).
RestoreOptions RestoreOptionsFromEnv();

struct RestoreStats {
  uint64_t data_bytes = 0;      // bytes of the data region read (and verified)
  uint64_t tensor_bytes = 0;    // bytes written into destinations
  uint64_t direct_bytes = 0;    // of those, read straight into the destination
  uint64_t pieces = 0;
  uint64_t odirect_bytes = 0;   // bytes of the data region read with O_DIRECT
  uint64_t retried_pieces = 0;  // O_DIRECT reads that failed, read again buffered
  double seconds = 0;           // wall time of the read
  int threads = 0;
  uint64_t h2d_bytes = 0;       // bytes copied into device destinations
  double h2d_wait_s = 0;        // time the threads waited for those copies (summed)
};

// Reads every tensor of committed checkpoint `info` of `file` into dst[i]
// (host memory of info.tensors[i].spec.nbytes bytes; nullptr: that tensor is
// verified but not kept). dst.size() must equal info.tensors.size(), and the
// destinations must not overlap. Every crc chunk of the data region is read
// and verified exactly once. Corruption (naming the chunk, the tensor and the
// checkpoint) on a checksum mismatch, IOError on a failed read; then the
// destinations are partly written.
Status ReadCheckpointInto(SlotFile& file, const CheckpointInfo& info,
                          const std::vector<void*>& dst, const RestoreOptions& opts = {},
                          RestoreStats* stats = nullptr);

// Gives the destinations for a selected checkpoint after checking that it fits
// (metadata, names, shapes, dtypes, RNG records): nothing may be written
// before it returns. Corruption: this checkpoint is malformed, try the next
// older one; any other error stops the restore.
using RestorePrepare = std::function<Result<std::vector<void*>>(const Selected&)>;

// The same, for destinations some of which may live on a device: where each
// one lives (empty: all host memory), in table order, as dst_devices.
struct RestoreDestinations {
  std::vector<void*> ptrs;
  std::vector<Device> devices;
};
using RestorePrepareDevices = std::function<Result<RestoreDestinations>(const Selected&)>;

struct RestoreResult {
  std::optional<Selected> chosen;     // empty: no checkpoint at all (a fresh start)
  std::vector<std::string> skipped;   // newer checkpoints not restored, and why
  bool fallback = false;              // chosen is not the newest usable one
  int attempts = 0;                   // checkpoints read (> 1 after a failure mid-read)
  RestoreStats stats;                 // of the read that succeeded
  double seconds = 0;                 // selection + prepare + every read
};

// Selects rank `rank`'s newest committed, non-abandoned checkpoint (or
// select.step's) through `jd`, asks `prepare` where its tensors go, and reads
// it with ReadCheckpointInto. A checkpoint whose data fails its checksums (or
// whose prepare says Corruption) is excluded and the next older one is
// selected and read into the destinations prepare gives for it. When none is
// left: Corruption, whose message says the destinations were partly
// overwritten when any read had begun. select.verify_data is ignored (the read
// verifies every chunk once).
Result<RestoreResult> RestoreFromJobDir(JobDir& jd, int rank, SelectOptions select,
                                        const RestorePrepare& prepare,
                                        const RestoreOptions& opts = {});
// With device destinations (opts.copy copies into them).
Result<RestoreResult> RestoreFromJobDir(JobDir& jd, int rank, SelectOptions select,
                                        const RestorePrepareDevices& prepare,
                                        const RestoreOptions& opts = {});

// The same walk over the checkpoints of one open slot file outside a job
// directory (the memory tier's segment, engine/memory_tier.h), as scanned in
// `report`: the planner (MakePlan) orders them with the job directory's
// `lineage` (never an abandoned counter, nor one in `exclude`), and the
// first that `prepare` accepts and that reads back intact is restored; one
// whose prepare says Corruption or whose data fails its checksums is named
// in `skipped` and the next older one is read into the destinations prepare
// gives for it. `where` (the file's path) is each Selected's location.where.
// None left: no `chosen`, `skipped` saying why. Any other error stops it.
Result<RestoreResult> RestoreFromSlotFile(SlotFile& file, const std::string& where,
                                          const ScanReport& report, const LineageRecord& lineage,
                                          const std::vector<uint64_t>& exclude,
                                          const RestorePrepareDevices& prepare,
                                          const RestoreOptions& opts = {});

}  // namespace nonstop
