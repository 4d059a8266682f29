// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for the peer tier's
// authentication (peer_wire.h; docs/TIERS.md "Trust"). Written from the
// standards' formulas; no external crypto library. On x86-64 processors with
// the SHA extensions the compression runs on them (chosen once at run time),
// else in portable C++; both give the same digests (sha256_test).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace nonstop::crypto {

inline constexpr size_t kSha256Bytes = 32;
inline constexpr size_t kSha256Block = 64;
using Digest = std::array<uint8_t, kSha256Bytes>;

class Sha256 {
 public:
  Sha256();
  void Update(const void* p, size_t n);
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  Digest Final();  // the object is spent afterwards (Reset to reuse)
  void Reset();

 private:
  uint32_t h_[8];
  uint8_t buf_[kSha256Block];
  size_t used_ = 0;      // bytes in buf_
  uint64_t total_ = 0;   // message bytes so far
};

Digest Sha256Of(std::string_view data);

// HMAC-SHA256 with a fixed key: the key's inner and outer blocks are hashed
// once at construction, so each MAC costs the message plus two blocks.
class HmacSha256 {
 public:
  HmacSha256() : HmacSha256(std::string_view{}) {}
  explicit HmacSha256(std::string_view key);
  // A MAC computation: Begin, Update..., Final.
  class Run {
   public:
    void Update(const void* p, size_t n) { inner_.Update(p, n); }
    void Update(std::string_view s) { inner_.Update(s); }
    Digest Final();

   private:
    friend class HmacSha256;
    Run(const Sha256& inner, const Sha256& outer) : inner_(inner), outer_(outer) {}
    Sha256 inner_, outer_;
  };
  Run Begin() const { return Run(inner_, outer_); }
  Digest Mac(std::string_view data) const;

 private:
  Sha256 inner_, outer_;  // after the key ^ ipad / key ^ opad block
};

// Equal bytes, in time that depends on the length only.
bool ConstantTimeEqual(const uint8_t* a, const uint8_t* b, size_t n);

// `n` bytes from the kernel's random source (getrandom); false on failure.
bool RandomBytes(void* p, size_t n);

std::string ToHex(const uint8_t* p, size_t n);

namespace detail {
// The compression of `blocks` 64-byte blocks into h, portable / with the SHA
// extensions (false: not available here). For tests.
void CompressPortable(uint32_t h[8], const uint8_t* p, size_t blocks);
bool CompressHardware(uint32_t h[8], const uint8_t* p, size_t blocks);
bool HardwareAvailable();
}  // namespace detail

}  // namespace nonstop::crypto
