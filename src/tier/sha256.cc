// SHA-256 and HMAC-SHA256 (sha256.h), from FIPS 180-4 section 6.2 and
// RFC 2104 section 2.
#include "tier/sha256.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace nonstop::crypto {
namespace {

// FIPS 180-4 4.2.2: the first 32 bits of the fractional parts of the cube
// roots of the first 64 primes.
alignas(16) constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// FIPS 180-4 5.3.3: the square roots of the first 8 primes.
constexpr uint32_t kH0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                             0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline uint32_t LoadBe32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

void StoreBe32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}

#if defined(__x86_64__)
bool DetectShaNi() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool sha = (b >> 29) & 1;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
  const bool sse41 = (c >> 19) & 1, ssse3 = (c >> 9) & 1;
  return sha && sse41 && ssse3;
}

// The SHA extensions keep the state as two vectors, (A,B,E,F) and (C,D,G,H)
// (lane 3 down to lane 0); SHA256RNDS2 does two rounds with the two lowest
// lanes of (W + K); SHA256MSG1/MSG2 compute the message schedule
// W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16] four words at a time.
__attribute__((target("sha,sse4.1,ssse3"))) void CompressShaNi(uint32_t h[8], const uint8_t* p,
                                                                size_t blocks) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bll, 0x0405060700010203ll);
  __m128i dcba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&h[0]));  // lanes a b c d
  __m128i hgfe = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&h[4]));  // lanes e f g h
  const __m128i badc = _mm_shuffle_epi32(dcba, 0xB1);                       // lanes b a d c
  const __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);                       // lanes h g f e
  __m128i abef = _mm_alignr_epi8(badc, efgh, 8);   // lanes f e b a
  __m128i cdgh = _mm_blend_epi16(efgh, badc, 0xF0);  // lanes h g d c
  for (size_t blk = 0; blk < blocks; ++blk, p += kSha256Block) {
    const __m128i abef0 = abef, cdgh0 = cdgh;
    __m128i w[4];  // W[4j .. 4j+3] for the last four groups, ring-indexed by j % 4
    for (int j = 0; j < 16; ++j) {
      __m128i cur;
      if (j < 4) {
        cur = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)), bswap);
      } else {
        const __m128i w16 = w[j & 3], w12 = w[(j + 1) & 3], w8 = w[(j + 2) & 3], w4 = w[(j + 3) & 3];
        cur = _mm_sha256msg1_epu32(w16, w12);                 // W[t-16] + s0(W[t-15])
        cur = _mm_add_epi32(cur, _mm_alignr_epi8(w4, w8, 4));  // + W[t-7]
        cur = _mm_sha256msg2_epu32(cur, w4);                   // + s1(W[t-2])
      }
      w[j & 3] = cur;
      __m128i wk = _mm_add_epi32(cur, _mm_load_si128(reinterpret_cast<const __m128i*>(&kK[4 * j])));
      // After two rounds the old (A,B,E,F) is the new (C,D,G,H): the first
      // RNDS2 leaves (A,B,E,F) in `cdgh` and (C,D,G,H) in `abef`, the
      // second swaps them back.
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
      wk = _mm_shuffle_epi32(wk, 0x0E);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, wk);
    }
    abef = _mm_add_epi32(abef, abef0);
    cdgh = _mm_add_epi32(cdgh, cdgh0);
  }
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);  // lanes a b e f
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);  // lanes g h c d
  dcba = _mm_blend_epi16(feba, dchg, 0xF0);            // lanes a b c d
  hgfe = _mm_alignr_epi8(dchg, feba, 8);               // lanes e f g h
  _mm_storeu_si128(reinterpret_cast<__m128i*>(&h[0]), dcba);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(&h[4]), hgfe);
}
#endif

const bool kHardware =
#if defined(__x86_64__)
    DetectShaNi();
#else
    false;
#endif

inline void Compress(uint32_t h[8], const uint8_t* p, size_t blocks) {
  if (!detail::CompressHardware(h, p, blocks)) detail::CompressPortable(h, p, blocks);
}

}  // namespace

