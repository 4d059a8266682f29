#include "media/fault_medium.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace nonstop {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint8_t v) { return std::vector<uint8_t>(n, v); }

TEST(FaultDiskTest, WriteSyncReadAndCounters) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  EXPECT_EQ(m->kind(), MediumKind::kBuffered);
  EXPECT_EQ(m->Alignment(), 1u);
  EXPECT_NE(m->Describe().find("fault-injecting"), std::string::npos);
  ASSERT_TRUE(m->Resize(4096).ok());
  auto a = Bytes(100, 0xAA);
  ASSERT_TRUE(m->Write(10, a.data(), a.size()).ok());
  EXPECT_EQ(disk->writes(), 1u);
  EXPECT_EQ(disk->unsynced_ops(), 2u);  // the resize and the write
  std::vector<uint8_t> got(100);
  ASSERT_TRUE(m->Read(10, got.data(), got.size()).ok());
  EXPECT_EQ(got, a);
  EXPECT_EQ(disk->DurableSnapshot().size(), 0u);
  ASSERT_TRUE(m->Sync().ok());
  EXPECT_EQ(disk->syncs(), 1u);
  EXPECT_EQ(disk->unsynced_ops(), 0u);
  EXPECT_EQ(disk->DurableSnapshot(), disk->Snapshot());
  EXPECT_EQ(m->Size(), 4096u);
  EXPECT_EQ(m->Read(4000, got.data(), got.size()).code(), StatusCode::kCorruption);
  // Writing past the end grows the disk, as a file grows.
  ASSERT_TRUE(m->Write(5000, a.data(), a.size()).ok());
  EXPECT_EQ(m->Size(), 5100u);
}

TEST(FaultDiskTest, DropCrashKeepsExactlyTheSyncedImage) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  auto a = Bytes(2048, 1);
  auto b = Bytes(1000, 2);
  ASSERT_TRUE(m->Write(0, a.data(), a.size()).ok());
  ASSERT_TRUE(m->Sync().ok());
  const std::vector<uint8_t> synced = disk->Snapshot();
  ASSERT_TRUE(m->Write(700, b.data(), b.size()).ok());
  ASSERT_TRUE(m->Write(4000, b.data(), b.size()).ok());  // also grows the disk
  ASSERT_TRUE(m->Resize(100000).ok());
  disk->Crash(CrashMode::kDropUnsynced, 1);
  EXPECT_EQ(disk->Snapshot(), synced);
  EXPECT_EQ(disk->crashes(), 1u);

  // The medium from before the crash is dead on every call.
  std::vector<uint8_t> got(10);
  for (Status st : {m->Write(0, b.data(), 10), m->Read(0, got.data(), 10), m->Sync(),
                    m->Resize(10)}) {
    EXPECT_EQ(st.code(), StatusCode::kIOError);
    EXPECT_NE(st.message().find("device crashed"), std::string::npos) << st.message();
  }
  EXPECT_EQ(disk->Snapshot(), synced);

  auto after = disk->Open();
  EXPECT_EQ(after->Size(), synced.size());
  ASSERT_TRUE(after->Read(0, got.data(), 10).ok());
  EXPECT_EQ(got, Bytes(10, 1));
}

