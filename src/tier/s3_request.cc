#include "tier/s3_request.h"

#include <ctime>
#include <map>
#include <regex>

#include "tier/sha256.h"

namespace nonstop::tier {

namespace {

using crypto::Digest;
using crypto::HmacSha256;
using crypto::Sha256Of;
using crypto::ToHex;

const char kDenied[] =
    "access denied (403): the credentials (remote_options key=/secret=, or the environment's) "
    "were refused or lack permission on this bucket and prefix";

std::string FirstLine(std::string_view text) {
  const size_t a = text.find_first_not_of(" \t\r\n");
  if (a == std::string_view::npos) return "";
  text = text.substr(a);
  text = text.substr(0, text.find('\n'));
  while (!text.empty() && (text.back() == ' ' || text.back() == '\r' || text.back() == '\t')) {
    text.remove_suffix(1);
  }
  return std::string(text);
}

bool Has(std::string_view text, std::string_view what) {
  return text.find(what) != std::string_view::npos;
}

bool Matches(const std::string& text, const char* re, bool icase = false) {
  auto flags = std::regex::ECMAScript;
  if (icase) flags |= std::regex::icase;
  return std::regex_search(text, std::regex(re, flags));
}

std::string Hex(const Digest& d) { return ToHex(d.data(), d.size()); }

}  // namespace

StoreFailure ClassifyStoreFailure(std::string_view view, bool denied, bool unauthenticated) {
  const std::string text(view);
  if (unauthenticated || Has(text, "169.254.169.254") || Has(text, "/latest/api/token")) {
    return {"no_credentials",
            "no credentials: give remote_options key= and secret= (or set AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY)"};
  }
  if (denied ||
      Matches(text, R"(\b403 Forbidden\b|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch)")) {
    return {"access_denied", kDenied};
  }
  if (Has(text, "NoSuchBucket") || (Matches(text, R"(\b404 Not Found\b)") &&
                                    Matches(text, "list request|performing PUT|put request", true))) {
    // a listing or a write answered 404: no bucket there
    return {"bucket_missing",
            "the bucket does not exist (404 on the bucket): create it (or pass "
            "remote_options={'create_bucket': True}), or fix the bucket name in the URL"};
  }
  if (Matches(text, "error sending request|connect|timed? ?out|dns error|Connection refused", true)) {
    std::smatch m;
    std::string where;
    if (std::regex_search(text, m, std::regex(R"((https?://[^/\s]+))"))) where = " (" + m.str(1) + ")";
    return {"unreachable", "the store is unreachable" + where + ": no answer after the client's retries"};
  }
  return {"other", FirstLine(text)};
}

double DurationSeconds(std::string_view v) {
  std::smatch m;
  const std::string s(v);
  if (!std::regex_match(s, m, std::regex(R"(^\s*([0-9.]+)\s*(ms|s|min|m)?\s*$)"))) return 60.0;
  double n = 0;
  try {
    n = std::stod(m.str(1));
  } catch (const std::exception&) {
    return 60.0;
  }
  const std::string unit = m.str(2);
  return unit == "ms" ? n * 1e-3 : (unit == "min" || unit == "m") ? n * 60.0 : n;
}

Result<CreateBucket> SignCreateBucket(const std::string& prefix_url, const std::string& endpoint,
                                      const std::string& bucket, const std::string& region,
                                      const std::string& key, const std::string& secret,
                                      const std::string& token, std::string amz) {
  CreateBucket out;
  out.what = prefix_url + ": creating bucket '" + bucket + "'";
  if (key.empty() || secret.empty()) {
    return Status::IOError(out.what +
                           ": no credentials: give remote_options key= and secret= (or set "
                           "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)");
  }
  out.base = endpoint.empty() ? "https://s3." + region + ".amazonaws.com" : endpoint;
  while (!out.base.empty() && out.base.back() == '/') out.base.pop_back();
  out.url = out.base + "/" + bucket;
  const size_t scheme = out.url.find("://");
  const size_t path_at = out.url.find('/', scheme == std::string::npos ? 0 : scheme + 3);
  const std::string host = out.url.substr(scheme + 3, path_at - scheme - 3);
  const std::string path = out.url.substr(path_at);
  if (region != "us-east-1") {
    out.body = "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
               "<LocationConstraint>" + region + "</LocationConstraint>"
               "</CreateBucketConfiguration>";
  }
  if (amz.empty()) {
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&now, &tm);
    char buf[32];
    std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &tm);
    amz = buf;
  }
  const std::string digest = Hex(Sha256Of(out.body));
  std::map<std::string, std::string> h = {
      {"host", host}, {"x-amz-content-sha256", digest}, {"x-amz-date", amz}};
  if (!token.empty()) h["x-amz-security-token"] = token;
  std::string canonical_headers, signed_headers;
  for (const auto& [k, v] : h) {
    canonical_headers += k + ":" + v + "\n";
    signed_headers += (signed_headers.empty() ? "" : ";") + k;
  }
  const std::string canonical =
      "PUT\n" + path + "\n\n" + canonical_headers + "\n" + signed_headers + "\n" + digest;
  const std::string scope = amz.substr(0, 8) + "/" + region + "/s3/aws4_request";
  const std::string to_sign =
      "AWS4-HMAC-SHA256\n" + amz + "\n" + scope + "\n" + Hex(Sha256Of(canonical));
  std::string k = "AWS4" + secret;
  for (const std::string& part : {amz.substr(0, 8), region, std::string("s3"),
                                  std::string("aws4_request")}) {
    const Digest d = HmacSha256(k).Mac(part);
    k.assign(reinterpret_cast<const char*>(d.data()), d.size());
  }
  const std::string sig = Hex(HmacSha256(k).Mac(to_sign));
  for (const auto& [name, v] : h) {
    if (name != "host") out.headers.emplace_back(name, v);
  }
  out.headers.emplace_back("Authorization", "AWS4-HMAC-SHA256 Credential=" + key + "/" + scope +
                                                ", SignedHeaders=" + signed_headers +
                                                ", Signature=" + sig);
  return out;
}

