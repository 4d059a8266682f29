// crc32c(A || B) from crc32c(A), crc32c(B) and the length of B (zlib's
// crc32_combine for the Castagnoli polynomial): a region's crc from its
// pieces' crcs without reading it again (layerwise commits; the peer
// tier's DATA frames). Defined in crc32c.cc.
#pragma once

#include <cstdint>

namespace nonstop {

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace nonstop