// Unsynced writes at unaligned offsets over a synced base, in disjoint places
// so each byte's origin is known. After a torn crash, every piece of a write
// that falls in one 512-byte device sector is either wholly new or wholly old.
TEST(FaultDiskTest, TornCrashKeepsOnlyWholeSectors) {
  constexpr size_t kDisk = 24 * 1024;
  constexpr int kWrites = 12;
  int kept = 0, lost = 0, torn = 0;
  for (uint64_t seed = 0; seed < 100; ++seed) {
    auto disk = FaultDisk::Create();
    auto m = disk->Open();
    std::vector<uint8_t> base(kDisk, 0);
    ASSERT_TRUE(m->Write(0, base.data(), base.size()).ok());
    ASSERT_TRUE(m->Sync().ok());

    std::mt19937_64 rng(seed * 7 + 1);
    struct W {
      uint64_t off;
      size_t len;
      uint8_t v;
    };
    std::vector<W> ws;
    const size_t slot = kDisk / kWrites;  // each write stays inside its own slot
    for (int i = 0; i < kWrites; ++i) {
      const uint64_t off = i * slot + rng() % 100;
      const size_t len = 1 + rng() % (slot - 100);
      const uint8_t v = static_cast<uint8_t>(i + 1);
      auto bytes = Bytes(len, v);
      ASSERT_TRUE(m->Write(off, bytes.data(), len).ok());
      ws.push_back({off, len, v});
    }
    disk->Crash(CrashMode::kTornUnsynced, seed);
    const std::vector<uint8_t> img = disk->Snapshot();
    ASSERT_EQ(img.size(), kDisk);

    std::vector<bool> covered(kDisk, false);
    for (const W& w : ws) {
      int new_pieces = 0, old_pieces = 0;
      for (uint64_t s = w.off; s < w.off + w.len;) {
        const uint64_t e = std::min<uint64_t>(w.off + w.len, (s / 512 + 1) * 512);
        const uint8_t first = img[s];
        ASSERT_TRUE(first == w.v || first == 0) << "seed " << seed;
        for (uint64_t i = s; i < e; ++i) {
          // A plain test first: per-byte gtest assertions are slow under TSan.
          if (img[i] != first) FAIL() << "partial sector at " << i << ", seed " << seed;
          covered[i] = true;
        }
        (first == w.v ? new_pieces : old_pieces)++;
        s = e;
      }
      if (old_pieces == 0) ++kept;
      else if (new_pieces == 0) ++lost;
      else ++torn;
    }
    // Bytes no unsynced write touched keep their synced value.
    for (size_t i = 0; i < kDisk; ++i) {
      if (!covered[i] && img[i] != 0) FAIL() << "synced byte " << i << " changed, seed " << seed;
    }
  }
  // All three outcomes happen.
  EXPECT_GT(kept, 0);
  EXPECT_GT(lost, 0);
  EXPECT_GT(torn, 0);
}

TEST(FaultDiskTest, TornCrashIsReproducibleBySeed) {
  auto run = [](uint64_t seed) {
    auto disk = FaultDisk::Create();
    auto m = disk->Open();
    for (int i = 0; i < 50; ++i) {
      auto b = Bytes(3000, static_cast<uint8_t>(i));
      EXPECT_TRUE(m->Write(i * 1111, b.data(), b.size()).ok());
      if (i == 20) {
        EXPECT_TRUE(m->Sync().ok());
      }
    }
    disk->Crash(CrashMode::kTornUnsynced, seed);
    return disk->Snapshot();
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(FaultDiskTest, SyncedDataSurvivesEveryCrash) {
  for (uint64_t seed = 0; seed < 50; ++seed) {
    auto disk = FaultDisk::Create();
    auto m = disk->Open();
    auto a = Bytes(10000, 7);
    ASSERT_TRUE(m->Write(0, a.data(), a.size()).ok());
    ASSERT_TRUE(m->Sync().ok());
    // Unsynced writes elsewhere and a shrink that may or may not survive.
    auto b = Bytes(5000, 9);
    ASSERT_TRUE(m->Write(20000, b.data(), b.size()).ok());
    disk->Crash(seed % 2 ? CrashMode::kTornUnsynced : CrashMode::kDropUnsynced, seed);
    std::vector<uint8_t> img = disk->Snapshot();
    ASSERT_GE(img.size(), 10000u);
    for (size_t i = 0; i < 10000; ++i) ASSERT_EQ(img[i], 7) << i;
  }
}

TEST(FaultDiskTest, InjectedErrorFailsTheNthCallOnly) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  auto a = Bytes(512, 1);
  auto b = Bytes(512, 2);
  ASSERT_TRUE(m->Write(0, a.data(), a.size()).ok());
  disk->InjectError(FaultOp::kWrite, 2, EIO);
  ASSERT_TRUE(m->Write(512, a.data(), a.size()).ok());  // call 1 from now
  const std::vector<uint8_t> before = disk->Snapshot();
  Status st = m->Write(0, b.data(), b.size());  // call 2: fails
  EXPECT_EQ(st.code(), StatusCode::kIOError);
  EXPECT_NE(st.message().find(std::strerror(EIO)), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("write at 0"), std::string::npos) << st.message();
  EXPECT_EQ(disk->Snapshot(), before);  // a failed write changes nothing
  ASSERT_TRUE(m->Write(0, b.data(), b.size()).ok());  // call 3: fine
  EXPECT_EQ(disk->writes(), 3u);
}

TEST(FaultDiskTest, PersistentErrorUntilCleared) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  auto a = Bytes(512, 1);
  disk->InjectErrorFrom(FaultOp::kWrite, 2, ENOSPC);
  ASSERT_TRUE(m->Write(0, a.data(), a.size()).ok());
  for (int i = 0; i < 5; ++i) {
    Status st = m->Write(512, a.data(), a.size());
    EXPECT_EQ(st.code(), StatusCode::kIOError);
    EXPECT_NE(st.message().find(std::strerror(ENOSPC)), std::string::npos);
  }
  EXPECT_EQ(disk->size(), 512u);
  ASSERT_TRUE(m->Sync().ok());  // other ops are unaffected
  disk->ClearErrors();
  ASSERT_TRUE(m->Write(512, a.data(), a.size()).ok());
}

