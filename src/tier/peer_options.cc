#include "tier/peer_options.h"

#include <cstdlib>

#include "tier/sha256.h"
#include "tier/uploader.h"

namespace nonstop::peer {

Result<OptionValue> CheckOption(std::string_view name, const OptionValue& v,
                                std::string_view repr) {
  std::string_view word, must;
  bool none_ok = false, ok = false;
  const int64_t n = v.n;
  if (name == "replicas" || name == "peer_budget_bytes") {
    none_ok = true;
    ok = n >= 0;
    must = "must be None or a non-negative integer";
  } else if (name == "peer_every") {
    ok = n >= 1;
    must = "must be an int >= 1 (1: every checkpoint, n: every n-th)";
  } else if (name == "peer_nice") {
    word = "idle";
    ok = 0 <= n && n <= 19;
    must = "must be an int from 0 to 19 or \"idle\"";
  } else if (name == "peer_bps") {
    word = "spread";
    ok = n == 0 || n >= kMinBps;
    must = "must be 0 (unpaced), \"spread\" or an int >= 1000000 (bytes a second)";
  } else {
    return Status::InvalidArgument("unknown peer option " + std::string(name));
  }
  if (v.kind == OptionValue::kNone && none_ok) return v;
  if (v.kind == OptionValue::kWord && !word.empty() && v.word == word) {
    if (word != "idle") return v;
    OptionValue idle;
    idle.kind = OptionValue::kInt;
    idle.n = tier::kIdleNice;
    return idle;
  }
  if (v.kind == OptionValue::kInt && ok) return v;
  return Status::InvalidArgument(std::string(name) + " " + std::string(must) + ", got " +
                                 std::string(repr));
}

namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool Space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

}  // namespace

Result<std::string> SecretFromHex(std::string_view text) {
  while (!text.empty() && Space(text.front())) text.remove_prefix(1);
  while (!text.empty() && Space(text.back())) text.remove_suffix(1);
  if (text.empty()) return std::string();
  std::string out;
  bool bad = false;
  for (size_t i = 0; i < text.size() && !bad;) {
    if (Space(text[i])) {
      ++i;
      continue;
    }
    const int hi = HexDigit(text[i]), lo = i + 1 < text.size() ? HexDigit(text[i + 1]) : -1;
    bad = hi < 0 || lo < 0;
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  if (bad || out.size() < 16 || out.size() > 64) {
    return Status::InvalidArgument(std::string("$") + kSecretEnv +
                                   " must be 16 to 64 bytes written in hex (32 to 128 hex digits)");
  }
  return out;
}

Result<std::string> EnvSecret() {
  const char* v = std::getenv(kSecretEnv);
  return SecretFromHex(v == nullptr ? "" : v);
}

std::string SecretFingerprint(std::string_view secret) {
  crypto::Sha256 h;
  h.Update(std::string_view("nonstop peer secret fingerprint\0", 32));
  h.Update(secret);
  const crypto::Digest d = h.Final();
  return crypto::ToHex(d.data(), d.size());
}

Result<std::string> AgreeSecret(const std::vector<std::string>& fingerprints,
                                std::string_view made_hex, const std::string& mine) {
  std::string set_on;
  size_t set = 0;
  for (size_t r = 0; r < fingerprints.size(); ++r) {
    if (fingerprints[r].empty()) continue;
    set_on += (set++ == 0 ? "" : ", ") + std::to_string(r);
  }
  if (set > 0 && set == fingerprints.size()) {
    for (const std::string& f : fingerprints) {
      if (f != fingerprints[0]) {
        return Status::InvalidArgument(std::string("$") + kSecretEnv + " differs between ranks");
      }
    }
    return mine;
  }
  if (set > 0) {
    return Status::InvalidArgument(std::string("$") + kSecretEnv + " is set on ranks [" + set_on +
                                   "] only: set it on every rank or on none");
  }
  std::string made;
  for (size_t i = 0; i + 1 < made_hex.size(); i += 2) {
    const int hi = HexDigit(made_hex[i]), lo = HexDigit(made_hex[i + 1]);
    if (hi < 0 || lo < 0) return Status::InvalidArgument("rank 0's peer secret is not hex");
    made.push_back(static_cast<char>(hi * 16 + lo));
  }
  if (made.size() != 32 || made_hex.size() != 64) {
    return Status::InvalidArgument("rank 0 sent no peer secret of 32 bytes");
  }
  return made;
}

}  // namespace nonstop::peer
