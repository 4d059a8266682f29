// A tier: one place that holds checkpoints (docs/ARCHITECTURE.md, "Tiers").
// It publishes a committed checkpoint, lists what it holds with each step's
// state, fetches a step into a local one-slot file, and deletes what its
// retention does not keep. The remote object store (remote_tier.h) is the
// first implementation; it speaks to its store only through a Transport
// (transport.h), which Python hands in as it hands in a Comm.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "jobdir/remote_layout.h"
#include "nonstop/status.h"

namespace nonstop::tier {

enum class StepState {
  kCommitted,    // readable: its commit record is there and parses
  kUncommitted,  // an upload under way or given up: never read
  kDamaged,      // its commit record is there but is not one: never read
};

// One step a tier holds.
struct HeldStep {
  int64_t step = 0;
  StepState state = StepState::kUncommitted;
  std::string reason;                // kDamaged: why (the decoder's line; empty when it vanished)
  std::optional<remote::Doc> marker;  // kCommitted: its commit record
  uint64_t bytes = 0;                // the asked rank's copy, 0 when it has none
  uint64_t objects = 0;              // every object of the step (parts, documents, others)
  uint64_t total_bytes = 0;          // their size
  std::vector<uint32_t> ranks;       // the ranks whose copy (part) is there, ascending
  // Why the asked rank cannot read this step (a listing's "reason"); empty
  // when it can: committed, and the rank within the commit's world.
  std::string note;
};

// One committed checkpoint to publish: rank `rank`'s copy of `step`
// (checkpoint `counter` of run `lineage`) in world `world_size`, as the
// one-slot file `name` of the local directory `dir`.
struct PublishRequest {
  int64_t step = 0;
  uint64_t counter = 0;
  int64_t lineage = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string dir;
  std::string name;
};

// What a publish did.
struct PublishReport {
  enum class Outcome {
    kUploaded,         // this rank's copy is there (a rank > 0: rank 0 commits it)
    kCommitted,        // rank 0: uploaded, and the step committed
    kSkippedExisting,  // already committed, by this checkpoint (a restart of the same run)
    kGivenUp,          // rank 0: another rank no longer holds the step (not an error)
    kNotCommitted,     // rank 0: the other ranks did not come in time (`error` says which)
  };
  Outcome outcome = Outcome::kUploaded;
  uint64_t bytes = 0;    // the part's size (0 when skipped)
  double crc_s = 0;      // the checksum pass
  double put_s = 0;      // the part's upload
  double upload_s = 0;   // checksums, part and manifest
  std::string error;     // kNotCommitted: one line
};

struct PublishOptions {
  double bps = 0;                // > 0: the part's upload at most that many bytes a second
  double commit_timeout_s = 120; // rank 0: how long the other ranks' copies are waited for
  double poll_s = 0.05;          // rank 0: how often they are looked for (at least 0.1 s)
};

class Tier {
 public:
  virtual ~Tier() = default;
  // Where it is (a URL or a path), for messages.
  virtual std::string where() const = 0;
  // Every step it holds, newest first; `rank`: whose copy `bytes` counts.
  virtual Result<std::vector<HeldStep>> List(uint32_t rank) = 0;
  // Rank `rank`'s copy of committed `step`, verified end to end, written
  // into a one-slot file under `local_dir`; returns the one-slot job
  // directory that holds it. Corruption for a missing or damaged copy.
  virtual Result<std::string> Fetch(int64_t step, uint32_t rank, const std::string& local_dir) = 0;
  // Publishes committed checkpoint `req`: rank 0 (and one process) leads
  // and commits once every rank's copy of the step and lineage is there.
  virtual Result<PublishReport> Publish(const PublishRequest& req, const PublishOptions& o) = 0;
  // Deletes the steps its retention does not keep; how many went.
  virtual Result<int> Retain(const remote::Retention& r) = 0;
};

}  // namespace nonstop::tier
