// The job manifest (docs/FORMAT.md "The job manifest"): per rank, what the
// tiers that live elsewhere (the remote object store, partners' memory in
// the peer tier) durably held when they last said so, and the job's
// identity. The file "manifest-rank-RRRRR.json" of the job directory.
//
// It is a *record*, never the truth: the disk, the memory segment and the
// lineage are read from themselves every time a view is made (engine/
// job_view.h); only what cannot be seen from this node without the network
// (which steps the remote committed, which checkpoint a partner holds) comes
// from here. It is written by the tiers' own background threads (the remote
// uploader after each publish, the peer replicator after each push), never
// on the commit path: a crash between a tier's commit and its note leaves
// the previous note, which under-reports (a step the remote has is missing),
// never over-reports what was not durable when the note was written.
//
// Each note replaces what was recorded for its (tier, where): the remote
// notes every committed step it lists after its retention, a partner the
// one checkpoint it holds. Written whole with WriteFileAtomic (temp,
// fsync, rename, SyncDir), so a reader sees one complete version or the
// previous one. Hostile bytes: the size is bounded before anything is read
// (kMaxManifestBytes), a crc32c line guards the text, every field is checked,
// and any failure is one line of Corruption.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/status.h"

namespace nonstop {

inline constexpr uint64_t kMaxManifestBytes = 64 << 10;
inline constexpr size_t kMaxManifestHolders = 16;
inline constexpr size_t kMaxManifestHeld = 256;   // per holder
inline constexpr size_t kMaxManifestText = 1024;  // a job name or a where

// One checkpoint a holder holds.
struct ManifestHeld {
  int64_t step = 0;
  uint64_t counter = 0;
};

// What one tier at one place held when it last said so.
struct ManifestHolder {
  std::string tier;    // "remote" or "peer"
  std::string where;   // the remote's URL; the partner's "host:port"
  double unix_s = 0;   // when it was noted
  std::vector<ManifestHeld> held;  // newest counter first
};

struct JobManifest {
  int rank = 0;
  std::string job;  // the job's identity (the remote's JOB name); empty when none was noted
  std::vector<ManifestHolder> holders;
};

std::string EncodeJobManifest(const JobManifest& m);
// Corruption naming `what` unless `text` is a manifest (crc, fields, bounds).
Result<JobManifest> DecodeJobManifest(std::string_view text, const std::string& what);

// Rank `rank`'s manifest in job directory `dir`: nullopt when there is none;
// Corruption (one line) when it is damaged or too large.
Result<std::optional<JobManifest>> ReadJobManifest(Directory& dir, int rank);

// Records that `holder.tier` at `holder.where` holds exactly `holder.held`
// now, replacing what was recorded for it, and `job` as the job's identity
// when not empty. Read-modify-write of rank `rank`'s manifest in `job_dir`
// (through `env`; serialized within the process); a damaged manifest is
// replaced by one with this note only. Call from a background thread.
Status NoteHeld(Env* env, const std::string& job_dir, int rank, const std::string& job,
                ManifestHolder holder);

}  // namespace nonstop
