// `nonstop inspect`, `verify` and `export` on real checkpoint directories:
// good files verify, every kind of single bit flip is named, and an export is
// a valid safetensors file holding exactly the checkpoint's bytes.
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/store.h"
#include "store/format.h"
#include "store_test_util.h"
#include "tools/commands.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct CliResult {
  int code = 0;
  std::string out, err;
};

CliResult RunCli(std::vector<std::string> args) {
  CLI::App app{"nonstop"};
  app.require_subcommand(1);
  cli::AddStoreCommands(app);
  std::vector<const char*> argv = {"nonstop"};
  for (const auto& a : args) argv.push_back(a.c_str());
  CliResult r;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  try {
    app.parse(static_cast<int>(argv.size()), const_cast<char**>(argv.data()));
  } catch (const CLI::Error& e) {
    r.code = e.get_exit_code();
  }
  std::fflush(stdout);
  r.out = ::testing::internal::GetCapturedStdout();
  r.err = ::testing::internal::GetCapturedStderr();
  return r;
}

// Exit code of RunCliWithoutWriteAccess's child when it cannot become nobody.
constexpr int kCannotDropRoot = 77;

// Runs the CLI in a child process that may not write `dir`'s slot files
// (the caller chmods them 0444): as root, whom mode bits do not stop, the
// child first becomes nobody (uid and gid 65534). Its stdout and stderr come
// back through a pipe.
CliResult RunCliInChild(const std::vector<std::string>& args, bool drop_root) {
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    if (drop_root && ::geteuid() == 0 && (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 ||
                             ::setuid(65534) != 0)) {
      ::_exit(kCannotDropRoot);
    }
    CliResult r = RunCli(args);
    const std::string both = r.out + '\0' + r.err;
    for (size_t done = 0; done < both.size();) {
      const ssize_t w = ::write(fds[1], both.data() + done, both.size() - done);
      if (w <= 0) ::_exit(3);
      done += static_cast<size_t>(w);
    }
    ::_exit(r.code);
  }
  ::close(fds[1]);
  std::string both;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) both.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  const size_t nul = both.find('\0');
  r.out = both.substr(0, nul);
  if (nul != std::string::npos) r.err = both.substr(nul + 1);
  return r;
}

CliResult RunCliWithoutWriteAccess(const std::vector<std::string>& args) {
  return RunCliInChild(args, /*drop_root=*/true);
}

