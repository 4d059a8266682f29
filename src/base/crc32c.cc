// crc32c (Castagnoli). ISA-L when built with it (~30 GB/s), else the SSE4.2
// instruction, else a table. All three give the standard CRC-32C and compose:
// Crc32c(b, nb, Crc32c(a, na)) == Crc32c(a || b).
#include <array>
#include <climits>
#include <cstring>

#include "base/crc32c_combine.h"
#include "nonstop/crc32c.h"

#ifdef NONSTOP_HAVE_ISAL
#include <isa-l/crc.h>
#endif
#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace nonstop {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

// Takes and returns the raw register (pre-inverted), like the hardware op.
[[maybe_unused]] uint32_t RawSoftware(const uint8_t* p, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = MakeTable();
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__) && !defined(NONSTOP_HAVE_ISAL)
__attribute__((target("sse4.2"))) uint32_t RawSse42(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

// a * b modulo the polynomial, both as reflected 32-bit polynomials.
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31;
  uint32_t p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) modulo the polynomial, k = 0..31.
const std::array<uint32_t, 32>& X2nTable() {
  static const std::array<uint32_t, 32> table = [] {
    std::array<uint32_t, 32> t{};
    uint32_t p = 1u << 30;  // x^1
    t[0] = p;
    for (int n = 1; n < 32; ++n) t[n] = p = MultModP(p, p);
    return t;
  }();
  return table;
}

// x^(n * 2^k) modulo the polynomial.
uint32_t X2nModP(uint64_t n, unsigned k) {
  const auto& table = X2nTable();
  uint32_t p = 1u << 31;  // x^0
  while (n) {
    if (n & 1) p = MultModP(table[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t raw = ~seed;
#ifdef NONSTOP_HAVE_ISAL
  // ISA-L takes an int length.
  while (n > 0) {
    size_t piece = n > (size_t{1} << 30) ? (size_t{1} << 30) : n;
    raw = crc32_iscsi(const_cast<uint8_t*>(p), static_cast<int>(piece), raw);
    p += piece;
    n -= piece;
  }
  return ~raw;
#else
#if defined(__x86_64__)
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (has_sse42) return ~RawSse42(p, n, raw);
#endif
  return ~RawSoftware(p, n, raw);
#endif
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (crc_a == 0) return crc_b;  // 0 times x^(8 len_b) is 0
  return MultModP(X2nModP(len_b, 3), crc_a) ^ crc_b;
}

}  // namespace nonstop
