// GHASH (ghash.h), from NIST SP 800-38D sections 6.3 (the multiplication)
// and 6.4 (GHASH).
//
// The field: GF(2^128) modulo P(x) = x^128 + x^7 + x^2 + x + 1; a block's
// bit i (bit 0: the most significant bit of byte 0) is the coefficient of
// x^i. Read big endian, a block is the 128-bit number B whose bit 127 - i
// is the coefficient of x^i: B is the polynomial with its bits reversed.
//
// The hardware paths: a carry-less multiplication of two such reversed
// numbers a, b (PCLMULQDQ: 64 x 64 -> 127 bits, four of them for 128 x 128)
// gives the 255-bit product whose bit 254 - k is the coefficient c_k of x^k
// in C = A * B. Shifted left by one it is a 256-bit number V = V1:V0 (128
// bits each) with bit 255 - k = c_k: V1 is C_low = c_0..c_127 reversed as a
// block is, V0 is C_high = c_128..c_254 reversed, where C = C_low + x^128
// C_high. Since x^128 = R(x) = x^7 + x^2 + x + 1 mod P,
//   C = C_low + C_high * R (mod P).
// Multiplying a reversed number by x^j is a right shift by j; the bits that
// fall off the right end (degree >= 128) form E * x^128 with E of degree
// <= 6, whose reversed form is e = (V0 << 127) ^ (V0 << 126) ^ (V0 << 121)
// (a bit b < j of V0, shifted right by j, lands on degree 128 + j - 1 - b).
// E * R has degree <= 13 and needs no further reduction. With
// f(v) = v ^ (v >> 1) ^ (v >> 2) ^ (v >> 7) (the product by R, reversed,
// its overflow dropped) and f linear:
//   A * B mod P = V1 ^ f(V0 ^ e).
// Shift and reduction are linear, so the products of several blocks with
// H^k..H^1 are summed unreduced and reduced once (GHASH's Horner form
// unrolled: Y' = (Y ^ X1) H^k ^ X2 H^(k-1) ^ ... ^ Xk H).
#include "tier/ghash.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace nonstop::crypto {
namespace {

uint64_t LoadBe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

void StoreBe64(uint8_t* p, uint64_t v) {
  for (int i = 7; i >= 0; --i) {
    p[i] = static_cast<uint8_t>(v);
    v >>= 8;
  }
}

std::atomic<GhashImpl> limit{GhashImpl::kVpclmul};

#if defined(__x86_64__)
bool DetectPclmul() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
  const bool pclmul = (c >> 1) & 1, ssse3 = (c >> 9) & 1;
  return pclmul && ssse3;
}

// VPCLMULQDQ on 256-bit registers needs AVX2 and the OS saving them (XCR0).
bool DetectVpclmul() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
  const bool osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
  if (!osxsave || !avx) return false;
  unsigned xlo = 0, xhi = 0;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  if ((xlo & 6) != 6) return false;  // SSE and AVX state
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool avx2 = (b >> 5) & 1, vpclmul = (c >> 10) & 1;
  return avx2 && vpclmul && DetectPclmul();
}

#define NONSTOP_CLMUL __attribute__((target("pclmul,ssse3")))
#define NONSTOP_VCLMUL __attribute__((target("vpclmulqdq,avx2,pclmul,ssse3")))

// The block at p, read big endian into one register (hi:lo).
NONSTOP_CLMUL inline __m128i LoadBlock(const uint8_t* p) {
  const __m128i reverse = _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), reverse);
}

NONSTOP_CLMUL inline __m128i ToReg(const Gf128& g) {
  return _mm_set_epi64x(static_cast<long long>(g.hi), static_cast<long long>(g.lo));
}

NONSTOP_CLMUL inline Gf128 FromReg(__m128i r) {
  Gf128 g;
  g.lo = static_cast<uint64_t>(_mm_cvtsi128_si64(r));
  g.hi = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_unpackhi_epi64(r, r)));
  return g;
}

