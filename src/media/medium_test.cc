// Tests of the real media: each kind on a temp file under /tmp (disk kinds)
// or /dev/shm (mmap, pmem).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "media/map_read.h"
#include "nonstop/env.h"
#include "nonstop/medium.h"

namespace nonstop {
namespace {

// A unique path in `dir`, removed when the test ends.
class TempPath {
 public:
  explicit TempPath(const std::string& dir) {
    std::string tmpl = dir + "/nonstop-media-test-XXXXXX";
    int fd = ::mkstemp(tmpl.data());
    EXPECT_GE(fd, 0) << tmpl;
    ::close(fd);
    ::unlink(tmpl.c_str());  // the medium creates it
    path_ = tmpl;
  }
  ~TempPath() { ::unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Page-aligned memory, as O_DIRECT wants.
struct AlignedBuf {
  explicit AlignedBuf(size_t n) : n(n) {
    p = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  }
  ~AlignedBuf() { std::free(p); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  uint8_t* p;
  size_t n;
};

void Fill(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>((i * 131 + seed * 7919) >> 3);
}

std::string DirFor(MediumKind k) {
  return (k == MediumKind::kMmap || k == MediumKind::kPmem) ? "/dev/shm" : "/tmp";
}

// Creates (OPEN_OR_SKIP) or reopens (REOPEN_OR_SKIP) `kind`, or skips the
// test where the kind is not available here.
#define OPEN_OR_SKIP(var, path, kind) OPEN_OR_SKIP_(var, path, kind, true)
#define REOPEN_OR_SKIP(var, path, kind) OPEN_OR_SKIP_(var, path, kind, false)
#define OPEN_OR_SKIP_(var, path, kind, create_it)                                    \
  std::unique_ptr<Medium> var;                                                       \
  {                                                                                  \
    MediumOptions o;                                                                 \
    o.create = create_it;                                                            \
    auto r = OpenMedium(path, kind, o);                                              \
    if (!r.ok() && r.status().code() == StatusCode::kUnavailable) {                  \
      GTEST_SKIP() << MediumKindName(kind) << ": " << r.status().message();          \
    }                                                                                \
    ASSERT_TRUE(r.ok()) << r.status().ToString();                                    \
    var = std::move(r).value();                                                      \
  }

class EachKind : public ::testing::TestWithParam<MediumKind> {};

TEST_P(EachKind, WritesReadsSyncsAndResizes) {
  const MediumKind kind = GetParam();
  TempPath tp(DirFor(kind));
  OPEN_OR_SKIP(m, tp.path(), kind);
  EXPECT_FALSE(m->Describe().empty());
  EXPECT_EQ(m->Size(), 0u);
  const size_t kBytes = 3 * (1 << 20) + 8192;  // several io_uring pieces, a partial last one
  ASSERT_TRUE(m->Resize(4 << 20).ok());
  EXPECT_EQ(m->Size(), uint64_t{4} << 20);

  AlignedBuf out(kBytes), in(kBytes);
  Fill(out.p, kBytes, 1);
  ASSERT_TRUE(m->Write(4096, out.p, kBytes).ok());
  ASSERT_TRUE(m->Sync().ok());
  ASSERT_TRUE(m->Read(4096, in.p, kBytes).ok());
  EXPECT_EQ(std::memcmp(in.p, out.p, kBytes), 0);

  // Reading past the end is Corruption, never a short read.
  Status past = m->Read(4 << 20, in.p, 4096);
  EXPECT_EQ(past.code(), StatusCode::kCorruption) << past.ToString();

  // The bytes are in the file: a fresh medium (a different kind) sees them.
  m.reset();
  MediumOptions o;
  auto again = OpenMedium(tp.path(), MediumKind::kBuffered, o);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->Size(), uint64_t{4} << 20);
  std::vector<uint8_t> check(kBytes);
  ASSERT_TRUE((*again)->Read(4096, check.data(), kBytes).ok());
  EXPECT_EQ(std::memcmp(check.data(), out.p, kBytes), 0);

  // Shrink and grow again.
  REOPEN_OR_SKIP(m2, tp.path(), kind);
  ASSERT_TRUE(m2->Resize(8192).ok());
  EXPECT_EQ(m2->Size(), 8192u);
  ASSERT_TRUE(m2->Read(4096, in.p, 4096).ok());
  EXPECT_EQ(std::memcmp(in.p, out.p, 4096), 0);
  ASSERT_TRUE(m2->Resize(1 << 20).ok());
  ASSERT_TRUE(m2->Write(1 << 19, out.p, 4096).ok());
  ASSERT_TRUE(m2->Sync().ok());
  ASSERT_TRUE(m2->Read(1 << 19, in.p, 4096).ok());
  EXPECT_EQ(std::memcmp(in.p, out.p, 4096), 0);
}

TEST_P(EachKind, ConcurrentWritersOnDisjointRanges) {
  const MediumKind kind = GetParam();
  TempPath tp(DirFor(kind));
  OPEN_OR_SKIP(m, tp.path(), kind);
  constexpr int kThreads = 4;
  constexpr int kChunks = 8;
  constexpr size_t kChunk = 256 << 10;
  constexpr size_t kPerThread = kChunks * kChunk;
  ASSERT_TRUE(m->Resize(kThreads * kPerThread).ok());

  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      AlignedBuf buf(kChunk);
      for (int c = 0; c < kChunks; ++c) {
        Fill(buf.p, kChunk, t * 100 + c);
        // Interleave the threads' chunks so their ranges alternate in the file.
        const uint64_t off = (static_cast<uint64_t>(c) * kThreads + t) * kChunk;
        Status st = m->Write(off, buf.p, kChunk);
        if (st.ok() && c % 3 == 2) st = m->Sync();
        if (!st.ok()) {
          results[t] = st;
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const Status& st : results) ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(m->Sync().ok());

  AlignedBuf want(kChunk), got(kChunk);
  for (int t = 0; t < kThreads; ++t) {
    for (int c = 0; c < kChunks; ++c) {
      Fill(want.p, kChunk, t * 100 + c);
      ASSERT_TRUE(m->Read((static_cast<uint64_t>(c) * kThreads + t) * kChunk, got.p, kChunk).ok());
      ASSERT_EQ(std::memcmp(want.p, got.p, kChunk), 0) << "thread " << t << " chunk " << c;
    }
  }
}

// The access mode of every descriptor this process holds open on `path`
// (O_RDONLY, O_WRONLY or O_RDWR), from /proc/self/fdinfo: what the kernel
// will allow, whoever runs the test (root ignores the file's mode bits).
std::vector<int> OpenAccessModes(const std::string& path) {
  std::vector<int> modes;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec) != path) continue;
    std::ifstream info("/proc/self/fdinfo/" + e.path().filename().string());
    std::string key;
    while (info >> key) {
      if (key == "flags:") {
        std::string octal;
        info >> octal;
        modes.push_back(static_cast<int>(std::stoul(octal, nullptr, 8)) & O_ACCMODE);
        break;
      }
    }
  }
  return modes;
}

// The permissions ("r--s", "rw-s") of every mapping of `path`, from /proc/self/maps.
std::vector<std::string> MappingPerms(const std::string& path) {
  std::vector<std::string> perms;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.size() > path.size() &&
        line.compare(line.size() - path.size(), path.size(), path) == 0) {
      perms.push_back(line.substr(line.find(' ') + 1, 4));
    }
  }
  return perms;
}

