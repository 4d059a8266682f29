// The peer options' checks and the job secret's agreement (tier/peer_options.h).
#include "tier/peer_options.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "tier/uploader.h"

namespace nonstop::peer {
namespace {

OptionValue Int(int64_t n) {
  OptionValue v;
  v.kind = OptionValue::kInt;
  v.n = n;
  return v;
}

OptionValue Word(const std::string& w) {
  OptionValue v;
  v.kind = OptionValue::kWord;
  v.word = w;
  return v;
}

// The value of an ok Result (fails the test otherwise).
std::string Ok(Result<std::string> r) {
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? r.value() : "";
}

std::string Refused(std::string_view name, const OptionValue& v, std::string_view repr) {
  Result<OptionValue> r = CheckOption(name, v, repr);
  EXPECT_FALSE(r.ok()) << name << " " << repr;
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return r.status().message();
}

TEST(PeerOptionsTest, EachOptionTakesItsValuesAndSaysWhatItMustBe) {
  EXPECT_EQ(CheckOption("replicas", OptionValue{}, "None")->kind, OptionValue::kNone);
  EXPECT_EQ(CheckOption("replicas", Int(0), "0")->n, 0);
  EXPECT_EQ(CheckOption("peer_budget_bytes", Int(1 << 20), "")->n, 1 << 20);
  EXPECT_EQ(Refused("peer_budget_bytes", Int(-1), "-1"),
            "peer_budget_bytes must be None or a non-negative integer, got -1");
  EXPECT_EQ(Refused("replicas", OptionValue{OptionValue::kOther, 0, ""}, "1.5"),
            "replicas must be None or a non-negative integer, got 1.5");
  EXPECT_EQ(CheckOption("peer_every", Int(3), "3")->n, 3);
  EXPECT_EQ(Refused("peer_every", Int(0), "0"),
            "peer_every must be an int >= 1 (1: every checkpoint, n: every n-th), got 0");
  EXPECT_EQ(Refused("peer_every", OptionValue{}, "None").substr(0, 26), "peer_every must be an int ");
  EXPECT_EQ(Refused("peer_every", Word("2"), "'2'").substr(0, 26), "peer_every must be an int ");
  // "idle": the SCHED_IDLE class, as an int.
  const Result<OptionValue> idle = CheckOption("peer_nice", Word("idle"), "'idle'");
  ASSERT_TRUE(idle.ok());
  EXPECT_EQ(idle->kind, OptionValue::kInt);
  EXPECT_EQ(idle->n, tier::kIdleNice);
  EXPECT_EQ(CheckOption("peer_nice", Int(19), "19")->n, 19);
  EXPECT_EQ(Refused("peer_nice", Int(20), "20"),
            "peer_nice must be an int from 0 to 19 or \"idle\", got 20");
  EXPECT_EQ(Refused("peer_nice", Word("spread"), "'spread'").substr(0, 20), "peer_nice must be an");
  // peer_bps: 0, "spread" (kept as the word) or at least kMinBps.
  EXPECT_EQ(CheckOption("peer_bps", Int(0), "0")->n, 0);
  EXPECT_EQ(CheckOption("peer_bps", Int(kMinBps), "")->n, kMinBps);
  EXPECT_EQ(CheckOption("peer_bps", Word("spread"), "")->word, "spread");
  EXPECT_EQ(Refused("peer_bps", Int(kMinBps - 1), "999999"),
            "peer_bps must be 0 (unpaced), \"spread\" or an int >= 1000000 (bytes a second), "
            "got 999999");
  EXPECT_FALSE(CheckOption("peer_bps", OptionValue{}, "None").ok());
  EXPECT_FALSE(CheckOption("no_such_option", Int(1), "1").ok());
}

TEST(PeerOptionsTest, TheSecretIsReadFromHex) {
  EXPECT_EQ(Ok(SecretFromHex("")), "");
  EXPECT_EQ(Ok(SecretFromHex("  \n")), "");
  EXPECT_EQ(Ok(SecretFromHex(" " + std::string(64, 'a') + "\n")), std::string(32, '\xaa'));
  EXPECT_EQ(Ok(SecretFromHex("AB " + std::string(30, 'c'))), "\xab" + std::string(15, '\xcc'));
  for (const std::string& bad : {std::string(64, 'z'), std::string(30, 'a'), std::string(129, 'a'),
                                std::string(130, 'a'), std::string(33, 'a')}) {
    const Result<std::string> r = SecretFromHex(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().message(),
              "$NONSTOP_PEER_SECRET must be 16 to 64 bytes written in hex (32 to 128 hex digits)");
  }
  setenv(kSecretEnv, std::string(64, 'b').c_str(), 1);
  EXPECT_EQ(Ok(EnvSecret()), std::string(32, '\xbb'));
  unsetenv(kSecretEnv);
  EXPECT_EQ(Ok(EnvSecret()), "");
}

TEST(PeerOptionsTest, TheSecretIsAgreed) {
  const std::string mine(32, '\xab');
  const std::string fp = SecretFingerprint(mine);
  // SHA-256 of the prefix (with its NUL) and the secret, as Python's hashlib gives it.
  EXPECT_EQ(fp, "81c30c872db0ba3ab9b2c470edb886b87a0ebe14a198c01afd4de55187de72ff");
  EXPECT_NE(fp, SecretFingerprint(std::string(32, 'x')));
  EXPECT_EQ(Ok(AgreeSecret({fp, fp, fp}, "", mine)), mine);
  Result<std::string> r = AgreeSecret({fp, SecretFingerprint("other")}, "", mine);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "$NONSTOP_PEER_SECRET differs between ranks");
  r = AgreeSecret({fp, "", fp}, "", mine);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "$NONSTOP_PEER_SECRET is set on ranks [0, 2] only: set it on every rank or on none");
  // Nobody set it: rank 0's 32 bytes.
  const std::string made = std::string(32, '\x01');
  std::string made_hex;
  for (int i = 0; i < 32; ++i) made_hex += "01";
  EXPECT_EQ(Ok(AgreeSecret({"", ""}, made_hex, "")), made);
  EXPECT_FALSE(AgreeSecret({"", ""}, "", "").ok());
  EXPECT_FALSE(AgreeSecret({"", ""}, std::string(64, 'g'), "").ok());
}

}  // namespace
}  // namespace nonstop::peer