// For inputs that crashed the CLI: a crash (SIGSEGV, abort) shows as an exit
// code above 128 instead of killing the test.
CliResult RunCliIsolated(const std::vector<std::string>& args) {
  return RunCliInChild(args, /*drop_root=*/false);
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Replaces the table of the checkpoint with ring sequence `seq` in slot file
// `path` by `t` (encoded as is, whatever rule it breaks) and makes the
// record's table crc and its own crc match: a crafted file with valid
// checksums, as an attacker would make it.
void CraftTable(const std::string& path, uint64_t seq, const format::Table& t) {
  std::vector<uint8_t> img = ReadFile(path);
  const format::FileHeader h = format::ParseHeader({img.data(), format::kHeaderBytes}).value();
  uint8_t* rb = img.data() + h.ring_offset + (seq % h.ring_records) * format::kRecordBytes;
  format::Record r = format::ParseRecord({rb, format::kRecordBytes}).value();
  const std::vector<uint8_t> tb = format::EncodeTable(t);
  const uint64_t padded = format::AlignUp(tb.size(), kStoreAlign);
  ASSERT_LE(r.data_bytes + padded, h.slot_bytes) << "crafted table does not fit the slot";
  std::fill(img.begin() + r.table_offset, img.begin() + r.table_offset + padded, 0);
  std::copy(tb.begin(), tb.end(), img.begin() + r.table_offset);
  r.table_bytes = tb.size();
  r.table_crc = Crc32c(img.data() + r.table_offset, padded);
  const std::vector<uint8_t> enc = format::EncodeRecord(r);
  std::copy(enc.begin(), enc.end(), rb);
  WriteFile(path, img);
}

class StoreCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "nonstop-cli-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    file_ = dir_ + "/" + SlotFileName(0);
    MediumOptions mo;
    mo.create = true;
    auto f = SlotFile::Create(OpenMedium(file_, MediumKind::kBuffered, mo).value(),
                              StoreGeometry{3, testing::kTestSlotBytes, 0, 1})
                 .value();
    // Steps 10..50 as checkpoints #1..#5 in slots 1, 2, 0, 1, 2.
    for (uint64_t c = 1; c <= 5; ++c) {
      ASSERT_TRUE(testing::WriteAndCommit(*f, testing::MakeCheckpoint(StepOf(c)),
                                          static_cast<uint32_t>(c % 3), c)
                      .ok());
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  static int64_t StepOf(uint64_t counter) { return static_cast<int64_t>(counter) * 10; }

  void FlipBit(uint64_t offset, int bit = 3) {
    std::fstream f(file_, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    char c;
    f.read(&c, 1);
    c = static_cast<char>(c ^ (1 << bit));
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
  }
  // The newest checkpoint (#5) as the store sees it.
  CheckpointInfo Newest() {
    auto f = SlotFile::Open(OpenMedium(file_, MediumKind::kBuffered, {}).value()).value();
    auto scan = f->Scan().value();
    return scan.checkpoints[scan.newest_valid].info;
  }

  std::string dir_, file_;
};

TEST_F(StoreCliTest, InspectListsEveryCheckpointAndSlot) {
  CliResult r = RunCli({"inspect", dir_, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  ASSERT_EQ(j["files"].size(), 1u);
  const json& f = j["files"][0];
  ASSERT_EQ(f["checkpoints"].size(), 5u);
  EXPECT_EQ(f["checkpoints"][0]["counter"], 5);
  EXPECT_EQ(f["checkpoints"][0]["state"], "committed");
  EXPECT_TRUE(f["checkpoints"][0]["newest_valid"].get<bool>());
  EXPECT_EQ(f["checkpoints"][0]["meta"]["step"], 50);
  EXPECT_EQ(f["checkpoints"][2]["state"], "committed");
  EXPECT_EQ(f["checkpoints"][3]["state"], "overwritten");  // #2, slot 2 reused by #5
  ASSERT_EQ(f["slots"].size(), 3u);
  for (const json& s : f["slots"]) EXPECT_EQ(s["state"], "committed");
  const auto want = testing::MakeCheckpoint(50);
  ASSERT_EQ(f["checkpoints"][0]["tensors"].size(), want.layout.tensors.size());
  EXPECT_EQ(f["checkpoints"][0]["tensors"][0]["name"], want.layout.tensors[0].spec.name);

  r = RunCli({"inspect", dir_});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("committed (newest)"), std::string::npos) << r.out;
}

TEST_F(StoreCliTest, VerifyPassesOnAGoodDirectory) {
  CliResult r = RunCli({"verify", dir_});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("OK: step 50", 0), 0u) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1);
  r = RunCli({"verify", dir_, "--step", "30"});
  EXPECT_EQ(r.code, 0) << r.err;
  r = RunCli({"verify", dir_, "--step", "20"});  // overwritten by #5
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("overwritten"), std::string::npos) << r.err;
  r = RunCli({"verify", dir_, "--step", "77"});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("no checkpoint at step 77"), std::string::npos) << r.err;
}

TEST_F(StoreCliTest, VerifyNamesEveryKindOfBitFlip) {
  const CheckpointInfo n = Newest();
  const uint64_t table = n.data_offset + n.data_bytes;
  const uint64_t record = format::kRingOffset + (n.sequence % kRingRecords) * format::kRecordBytes;
  const TensorEntry& t0 = n.tensors[0];
  struct Case {
    const char* what;
    uint64_t offset;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"data", n.data_offset + t0.data_offset + t0.spec.nbytes / 2,
       "(tensor '" + t0.spec.name + "')"},
      {"table", table + 30, "tensor table checksum mismatch"},
      {"table padding", table + n.table_bytes + 1, "tensor table checksum mismatch"},
      {"record", record + 33, "ring entry"},
      {"header", 20, "file header checksum mismatch); used the copy at offset 4096; step 50 verified"},
      {"header padding", 3000, "file header checksum mismatch); used the copy at offset 4096"},
      {"header copy", 4096 + 30, "header copy at offset 4096 is damaged"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    CliResult good = RunCli({"verify", dir_});
    ASSERT_EQ(good.code, 0);
    FlipBit(c.offset);
    CliResult r = RunCli({"verify", dir_});
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(SlotFileName(0)), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    FlipBit(c.offset);  // undo
  }
}

