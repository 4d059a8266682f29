// The first checkpoint's check that the tensors treated as replicated are
// equal on every rank (python/nonstop/_replica.py, docs/DISTRIBUTED.md
// "Replicated means equal"), decided on what the ranks gathered (Python's
// two all_gathers over the Checkpointer's gloo group). Each error is one
// InvalidArgument line that names the first difference and local=.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::dist {

// `heads`: each rank's [number of names, crc32 of the names joined by "\n"];
// they must be equal (else the digests could not be compared). `rank`: this one.
Status CheckReplicaNames(int rank, const std::vector<std::vector<int64_t>>& heads);
// `digests`: each rank's hash of each of `names`, in that order.
Status CheckReplicaDigests(const std::vector<std::string>& names,
                           const std::vector<std::vector<int64_t>>& digests);

}  // namespace nonstop::dist
