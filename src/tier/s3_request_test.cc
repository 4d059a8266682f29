// The object store transport's decisions (tier/s3_request.h): a failed
// call's kind and line, a duration option, and the CreateBucket request:
// its AWS Signature V4 equals the one Python's hashlib/hmac computed for
// the same inputs (the values below), and its answers' meaning.
#include "tier/s3_request.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace nonstop::tier {
namespace {

std::string Header(const CreateBucket& r, const std::string& name) {
  for (const auto& [k, v] : r.headers) {
    if (k == name) return v;
  }
  return "";
}

TEST(S3Request, SignsCreateBucketAsSignatureV4) {
  auto r = SignCreateBucket("s3://ckpt/job", "http://127.0.0.1:8333/", "ckpt", "us-east-1", "AKID",
                            "SECRET", "", "20260101T120000Z");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r.value().url, "http://127.0.0.1:8333/ckpt");
  EXPECT_EQ(r.value().body, "");
  EXPECT_EQ(Header(r.value(), "Authorization"),
            "AWS4-HMAC-SHA256 Credential=AKID/20260101/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-content-sha256;x-amz-date, "
            "Signature=a7101d23330a01d08a71d3046f5c08de58e0a006d41103b245178cc7fafd997d");
  EXPECT_EQ(Header(r.value(), "host"), "");  // the HTTP client sends Host itself
  auto t = SignCreateBucket("s3://my-bucket", "", "my-bucket", "eu-west-1", "AKID2", "s3cr3t",
                            "TOKEN", "20261129T044500Z");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t.value().url, "https://s3.eu-west-1.amazonaws.com/my-bucket");
  EXPECT_NE(t.value().body.find("<LocationConstraint>eu-west-1</LocationConstraint>"),
            std::string::npos);
  EXPECT_EQ(Header(t.value(), "x-amz-security-token"), "TOKEN");
  EXPECT_EQ(Header(t.value(), "Authorization"),
            "AWS4-HMAC-SHA256 Credential=AKID2/20261129/eu-west-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-security-token, "
            "Signature=85cdf1bd703bd826573fb5a8601d15ac25fd391d59c219065f4e28d49da7d060");
  EXPECT_EQ(SignCreateBucket("s3://b", "", "b", "us-east-1", "", "x", "", "").status().code(),
            StatusCode::kIOError);
  EXPECT_EQ(SignCreateBucket("s3://b", "", "b", "us-east-1", "k", "x", "", "").value().url,
            "https://s3.us-east-1.amazonaws.com/b");
}

TEST(S3Request, CreateBucketAnswers) {
  EXPECT_FALSE(CreateBucketAnswer("w", 409, "<Code>BucketAlreadyOwnedByYou</Code>").value());
  EXPECT_NE(CreateBucketAnswer("w", 409, "").status().message().find("the name is taken"),
            std::string::npos);
  EXPECT_NE(CreateBucketAnswer("w", 403, "").status().message().find("access denied"),
            std::string::npos);
  EXPECT_EQ(CreateBucketAnswer("w", 500, "<Error><Code>InternalError</Code>").status().message(),
            "w: HTTP 500 InternalError");
}

TEST(S3Request, ClassifiesFailuresInOneLine) {
  EXPECT_EQ(ClassifyStoreFailure("GET http://169.254.169.254/latest/api/token failed", false,
                                 false).kind, "no_credentials");
  EXPECT_EQ(ClassifyStoreFailure("x", false, true).kind, "no_credentials");
  EXPECT_EQ(ClassifyStoreFailure("Client error 403 Forbidden: <AccessDenied>", false, false).kind,
            "access_denied");
  EXPECT_EQ(ClassifyStoreFailure("x", true, false).kind, "access_denied");
  EXPECT_EQ(ClassifyStoreFailure("<Code>NoSuchBucket</Code>", false, false).kind, "bucket_missing");
  EXPECT_EQ(ClassifyStoreFailure("Error performing PUT: 404 Not Found", false, false).kind,
            "bucket_missing");
  EXPECT_EQ(ClassifyStoreFailure("Error performing GET: 404 Not Found", false, false).kind, "other");
  StoreFailure u = ClassifyStoreFailure(
      "error sending request for url (http://127.0.0.1:9/b/x)\nConnection refused", false, false);
  EXPECT_EQ(u.kind, "unreachable");
  EXPECT_EQ(u.line, "the store is unreachable (http://127.0.0.1:9): no answer after the client's "
                    "retries");
  EXPECT_EQ(ClassifyStoreFailure("  first line  \nsecond", false, false).line, "first line");
}

TEST(S3Request, DurationOptions) {
  EXPECT_DOUBLE_EQ(DurationSeconds("5s"), 5.0);
  EXPECT_DOUBLE_EQ(DurationSeconds("500ms"), 0.5);
  EXPECT_DOUBLE_EQ(DurationSeconds("2min"), 120.0);
  EXPECT_DOUBLE_EQ(DurationSeconds(" 3 "), 3.0);
  EXPECT_DOUBLE_EQ(DurationSeconds("soon"), 60.0);
}

