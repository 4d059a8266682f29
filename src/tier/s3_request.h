// What the remote tier's object store transport decides besides the bytes
// (python/nonstop/_remote.py ObjectStore hands obstore the bytes): the one
// line a failed store call is reported with and its kind, a client option's
// duration, and the S3 CreateBucket request obstore has no call for (path
// style, signed with AWS Signature V4) with the meaning of its answer.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::tier {

// A failed store call: kind is one of bucket_missing, access_denied,
// no_credentials (waiting will not help: the advice says what to fix),
// unreachable, other; `line` the one line to report (never the raw
// response, never the cloud metadata address a client tried for
// credentials). `denied`/`unauthenticated`: the client's exception class
// said so.
struct StoreFailure {
  std::string kind;
  std::string line;
};
StoreFailure ClassifyStoreFailure(std::string_view text, bool denied, bool unauthenticated);

// A client option's duration ("5s", "500ms", "2min", or a number) in
// seconds; 60 when it does not parse.
double DurationSeconds(std::string_view v);

struct CreateBucket {
  std::string url;   // the PUT's URL (path style)
  std::string body;  // empty in us-east-1, else the LocationConstraint document
  std::vector<std::pair<std::string, std::string>> headers;  // Authorization included; not Host
  std::string what;  // "URL: creating bucket 'B'", for messages
  std::string base;  // the endpoint
};
// The signed CreateBucket of `bucket` (endpoint: "" for AWS's of `region`);
// amz_date "YYYYMMDDTHHMMSSZ" (empty: now). IOError (one line) without
// key or secret.
Result<CreateBucket> SignCreateBucket(const std::string& prefix_url, const std::string& endpoint,
                                      const std::string& bucket, const std::string& region,
                                      const std::string& key, const std::string& secret,
                                      const std::string& token, std::string amz_date);
// The HTTP error answer (code, the start of its body) of a CreateBucket:
// false when the bucket was there already (owned by these credentials),
// else IOError with one line.
Result<bool> CreateBucketAnswer(const std::string& what, int code, std::string_view body);

// The remote_options that are the tier's own (the uploader's, the tier's,
// the transport's part size and concurrency): never handed to the client.
inline constexpr std::string_view kTierOptions[] = {
    "max_to_keep", "bandwidth_bps", "close_timeout_s", "poll_s",      "commit_timeout_s",
    "retry_max_s", "nice",          "job",             "adopt",       "every",
    "create_bucket", "note_manifest", "max_concurrency", "part_bytes"};

// remote_options of an object store URL sorted out for its client
// (docs/TIERS.md "Object stores"): where each option goes, and for an
// s3:// URL what the client and CreateBucket are given.
struct StoreOptions {
  // Each key given, in order, and the store keyword it becomes: "" when it
  // is not the store's (the tier's own, or read here), else its obstore name
  // (key -> access_key_id, secret -> secret_access_key, token ->
  // session_token, the rest as given).
  std::vector<std::pair<std::string, std::string>> route;
  bool s3 = false;             // an s3:// URL: the fields below are set
  std::string bucket, prefix;  // s3://bucket/prefix ("" no prefix)
  std::string endpoint;        // endpoint, else endpoint_url, else client_kwargs'; "" AWS's
  bool allow_http = false;     // an http:// endpoint
  std::string timeout = "60s", connect_timeout = "5s";  // the client's
  double request_timeout_s = 65;  // connect_timeout + timeout (CreateBucket's request)
};
// `keys` the options given; `text` the values of those read here that are
// set (endpoint, endpoint_url, "client_kwargs.endpoint_url", timeout,
// connect_timeout, key, secret, token, region), as text.
StoreOptions SortStoreOptions(const std::string& url, const std::vector<std::string>& keys,
                              const std::map<std::string, std::string>& text);

// S3 credentials for CreateBucket: those given, else the environment's
// (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN unless a key
// was given; the region AWS_REGION, AWS_DEFAULT_REGION, else us-east-1).
struct S3Credentials {
  std::string key, secret, token, region;
};
S3Credentials WithEnvironmentCredentials(S3Credentials given);

}  // namespace nonstop::tier