TEST_F(StoreCliTest, ExportWritesAValidSafetensorsFileWithTheCheckpointBytes) {
  const std::string out = dir_ + "/out.safetensors";
  CliResult r = RunCli({"export", dir_, "--step", "40", "-o", out});
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream f(out, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_GE(bytes.size(), 8u);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t{bytes[i]} << (8 * i);
  ASSERT_EQ((8 + hlen) % 8, 0u);
  ASSERT_LE(8 + hlen, bytes.size());
  json h = json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + hlen));
  EXPECT_EQ(h["__metadata__"]["nonstop.step"], "40");
  EXPECT_EQ(h["__metadata__"]["nonstop.meta"], testing::MetaForStep(40));
  const auto want = testing::MakeCheckpoint(40);
  const uint8_t* data = bytes.data() + 8 + hlen;
  uint64_t total = 0;
  for (const TensorEntry& te : want.layout.tensors) {
    const json& e = h.at(te.spec.name);
    EXPECT_EQ(e["dtype"], std::string(DTypeSafetensorsName(te.spec.dtype)));
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), te.spec.shape);
    const uint64_t b = e["data_offsets"][0], end = e["data_offsets"][1];
    ASSERT_EQ(end - b, te.spec.nbytes);
    ASSERT_LE(8 + hlen + end, bytes.size());
    EXPECT_EQ(std::memcmp(data + b, want.data.data() + te.data_offset, te.spec.nbytes), 0)
        << te.spec.name;
    total += te.spec.nbytes;
  }
  EXPECT_EQ(8 + hlen + total, bytes.size());  // contiguous, no holes
}

// A read-only slot file (a read-only mount, or files kept 0444) is read
// through a descriptor opened O_RDONLY: inspect, verify and export work on it
// and leave it unchanged.
TEST_F(StoreCliTest, InspectVerifyAndExportReadAReadOnlyFile) {
  std::ifstream before_in(file_, std::ios::binary);
  const std::string before((std::istreambuf_iterator<char>(before_in)),
                           std::istreambuf_iterator<char>());
  ASSERT_EQ(::chmod(file_.c_str(), 0444), 0);
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);  // nobody may enter, not write
  const std::string out_dir = dir_ + "/out";
  ASSERT_TRUE(fs::create_directory(out_dir));
  ASSERT_EQ(::chmod(out_dir.c_str(), 0777), 0);  // where export may write

  CliResult r = RunCliWithoutWriteAccess({"inspect", dir_, "--json"});
  if (r.code == kCannotDropRoot) GTEST_SKIP() << "running as root and cannot become nobody";
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  ASSERT_EQ(j["files"].size(), 1u);
  EXPECT_FALSE(j["files"][0].contains("error")) << j["files"][0]["error"];
  EXPECT_EQ(j["files"][0]["checkpoints"].size(), 5u) << r.out;

  r = RunCliWithoutWriteAccess({"verify", dir_});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("OK: step 50", 0), 0u) << r.out << r.err;

  const std::string out = out_dir + "/model.safetensors";
  r = RunCliWithoutWriteAccess({"export", dir_, "-o", out});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_GT(fs::file_size(out), 8u);

  std::ifstream after_in(file_, std::ios::binary);
  const std::string after((std::istreambuf_iterator<char>(after_in)),
                          std::istreambuf_iterator<char>());
  EXPECT_TRUE(before == after);
}

TEST_F(StoreCliTest, ClearOneLineErrors) {
  CliResult r = RunCli({"verify", fs::temp_directory_path().string() + "/no-such-dir-nonstop"});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("no such directory"), std::string::npos) << r.err;
  const std::string empty = dir_ + "/empty";
  fs::create_directory(empty);
  r = RunCli({"inspect", empty});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("is not a nonstop checkpoint directory (no rank-*.nsck files)"),
            std::string::npos)
      << r.err;
  // A multi-rank directory is exported consolidated by the package's Python
  // (the CLI replaces itself with `PY -m nonstop._export`; tests/python's
  // test_export checks the result): with no such Python, one line naming
  // NONSTOP_PYTHON, and no file.
  fs::copy_file(file_, dir_ + "/" + SlotFileName(1));
  ::setenv("NONSTOP_PYTHON", (dir_ + "/no-such-python").c_str(), 1);
  r = RunCli({"export", dir_, "-o", dir_ + "/x.safetensors"});
  ::unsetenv("NONSTOP_PYTHON");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("to export a multi-rank directory"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("NONSTOP_PYTHON"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ + "/x.safetensors"));
}