Result<bool> CreateBucketAnswer(const std::string& what, int code, std::string_view body) {
  if (code == 409 && Has(body, "BucketAlreadyOwnedByYou")) return false;
  if (code == 409) {
    return Status::IOError(what + ": the name is taken (409 BucketAlreadyExists): choose another "
                                  "bucket name");
  }
  if (code == 403) return Status::IOError(what + ": " + kDenied);
  std::smatch m;
  const std::string text(body);
  std::string name;
  if (std::regex_search(text, m, std::regex("<Code>([^<]{1,64})</Code>"))) name = " " + m.str(1);
  return Status::IOError(what + ": HTTP " + std::to_string(code) + name);
}

StoreOptions SortStoreOptions(const std::string& url, const std::vector<std::string>& keys,
                              const std::map<std::string, std::string>& text) {
  StoreOptions out;
  auto given = [&](const std::string& k) {
    auto it = text.find(k);
    return it == text.end() ? std::string() : it->second;
  };
  static const std::regex kS3(R"(^s3://([^/]+)/?(.*)$)");
  std::smatch m;
  out.s3 = std::regex_match(url, m, kS3);
  for (const std::string& k : keys) {
    bool tier = false;
    for (std::string_view t : kTierOptions) tier = tier || k == t;
    std::string to = tier ? "" : k;
    if (out.s3) {
      if (k == "endpoint" || k == "endpoint_url" || k == "client_kwargs" || k == "timeout" ||
          k == "connect_timeout") {
        to = "";
      } else if (k == "key" || k == "secret" || k == "token" || k == "region") {
        static const std::map<std::string, std::string> kNames = {
            {"key", "access_key_id"}, {"secret", "secret_access_key"},
            {"token", "session_token"}, {"region", "region"}};
        to = text.count(k) ? kNames.at(k) : "";
      }
    }
    out.route.emplace_back(k, to);
  }
  if (!out.s3) return out;
  out.bucket = m.str(1);
  out.prefix = m.str(2);
  while (!out.prefix.empty() && out.prefix.front() == '/') out.prefix.erase(0, 1);
  while (!out.prefix.empty() && out.prefix.back() == '/') out.prefix.pop_back();
  for (const char* k : {"endpoint", "endpoint_url", "client_kwargs.endpoint_url"}) {
    if (out.endpoint.empty()) out.endpoint = given(k);
  }
  out.allow_http = out.endpoint.rfind("http://", 0) == 0;
  if (text.count("timeout")) out.timeout = given("timeout");
  if (text.count("connect_timeout")) out.connect_timeout = given("connect_timeout");
  out.request_timeout_s = DurationSeconds(out.connect_timeout) + DurationSeconds(out.timeout);
  return out;
}

S3Credentials WithEnvironmentCredentials(S3Credentials c) {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v == nullptr ? "" : v);
  };
  for (const char* name : {"AWS_REGION", "AWS_DEFAULT_REGION"}) {
    if (c.region.empty()) c.region = env(name);
  }
  if (c.region.empty()) c.region = "us-east-1";
  if (c.token.empty() && c.key.empty()) c.token = env("AWS_SESSION_TOKEN");
  if (c.key.empty()) c.key = env("AWS_ACCESS_KEY_ID");
  if (c.secret.empty()) c.secret = env("AWS_SECRET_ACCESS_KEY");
  return c;
}

}  // namespace nonstop::tier