// An unreduced 256-bit product: low (bits 0..127), mid (bits 64..191,
// the two cross products), high (bits 128..255).
struct Wide {
  __m128i lo, mid, hi;
};

NONSTOP_CLMUL inline void MulAdd(Wide* w, __m128i a, __m128i b) {
  w->lo = _mm_xor_si128(w->lo, _mm_clmulepi64_si128(a, b, 0x00));
  w->hi = _mm_xor_si128(w->hi, _mm_clmulepi64_si128(a, b, 0x11));
  w->mid = _mm_xor_si128(w->mid, _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x01),
                                               _mm_clmulepi64_si128(a, b, 0x10)));
}

// v >> s over all 128 bits, 0 < s < 64.
template <int s>
NONSTOP_CLMUL inline __m128i Shr128(__m128i v) {
  return _mm_or_si128(_mm_srli_epi64(v, s), _mm_slli_epi64(_mm_srli_si128(v, 8), 64 - s));
}

// The product of a Wide sum, reduced (see the top of this file).
NONSTOP_CLMUL inline __m128i Reduce(const Wide& w) {
  __m128i v0 = _mm_xor_si128(w.lo, _mm_slli_si128(w.mid, 8));
  __m128i v1 = _mm_xor_si128(w.hi, _mm_srli_si128(w.mid, 8));
  // V <<= 1 over 256 bits.
  const __m128i carry0 = _mm_srli_epi64(v0, 63);  // the top bit of each 64-bit lane of v0
  const __m128i carry1 = _mm_srli_epi64(v1, 63);
  v1 = _mm_or_si128(_mm_slli_epi64(v1, 1), _mm_or_si128(_mm_slli_si128(carry1, 8), _mm_srli_si128(carry0, 8)));
  v0 = _mm_or_si128(_mm_slli_epi64(v0, 1), _mm_slli_si128(carry0, 8));
  // e = (v0 << 127) ^ (v0 << 126) ^ (v0 << 121): only v0's low 64 bits
  // reach past bit 64, into the high lane.
  const __m128i t = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi64(v0, 63), _mm_slli_epi64(v0, 62)),
                                  _mm_slli_epi64(v0, 57));
  const __m128i d = _mm_xor_si128(v0, _mm_slli_si128(t, 8));
  const __m128i fd = _mm_xor_si128(_mm_xor_si128(d, Shr128<1>(d)), _mm_xor_si128(Shr128<2>(d), Shr128<7>(d)));
  return _mm_xor_si128(v1, fd);
}

NONSTOP_CLMUL void BlocksClmul(const Gf128 pow[Ghash::kAggregate], Gf128* y, const uint8_t* p,
                               size_t blocks) {
  constexpr int k = Ghash::kAggregate;
  __m128i h[k];
  for (int i = 0; i < k; ++i) h[i] = ToReg(pow[i]);
  __m128i acc = ToReg(*y);
  const __m128i zero = _mm_setzero_si128();
  for (; blocks >= static_cast<size_t>(k); blocks -= k, p += k * kGhashBytes) {
    Wide w{zero, zero, zero};
    MulAdd(&w, _mm_xor_si128(acc, LoadBlock(p)), h[k - 1]);
    for (int i = 1; i < k; ++i) MulAdd(&w, LoadBlock(p + i * kGhashBytes), h[k - 1 - i]);
    acc = Reduce(w);
  }
  for (; blocks > 0; --blocks, p += kGhashBytes) {
    Wide w{zero, zero, zero};
    MulAdd(&w, _mm_xor_si128(acc, LoadBlock(p)), h[0]);
    acc = Reduce(w);
  }
  *y = FromReg(acc);
}

// One product x * y, reduced.
NONSTOP_CLMUL Gf128 MulClmul(const Gf128& x, const Gf128& y) {
  const __m128i zero = _mm_setzero_si128();
  Wide w{zero, zero, zero};
  MulAdd(&w, ToReg(x), ToReg(y));
  return FromReg(Reduce(w));
}