// A damaged header is salvaged from its copy: inspect says so and lists
// every checkpoint, export works, and verify names the damage and what it used.
TEST_F(StoreCliTest, DamagedHeaderOrTruncatedTailIsSalvaged) {
  FlipBit(40);
  CliResult r = RunCli({"inspect", dir_, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  const json& f = j["files"][0];
  ASSERT_FALSE(f.contains("error")) << f["error"];
  ASSERT_EQ(f["salvaged"].size(), 1u);
  EXPECT_NE(f["salvaged"][0].get<std::string>().find("used the copy at offset 4096"),
            std::string::npos);
  EXPECT_EQ(f["checkpoints"].size(), 5u);
  EXPECT_EQ(f["checkpoints"][0]["state"], "committed");
  r = RunCli({"export", dir_, "-o", dir_ + "/out.safetensors"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("used the copy"), std::string::npos) << r.err;
  FlipBit(40);

  // One byte cut from the unused tail of the last slot.
  fs::resize_file(file_, fs::file_size(file_) - 1);
  r = RunCli({"verify", dir_});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("slot file is truncated"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("step 50 verified"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  r = RunCli({"verify", dir_, "--step", "30"});
  EXPECT_NE(r.err.find("step 30 verified"), std::string::npos) << r.err;
}

format::Table TableOfNewest(const std::string& file, CheckpointInfo* info) {
  auto f = SlotFile::Open(OpenMedium(file, MediumKind::kBuffered, {}).value()).value();
  auto scan = f->Scan().value();
  *info = scan.checkpoints[0].info;
  const format::FileHeader h =
      format::ParseHeader({ReadFile(file).data(), format::kHeaderBytes}).value();
  format::Table t;
  t.uuid_hi = h.uuid_hi;
  t.uuid_lo = h.uuid_lo;
  t.counter = info->counter;
  t.step = info->step;
  t.crc_chunk_bytes = info->crc_chunk_bytes;
  t.data_bytes = info->data_bytes;
  t.tensors = info->tensors;
  t.chunk_crcs = info->chunk_crcs;
  t.meta_json = info->meta_json;
  return t;
}

// 2,000 entries that all cover the data region, with valid checksums: verify
// refuses the checkpoint naming the entry (it said OK), export writes
// nothing (it wrote 2,000 copies of the data region).
TEST_F(StoreCliTest, CraftedOverlappingTableIsRefusedByVerifyAndExport) {
  // A directory whose slots have room for a 2,000-entry table.
  const std::string dir = dir_ + "/big";
  fs::create_directory(dir);
  const std::string file = dir + "/" + SlotFileName(0);
  {
    MediumOptions mo;
    mo.create = true;
    auto f = SlotFile::Create(OpenMedium(file, MediumKind::kBuffered, mo).value(),
                              StoreGeometry{3, testing::kTestSlotBytes + (128 << 10), 0, 1})
                 .value();
    ASSERT_TRUE(testing::WriteAndCommit(*f, testing::MakeCheckpoint(10), 0, 1).ok());
    ASSERT_TRUE(testing::WriteAndCommit(*f, testing::MakeCheckpoint(20), 1, 2).ok());
  }
  CheckpointInfo info;
  format::Table t = TableOfNewest(file, &info);
  t.tensors.clear();
  for (int i = 0; i < 2000; ++i) {
    TensorEntry te;
    te.spec = {"t" + std::to_string(i), DType::kUInt8, {static_cast<int64_t>(t.data_bytes)},
               t.data_bytes, {}};
    t.tensors.push_back(te);
  }
  CraftTable(file, info.sequence, t);
  CliResult r = RunCli({"verify", dir});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.err.find("tensor table entry 1 ('t1') overlaps entry 0 ('t0')"), std::string::npos)
      << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  r = RunCli({"export", dir, "--step", "20", "-o", dir + "/x.safetensors"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("overlaps"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/x.safetensors"));
  EXPECT_FALSE(fs::exists(dir + "/x.safetensors.tmp"));
  // What recovery would load is the intact step 10.
  r = RunCli({"export", dir, "-o", dir + "/y.safetensors"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step 10"), std::string::npos) << r.out;
}

// Inputs that crashed `nonstop inspect --json`: 200,000 nested brackets in
// the metadata (SIGSEGV), a tensor name that is not UTF-8 and a file name
// that is not UTF-8 (uncaught nlohmann exception, abort).
TEST_F(StoreCliTest, InspectNeverCrashesOnHostileInput) {
  const std::string dir = dir_ + "/deep";
  fs::create_directory(dir);
  const std::string file = dir + "/" + SlotFileName(0);
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  {
    MediumOptions mo;
    mo.create = true;
    auto f = SlotFile::Create(OpenMedium(file, MediumKind::kBuffered, mo).value(),
                              StoreGeometry{3, testing::kTestSlotBytes + (512 << 10), 0, 1})
                 .value();
    testing::TestCheckpoint c = testing::MakeCheckpoint(10);
    c.meta_json = deep;  // a writer may store any UTF-8 of bounded size
    ASSERT_TRUE(f->WriteData(0, 0, c.data.data(), c.data.size()).ok());
    ASSERT_TRUE(f->Commit(testing::MakeCommitRequest(c, 0, 1)).ok());
  }
  CliResult r = RunCliIsolated({"inspect", dir, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  json j = json::parse(r.out);
  EXPECT_EQ(j["files"][0]["checkpoints"][0]["meta"], deep);  // shown as text, not parsed
  r = RunCliIsolated({"inspect", dir});
  EXPECT_EQ(r.code, 0) << r.err;

  // A tensor name that is not UTF-8, with valid checksums.
  CheckpointInfo info;
  format::Table t = TableOfNewest(file_, &info);
  t.tensors[0].spec.name = "w\xff\xfe";
  CraftTable(file_, info.sequence, t);
  r = RunCliIsolated({"inspect", dir_, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  j = json::parse(r.out);
  EXPECT_EQ(j["files"][0]["checkpoints"][0]["state"], "damaged");
  EXPECT_NE(j["files"][0]["checkpoints"][0]["reason"].get<std::string>().find(
                "('w\\xFF\\xFE'): name is not valid UTF-8"),
            std::string::npos)
      << r.out;
  r = RunCliIsolated({"export", dir_, "--step", "50", "-o", dir_ + "/x.safetensors"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("not valid UTF-8"), std::string::npos) << r.err;

  // A slot file whose name is not UTF-8.
  fs::copy_file(file, dir + "/rank-\xff\xfe.nsck");
  r = RunCliIsolated({"inspect", dir, "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  j = json::parse(r.out);
  EXPECT_EQ(j["files"].size(), 2u);
}

// A symlink planted at OUT.tmp is refused and its target left untouched
// (export used to open OUT.tmp with O_TRUNC through the link and then rename
// it, so it overwrote the target). A regular OUT.tmp left by an interrupted
// export is replaced.
TEST_F(StoreCliTest, ExportRefusesASymlinkAtItsTempName) {
  const std::string out = dir_ + "/model.safetensors";
  const std::string victim = dir_ + "/victim.txt";
  { std::ofstream(victim) << "precious"; }
  fs::create_symlink(victim, out + ".tmp");
  CliResult r = RunCli({"export", dir_, "-o", out});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("model.safetensors.tmp"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  std::ifstream v(victim);
  std::string content((std::istreambuf_iterator<char>(v)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "precious");
  EXPECT_TRUE(fs::is_symlink(out + ".tmp"));
  EXPECT_FALSE(fs::exists(out));

  fs::remove(out + ".tmp");
  { std::ofstream(out + ".tmp") << "half an export"; }
  r = RunCli({"export", dir_, "-o", out});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  EXPECT_GT(fs::file_size(out), 100u);
}

}  // namespace
}  // namespace nonstop
