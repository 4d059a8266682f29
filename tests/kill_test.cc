// Real kill -9: a child process writes checkpoints in a loop into a slot file
// on the real file system and is SIGKILLed at random moments. After every
// kill the parent recovers the file and checks its content, and the newest
// checkpoint the child reported as committed (over a pipe, after Commit
// returned) is never lost. Each child starts by recovering the file the
// previous one was killed over, so recovery-then-continue is exercised too.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

using testing::CheckContent;
using testing::MakeCheckpoint;
using testing::MakeCommitRequest;
using testing::TestCheckpoint;

constexpr int kKills = 60;
constexpr uint32_t kSlots = 3;
constexpr int kChildWriters = 2;
constexpr auto kChildStartTimeout = std::chrono::seconds(20);

// The step of checkpoint #counter: any recovered counter says what to expect.
int64_t StepFor(uint64_t counter) { return static_cast<int64_t>(counter * 10 + counter % 7); }

// What a child tells its parent, one fixed-size message per event.
struct Message {
  uint64_t counter = 0;  // 0: ready (recovered, about to write)
  int32_t failed = 0;    // 1: the child hit an error; text holds it
  char text[116] = {};
};
static_assert(sizeof(Message) <= PIPE_BUF, "pipe writes of one message must be atomic");

void Send(int fd, const Message& m) {
  const char* p = reinterpret_cast<const char*>(&m);
  size_t left = sizeof(m);
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ::_exit(3);
    p += n;
    left -= static_cast<size_t>(n);
  }
}

[[noreturn]] void ChildFail(int fd, const std::string& why) {
  Message m;
  m.failed = 1;
  std::snprintf(m.text, sizeof(m.text), "%s", why.c_str());
  Send(fd, m);
  ::_exit(2);
}

// The child: recover, then commit checkpoints until killed. Data is written
// by kChildWriters threads in parallel, each taking every other 16 KiB piece.
[[noreturn]] void ChildMain(const std::string& path, int fd) {
  auto medium = OpenMedium(path, MediumKind::kBuffered, {});
  if (!medium.ok()) ChildFail(fd, medium.status().ToString());
  auto opened = SlotFile::Open(std::move(medium).value());
  if (!opened.ok()) ChildFail(fd, opened.status().ToString());
  std::unique_ptr<SlotFile> file = std::move(opened).value();
  auto scan = file->Scan();
  if (!scan.ok() || scan->newest_valid < 0) ChildFail(fd, "child found nothing to recover");
  uint32_t protect = scan->checkpoints[scan->newest_valid].info.slot;
  uint64_t counter = file->newest_committed_counter() + 1;
  Send(fd, Message{});
  for (;; ++counter) {
    uint32_t slot = (protect + 1 + counter % 2) % kSlots;  // never the newest committed one
    TestCheckpoint c = MakeCheckpoint(StepFor(counter));
    constexpr uint64_t kPiece = 16 << 10;
    std::vector<Status> results(kChildWriters);
    std::vector<std::thread> writers;
    for (int w = 0; w < kChildWriters; ++w) {
      writers.emplace_back([&, w] {
        for (uint64_t off = w * kPiece; off < c.data.size(); off += kChildWriters * kPiece) {
          const uint64_t n = std::min<uint64_t>(kPiece, c.data.size() - off);
          Status st = file->WriteData(slot, off, c.data.data() + off, n);
          if (!st.ok()) {
            results[w] = st;
            return;
          }
        }
      });
    }
    for (auto& t : writers) t.join();
    for (const Status& st : results) {
      if (!st.ok()) ChildFail(fd, st.ToString());
    }
    auto r = file->Commit(MakeCommitRequest(c, slot, counter));
    if (!r.ok()) ChildFail(fd, r.status().ToString());
    protect = slot;
    Message m;
    m.counter = counter;
    Send(fd, m);
  }
}

