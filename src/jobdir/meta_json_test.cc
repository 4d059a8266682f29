// CheckMetaJson (records.h): a checkpoint's metadata document, hostile
// bytes, checked before the Python front end parses it.
#include <gtest/gtest.h>

#include <string>

#include "jobdir/records.h"
#include "store/format.h"

namespace nonstop::jobdir_internal {
namespace {

std::string Why(const std::string& text) {
  Status s = CheckMetaJson(text);
  EXPECT_TRUE(s.ok() || s.code() == StatusCode::kCorruption) << s.ToString();
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
  return s.message();
}

TEST(MetaJsonTest, AcceptsWhatPythonsJsonWrites) {
  EXPECT_EQ(Why("{\"step\":3,\"state\":{\"a\":[1,-2.5e-3,\"x\\u00e9\\ud83d\\ude00\",true,false,"
                "null,{}],\"\xc3\xa9\":0}}"),
            "");
  EXPECT_EQ(Why(" [0, -0, 0.5, 1E+2, 12e-1] "), "");
  EXPECT_EQ(Why("\"\\ud800\""), "");  // a lone surrogate escape: Python's json reads it
  // Python ints of any size (up to int()'s 4300 digits).
  EXPECT_EQ(Why("[" + std::string(4300, '7') + "]"), "");
  EXPECT_NE(Why("[" + std::string(4301, '7') + "]").find("bad number"), std::string::npos);
  // A value that starts with no JSON value's character is named so, not a number.
  EXPECT_NE(Why("{\"a\":\xc3\xbf}").find("unexpected character at byte 5"), std::string::npos)
      << Why("{\"a\":\xc3\xbf}");
  EXPECT_NE(Why("[01]").find("bad number"), std::string::npos);
}

TEST(MetaJsonTest, RefusesDeepNestingAndBadJsonWithOneLine) {
  // 200 levels of arrays and objects: fine; 201 (even empty): refused.
  EXPECT_EQ(Why(std::string(200, '[') + "1" + std::string(200, ']')), "");
  EXPECT_NE(Why(std::string(201, '[') + std::string(201, ']')).find("nested too deep"),
            std::string::npos);
  std::string deep;
  for (int i = 0; i < 201; ++i) deep += "{\"k\":";
  deep += "1" + std::string(201, '}');
  EXPECT_NE(Why(deep).find("nested too deep"), std::string::npos);
  // Brackets inside strings do not nest.
  EXPECT_EQ(Why("[\"" + std::string(5000, '[') + "\"]"), "");
  // A million unclosed brackets: refused at depth 201, nothing built.
  EXPECT_NE(Why(std::string(1 << 20, '[')).find("nested too deep"), std::string::npos);
  for (const char* bad : {"", "[1,]", "{\"a\" 1}", "{1:2}", "[01]", "[1.]", "[.5]", "[+1]",
                          "[1e]", "[-]", "[NaN]", "[Infinity]", "[1] x", "\"a\x01\"", "\"\\x\"",
                          "\"\\u12\"", "\"abc", "tru", "[1 2]"}) {
    const std::string why = Why(bad);
    EXPECT_EQ(why.rfind("metadata: not valid JSON (", 0), 0u) << bad << ": " << why;
  }
  EXPECT_EQ(Why("\"\xff\""), "metadata is not valid UTF-8");
  EXPECT_EQ(Why("\"\xed\xa0\x80\""), "metadata is not valid UTF-8");  // a surrogate's bytes
  EXPECT_EQ(Why("\"\xc0\xaf\""), "metadata is not valid UTF-8");      // overlong
}

TEST(MetaJsonTest, RefusesMoreThanTheFormatsLimit) {
  std::string big = "\"" + std::string(format::kMaxMetaBytes - 1, 'a') + "\"";
  EXPECT_NE(Why(big).find("more than the limit of 67108864"), std::string::npos);
  big.resize(format::kMaxMetaBytes - 1);
  big.back() = '"';
  EXPECT_EQ(Why(big), "");
}

}  // namespace
}  // namespace nonstop::jobdir_internal