// The two 128-bit lanes of v added.
NONSTOP_VCLMUL inline __m128i Fold(__m256i v) {
  return _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// The same with two blocks per instruction: blocks 2j and 2j+1 of a group
// of kAggregate (16) in the low and high 128-bit lanes of register j,
// against H^(16-2j) and H^(15-2j); the lanes' sums are added before the one
// reduction. Karatsuba: each pair's middle product is one carry-less
// multiplication of (hi ^ lo) of block and key, the key's halves XORed
// ahead (mid = that ^ lo ^ hi, summed over the group first): three
// multiplications a block instead of four. A reduction per 16 blocks, not
// per 8, halves the loop's dependency chain through the running value.
NONSTOP_VCLMUL void BlocksVclmul(const Gf128 pow[Ghash::kAggregate], Gf128* y, const uint8_t* p,
                                 size_t blocks) {
  constexpr int k = Ghash::kAggregate;
  static_assert(k % 2 == 0, "pairs of blocks per group");
  __m256i h[k / 2], hk[k / 2];
  for (int j = 0; j < k / 2; ++j) {
    h[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(ToReg(pow[k - 1 - 2 * j])),
                                   ToReg(pow[k - 2 - 2 * j]), 1);
    // Per lane: the key's hi ^ lo in the low 64 bits.
    hk[j] = _mm256_xor_si256(h[j], _mm256_shuffle_epi32(h[j], 0x4E));
  }
  const __m256i reverse = _mm256_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                          0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m128i acc = ToReg(*y);
  for (; blocks >= static_cast<size_t>(k); blocks -= k, p += k * kGhashBytes) {
    __m256i lo = _mm256_setzero_si256(), mid = lo, hi = lo;
    for (int j = 0; j < k / 2; ++j) {
      __m256i x = _mm256_shuffle_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * j * kGhashBytes)), reverse);
      if (j == 0) x = _mm256_xor_si256(x, _mm256_castsi128_si256(acc));  // the low lane: block 0
      const __m256i xk = _mm256_xor_si256(x, _mm256_shuffle_epi32(x, 0x4E));
      lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128(x, h[j], 0x00));
      hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128(x, h[j], 0x11));
      mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(xk, hk[j], 0x00));
    }
    mid = _mm256_xor_si256(mid, _mm256_xor_si256(lo, hi));
    acc = Reduce(Wide{Fold(lo), Fold(mid), Fold(hi)});
  }
  *y = FromReg(acc);
  if (blocks > 0) BlocksClmul(pow, y, p, blocks);
}
#endif

GhashImpl BestHere() {
#if defined(__x86_64__)
  static const GhashImpl best = DetectVpclmul() ? GhashImpl::kVpclmul
                                : DetectPclmul() ? GhashImpl::kPclmul
                                                 : GhashImpl::kPortable;
  return best;
#else
  return GhashImpl::kPortable;
#endif
}

// x * y with the fastest multiplication this CPU has.
Gf128 MulBest(const Gf128& x, const Gf128& y) {
#if defined(__x86_64__)
  if (BestHere() != GhashImpl::kPortable) return MulClmul(x, y);
#endif
  return GfMul(x, y);
}

void BlocksPortable(const Gf128 pow[Ghash::kAggregate], Gf128* y, const uint8_t* p, size_t blocks) {
  Gf128 acc = *y;
  for (size_t i = 0; i < blocks; ++i, p += kGhashBytes) {
    const Gf128 x = Gf128::Load(p);
    acc = GfMul(Gf128{acc.hi ^ x.hi, acc.lo ^ x.lo}, pow[0]);
  }
  *y = acc;
}

}  // namespace

Gf128 Gf128::Load(const uint8_t p[kGhashBytes]) { return Gf128{LoadBe64(p), LoadBe64(p + 8)}; }

