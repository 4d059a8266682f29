// SlotFile::Create writes zeros over the slots of a file in the page cache
// (the unwritten-extent guard, slot_file.cc WriteExtents), but not over a
// file in memory (tmpfs: /dev/shm), where they are pure cost: counted here
// by the bytes written through the medium the Env opened.
#include <gtest/gtest.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include "media/medium_wrapper.h"
#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;

// Forwards to the medium the Env opened, counting the bytes written.
class CountingMedium final : public media::MediumWrapper {
 public:
  CountingMedium(std::unique_ptr<Medium> inner, std::shared_ptr<std::atomic<uint64_t>> written)
      : MediumWrapper(std::move(inner)), written_(std::move(written)) {}
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    *written_ += n;
    return MediumWrapper::Write(offset, buf, n);
  }

 private:
  std::shared_ptr<std::atomic<uint64_t>> written_;
};

bool IsTmpfs(const std::string& path) {
  struct statfs sf;
  return ::statfs(path.c_str(), &sf) == 0 && sf.f_type == TMPFS_MAGIC;
}

constexpr uint64_t kSlotBytes = 8ull << 20;

// Creates a 2-slot file in `root` with `kind`; returns the bytes written.
uint64_t CreateAndCount(const std::string& root, MediumKind kind, bool* in_memory) {
  const std::string dir = root + "/nonstop-slotzero-" + std::to_string(::getpid());
  fs::remove_all(dir);
  auto d = DefaultEnv()->OpenDirectory(dir, true);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  auto m = (*d)->CreateFile("rank-00000.nsck", kind, MediumOptions{});
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  *in_memory = (*m)->InMemory();
  auto written = std::make_shared<std::atomic<uint64_t>>(0);
  StoreGeometry g;
  g.slots = 2;
  g.slot_bytes = kSlotBytes;
  auto f = SlotFile::Create(std::make_unique<CountingMedium>(std::move(m).value(), written), g);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  // The file is whole and readable as an empty slot file either way.
  if (f.ok()) {
    auto scan = (*f)->Scan();
    EXPECT_TRUE(scan.ok());
    if (scan.ok()) {
      EXPECT_TRUE(scan->checkpoints.empty());
    }
  }
  f = Status::Internal("closed");
  fs::remove_all(dir);
  return written->load();
}

TEST(SlotZeroTest, TmpfsFileIsNotZeroFilled) {
  if (!IsTmpfs("/dev/shm")) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  for (MediumKind kind : {MediumKind::kBuffered, MediumKind::kMmap}) {
    bool in_memory = false;
    const uint64_t written = CreateAndCount("/dev/shm", kind, &in_memory);
    EXPECT_TRUE(in_memory) << MediumKindName(kind);
    // the header, its copy and the ring only
    EXPECT_LT(written, 1u << 20) << MediumKindName(kind);
  }
}

TEST(SlotZeroTest, DiskFileIsStillZeroFilled) {
  const std::string tmp = fs::temp_directory_path().string();
  if (IsTmpfs(tmp)) GTEST_SKIP() << tmp << " is tmpfs here";
  bool in_memory = true;
  const uint64_t written = CreateAndCount(tmp, MediumKind::kBuffered, &in_memory);
  EXPECT_FALSE(in_memory);
  EXPECT_GE(written, 2 * kSlotBytes);  // every slot byte written once
}

}  // namespace
}  // namespace nonstop
