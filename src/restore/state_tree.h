// Rewrites of a checkpoint's state trees (the JSON _state.flatten writes:
// tensors as {"__tensor__": name} leaves) that move tensors between names:
// a ZeroRedundancyOptimizer's shards consolidated into one state_dict
// (_distributed.consolidate: a reshard, the DCP export) and a module's tree
// renamed between DDP's "module." prefix and none. Python keeps the tensors
// and applies the renames; numbers are copied as their text (exact).
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "nonstop/status.h"

namespace nonstop {

struct TreeRewrite {
  std::string tree;  // the new tree (JSON)
  // (old rank, old name, new name) of each tensor the tree now names, in
  // order (a rename may use a name an earlier one freed).
  std::vector<std::tuple<int, std::string, std::string>> renames;
};

// The consolidated state_dict of the ZeroRedundancyOptimizer saved under
// `key`: {"state": {global index: value} (by index), "param_groups": rank
// 0's groups, each group's parameters numbered in order,
// "nonstop_consolidated_zero": 1}. trees[r]: old rank r's tree of it (its
// local optimizer's state_dict); layouts[r]: its meta["dist"]["zero"][key]
// ({"index": [...], "groups": [...]}); names[r]: the tensor names rank r
// holds. Its tensors are renamed "{key}#zero/{r}/{old name}". Corruption
// naming `key` (dist.h ZeroGlobalIds for the indices) on anything malformed.
Result<TreeRewrite> ConsolidateZero(const std::string& key, const std::vector<std::string>& trees,
                                    const std::vector<std::string>& layouts,
                                    const std::vector<std::vector<std::string>>& names);

// A module's state tree saved under DDP ("module." prefixes) for a plain
// module (add=false), or back (add=true): each top-level key renamed, and
// the tensor a top-level entry names directly, "{key}/{new key}" unless that
// name is taken (`names`: the tensors held). A tree that is not an object is
// returned as it is.
Result<TreeRewrite> RenameModuleKeys(const std::string& key, const std::string& tree, bool add,
                                     const std::vector<std::string>& names);

}  // namespace nonstop
