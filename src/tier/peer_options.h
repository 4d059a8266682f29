// The peer tier's options and job secret as the Checkpointer takes them
// (docs/TIERS.md "The peer tier from Python" and "Trust"): the checks of
// replicas=, peer_budget_bytes=, peer_every=, peer_nice=, peer_bps= and the
// agreement on the secret over the ranks' first exchange (the Python front
// end only gathers what these functions are given).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::peer {

// A peer option's value as the caller gave it.
struct OptionValue {
  enum Kind { kNone, kInt, kWord, kOther };
  Kind kind = kNone;
  int64_t n = 0;     // kInt
  std::string word;  // kWord
};

// The options, in DistOptions' order.
inline constexpr std::string_view kOptionNames[] = {"replicas", "peer_budget_bytes",
                                                    "peer_every", "peer_nice", "peer_bps"};
inline constexpr int64_t kMinBps = 1000000;  // peer_bps: less is refused (0: unpaced)
inline constexpr double kSpreadS = 10.0;     // peer_bps="spread": a push over this at least

// Option `name` checked: the value to use (peer_nice "idle" as the int
// tier::kIdleNice; None and peer_bps "spread" as given). Else InvalidArgument
// "<name> must be ..., got <repr>" (repr: how the caller writes the value).
Result<OptionValue> CheckOption(std::string_view name, const OptionValue& v,
                                std::string_view repr);

inline constexpr char kSecretEnv[] = "NONSTOP_PEER_SECRET";

// A secret written in hex (whitespace between bytes allowed, around it
// ignored): its bytes; "" for a blank text; InvalidArgument unless 16 to 64
// bytes.
Result<std::string> SecretFromHex(std::string_view text);

// $NONSTOP_PEER_SECRET as SecretFromHex reads it ("" when unset).
Result<std::string> EnvSecret();

// Names a secret without telling it (SHA-256 hex of a fixed prefix and it):
// every rank's must match.
std::string SecretFingerprint(std::string_view secret);

// The job's secret from the first exchange: `fingerprints` each rank's of
// $NONSTOP_PEER_SECRET ("" where unset), `made_hex` the 32 random bytes rank
// 0 made (hex), `mine` this rank's own. Every rank set it: the same on all
// (mine), else InvalidArgument; none did: rank 0's bytes; some did:
// InvalidArgument naming them.
Result<std::string> AgreeSecret(const std::vector<std::string>& fingerprints,
                                std::string_view made_hex, const std::string& mine);

}  // namespace nonstop::peer
