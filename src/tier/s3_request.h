// What the remote tier's object store transport decides besides the bytes
// (python/nonstop/_remote.py ObjectStore hands obstore the bytes): the one
// line a failed store call is reported with and its kind, a client option's
// duration, and the S3 CreateBucket request obstore has no call for (path
// style, signed with AWS Signature V4) with the meaning of its answer.
#pragma once

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

}  // namespace nonstop::tier
