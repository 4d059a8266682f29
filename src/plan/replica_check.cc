#include "plan/replica_check.h"

namespace nonstop::dist {

Status CheckReplicaNames(int rank, const std::vector<std::vector<int64_t>>& heads) {
  if (rank < 0 || static_cast<size_t>(rank) >= heads.size() || heads[rank].size() != 2) {
    return Status::Internal("replica check: no names' count of rank " + std::to_string(rank));
  }
  for (size_t r = 0; r < heads.size(); ++r) {
    if (heads[r] == heads[rank]) continue;
    const std::string theirs = heads[r].empty() ? "?" : std::to_string(heads[r][0]);
    return Status::InvalidArgument(
        "rank " + std::to_string(rank) + " and rank " + std::to_string(r) +
        " hold different state: " + std::to_string(heads[rank][0]) + " and " + theirs +
        " tensors treated as replicated; every rank must give the same state (rank-local keys "
        "under local=)");
  }
  return Status::OK();
}

Status CheckReplicaDigests(const std::vector<std::string>& names,
                           const std::vector<std::vector<int64_t>>& digests) {
  for (const std::vector<int64_t>& d : digests) {
    if (d.size() < names.size()) {
      return Status::Internal("replica check: fewer digests than the " +
                              std::to_string(names.size()) + " tensors");
    }
  }
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t r = 1; r < digests.size(); ++r) {
      if (digests[r][i] == digests[0][i]) continue;
      const std::string key = names[i].substr(0, names[i].find('/'));
      return Status::InvalidArgument(
          "state['" + key + "']: tensor '" + names[i] +
          "' is treated as replicated but differs between rank 0 and rank " + std::to_string(r) +
          "; if it is rank-local state, pass local=['" + key + "'] to the Checkpointer");
    }
  }
  return Status::OK();
}

}  // namespace nonstop::dist
