// MakeBestCopyEngine's choice, and the CUDA engine where a device is usable.
// On a machine without a GPU (CI) the device tests skip and the fallback
// tests check that a CUDA build still works, with host copies.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#ifdef NONSTOP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "copy/cuda_copy_engine.h"
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

bool HaveDevice() { return CudaDeviceCount(nullptr) > 0; }

TEST(CudaSelectTest, BuiltWithCudaMatchesTheBuild) {
#ifdef NONSTOP_HAVE_CUDA
  EXPECT_TRUE(BuiltWithCuda());
#else
  EXPECT_FALSE(BuiltWithCuda());
#endif
}

TEST(CudaSelectTest, NoDeviceFallsBackToHostCopiesWithANote) {
  std::string error;
  if (CudaDeviceCount(&error) > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(error.empty());
  std::string note;
  std::unique_ptr<CopyEngine> engine = MakeBestCopyEngine(2, &note);
  ASSERT_NE(engine, nullptr);
  EXPECT_NE(note.find("using host copies"), std::string::npos) << note;
  if (BuiltWithCuda()) {
    EXPECT_NE(note.find("built with CUDA but no usable device: cudaGetDeviceCount: "),
              std::string::npos)
        << note;
  } else {
    EXPECT_NE(note.find("built without CUDA"), std::string::npos) << note;
  }

  // The fallback engine works: host-to-host copies through its own memory.
  constexpr size_t kBytes = 1 << 20;
  // `pinned` here means mlock'ed, which depends on RLIMIT_MEMLOCK: not checked.
  bool pinned = false;
  auto* dst = static_cast<uint8_t*>(engine->AllocHost(kBytes, &pinned));
  ASSERT_NE(dst, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(dst) % 4096, 0u);
  std::vector<uint8_t> src(kBytes);
  std::iota(src.begin(), src.end(), 0);
  auto done = engine->Copy(src.data(), Device{}, dst, kBytes);
  ASSERT_TRUE(done->Wait().ok());
  EXPECT_TRUE(done->Ready());
  EXPECT_EQ(std::memcmp(src.data(), dst, kBytes), 0);
  engine->FreeHost(dst, kBytes);
}

TEST(CudaSelectTest, CudaEngineIsUnavailableWithoutADevice) {
  if (HaveDevice()) GTEST_SKIP() << "a CUDA device is present";
  auto engine = MakeCudaCopyEngine(CudaCopyOptions{}, nullptr);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(engine.status().message().empty());
}

#ifdef NONSTOP_HAVE_CUDA
TEST(CudaSelectTest, DeviceRoundTrip) {
  if (!HaveDevice()) GTEST_SKIP() << "no usable CUDA device; tests/gpu covers the device path";
  std::string note;
  auto engine = MakeBestCopyEngine(2, &note);
  ASSERT_NE(note.find("cuda copy engine"), std::string::npos) << note;
  auto* cuda = dynamic_cast<CudaCopyEngine*>(engine.get());
  ASSERT_NE(cuda, nullptr);
  constexpr size_t kBytes = (3 << 20) + 5;
  std::vector<uint8_t> src(kBytes);
  std::iota(src.begin(), src.end(), 7);
  void* dev = cuda->AllocDevice(0, kBytes);
  ASSERT_NE(dev, nullptr);
  ASSERT_EQ(cudaMemcpy(dev, src.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  bool pinned = false;
  auto* host = static_cast<uint8_t*>(engine->AllocHost(kBytes, &pinned));
  ASSERT_NE(host, nullptr);
  EXPECT_TRUE(pinned);
  auto done = engine->Copy(dev, Device{DeviceKind::kCuda, 0, 0}, host, kBytes);
  ASSERT_TRUE(done->Wait().ok());
  EXPECT_EQ(std::memcmp(src.data(), host, kBytes), 0);
  engine->FreeHost(host, kBytes);
  cuda->FreeDevice(0, dev);
}
#endif

}  // namespace
}  // namespace nonstop
