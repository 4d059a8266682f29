// GHASH (NIST SP 800-38D section 6.4): the polynomial universal hash over
// GF(2^128) of GCM, for the peer wire's MAC of DATA frames (peer_wire.h;
// docs/TIERS.md "Trust"). Written from the spec's math; no external crypto
// library. On x86-64 processors with VPCLMULQDQ (AVX2: two blocks per
// instruction, Karatsuba: three multiplications a block) or PCLMULQDQ the multiplications run on them, several blocks
// per reduction (the powers H^1..H^kAggregate are precomputed), chosen once
// at run time; else in portable C++ (the spec's Algorithm 1). All give the
// same values (ghash_test).
//
// A hash alone is no MAC: the peer wire adds a one-time pad per frame
// (Carter-Wegman). See peer_wire.cc FrameTag.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace nonstop::crypto {

inline constexpr size_t kGhashBytes = 16;
using Block = std::array<uint8_t, kGhashBytes>;

// An element of GF(2^128) as the spec writes a block: bit 0 (the
// coefficient of x^0) is the most significant bit of byte 0. Held as two
// big-endian 64-bit halves: hi = bytes 0..7, lo = bytes 8..15, so the
// coefficient of x^i is bit 127 - i of the 128-bit number hi:lo.
struct Gf128 {
  uint64_t hi = 0, lo = 0;
  static Gf128 Load(const uint8_t p[kGhashBytes]);
  void Store(uint8_t p[kGhashBytes]) const;
  bool operator==(const Gf128&) const = default;
};

// The implementations of the block loop, slowest first.
enum class GhashImpl { kPortable, kPclmul, kVpclmul };

class Ghash {
 public:
  static constexpr int kAggregate = 16;  // blocks per reduction on the hardware path

  // H: the hash key (16 bytes). A zero key hashes everything to zero: the
  // caller derives it from a secret (a zero key has probability 2^-128).
  explicit Ghash(const uint8_t key[kGhashBytes]);
  Ghash() : Ghash(Block{}.data()) {}

  // GHASH_H(X) of SP 800-38D for `blocks` whole 16-byte blocks, continuing
  // from *y (the running value Y; zero to start).
  void Blocks(Gf128* y, const uint8_t* p, size_t blocks) const;
  // The GCM-shaped hash of a pair (A, C) (SP 800-38D 7.1 step 5): GHASH of A
  // zero-padded to whole blocks, C likewise, then [len(A)]64 || [len(C)]64
  // (bit lengths).
  Block Hash(std::string_view a, std::string_view c) const;
  // y * H^m: where GHASH of blocks X1..Xm from a running value y equals
  // y * H^m + GHASH of X1..Xm from zero (GHASH is linear in y), so a hash
  // of bytes that come before may be joined afterwards (the peer wire's
  // fused pass: peer_wire.cc). One multiplication per bit set in m.
  Gf128 MulPow(const Gf128& y, uint64_t m) const;

  GhashImpl impl() const { return impl_; }
  const Gf128* powers() const { return pow_; }  // H^1..H^kAggregate

 private:
  Gf128 pow_[kAggregate];  // H^1 .. H^kAggregate
  Gf128 sq_[64];           // H^(2^k), k = 0..63 (MulPow)
  GhashImpl impl_ = GhashImpl::kPortable;
};

// The GF(2^128) product (the spec's X • Y), portable.
Gf128 GfMul(const Gf128& x, const Gf128& y);

namespace detail {
// The block loop with `impl` (false: not available on this CPU). pow:
// H^1..H^kAggregate. For tests.
bool GhashBlocks(GhashImpl impl, const Gf128 pow[Ghash::kAggregate], Gf128* y, const uint8_t* p,
                 size_t blocks);
// The fastest implementation this CPU has.
GhashImpl GhashBest();
// Caps the implementation of Ghash objects made afterwards at `most`
// (tests; kVpclmul: no cap).
void GhashLimit(GhashImpl most);
}  // namespace detail

}  // namespace nonstop::crypto