TEST(FaultDiskTest, FailedSyncMakesNothingDurable) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  auto a = Bytes(512, 1);
  ASSERT_TRUE(m->Write(0, a.data(), a.size()).ok());
  disk->InjectError(FaultOp::kSync, 1, EIO);
  EXPECT_EQ(m->Sync().code(), StatusCode::kIOError);
  disk->Crash(CrashMode::kDropUnsynced, 0);
  EXPECT_TRUE(disk->Snapshot().empty());
}

TEST(FaultDiskTest, UnwrittenExtentsLoseARewriteOfAPageWhoseWritebackFailed) {
  // What ext4 did in issue 24: in a fallocated (unwritten) range, a page
  // whose failed sync dropped it goes stale; its rewrite syncs with OK but is
  // lost at a crash. Where a sync had written the page before, the rewrite
  // is durable; a crash empties the cache and the page works again.
  FaultDiskOptions o;
  o.forget_failed_syncs = true;
  o.unwritten_extents = true;
  auto disk = FaultDisk::Create(o);
  auto m = disk->Open();
  ASSERT_TRUE(m->Resize(4 * 4096).ok());
  auto zeros = Bytes(4096, 0);
  ASSERT_TRUE(m->Write(0, zeros.data(), zeros.size()).ok());  // page 0 written
  ASSERT_TRUE(m->Sync().ok());
  auto a = Bytes(2 * 4096, 0xA1);
  auto b = Bytes(2 * 4096, 0xB2);
  ASSERT_TRUE(m->Write(0, a.data(), a.size()).ok());  // pages 0 (written) and 1 (unwritten)
  disk->InjectError(FaultOp::kSync, 1, EIO);
  EXPECT_EQ(m->Sync().code(), StatusCode::kIOError);
  ASSERT_TRUE(m->Write(0, b.data(), b.size()).ok());
  ASSERT_TRUE(m->Sync().ok());  // as on Linux: 0
  EXPECT_EQ(disk->lost_writes(), 1u);
  std::vector<uint8_t> got(2 * 4096);
  ASSERT_TRUE(m->Read(0, got.data(), got.size()).ok());
  EXPECT_EQ(got, b);  // the cache shows it
  disk->Crash(CrashMode::kDropUnsynced, 1);
  auto after = disk->Open();
  ASSERT_TRUE(after->Read(0, got.data(), got.size()).ok());
  EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.begin() + 4096), Bytes(4096, 0xB2));
  EXPECT_EQ(std::vector<uint8_t>(got.begin() + 4096, got.end()), Bytes(4096, 0))
      << "the rewrite of the stale page survived the crash";
  // After the crash the page is unwritten, not stale: a synced write holds.
  ASSERT_TRUE(after->Write(4096, b.data(), 4096).ok());
  ASSERT_TRUE(after->Sync().ok());
  disk->Crash(CrashMode::kDropUnsynced, 2);
  auto third = disk->Open();
  ASSERT_TRUE(third->Read(0, got.data(), got.size()).ok());
  EXPECT_EQ(got, b);

  // Without the option a synced rewrite is durable either way.
  FaultDiskOptions plain;
  plain.forget_failed_syncs = true;
  auto d2 = FaultDisk::Create(plain);
  auto m2 = d2->Open();
  ASSERT_TRUE(m2->Resize(2 * 4096).ok());
  ASSERT_TRUE(m2->Write(0, a.data(), a.size()).ok());
  d2->InjectError(FaultOp::kSync, 1, EIO);
  EXPECT_FALSE(m2->Sync().ok());
  ASSERT_TRUE(m2->Write(0, b.data(), b.size()).ok());
  ASSERT_TRUE(m2->Sync().ok());
  d2->Crash(CrashMode::kDropUnsynced, 1);
  auto m3 = d2->Open();
  ASSERT_TRUE(m3->Read(0, got.data(), got.size()).ok());
  EXPECT_EQ(got, b);
}

TEST(FaultDiskTest, FailedResizeAndReadChangeNothing) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  ASSERT_TRUE(m->Resize(1024).ok());
  disk->InjectError(FaultOp::kResize, 1, ENOSPC);
  EXPECT_EQ(m->Resize(1 << 20).code(), StatusCode::kIOError);
  EXPECT_EQ(m->Size(), 1024u);
  disk->InjectError(FaultOp::kRead, 1, EIO);
  std::vector<uint8_t> got(16);
  EXPECT_EQ(m->Read(0, got.data(), got.size()).code(), StatusCode::kIOError);
  EXPECT_TRUE(m->Read(0, got.data(), got.size()).ok());
}

