#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

TEST(HostCopyEngineTest, CopiesBytesOnBackgroundThreads) {
  auto engine = MakeHostCopyEngine(2);
  std::vector<uint8_t> src(1 << 20);
  std::iota(src.begin(), src.end(), 0);
  std::vector<std::vector<uint8_t>> dst(16, std::vector<uint8_t>(src.size()));
  std::vector<std::unique_ptr<CopyCompletion>> done;
  for (auto& d : dst) done.push_back(engine->Copy(src.data(), Device{}, d.data(), src.size()));
  for (auto& c : done) ASSERT_TRUE(c->Wait().ok());
  for (auto& d : dst) {
    EXPECT_TRUE(done.back()->Ready());
    EXPECT_EQ(0, std::memcmp(d.data(), src.data(), src.size()));
  }
}

TEST(HostCopyEngineTest, InlineEngineIsReadyOnReturn) {
  auto engine = MakeHostCopyEngine(0);
  uint64_t a = 42, b = 0;
  auto c = engine->Copy(&a, Device{}, &b, sizeof a);
  EXPECT_TRUE(c->Ready());
  EXPECT_TRUE(c->Wait().ok());
  EXPECT_EQ(b, 42u);
}

TEST(HostCopyEngineTest, DeviceSourceFailsClearly) {
  auto engine = MakeHostCopyEngine(1);
  uint64_t a = 1, b = 0;
  auto c = engine->Copy(&a, Device{DeviceKind::kCuda, 0, 0}, &b, sizeof a);
  Status st = c->Wait();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_EQ(b, 0u);
}

// The capability queries the engine asks instead of testing the type: the
// host engine pins nothing through a driver, keeps nothing in device memory
// and orders no device stream; its device-snapshot calls fail in one line.
TEST(HostCopyEngineTest, CapabilitiesAreThoseOfAHostEngine) {
  auto engine = MakeHostCopyEngine(1);
  EXPECT_FALSE(engine->PinsHostMemory());
  EXPECT_FALSE(engine->CanSnapshotOnDevice());
  EXPECT_FALSE(engine->CanOrderStreams(Device{DeviceKind::kCuda, 0, 0}));
  EXPECT_EQ(engine->AllocDevice(0, 64), nullptr);
  uint64_t a = 1, b = 0;
  auto snap = engine->SnapshotToDevice(&a, Device{DeviceKind::kCuda, 0, 0}, &b, sizeof a);
  EXPECT_TRUE(snap->Ready());
  Status st = snap->Wait();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("copy='device'"), std::string::npos) << st.ToString();
  EXPECT_EQ(engine->DrainToHost(&a, 0, &b, sizeof a)->Wait().code(), StatusCode::kUnavailable);
  EXPECT_EQ(b, 0u);
  auto done = MakeDoneCopy(Status::IOError("x"));
  EXPECT_TRUE(done->Ready());
  EXPECT_EQ(done->Wait().code(), StatusCode::kIOError);
}

TEST(HostCopyEngineTest, AllocHostIsAlignedAndWritable) {
  auto engine = MakeHostCopyEngine(1);
  bool pinned = true;
  const size_t n = 8 << 20;
  void* p = engine->AllocHost(n, &pinned);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
  std::memset(p, 7, n);
  engine->FreeHost(p, n);
  EXPECT_NE(engine->Describe().find("host memcpy"), std::string::npos);
}

TEST(HostCopyEngineTest, DestructorCompletesQueuedCopies) {
  std::vector<uint8_t> src(4 << 20, 3), dst(4 << 20, 0);
  std::unique_ptr<CopyCompletion> c;
  {
    auto engine = MakeHostCopyEngine(1);
    c = engine->Copy(src.data(), Device{}, dst.data(), src.size());
  }
  EXPECT_TRUE(c->Ready());
  EXPECT_EQ(dst[dst.size() - 1], 3);
}

}  // namespace
}  // namespace nonstop