void Gf128::Store(uint8_t p[kGhashBytes]) const {
  StoreBe64(p, hi);
  StoreBe64(p + 8, lo);
}

// SP 800-38D 6.3, Algorithm 1: Z accumulates V = Y x^i for the bits x_i of
// X that are set; V x is V shifted right by one bit (as a block), reduced by
// R = 11100001 || 0^120 when the bit x^127 falls off.
Gf128 GfMul(const Gf128& x, const Gf128& y) {
  Gf128 z, v = y;
  for (int i = 0; i < 128; ++i) {
    const uint64_t xi = i < 64 ? (x.hi >> (63 - i)) & 1 : (x.lo >> (127 - i)) & 1;
    const uint64_t mask = 0 - xi;
    z.hi ^= v.hi & mask;
    z.lo ^= v.lo & mask;
    const uint64_t drop = 0 - (v.lo & 1);
    v.lo = (v.lo >> 1) | (v.hi << 63);
    v.hi = (v.hi >> 1) ^ (0xE100000000000000ull & drop);
  }
  return z;
}

namespace detail {

bool GhashBlocks(GhashImpl impl, const Gf128 pow[Ghash::kAggregate], Gf128* y, const uint8_t* p,
                 size_t blocks) {
  if (impl > BestHere()) return false;
  switch (impl) {
    case GhashImpl::kPortable: BlocksPortable(pow, y, p, blocks); return true;
#if defined(__x86_64__)
    case GhashImpl::kPclmul: BlocksClmul(pow, y, p, blocks); return true;
    case GhashImpl::kVpclmul: BlocksVclmul(pow, y, p, blocks); return true;
#else
    default: return false;
#endif
  }
  return false;
}

GhashImpl GhashBest() { return BestHere(); }

void GhashLimit(GhashImpl most) { limit.store(most); }

}  // namespace detail

Ghash::Ghash(const uint8_t key[kGhashBytes]) {
  pow_[0] = Gf128::Load(key);
  for (int i = 1; i < kAggregate; ++i) pow_[i] = GfMul(pow_[i - 1], pow_[0]);
  impl_ = std::min(BestHere(), limit.load());
  sq_[0] = pow_[0];
  for (int k = 1; k < 64; ++k) {
    sq_[k] = impl_ == GhashImpl::kPortable ? GfMul(sq_[k - 1], sq_[k - 1]) : MulBest(sq_[k - 1], sq_[k - 1]);
  }
}

Gf128 Ghash::MulPow(const Gf128& y, uint64_t m) const {
  Gf128 r = y;
  for (int k = 0; m != 0; ++k, m >>= 1) {
    if ((m & 1) == 0) continue;
    r = impl_ == GhashImpl::kPortable ? GfMul(r, sq_[k]) : MulBest(r, sq_[k]);
  }
  return r;
}

void Ghash::Blocks(Gf128* y, const uint8_t* p, size_t blocks) const {
  if (blocks == 0) return;
  (void)detail::GhashBlocks(impl_, pow_, y, p, blocks);
}

Block Ghash::Hash(std::string_view a, std::string_view c) const {
  Gf128 y;
  for (std::string_view part : {a, c}) {
    const auto* p = reinterpret_cast<const uint8_t*>(part.data());
    const size_t whole = part.size() / kGhashBytes;
    Blocks(&y, p, whole);
    if (const size_t rest = part.size() % kGhashBytes; rest != 0) {
      uint8_t last[kGhashBytes] = {};
      std::memcpy(last, p + whole * kGhashBytes, rest);
      Blocks(&y, last, 1);
    }
  }
  uint8_t lens[kGhashBytes];
  StoreBe64(lens, static_cast<uint64_t>(a.size()) * 8);
  StoreBe64(lens + 8, static_cast<uint64_t>(c.size()) * 8);
  Blocks(&y, lens, 1);
  Block out;
  y.Store(out.data());
  return out;
}

}  // namespace nonstop::crypto
