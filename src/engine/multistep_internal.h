// Internals of the multi-step schedule, exposed for tests.
#pragma once

#include <cstddef>
#include <vector>

namespace nonstop::multistep_internal {

// Elements [begin, end) of one tensor.
struct Piece {
  int tensor = 0;
  size_t begin = 0, end = 0;
};

// One block: up to block_elements consecutive elements of the flattened
// parameters (several small tensors may share a block).
struct Block {
  std::vector<Piece> pieces;
};

// One part: consecutive blocks, [flat_begin, flat_end) of the flattened parameters.
struct Part {
  size_t flat_begin = 0, flat_end = 0;
  std::vector<Block> blocks;
};

// Splits tensors of `numels` elements (flattened in order) into `parts` parts
// of whole blocks, as equal as blocks allow. Parts may be empty when there are
// fewer blocks than parts.
std::vector<Part> PlanParts(const std::vector<size_t>& numels, size_t block_elements, int parts);

}  // namespace nonstop::multistep_internal
