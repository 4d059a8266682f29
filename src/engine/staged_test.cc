// Staged tensors (TensorRef::staged): memory that already is a tensor's
// staging (the multi-step schedule's host buffers) is written to the medium
// as it is by a layer-wise checkpoint, through the one write path and the
// committer, with no copy and without growing the staging pool.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/counting_copy_engine.h"
#include "engine/engine_internal.h"
#include "nonstop/copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;


// A host buffer laid out as staging: 4 KiB-aligned, zero to the next 4 KiB.
struct StagedBuffer {
  explicit StagedBuffer(size_t n) : numel(n), bytes((n * 4 + kStoreAlign - 1) / kStoreAlign * kStoreAlign) {
    void* p = nullptr;
    EXPECT_EQ(posix_memalign(&p, kStoreAlign, bytes), 0);
    data = static_cast<float*>(p);
    std::memset(p, 0, bytes);
  }
  ~StagedBuffer() { free(data); }
  StagedBuffer(const StagedBuffer&) = delete;
  StagedBuffer& operator=(const StagedBuffer&) = delete;
  void Fill(float base) {
    for (size_t i = 0; i < numel; ++i) data[i] = base + static_cast<float>(i % 977);
  }
  TensorRef Ref(const std::string& name, bool staged = true) const {
    TensorRef r;
    r.spec.name = name;
    r.spec.dtype = DType::kFloat32;
    r.spec.shape = {static_cast<int64_t>(numel)};
    r.spec.nbytes = numel * 4;
    r.data = data;
    r.staged = staged;
    return r;
  }
  size_t numel, bytes;
  float* data = nullptr;
};

class StagedTest : public ::testing::TestWithParam<MediumKind> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nonstop_staged_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  EngineOptions Options() const {
    EngineOptions o;
    o.dir = dir_.string();
    o.medium = GetParam();
    o.chunk_bytes = 64 << 10;
    o.max_in_flight = 1;
    o.memory_tier = "disk";
    return o;
  }
  fs::path dir_;
};

TEST_P(StagedTest, StagedTensorsAreWrittenFromTheirMemoryWithoutACopyOrStaging) {
  auto copied = std::make_shared<std::atomic<uint64_t>>(0);
  EngineMedia media;
  media.copy = [copied](int threads) -> std::unique_ptr<CopyEngine> {
    return std::make_unique<CountingCopyEngine>(threads, copied);
  };
  // Two large tensors (one not a multiple of 4 KiB: its unit ends in
  // padding read from the buffer) and a small one (packed into the small region).
  StagedBuffer a(70001), b(50000), c(100);
  const uint64_t state_bytes = a.bytes + b.bytes + c.bytes;
  {
    auto engine = OpenEngine(Options(), media);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->Register({a.Ref("a"), b.Ref("b"), c.Ref("c")}).ok());
    // The pool is not sized for the state: only its smallest size is kept.
    EXPECT_LT((*engine)->Stats().staging_bytes, state_bytes);
    for (int64_t step : {3, 8}) {
      a.Fill(static_cast<float>(step));
      b.Fill(static_cast<float>(2 * step));
      c.Fill(static_cast<float>(3 * step));
      auto counter = (*engine)->BeginCheckpoint(step);
      ASSERT_TRUE(counter.ok()) << counter.status().ToString();
      ASSERT_TRUE((*engine)->EndCheckpoint(*counter, step, "{}").ok());
      ASSERT_TRUE((*engine)->WaitCopied().ok());
      ASSERT_TRUE((*engine)->WaitCommitted(*counter).ok());
    }
    EXPECT_EQ(copied->load(), 0u) << "staged bytes went through the copy engine";
    EXPECT_EQ((*engine)->Stats().committed, 2u);
    ASSERT_TRUE((*engine)->Close().ok());
  }
  // Read back (into plain, unstaged buffers) and compare: the newest is step 8.
  StagedBuffer ra(70001), rb(50000), rc(100);
  auto reader = Engine::Open(Options());
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE((*reader)->Register({ra.Ref("a", false), rb.Ref("b", false), rc.Ref("c", false)}).ok());
  auto info = (*reader)->Restore(std::nullopt);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->step, 8);
  EXPECT_EQ(std::memcmp(ra.data, a.data, a.numel * 4), 0);
  EXPECT_EQ(std::memcmp(rb.data, b.data, b.numel * 4), 0);
  EXPECT_EQ(std::memcmp(rc.data, c.data, c.numel * 4), 0);
  ASSERT_TRUE((*reader)->Close().ok());
}

TEST_P(StagedTest, StagedMemoryMustBeHostAlignedAndNotCopiedAtCheckpoint) {
  auto engine = Engine::Open(Options());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  StagedBuffer a(70000);
  TensorRef misaligned = a.Ref("a");
  misaligned.data = a.data + 1;
  misaligned.spec.nbytes -= 4;
  misaligned.spec.shape = {69999};
  Status s = (*engine)->Register({misaligned});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  TensorRef device = a.Ref("a");
  device.device.kind = DeviceKind::kCuda;
  s = (*engine)->Register({device});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  TensorRef at_checkpoint = a.Ref("a");
  at_checkpoint.copy_at_checkpoint = true;
  s = (*engine)->Register({at_checkpoint});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  ASSERT_TRUE((*engine)->Close().ok());
}

// Buffered (pwrite) and O_DIRECT, whose writes must be aligned in memory too.
INSTANTIATE_TEST_SUITE_P(Media, StagedTest,
                         ::testing::Values(MediumKind::kBuffered, MediumKind::kDirect));

}  // namespace
}  // namespace nonstop
