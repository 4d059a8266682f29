// The object store transport's decisions (tier/s3_request.h): a failed
// call's kind and line, a duration option, and the CreateBucket request:
// its AWS Signature V4 equals the one Python's hashlib/hmac computed for
// the same inputs (the values below), and its answers' meaning.
#include "tier/s3_request.h"

#include <gtest/gtest.h>

#include <string>

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

}  // namespace
}  // namespace nonstop::tier