TEST(FaultDiskTest, CrashOnCallStopsTheRunAtThatPoint) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  auto a = Bytes(512, 1);
  ASSERT_TRUE(m->Write(0, a.data(), a.size()).ok());
  ASSERT_TRUE(m->Sync().ok());
  disk->CrashOnCall(FaultOp::kWrite, 3, CrashMode::kDropUnsynced, 0);
  auto b = Bytes(512, 2);
  ASSERT_TRUE(m->Write(512, b.data(), b.size()).ok());
  ASSERT_TRUE(m->Write(1024, b.data(), b.size()).ok());
  Status st = m->Write(1536, b.data(), b.size());
  EXPECT_NE(st.message().find("device crashed"), std::string::npos) << st.message();
  EXPECT_EQ(disk->crashes(), 1u);
  EXPECT_EQ(disk->Snapshot(), a);
  EXPECT_NE(m->Sync().message().find("device crashed"), std::string::npos);
}

TEST(FaultDiskTest, AlignmentIsEnforcedLikeODirect) {
  FaultDiskOptions opts;
  opts.alignment = 512;
  opts.kind = MediumKind::kDirect;
  auto disk = FaultDisk::Create(opts);
  auto m = disk->Open();
  EXPECT_EQ(m->Alignment(), 512u);
  EXPECT_EQ(m->kind(), MediumKind::kDirect);
  alignas(512) static uint8_t buf[1024];
  EXPECT_TRUE(m->Write(0, buf, 512).ok());
  EXPECT_EQ(m->Write(1, buf, 512).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Write(0, buf, 100).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Write(0, buf + 1, 512).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(disk->writes(), 1u);
}

TEST(FaultDiskConcurrencyTest, ConcurrentWritersAndSyncs) {
  auto disk = FaultDisk::Create();
  constexpr int kThreads = 4;
  constexpr int kWrites = 200;
  constexpr size_t kLen = 700;  // not sector-aligned on purpose
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto m = disk->Open();  // one medium per thread, and one shared below
      for (int i = 0; i < kWrites; ++i) {
        auto b = Bytes(kLen, static_cast<uint8_t>(t * 50 + i % 50 + 1));
        const uint64_t off = (static_cast<uint64_t>(i) * kThreads + t) * kLen;
        if (!m->Write(off, b.data(), kLen).ok()) ++failures;
        if (i % 17 == 0 && !m->Sync().ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  auto m = disk->Open();
  ASSERT_TRUE(m->Sync().ok());
  disk->Crash(CrashMode::kTornUnsynced, 5);  // everything was synced: nothing changes
  const std::vector<uint8_t> img = disk->Snapshot();
  ASSERT_EQ(img.size(), kThreads * kWrites * kLen);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kWrites; ++i) {
      const uint64_t off = (static_cast<uint64_t>(i) * kThreads + t) * kLen;
      for (size_t j = 0; j < kLen; ++j) {
        ASSERT_EQ(img[off + j], t * 50 + i % 50 + 1) << "thread " << t << " write " << i;
      }
    }
  }
  EXPECT_EQ(disk->writes(), uint64_t{kThreads} * kWrites);
}

TEST(FaultDiskConcurrencyTest, CrashWhileWritersRunStopsThemAll) {
  auto disk = FaultDisk::Create();
  auto m = disk->Open();
  std::atomic<bool> go{false};
  std::atomic<int> stopped{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      auto b = Bytes(512, static_cast<uint8_t>(t + 1));
      for (uint64_t i = 0;; ++i) {
        Status st = m->Write((i % 64 * 4 + t) * 512, b.data(), b.size());
        if (st.ok() && i % 8 == 0) st = m->Sync();
        if (!st.ok()) {
          EXPECT_NE(st.message().find("device crashed"), std::string::npos) << st.message();
          ++stopped;
          return;
        }
      }
    });
  }
  go = true;
  while (disk->writes() < 200) std::this_thread::yield();
  disk->Crash(CrashMode::kTornUnsynced, 9);
  const std::vector<uint8_t> after = disk->Snapshot();
  for (auto& th : threads) th.join();
  EXPECT_EQ(stopped.load(), 4);
  EXPECT_EQ(disk->Snapshot(), after);  // nobody wrote into the post-crash image
}

}  // namespace
}  // namespace nonstop
