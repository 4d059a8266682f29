// GHASH (tier/ghash.h) against the GHASH values published with the GCM test
// cases (McGrew & Viega, "The Galois/Counter Mode of Operation", test cases
// 2, 3, 4 and 18; the values SP 800-38D's GHASH gives for their H, A, C),
// the field's laws, and the PCLMULQDQ and VPCLMULQDQ paths against the
// portable one on random inputs of every length 0..300 bytes and on big
// ones.
#include "tier/ghash.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "tier/sha256.h"

namespace nonstop::crypto {
namespace {

std::string Unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::string Hex(const Block& b) { return ToHex(b.data(), b.size()); }

Gf128 G(const std::string& hex) {
  const std::string b = Unhex(hex);
  return Gf128::Load(reinterpret_cast<const uint8_t*>(b.data()));
}

std::string Hex(const Gf128& g) {
  Block b;
  g.Store(b.data());
  return Hex(b);
}

struct Vector {
  const char* name;
  const char* h;
  const char* a;
  const char* c;
  const char* ghash;
};

// H = E(K, 0^128) and C of the published test cases, with GHASH(H, A, C).
const Vector kVectors[] = {
    {"case 2", "66e94bd4ef8a2c3b884cfa59ca342b2e", "", "0388dace60b6a392f328c2b971b2fe78",
     "f38cbb1ad69223dcc3457ae5b6b0f885"},
    {"case 3", "b83b533708bf535d0aa6e52980d53b78", "",
     "42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e"
     "21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091473f5985",
     "7f1b32b81b820d02614f8895ac1d4eac"},
    {"case 4", "b83b533708bf535d0aa6e52980d53b78", "feedfacedeadbeeffeedfacedeadbeefabaddad2",
     "42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e"
     "21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091",
     "698e57f70e6ecc7fd9463b7260a9ae5f"},
    {"case 18", "acbef20579b4b8ebce889bac8732dad7", "feedfacedeadbeeffeedfacedeadbeefabaddad2",
     "5a8def2f0c9e53f1f75d7853659e2a20eeb2b22aafde6419a058ab4f6f746bf4"
     "0fc0c3b780f244452da3ebf1c5d82cdea2418997200ef82e44ae7e3f",
     "d5ffcf6fc5ac4d69722187421a7f170b"},
};

const GhashImpl kImpls[] = {GhashImpl::kPortable, GhashImpl::kPclmul, GhashImpl::kVpclmul};
const char* Name(GhashImpl i) {
  return i == GhashImpl::kPortable ? "portable" : i == GhashImpl::kPclmul ? "pclmulqdq" : "vpclmulqdq";
}

TEST(GhashTest, PublishedGcmVectors) {
  for (GhashImpl impl : kImpls) {
    if (impl > detail::GhashBest()) continue;
    detail::GhashLimit(impl);
    for (const Vector& v : kVectors) {
      SCOPED_TRACE(std::string(v.name) + " " + Name(impl));
      const std::string h = Unhex(v.h);
      const Ghash g(reinterpret_cast<const uint8_t*>(h.data()));
      EXPECT_EQ(g.impl(), impl);
      EXPECT_EQ(Hex(g.Hash(Unhex(v.a), Unhex(v.c))), v.ghash);
    }
  }
  detail::GhashLimit(GhashImpl::kVpclmul);
  // Nothing hashed: Y stays zero whatever H.
  const std::string h = Unhex(kVectors[0].h);
  EXPECT_EQ(Hex(Ghash(reinterpret_cast<const uint8_t*>(h.data())).Hash("", "")),
            "00000000000000000000000000000000");
}

TEST(GhashTest, TheFieldsLaws) {
  // 1 is the block 10000000 0^120 (x^0 is the first bit); x is 01000000 ...
  const Gf128 one = G("80000000000000000000000000000000");
  const Gf128 x = G("40000000000000000000000000000000");
  const Gf128 h = G("66e94bd4ef8a2c3b884cfa59ca342b2e");
  EXPECT_EQ(GfMul(h, one), h);
  EXPECT_EQ(GfMul(one, h), h);
  // x^127 * x = x^128 = x^7 + x^2 + x + 1: bits 0, 1, 2 and 7, i.e. 11100001.
  EXPECT_EQ(Hex(GfMul(G("00000000000000000000000000000001"), x)), "e1000000000000000000000000000000");
  std::mt19937_64 rng(7);
  const auto rnd = [&] { return Gf128{rng(), rng()}; };
  for (int i = 0; i < 200; ++i) {
    const Gf128 a = rnd(), b = rnd(), c = rnd();
    EXPECT_EQ(GfMul(a, b), GfMul(b, a));
    EXPECT_EQ(GfMul(GfMul(a, b), c), GfMul(a, GfMul(b, c)));
    EXPECT_EQ(GfMul(a, Gf128{b.hi ^ c.hi, b.lo ^ c.lo}),
              (Gf128{GfMul(a, b).hi ^ GfMul(a, c).hi, GfMul(a, b).lo ^ GfMul(a, c).lo}));
  }
  // a^(2^128) = a: squaring 128 times is the identity (the Frobenius map of
  // GF(2^128) has order 128), which fails for any wrong reduction polynomial.
  for (int i = 0; i < 4; ++i) {
    const Gf128 a = rnd();
    Gf128 s = a;
    for (int k = 0; k < 128; ++k) s = GfMul(s, s);
    EXPECT_EQ(s, a);
  }
}

TEST(GhashTest, HardwareAndPortableAgree) {
  if (detail::GhashBest() == GhashImpl::kPortable) GTEST_SKIP() << "no PCLMULQDQ on this CPU";
  std::mt19937_64 rng(11);
  std::string data(3 << 20, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  const auto* p = reinterpret_cast<const uint8_t*>(data.data());
  const auto make = [](const uint8_t* key, GhashImpl impl) {
    detail::GhashLimit(impl);
    Ghash g(key);
    detail::GhashLimit(GhashImpl::kVpclmul);
    EXPECT_EQ(g.impl(), impl);
    return g;
  };
  for (GhashImpl impl : {GhashImpl::kPclmul, GhashImpl::kVpclmul}) {
    if (impl > detail::GhashBest()) continue;
    SCOPED_TRACE(Name(impl));
    for (int trial = 0; trial < 8; ++trial) {
      uint8_t key[kGhashBytes];
      for (uint8_t& k : key) k = static_cast<uint8_t>(rng());
      if (trial == 0) std::fill(key, key + kGhashBytes, 0xff);
      const Ghash slow = make(key, GhashImpl::kPortable), fast = make(key, impl);
      // Every length 0..300 bytes (every count of whole blocks around the
      // aggregation width, every partial tail), the header part too.
      for (size_t n = 0; n <= 300; ++n) {
        const size_t off = rng() % 4096, alen = rng() % 40;
        const std::string_view a(data.data() + off, alen), c(data.data() + off + alen, n);
        ASSERT_EQ(Hex(slow.Hash(a, c)), Hex(fast.Hash(a, c))) << "length " << n << " header " << alen;
      }
      // The block loop itself from a random running value.
      for (size_t blocks : {1, 7, 8, 9, 15, 16, 17, 100}) {
        Gf128 y0{rng(), rng()}, y1 = y0;
        ASSERT_TRUE(detail::GhashBlocks(GhashImpl::kPortable, slow.powers(), &y0, p, blocks));
        ASSERT_TRUE(detail::GhashBlocks(impl, slow.powers(), &y1, p, blocks));
        ASSERT_EQ(y0, y1) << blocks << " blocks";
      }
    }
    // Big ones: a frame-sized and an odd-sized input.
    const uint8_t key[kGhashBytes] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    const Ghash slow = make(key, GhashImpl::kPortable), fast = make(key, impl);
    for (size_t n : {size_t{1} << 20, (size_t{3} << 20) - 24 - 5}) {
      const std::string_view a(data.data(), 24), c(data.data() + 24, n);
      EXPECT_EQ(Hex(slow.Hash(a, c)), Hex(fast.Hash(a, c))) << n;
    }
  }
}

TEST(GhashTest, OneBitAnywhereChangesTheHash) {
  // The property the peer wire's MAC rests on: for a secret H, two different
  // inputs of the same length hash alike with probability <= blocks/2^128,
  // so any single flip changes it (a flip is a nonzero difference polynomial
  // of degree <= blocks; it has H as a root for only that many H).
  std::mt19937_64 rng(3);
  std::string c(1000, '\0');
  for (char& ch : c) ch = static_cast<char>(rng());
  const uint8_t key[kGhashBytes] = {0x42, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0xaa, 0xbb, 0xcc, 0xdd, 0xee};
  const Ghash g(key);
  const Block base = g.Hash("header", c);
  for (size_t bit = 0; bit < c.size() * 8; bit += 37) {
    std::string d = c;
    d[bit / 8] = static_cast<char>(d[bit / 8] ^ (1 << (bit % 8)));
    EXPECT_NE(Hex(g.Hash("header", d)), Hex(base)) << bit;
  }
  EXPECT_NE(Hex(g.Hash("headeR", c)), Hex(base));
  // Lengths count: a trailing zero byte moved from C to A, or appended.
  EXPECT_NE(Hex(g.Hash("header", c + std::string(1, '\0'))), Hex(base));
  EXPECT_NE(Hex(g.Hash(std::string("header") + c.substr(0, 1), c.substr(1))), Hex(base));
}

// MulPow(y, m) is y * H^m: GHASH of m zero blocks from y, on every
// implementation (the fused pass of the peer wire joins a header's hash
// with it, peer_wire_test).
TEST(GhashTest, MulPowIsTheHashOfZeroBlocks) {
  std::mt19937_64 rng(2715);
  for (GhashImpl impl : {GhashImpl::kPortable, GhashImpl::kPclmul, GhashImpl::kVpclmul}) {
    if (impl > detail::GhashBest()) continue;
    detail::GhashLimit(impl);
    Block key;
    for (auto& b : key) b = static_cast<uint8_t>(rng());
    const Ghash h(key.data());
    detail::GhashLimit(GhashImpl::kVpclmul);
    const std::string zeros(300 * kGhashBytes, '\0');
    const auto* z = reinterpret_cast<const uint8_t*>(zeros.data());
    for (uint64_t m : {0, 1, 2, 3, 15, 16, 17, 31, 64, 255, 299, 300}) {
      const Gf128 y{rng(), rng()};
      Gf128 want = y;
      h.Blocks(&want, z, m);
      EXPECT_EQ(Hex(h.MulPow(y, m)), Hex(want)) << "m=" << m << " impl=" << static_cast<int>(impl);
    }
    // A large m against the square-and-multiply by hand: H^(2^20 + 5).
    const Gf128 y{rng(), rng()};
    Gf128 want = y;
    for (int i = 0; i < 5; ++i) want = GfMul(want, h.powers()[0]);
    Gf128 p = h.powers()[0];
    for (int i = 0; i < 20; ++i) p = GfMul(p, p);
    want = GfMul(want, p);
    EXPECT_EQ(Hex(h.MulPow(y, (1u << 20) + 5)), Hex(want));
  }
}

}  // namespace
}  // namespace nonstop::crypto
