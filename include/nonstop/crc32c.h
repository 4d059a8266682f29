// crc32c (Castagnoli): the checksum of every stored chunk, table and record.
#pragma once

#include <cstddef>
#include <cstdint>

namespace nonstop {

// ISA-L when built with it, else SSE4.2, else software. All give the standard
// CRC-32C and compose: Crc32c(b, nb, Crc32c(a, na)) == Crc32c(a || b).
uint32_t Crc32c(const void* data, size_t n, uint32_t seed = 0);

}  // namespace nonstop