TEST_P(EachKind, ReadOnlyOpensTheFileForReadingAndRefusesWrites) {
  const MediumKind kind = GetParam();
  TempPath tp(DirFor(kind));
  const size_t kBytes = 64 << 10;
  AlignedBuf out(kBytes), in(kBytes);
  Fill(out.p, kBytes, 5);
  {
    OPEN_OR_SKIP(w, tp.path(), kind);
    ASSERT_TRUE(w->Resize(kBytes).ok());
    ASSERT_TRUE(w->Write(0, out.p, kBytes).ok());
    ASSERT_TRUE(w->Sync().ok());
  }
  ASSERT_EQ(::chmod(tp.path().c_str(), 0444), 0);
  MediumOptions ro;
  ro.read_only = true;
  auto r = OpenMedium(tp.path(), kind, ro);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::unique_ptr<Medium> m = std::move(r).value();
  EXPECT_NE(m->Describe().find("read-only"), std::string::npos) << m->Describe();
  EXPECT_EQ(m->Size(), kBytes);
  ASSERT_TRUE(m->Read(0, in.p, kBytes).ok());
  EXPECT_EQ(std::memcmp(in.p, out.p, kBytes), 0);

  // The kernel, not only this class, refuses writes: every descriptor on the
  // file is O_RDONLY and every mapping of it lacks 'w'.
  const std::vector<int> modes = OpenAccessModes(tp.path());
  ASSERT_FALSE(modes.empty());
  for (int mode : modes) EXPECT_EQ(mode, O_RDONLY);
  for (const std::string& p : MappingPerms(tp.path())) EXPECT_EQ(p[1], '-') << p;
  if (kind == MediumKind::kMmap || kind == MediumKind::kPmem) {
    EXPECT_FALSE(MappingPerms(tp.path()).empty());
  }

  Status w = m->Write(0, out.p, kBytes);
  EXPECT_EQ(w.code(), StatusCode::kFailedPrecondition) << w.ToString();
  EXPECT_NE(w.message().find("read-only"), std::string::npos) << w.message();
  EXPECT_EQ(m->Resize(2 * kBytes).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(m->Sync().ok());
  EXPECT_EQ(m->Size(), kBytes);

  ro.create = true;  // a contradiction
  EXPECT_EQ(OpenMedium(tp.path(), kind, ro).status().code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Media, EachKind,
                         ::testing::Values(MediumKind::kBuffered, MediumKind::kDirect,
                                           MediumKind::kUring, MediumKind::kMmap,
                                           MediumKind::kPmem),
                         [](const ::testing::TestParamInfo<MediumKind>& info) {
                           return std::string(MediumKindName(info.param));
                         });

class AlignedKind : public ::testing::TestWithParam<MediumKind> {};

TEST_P(AlignedKind, EnforcesAlignment) {
  TempPath tp("/tmp");
  OPEN_OR_SKIP(m, tp.path(), GetParam());
  const size_t a = m->Alignment();
  EXPECT_GE(a, 512u);
  EXPECT_EQ(a & (a - 1), 0u) << "alignment " << a << " is not a power of two";
  EXPECT_NE(m->Describe().find("align " + std::to_string(a)), std::string::npos)
      << m->Describe();
  AlignedBuf buf(2 * a);
  Fill(buf.p, 2 * a, 3);
  ASSERT_TRUE(m->Write(0, buf.p, a).ok());

  Status bad_offset = m->Write(a / 2, buf.p, a);
  EXPECT_EQ(bad_offset.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_offset.message().find("multiples of " + std::to_string(a)), std::string::npos)
      << bad_offset.message();
  EXPECT_NE(bad_offset.message().find(tp.path()), std::string::npos) << bad_offset.message();
  EXPECT_EQ(m->Write(0, buf.p, a - 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Write(0, buf.p + 1, a).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Read(0, buf.p + 1, a).code(), StatusCode::kInvalidArgument);
  // A rejected write changed nothing.
  AlignedBuf got(a);
  ASSERT_TRUE(m->Read(0, got.p, a).ok());
  EXPECT_EQ(std::memcmp(got.p, buf.p, a), 0);
}

INSTANTIATE_TEST_SUITE_P(Media, AlignedKind,
                         ::testing::Values(MediumKind::kDirect, MediumKind::kUring),
                         [](const ::testing::TestParamInfo<MediumKind>& info) {
                           return std::string(MediumKindName(info.param));
                         });

TEST(MediumKindTest, NamesRoundTrip) {
  for (MediumKind k : {MediumKind::kAuto, MediumKind::kBuffered, MediumKind::kDirect,
                       MediumKind::kUring, MediumKind::kMmap, MediumKind::kPmem}) {
    MediumKind parsed = MediumKind::kAuto;
    ASSERT_TRUE(ParseMediumKind(MediumKindName(k), &parsed)) << MediumKindName(k);
    EXPECT_EQ(parsed, k);
  }
  MediumKind out;
  EXPECT_FALSE(ParseMediumKind("o_direct", &out));
  EXPECT_FALSE(ParseMediumKind("", &out));
  EXPECT_STREQ(MediumKindName(MediumKind::kUring), "uring");
}

TEST(AutoMediumTest, PicksTheFastestKindThatWorks) {
  TempPath tp("/tmp");
  MediumOptions o;
  o.create = true;
  auto m = OpenMedium(tp.path(), MediumKind::kAuto, o);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const std::string d = (*m)->Describe();
#ifdef NONSTOP_HAVE_URING
  // This machine's ext4 supports io_uring and O_DIRECT; elsewhere the
  // fallback must say why.
  if ((*m)->kind() != MediumKind::kUring) {
    EXPECT_NE(d.find("io_uring: "), std::string::npos) << d;
  }
#else
  EXPECT_NE(d.find("io_uring: "), std::string::npos) << d;
#endif
  if ((*m)->kind() == MediumKind::kBuffered) {
    EXPECT_NE(d.find("O_DIRECT: "), std::string::npos) << d;
  }
  std::printf("auto on /tmp: %s\n", d.c_str());
}

TEST(OpenMediumTest, MissingFileWithoutCreateIsNotFound) {
  for (MediumKind k : {MediumKind::kAuto, MediumKind::kBuffered, MediumKind::kDirect,
                       MediumKind::kUring, MediumKind::kMmap, MediumKind::kPmem}) {
    auto m = OpenMedium("/tmp/nonstop-no-such-dir/file", k, MediumOptions{});
    ASSERT_FALSE(m.ok()) << MediumKindName(k);
    if (m.status().code() == StatusCode::kUnavailable) continue;  // uring not built in
    EXPECT_EQ(m.status().code(), StatusCode::kNotFound) << m.status().ToString();
    EXPECT_NE(m.status().message().find("/tmp/nonstop-no-such-dir/file"), std::string::npos);
  }
}

TEST(BufferedMediumTest, WritesPastTheEndGrowTheFile) {
  TempPath tp("/tmp");
  OPEN_OR_SKIP(m, tp.path(), MediumKind::kBuffered);
  EXPECT_EQ(m->Alignment(), 1u);
  const char msg[] = "hello, medium";
  ASSERT_TRUE(m->Write(1000, msg, sizeof msg).ok());
  EXPECT_EQ(m->Size(), 1000 + sizeof msg);
  char got[sizeof msg];
  ASSERT_TRUE(m->Read(1000, got, sizeof msg).ok());
  EXPECT_STREQ(got, msg);
  EXPECT_EQ(m->Read(1001, got, sizeof msg).code(), StatusCode::kCorruption);
}

// MapForRead (the peer tier's sender): the exact bytes of a range at any
// offset, read-only pages shared with the file; a range past the end
// refused; what the file holds later shows through the same mapping.
TEST(BufferedMediumTest, MapForReadShowsTheRangeWithoutACopy) {
  TempPath tp("/dev/shm");
  OPEN_OR_SKIP(m, tp.path(), MediumKind::kBuffered);
  std::vector<uint8_t> data(3 * 4096 + 777);
  Fill(data.data(), data.size(), 5);
  ASSERT_TRUE(m->Write(0, data.data(), data.size()).ok());
  for (uint64_t off : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{5000}}) {
    const uint64_t n = data.size() - off;
    auto v = media::MapForRead(*m, off, n);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    ASSERT_EQ(v.value()->size(), n);
    EXPECT_EQ(std::memcmp(v.value()->data(), data.data() + off, n), 0) << off;
  }
  auto v = media::MapForRead(*m, 100, 50);
  ASSERT_TRUE(v.ok());
  const uint8_t later[4] = {1, 2, 3, 4};
  ASSERT_TRUE(m->Write(120, later, sizeof later).ok());
  EXPECT_EQ(std::memcmp(v.value()->data() + 20, later, sizeof later), 0) << "not the file's pages";
  EXPECT_FALSE(media::MapForRead(*m, data.size() - 10, 11).ok());
  EXPECT_FALSE(media::MapForRead(*m, 0, 0).ok());
}

TEST(MmapMediumTest, WritePastTheMappingIsRefused) {
  for (MediumKind k : {MediumKind::kMmap, MediumKind::kPmem}) {
    TempPath tp("/dev/shm");
    OPEN_OR_SKIP(m, tp.path(), k);
    char b[100] = {1};
    Status st = m->Write(0, b, sizeof b);  // empty file: nothing is mapped
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("Resize"), std::string::npos) << st.message();
    ASSERT_TRUE(m->Resize(4096).ok());
    ASSERT_TRUE(m->Write(4000, b, 96).ok());
    EXPECT_EQ(m->Write(4000, b, 97).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(m->Sync().ok());
    ASSERT_TRUE(m->Sync().ok());  // nothing dirty: still OK
  }
}

TEST(PmemMediumTest, SaysWhichPersistenceItUses) {
  TempPath tp("/dev/shm");
  OPEN_OR_SKIP(m, tp.path(), MediumKind::kPmem);
  ASSERT_TRUE(m->Resize(1 << 20).ok());
  const std::string d = m->Describe();
#ifdef NONSTOP_HAVE_PMEM2
  EXPECT_EQ(m->kind(), MediumKind::kPmem);
  // tmpfs is not DAX: libpmem2 maps it at page granularity.
  EXPECT_EQ(d, "pmem (libpmem2, page granularity: msync)");
#else
  EXPECT_EQ(m->kind(), MediumKind::kMmap);
  EXPECT_NE(d.find("libpmem2 not built in"), std::string::npos) << d;
#endif
}

TEST(DirectMediumTest, ReportsTheDiskAlignment) {
  TempPath tp("/tmp");
  OPEN_OR_SKIP(m, tp.path(), MediumKind::kDirect);
  // Printed, not asserted: the value belongs to the machine (512 on this
  // project's ext4 disk).
  std::printf("direct on /tmp: %s\n", m->Describe().c_str());
  EXPECT_EQ(m->kind(), MediumKind::kDirect);
}

// Medium::OpenReadQueue: many reads in flight come back whole and
// bit-exact, in whatever order they finish; a read past the end, a
// misaligned one and one more than the depth are refused without being
// started; and a queue dropped with reads still in flight waits for them.
class ReadQueueKind : public ::testing::TestWithParam<MediumKind> {};

TEST_P(ReadQueueKind, ReadsInFlightComeBackWholeAndBitExact) {
  TempPath tp("/tmp");
  constexpr size_t kPiece = 256 << 10;
  constexpr unsigned kDepth = 8;
  constexpr size_t kPieces = 40;
  {
    OPEN_OR_SKIP(w, tp.path(), MediumKind::kBuffered);
    AlignedBuf all(kPiece * kPieces);
    Fill(all.p, all.n, 11);
    ASSERT_TRUE(w->Write(0, all.p, all.n).ok());
    ASSERT_TRUE(w->Sync().ok());
  }
  REOPEN_OR_SKIP(m, tp.path(), GetParam());
  std::unique_ptr<ReadQueue> q = m->OpenReadQueue(kDepth);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->depth(), kDepth);
  EXPECT_EQ(q->Next().status().code(), StatusCode::kFailedPrecondition);  // nothing outstanding
  AlignedBuf got(kPiece * kPieces);
  std::memset(got.p, 0, got.n);
  std::vector<int> seen(kPieces, 0);
  size_t next = 0, done = 0;
  while (done < kPieces) {
    while (next < kPieces && q->outstanding() < q->depth()) {
      ASSERT_TRUE(q->Submit(next * kPiece, got.p + next * kPiece, kPiece, 1000 + next).ok());
      ++next;
    }
    if (next < kPieces) {  // full: one more is refused, and not started
      EXPECT_EQ(q->Submit(0, got.p, kPiece, 1).code(), StatusCode::kFailedPrecondition);
      EXPECT_EQ(q->outstanding(), kDepth);
    }
    Result<ReadDone> d = q->Next();
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    ASSERT_TRUE(d->status.ok()) << d->status.ToString();
    ASSERT_GE(d->tag, 1000u);
    ASSERT_LT(d->tag, 1000u + kPieces);
    ++seen[d->tag - 1000];
    ++done;
  }
  EXPECT_EQ(q->outstanding(), 0u);
  for (size_t i = 0; i < kPieces; ++i) EXPECT_EQ(seen[i], 1) << "piece " << i;
  AlignedBuf want(kPiece * kPieces);
  Fill(want.p, want.n, 11);
  EXPECT_EQ(std::memcmp(got.p, want.p, want.n), 0);

  // Refused, by Submit or in the read's result: past the end (Corruption,
  // as Read) and, for O_DIRECT, a misaligned buffer.
  auto outcome = [&](uint64_t offset, uint8_t* buf, size_t n) -> Status {
    NONSTOP_RETURN_IF_ERROR(q->Submit(offset, buf, n, 7));
    Result<ReadDone> r = q->Next();
    return r.ok() ? r->status : r.status();
  };
  EXPECT_EQ(outcome(kPiece * kPieces - 4096, got.p, 8192).code(), StatusCode::kCorruption);
  if (m->Alignment() > 1) {
    EXPECT_EQ(outcome(0, got.p + 1, kPiece).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(q->outstanding(), 0u);

  // The last piece of the file, exactly to its end, then a queue dropped
  // with reads in flight (its destructor waits for them before `late` goes).
  AlignedBuf late(kPiece * kDepth);
  ASSERT_TRUE(q->Submit((kPieces - 1) * kPiece, late.p, kPiece, 5).ok());
  Result<ReadDone> d = q->Next();
  ASSERT_TRUE(d.ok() && d->status.ok());
  EXPECT_EQ(d->tag, 5u);
  EXPECT_EQ(std::memcmp(late.p, want.p + (kPieces - 1) * kPiece, kPiece), 0);
  for (unsigned i = 0; i < kDepth; ++i) {
    ASSERT_TRUE(q->Submit(i * kPiece, late.p + i * kPiece, kPiece, i).ok());
  }
  q.reset();
  EXPECT_EQ(std::memcmp(late.p, want.p, kPiece * kDepth), 0);
}

INSTANTIATE_TEST_SUITE_P(Media, ReadQueueKind,
                         ::testing::Values(MediumKind::kBuffered, MediumKind::kDirect,
                                           MediumKind::kUring),
                         [](const ::testing::TestParamInfo<MediumKind>& info) {
                           return std::string(MediumKindName(info.param));
                         });

}  // namespace
}  // namespace nonstop
