// The upload bandwidth limit (pacer.h) on a clock of its own: the time a
// stream takes is its bytes over the limit, in naps of at most 50 ms; no
// limit never sleeps; an abort stops it at once, with or without a limit.
#include "tier/pacer.h"

#include <gtest/gtest.h>

#include <vector>

namespace nonstop::tier {
namespace {

struct FakeTime {
  double now = 100.0;
  std::vector<double> naps;
  Pacer Make(double bps) {
    return Pacer(
        bps, [this] { return now; },
        [this](double s) {
          naps.push_back(s);
          now += s;
        });
  }
};

TEST(PacerTest, KeepsToTheLimitInShortNaps) {
  FakeTime t;
  Pacer p = t.Make(1000.0);
  ASSERT_TRUE(p.Wait(500, nullptr).ok());
  EXPECT_NEAR(t.now, 100.5, 1e-9);  // 500 bytes at 1000 B/s
  for (double nap : t.naps) EXPECT_LE(nap, 0.05 + 1e-12);
  EXPECT_GE(t.naps.size(), 10u);
  t.now += 2.0;  // time passed elsewhere (the read): 1500 bytes are not ahead at 102.5
  const size_t before = t.naps.size();
  ASSERT_TRUE(p.Wait(1500, nullptr).ok());
  EXPECT_EQ(t.naps.size(), before);
  ASSERT_TRUE(p.Wait(3000, nullptr).ok());
  EXPECT_NEAR(t.now, 103.0, 1e-9);
}

TEST(PacerTest, NoLimitNeverSleeps) {
  FakeTime t;
  Pacer p = t.Make(0);
  ASSERT_TRUE(p.Wait(uint64_t{1} << 40, nullptr).ok());
  EXPECT_TRUE(t.naps.empty());
}

TEST(PacerTest, AnAbortStopsItAtOnce) {
  FakeTime t;
  Pacer p = t.Make(10.0);
  int asked = 0;
  Status s = p.Wait(1000, [&] { return ++asked > 3; });  // 100 s of pace; aborted after 3 naps
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(s.message(), "upload aborted (close_timeout_s passed)");
  EXPECT_EQ(t.naps.size(), 3u);
  Pacer unlimited = t.Make(0);
  EXPECT_EQ(unlimited.Wait(1, [] { return true; }).code(), StatusCode::kAborted);
}

}  // namespace
}  // namespace nonstop::tier
