// The layout and commit rules of a remote checkpoint (the remote tier,
// docs/TIERS.md): the names of its objects, its small JSON documents
// (manifest, COMMITTED marker, LEAD and skip notes) and their validation,
// the commit rule, and retention. Pure functions: no I/O. The remote tier
// (tier/remote_tier.h) asks these for every name and decision; the bytes
// move through the transport Python hands it (python/nonstop/_remote.py).
//
//   PREFIX/step-NNNNNNNNNNNN/rank-RRRRR.nsck   one-slot copy of rank R's checkpoint
//   PREFIX/step-NNNNNNNNNNNN/rank-RRRRR.json   rank R's manifest, written after its part
//   PREFIX/step-NNNNNNNNNNNN/COMMITTED         written last by rank 0, once every rank's
//                                              manifest of the step and lineage is there
//   PREFIX/step-NNNNNNNNNNNN/LEAD              world > 1: rank 0 will upload this step
//   PREFIX/step-NNNNNNNNNNNN/rank-RRRRR.skip   world > 1: rank R no longer holds it
//   PREFIX/JOB                                 the job that owns the prefix (its identity);
//                                              another job refuses the prefix unless it adopts it
//
// A document is validated before anything sized by it is allocated: its
// length first (kRemoteMaxDocBytes), then the bounded parser
// (jobdir/records.h), then every field, and the checksum list's length
// against the size it claims before the list is copied.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/status.h"

namespace nonstop::remote {

inline constexpr const char* kFormat = "nonstop.remote/1";
inline constexpr uint64_t kMaxDocBytes = 256 << 10;  // the bounded parser's limit
inline constexpr uint32_t kMaxWorld = 1u << 16;
inline constexpr int64_t kMaxStep = 999'999'999'999;  // 12 digits in the name
inline constexpr uint64_t kMinPartBytes = 4096;
inline constexpr uint64_t kMaxPartBytes = 1ull << 30;
inline constexpr uint64_t kMaxParts = 16384;  // checksums in one manifest

// Names, relative to the prefix. step in [0, kMaxStep], rank < kMaxWorld.
std::string StepDir(int64_t step);
std::string PartKey(int64_t step, uint32_t rank);
std::string ManifestKey(int64_t step, uint32_t rank);
std::string MarkerKey(int64_t step);
std::string LeadKey(int64_t step);
std::string SkipKey(int64_t step, uint32_t rank);
std::string JobKey();  // "JOB"

// What an object's key names. kOther: in a step directory, not one of ours
// (a temp file of a shared file system, a stranger's object).
struct Key {
  enum class Kind { kPart, kManifest, kMarker, kLead, kSkip, kOther };
  int64_t step = 0;
  Kind kind = Kind::kOther;
  uint32_t rank = 0;  // kPart, kManifest, kSkip
};
// nullopt: not of the form step-NNNNNNNNNNNN/NAME.
std::optional<Key> ParseKey(std::string_view key);

// The checksum unit for a part of `size` bytes: `preferred` (clamped to
// [kMinPartBytes, kMaxPartBytes]), doubled until at most kMaxParts units.
uint64_t ChecksumUnit(uint64_t size, uint64_t preferred);

// COMMITTED, LEAD and skip notes share these fields.
struct Doc {
  int64_t step = 0;
  uint32_t world_size = 0;
  int64_t lineage = 0;
  std::optional<uint64_t> counter;  // COMMITTED
  std::optional<uint32_t> rank;     // skip notes
  std::optional<double> unix_s;     // when it was written (informational)
};

struct Manifest {
  int64_t step = 0;
  uint64_t counter = 0;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  int64_t lineage = 0;
  uint64_t bytes = 0;        // the part's size
  uint64_t part_bytes = 0;   // checksum unit
  std::vector<uint32_t> part_crc32;  // zlib crc32 of each unit, ceil(bytes / part_bytes)
};

// Corruption naming `what` when the text is not such a document.
Result<Doc> DecodeDoc(std::string_view text, const std::string& what);
Result<Manifest> DecodeManifest(std::string_view text, const std::string& what);

std::string EncodeManifest(const Manifest& m, double unix_s);
// COMMITTED for `step`, from the manifests of every rank (checked by Committed).
std::string EncodeMarker(const Doc& marker, const std::vector<Manifest>& manifests, double unix_s);
std::string EncodeLead(const Doc& lead, double unix_s);
std::string EncodeSkip(const Doc& skip, double unix_s);

// The JOB document: the identity of the job that owns the prefix (a name
// of at most 4096 bytes). DecodeJob: Corruption naming `what` otherwise.
std::string EncodeJob(const std::string& job, double unix_s);
Result<std::string> DecodeJob(std::string_view text, const std::string& what);

// The commit rule: one manifest per rank 0..world_size-1, each of the
// marker's step and lineage and world size.
bool Committed(const Doc& marker, const std::vector<Manifest>& manifests);

// Before rank `rank`'s part of committed step `step` is fetched: the
// marker and the manifest are of that step, rank and lineage, and the rank
// is within the marker's world. Corruption naming `where` otherwise.
Status CheckFetch(const Doc& marker, const Manifest& manifest, int64_t step, uint32_t rank,
                  const std::string& where);

// Retention. One entry per step directory.
struct StepState {
  int64_t step = 0;
  bool committed = false;
  std::optional<uint64_t> counter;  // from the marker, when read
};
struct Retention {
  uint32_t max_to_keep = 2;  // newest committed steps that stay (>= 1)
  uint64_t keep_every = 0;   // keep=k: committed steps whose counter is a multiple of k stay
  uint32_t keep_max = 0;     // with keep=: only the newest keep_max of those (0: all)
};
// The steps to delete, oldest first. Nothing goes before a newer step is
// committed; an uncommitted step newer than the newest committed one is an
// upload under way and stays; an older one is abandoned and goes.
std::vector<int64_t> StepsToDelete(const std::vector<StepState>& steps, const Retention& r);

// The objects of one step in deletion order: the marker alone, then the
// manifests and notes, then the parts and the rest. A deletion cut short
// leaves an uncommitted step (never a marker whose parts are gone), which
// the next retention deletes.
std::vector<std::vector<std::string>> DeleteBatches(const std::vector<std::string>& keys);

// A plain directory used as a remote (a shared file system) rather than a
// job directory: it holds a step-NNNNNNNNNNNN directory and no slot file
// (rank-RRRRR.nsck). `nonstop ls PATH` and nonstop.list(PATH) use it to
// list such a directory as a remote. False when it cannot be listed.
bool LooksLikeRemoteRoot(Env* env, const std::string& path);

}  // namespace nonstop::remote
