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
  // Deletes the steps its retention does not keep; how many went.
  virtual Result<int> Retain(const remote::Retention& r) = 0;
};

}  // namespace nonstop::tier
