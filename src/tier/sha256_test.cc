// SHA-256 and HMAC-SHA256 (tier/sha256.h) against the standard test vectors
// (FIPS 180-2 appendix B / NIST examples, RFC 4231), and the SHA-extension
// compression against the portable one on every length around the block
// boundaries.
#include "tier/sha256.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace nonstop::crypto {
namespace {

std::string Hex(const Digest& d) { return ToHex(d.data(), d.size()); }

std::string Unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  }
  return out;
}

TEST(Sha256Test, NistVectors) {
  EXPECT_EQ(Hex(Sha256Of("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Hex(Sha256Of("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  // 448 bits: the padding needs a second block.
  EXPECT_EQ(Hex(Sha256Of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Hex(Sha256Of("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjk"
                         "lmnopqklmnopqrlmnopqrsmnopqrstnopqrstu")),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  // One million 'a', fed in uneven pieces.
  Sha256 s;
  const std::string a(1000000, 'a');
  size_t off = 0;
  for (size_t n = 1; off < a.size(); n = n * 3 + 1) {
    const size_t take = std::min(n % 9973, a.size() - off);
    s.Update(a.data() + off, take);
    off += take;
  }
  EXPECT_EQ(Hex(s.Final()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256Test, Rfc4231HmacVectors) {
  const auto mac = [](const std::string& key, const std::string& data) {
    return Hex(HmacSha256(key).Mac(data));
  };
  EXPECT_EQ(mac(std::string(20, '\x0b'), "Hi There"),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(mac("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(mac(std::string(20, '\xaa'), std::string(50, '\xdd')),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  EXPECT_EQ(mac(Unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"), std::string(50, '\xcd')),
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  // Keys longer than a block are hashed first.
  EXPECT_EQ(mac(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(mac(std::string(131, '\xaa'),
                "This is a test using a larger than block-size key and a larger than block-size "
                "data. The key needs to be hashed before being used by the HMAC algorithm."),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
  // A run fed in pieces equals the one-shot MAC; the key object is reusable.
  HmacSha256 h("Jefe");
  HmacSha256::Run r = h.Begin();
  r.Update("what do ya ");
  r.Update("want for nothing?");
  EXPECT_EQ(Hex(r.Final()), mac("Jefe", "what do ya want for nothing?"));
  EXPECT_EQ(Hex(h.Mac("what do ya want for nothing?")), mac("Jefe", "what do ya want for nothing?"));
}

TEST(Sha256Test, HardwareAndPortableAgree) {
  if (!detail::HardwareAvailable()) GTEST_SKIP() << "no SHA extensions on this CPU";
  std::mt19937_64 rng(7);
  std::string data(64 * 40, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  for (size_t blocks : {1, 2, 3, 17, 40}) {
    uint32_t a[8], b[8];
    for (int i = 0; i < 8; ++i) a[i] = b[i] = static_cast<uint32_t>(rng());
    detail::CompressPortable(a, reinterpret_cast<const uint8_t*>(data.data()), blocks);
    ASSERT_TRUE(detail::CompressHardware(b, reinterpret_cast<const uint8_t*>(data.data()), blocks));
    for (int i = 0; i < 8; ++i) EXPECT_EQ(a[i], b[i]) << blocks << " blocks, word " << i;
  }
}

TEST(Sha256Test, ConstantTimeEqual) {
  const uint8_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
  EXPECT_TRUE(ConstantTimeEqual(a, a, 4));
  EXPECT_FALSE(ConstantTimeEqual(a, b, 4));
  EXPECT_TRUE(ConstantTimeEqual(a, b, 3));
  uint8_t r1[32] = {}, r2[32] = {};
  ASSERT_TRUE(RandomBytes(r1, sizeof(r1)));
  ASSERT_TRUE(RandomBytes(r2, sizeof(r2)));
  EXPECT_FALSE(ConstantTimeEqual(r1, r2, 32));
}

}  // namespace
}  // namespace nonstop::crypto