namespace detail {

void CompressPortable(uint32_t h[8], const uint8_t* p, size_t blocks) {
  uint32_t w[64];
  for (size_t blk = 0; blk < blocks; ++blk, p += kSha256Block) {
    for (int t = 0; t < 16; ++t) w[t] = LoadBe32(p + 4 * t);
    for (int t = 16; t < 64; ++t) {
      const uint32_t s0 = Rotr(w[t - 15], 7) ^ Rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      const uint32_t s1 = Rotr(w[t - 2], 17) ^ Rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = s1 + w[t - 7] + s0 + w[t - 16];
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; ++t) {
      const uint32_t S1 = Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25);
      const uint32_t ch = (e & f) ^ (~e & g);
      const uint32_t t1 = hh + S1 + ch + kK[t] + w[t];
      const uint32_t S0 = Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22);
      const uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
      const uint32_t t2 = S0 + maj;
      hh = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
  }
}

bool HardwareAvailable() { return kHardware; }

bool CompressHardware(uint32_t h[8], const uint8_t* p, size_t blocks) {
#if defined(__x86_64__)
  if (kHardware) {
    CompressShaNi(h, p, blocks);
    return true;
  }
#else
  (void)h;
  (void)p;
  (void)blocks;
#endif
  return false;
}

}  // namespace detail

Sha256::Sha256() { Reset(); }

void Sha256::Reset() {
  std::memcpy(h_, kH0, sizeof(h_));
  used_ = 0;
  total_ = 0;
}

void Sha256::Update(const void* data, size_t n) {
  if (n == 0) return;  // an empty view's data may be null: nothing to copy from it
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (used_ > 0) {
    const size_t take = std::min(n, kSha256Block - used_);
    std::memcpy(buf_ + used_, p, take);
    used_ += take;
    p += take;
    n -= take;
    if (used_ < kSha256Block) return;
    Compress(h_, buf_, 1);
    used_ = 0;
  }
  const size_t blocks = n / kSha256Block;
  if (blocks > 0) {
    Compress(h_, p, blocks);
    p += blocks * kSha256Block;
    n -= blocks * kSha256Block;
  }
  if (n > 0) {
    std::memcpy(buf_, p, n);
    used_ = n;
  }
}

Digest Sha256::Final() {
  // FIPS 180-4 5.1.1: a 1 bit, zeros to 56 mod 64 bytes, the length in bits.
  const uint64_t bits = total_ * 8;
  buf_[used_++] = 0x80;
  if (used_ > 56) {
    std::memset(buf_ + used_, 0, kSha256Block - used_);
    Compress(h_, buf_, 1);
    used_ = 0;
  }
  std::memset(buf_ + used_, 0, 56 - used_);
  for (int i = 0; i < 8; ++i) buf_[56 + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  Compress(h_, buf_, 1);
  used_ = 0;
  Digest d;
  for (int i = 0; i < 8; ++i) StoreBe32(d.data() + 4 * i, h_[i]);
  return d;
}

Digest Sha256Of(std::string_view data) {
  Sha256 s;
  s.Update(data);
  return s.Final();
}

HmacSha256::HmacSha256(std::string_view key) {
  // RFC 2104: a key longer than the block is hashed first; then zero-padded.
  uint8_t k[kSha256Block] = {};
  if (key.size() > kSha256Block) {
    const Digest d = Sha256Of(key);
    std::memcpy(k, d.data(), d.size());
  } else if (!key.empty()) {  // an empty view's data() may be null: no memcpy from it
    std::memcpy(k, key.data(), key.size());
  }
  uint8_t pad[kSha256Block];
  for (size_t i = 0; i < kSha256Block; ++i) pad[i] = k[i] ^ 0x36;
  inner_.Update(pad, sizeof(pad));
  for (size_t i = 0; i < kSha256Block; ++i) pad[i] = k[i] ^ 0x5c;
  outer_.Update(pad, sizeof(pad));
  std::memset(k, 0, sizeof(k));
  std::memset(pad, 0, sizeof(pad));
}

Digest HmacSha256::Run::Final() {
  const Digest in = inner_.Final();
  outer_.Update(in.data(), in.size());
  return outer_.Final();
}

Digest HmacSha256::Mac(std::string_view data) const {
  Run r = Begin();
  r.Update(data);
  return r.Final();
}

bool ConstantTimeEqual(const uint8_t* a, const uint8_t* b, size_t n) {
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

bool RandomBytes(void* p, size_t n) {
  uint8_t* c = static_cast<uint8_t*>(p);
  while (n > 0) {
    const ssize_t r = ::getrandom(c, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

std::string ToHex(const uint8_t* p, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kDigits[p[i] >> 4];
    s[2 * i + 1] = kDigits[p[i] & 15];
  }
  return s;
}

}  // namespace nonstop::crypto