std::string RouteOf(const StoreOptions& o, const std::string& key) {
  for (const auto& [k, to] : o.route) {
    if (k == key) return to;
  }
  return "(not given)";
}

TEST(StoreOptionsTest, TheTiersOwnNeverReachTheClientAndS3KeysAreRenamed) {
  const std::vector<std::string> keys = {"max_to_keep", "job",     "part_bytes", "key",
                                         "secret",      "token",   "region",     "endpoint",
                                         "timeout",     "virtual_hosted_style_request"};
  StoreOptions o = SortStoreOptions(
      "s3://bucket/a/b/", keys,
      {{"key", "K"}, {"secret", "S"}, {"region", "eu"}, {"endpoint", "http://h:1"},
       {"timeout", "30s"}, {"virtual_hosted_style_request", "False"}});
  ASSERT_TRUE(o.s3);
  EXPECT_EQ(o.bucket, "bucket");
  EXPECT_EQ(o.prefix, "a/b");
  EXPECT_EQ(RouteOf(o, "max_to_keep"), "");
  EXPECT_EQ(RouteOf(o, "job"), "");
  EXPECT_EQ(RouteOf(o, "part_bytes"), "");
  EXPECT_EQ(RouteOf(o, "key"), "access_key_id");
  EXPECT_EQ(RouteOf(o, "secret"), "secret_access_key");
  EXPECT_EQ(RouteOf(o, "token"), "");  // given as None: not the client's
  EXPECT_EQ(RouteOf(o, "region"), "region");
  EXPECT_EQ(RouteOf(o, "endpoint"), "");  // read here: the store's endpoint keyword
  EXPECT_EQ(RouteOf(o, "timeout"), "");   // a client option
  EXPECT_EQ(RouteOf(o, "virtual_hosted_style_request"), "virtual_hosted_style_request");
  EXPECT_EQ(o.endpoint, "http://h:1");
  EXPECT_TRUE(o.allow_http);
  EXPECT_EQ(o.timeout, "30s");
  EXPECT_EQ(o.connect_timeout, "5s");
  EXPECT_DOUBLE_EQ(o.request_timeout_s, 35.0);
  // The endpoint: endpoint, else endpoint_url, else client_kwargs'.
  o = SortStoreOptions("s3://b", {"endpoint_url", "client_kwargs"},
                       {{"endpoint_url", "https://e"}, {"client_kwargs.endpoint_url", "http://c"}});
  EXPECT_EQ(o.endpoint, "https://e");
  EXPECT_FALSE(o.allow_http);
  EXPECT_EQ(o.prefix, "");
  EXPECT_EQ(RouteOf(o, "client_kwargs"), "");
  o = SortStoreOptions("s3://b/", {"client_kwargs"}, {{"client_kwargs.endpoint_url", "http://c"}});
  EXPECT_EQ(o.endpoint, "http://c");
  EXPECT_TRUE(o.allow_http);
  EXPECT_DOUBLE_EQ(o.request_timeout_s, 65.0);
  // Another scheme: the tier's own dropped, everything else the store's as given.
  o = SortStoreOptions("gs://b/p", {"every", "key", "endpoint"}, {{"key", "K"}});
  EXPECT_FALSE(o.s3);
  EXPECT_EQ(RouteOf(o, "every"), "");
  EXPECT_EQ(RouteOf(o, "key"), "key");
  EXPECT_EQ(RouteOf(o, "endpoint"), "endpoint");
}

TEST(StoreOptionsTest, CredentialsNotGivenAreTheEnvironments) {
  setenv("AWS_ACCESS_KEY_ID", "envkey", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "envsecret", 1);
  setenv("AWS_SESSION_TOKEN", "envtoken", 1);
  unsetenv("AWS_REGION");
  setenv("AWS_DEFAULT_REGION", "ap-1", 1);
  S3Credentials c = WithEnvironmentCredentials({});
  EXPECT_EQ(c.key, "envkey");
  EXPECT_EQ(c.secret, "envsecret");
  EXPECT_EQ(c.token, "envtoken");
  EXPECT_EQ(c.region, "ap-1");
  setenv("AWS_REGION", "eu-2", 1);
  // A key given: the environment's session token is not its.
  c = WithEnvironmentCredentials({"k", "", "", ""});
  EXPECT_EQ(c.key, "k");
  EXPECT_EQ(c.secret, "envsecret");
  EXPECT_EQ(c.token, "");
  EXPECT_EQ(c.region, "eu-2");
  c = WithEnvironmentCredentials({"k", "s", "t", "r"});
  EXPECT_EQ(c.token, "t");
  EXPECT_EQ(c.region, "r");
  for (const char* n : {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                        "AWS_REGION", "AWS_DEFAULT_REGION"}) {
    unsetenv(n);
  }
  c = WithEnvironmentCredentials({});
  EXPECT_EQ(c.key, "");
  EXPECT_EQ(c.region, "us-east-1");
}

}  // namespace
}  // namespace nonstop::tier