// Reads one message, waiting at most `timeout`. False on EOF or timeout.
bool Receive(int fd, Message* m, std::chrono::milliseconds timeout) {
  char* p = reinterpret_cast<char*>(m);
  size_t got = 0;
  while (got < sizeof(*m)) {
    pollfd pfd{fd, POLLIN, 0};
    int pr = ::poll(&pfd, 1, static_cast<int>(timeout.count()));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return false;
    ssize_t n = ::read(fd, p + got, sizeof(*m) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  return true;
}

class KillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr ? tmp : "/tmp") + "/nonstop-kill-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    dir_ = tmpl;
    path_ = dir_ + "/" + SlotFileName(0);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string dir_, path_;
};

TEST_F(KillTest, Sigkill50TimesNeverLosesACommittedCheckpoint) {
  {  // The file with a first checkpoint, so every child has one to recover.
    MediumOptions mo;
    mo.create = true;
    auto f = SlotFile::Create(OpenMedium(path_, MediumKind::kBuffered, mo).value(),
                              StoreGeometry{kSlots, testing::kTestSlotBytes, 0, 1})
                 .value();
    TestCheckpoint c = MakeCheckpoint(StepFor(1));
    ASSERT_TRUE(testing::WriteAndCommit(*f, c, 0, 1).ok());
  }
  std::mt19937_64 rng(12345);
  uint64_t newest_reported = 1;
  int recovered = 0, mid_checkpoint = 0, lost = 0;
  uint64_t child_commits = 0;
  for (int kill = 0; kill < kKills; ++kill) {
    SCOPED_TRACE("kill " + std::to_string(kill));
    int fds[2];
    ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) {
      ::close(fds[0]);
      ChildMain(path_, fds[1]);
    }
    ::close(fds[1]);
    Message m;
    const bool ready = Receive(fds[0], &m, kChildStartTimeout);
    if (ready && m.failed == 0) {
      // Kill somewhere within the next few checkpoints.
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 40000));
    }
    ::kill(pid, SIGKILL);
    int wstatus = 0;
    ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
    // Everything the child reported before it died.
    std::string child_error;
    while (Receive(fds[0], &m, std::chrono::milliseconds(1000))) {
      if (m.failed) {
        child_error = m.text;
      } else if (m.counter > 0) {
        EXPECT_GT(m.counter, newest_reported);
        newest_reported = std::max(newest_reported, m.counter);
        child_commits++;
      }
    }
    ::close(fds[0]);
    ASSERT_TRUE(ready) << "the child did not recover the file within 20 s";
    ASSERT_TRUE(child_error.empty()) << "the child failed: " << child_error;
    ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);

    // Recovery on the real file, as a restarted job would do it.
    auto medium = OpenMedium(path_, MediumKind::kBuffered, {});
    ASSERT_TRUE(medium.ok()) << medium.status().ToString();
    auto opened = SlotFile::Open(std::move(medium).value());
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    auto scan = (*opened)->Scan();
    ASSERT_TRUE(scan.ok()) << scan.status().ToString();
    ASSERT_GE(scan->newest_valid, 0) << "nothing recovered after kill " << kill;
    const CheckpointInfo& info = scan->checkpoints[scan->newest_valid].info;
    EXPECT_GE(info.counter, newest_reported) << "committed checkpoint lost";
    if (info.counter < newest_reported) ++lost;
    EXPECT_EQ(info.step, StepFor(info.counter));
    Status content = CheckContent(**opened, info);
    EXPECT_TRUE(content.ok()) << content.ToString();
    if (content.ok() && info.counter >= newest_reported) ++recovered;
    // A newer record than any reported: killed between record and report.
    if (info.counter > newest_reported) ++mid_checkpoint;
    newest_reported = std::max(newest_reported, info.counter);
  }
  std::printf("kills: %d, recovered: %d, checkpoints committed by children: %llu, "
              "recovered one not yet reported: %d, committed lost: %d\n",
              kKills, recovered, static_cast<unsigned long long>(child_commits), mid_checkpoint,
              lost);
  EXPECT_EQ(recovered, kKills);
  EXPECT_EQ(lost, 0);
}

}  // namespace
}  // namespace nonstop
