// The job manifest (jobdir/manifest.h) and the job view (engine/job_view.h)
// on the fault-injecting Env: the manifest's format and its hostile bytes,
// the view of a job whose steps live on disk, the remote and a partner, a
// damaged manifest shown as damage, and a crash at every call of a workflow
// of commits, rollbacks and manifest notes: after each, the view equals the
// truth (the view of the workflow run without a crash up to the operation
// that was cut, or through it), so no committed checkpoint is lost and no
// step is shown on a tier that did not hold it.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine/job_view.h"
#include "env/fault_env.h"
#include "jobdir/manifest.h"
#include "nonstop/crc32c.h"
#include "nonstop/jobdir.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop {
namespace {

using testing::kTestSlotBytes;
using testing::MakeCheckpoint;
using testing::MakeCommitRequest;

ManifestHolder Holder(const std::string& tier, const std::string& where,
                      std::vector<ManifestHeld> held) {
  ManifestHolder h;
  h.tier = tier;
  h.where = where;
  h.unix_s = 1.5;
  h.held = std::move(held);
  return h;
}

// "step/counter/where/state/tiers" per row: what `nonstop ls` shows.
std::vector<std::string> Canon(const JobView& v) {
  std::vector<std::string> out;
  for (const ViewRow& r : v.rows) {
    std::string t = TierList(r);
    for (const ViewHolder& h : r.tiers) {
      if (h.tier == "remote" || h.tier == "peer") t += " " + h.tier + "@" + h.where;
    }
    out.push_back(std::to_string(r.step) + "/#" + std::to_string(r.counter) + "/" + r.where + "/" +
                  r.state + "/" + t);
  }
  return out;
}

std::string Join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "  " + x + "\n";
  return s;
}

// ---------------------------------------------------------------- the format

TEST(JobManifest, RoundTripsAndRefusesHostileBytesInOneLine) {
  JobManifest m;
  m.rank = 3;
  m.job = "job \"a\"";
  m.holders.push_back(Holder("remote", "s3://b/p", {{30, 3}, {20, 2}}));
  m.holders.push_back(Holder("peer", "10.0.0.2:7000", {{30, 3}}));
  const std::string text = EncodeJobManifest(m);
  auto back = DecodeJobManifest(text, "m");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back.value().rank, 3);
  EXPECT_EQ(back.value().job, m.job);
  ASSERT_EQ(back.value().holders.size(), 2u);
  EXPECT_EQ(back.value().holders[0].held[1].counter, 2u);
  EXPECT_EQ(back.value().holders[1].where, "10.0.0.2:7000");

  auto refused = [](const std::string& t, const std::string& why) {
    auto r = DecodeJobManifest(t, "DIR/manifest-rank-00003.json");
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << why;
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos) << why;
    EXPECT_NE(r.status().message().find("DIR/manifest-rank-00003.json"), std::string::npos) << why;
  };
  std::string flipped = text;
  flipped[20] ^= 0x01;
  refused(flipped, "a flipped bit");
  // Still valid JSON with valid fields: only the crc finds it.
  std::string lied = text;
  const size_t at = lied.find("[20, 2]");
  ASSERT_NE(at, std::string::npos);
  lied[at + 5] = '7';
  refused(lied, "another counter");
  refused(text.substr(0, text.size() / 2), "cut short");
  refused("", "empty");
  refused(std::string(kMaxManifestBytes + 1, ' '), "too large");
  // A body with a valid crc but fields that lie.
  auto sealed = [](const std::string& body) {
    char crc[16];
    std::snprintf(crc, sizeof(crc), "%08x", Crc32c(body.data(), body.size()));
    return body + "crc32c=" + crc + "\n";
  };
  refused(sealed("{\"format\": \"nonstop.manifest/1\", \"rank\": 0, \"job\": \"\", \"holders\": "
                 "[{\"tier\": \"tape\", \"where\": \"x\", \"unix_s\": 0, \"held\": []}]}\n"),
          "an unknown tier");
  refused(sealed("{\"format\": \"nonstop.manifest/1\", \"rank\": 0, \"job\": \"\", \"holders\": "
                 "[{\"tier\": \"remote\", \"where\": \"x\", \"unix_s\": 0, \"held\": [[1, -2]]}]}\n"),
          "a negative counter");
  refused(sealed("{\"format\": \"nonstop.manifest/1\", \"rank\": 0, \"job\": \"\", \"holders\": 7}\n"),
          "holders not a list");
  std::string many = "{\"format\": \"nonstop.manifest/1\", \"rank\": 0, \"job\": \"\", \"holders\": "
                     "[{\"tier\": \"remote\", \"where\": \"x\", \"unix_s\": 0, \"held\": [";
  for (size_t i = 0; i <= kMaxManifestHeld; ++i) many += (i ? ", [1, " : "[1, ") + std::to_string(i + 1) + "]";
  refused(sealed(many + "]}]}\n"), "too many held checkpoints");
  refused(sealed("{\"format\": \"nonstop.other/1\", \"rank\": 0, \"job\": \"\", \"holders\": []}\n"),
          "another format");
}

// ---------------------------------------------------------------- the workflow

// The operations of a job: commits into a ring of 3 slots, the notes of the
// remote uploader and the peer replicator, and a rollback.
struct Workflow {
  std::shared_ptr<FaultEnv> env;
  std::unique_ptr<JobDir> jd;
  std::unique_ptr<SlotFile> file;

  explicit Workflow(std::shared_ptr<FaultEnv> e) : env(std::move(e)) {
    auto j = JobDir::OpenForWrite("/job", 0, 1, env.get());
    EXPECT_TRUE(j.ok()) << j.status().ToString();
    jd = std::move(j).value();
    auto m = jd->CreateTempSlot(MediumKind::kBuffered);
    StoreGeometry g;
    g.slots = 3;
    g.slot_bytes = kTestSlotBytes;
    auto f = SlotFile::Create(std::move(m).value(), g);
    EXPECT_TRUE(f.ok());
    file = std::move(f).value();
    EXPECT_TRUE(jd->PublishTempSlot().ok());
  }

  Status Commit(int64_t step) {
    NONSTOP_ASSIGN_OR_RETURN(uint64_t c, jd->NextCounter(0));
    auto ck = MakeCheckpoint(step);
    const uint32_t slot = static_cast<uint32_t>(c % 3);
    NONSTOP_RETURN_IF_ERROR(file->WriteData(slot, 0, ck.data.data(), ck.data.size()));
    return file->Commit(MakeCommitRequest(ck, slot, c)).status();
  }
  Status Note(const std::string& tier, const std::string& where, std::vector<ManifestHeld> held) {
    return NoteHeld(env.get(), "/job", 0, tier == "remote" ? "job-a" : "",
                    Holder(tier, where, std::move(held)));
  }

  // The operations, in order; op i returns its status.
  std::vector<std::function<Status()>> Ops() {
    const std::string remote = "s3://bucket/job-a", peer = "10.0.0.2:7000";
    return {
        [=, this] { return Commit(10); },                                  // #1
        [=, this] { return Note("remote", remote, {{10, 1}}); },
        [=, this] { return Commit(20); },                                  // #2
        [=, this] { return Note("peer", peer, {{20, 2}}); },
        [=, this] { return Commit(30); },                                  // #3
        [=, this] { return Note("remote", remote, {{30, 3}, {20, 2}, {10, 1}}); },
        [=, this] { return Note("peer", peer, {{30, 3}}); },
        [=, this] { return jd->RecordRestore(0, 2); },                     // back to step 20
        [=, this] { return Commit(30); },                                  // #4 (reuses #1's slot)
        [=, this] { return Note("remote", remote, {{30, 4}, {30, 3}, {20, 2}, {10, 1}}); },
        [=, this] { return Commit(40); },                                  // #5 (reuses #2's slot)
        [=, this] { return Note("peer", peer, {{40, 5}}); },
    };
  }
};

Result<JobView> View(FaultEnv* env) { return ViewJob("/job", 0, env); }

// `nonstop ls`'s table (LsText), one format for a job directory and a
// remote: the job, the columns, a committed row's size, tiers (a partner
// named, control characters escaped) and metrics, the reason in place of the
// metrics wherever there is one, and an empty view's one line.
TEST(JobView, LsTextIsOneTableForEveryPlace) {
  JobView v;
  EXPECT_EQ(LsText(v, 3, "s3://b/p"), "no checkpoint of rank 3 in s3://b/p\n");
  v.job = "the-job";
  ViewRow a;
  a.step = 7;
  a.where = "ring";
  a.state = "committed";
  a.commit_unix_ns = 86400ull * 1000000000ull;
  a.bytes = 1536;
  a.metrics = {{"loss", 0.25}};
  a.tiers = {{"disk", "d", false}, {"peer", "10.0.0.2:7\n", true}};
  ViewRow b;
  b.step = 5;
  b.where = "remote";
  b.state = "committed";
  b.bytes = 10;
  b.reason = "no part of rank 1";
  ViewRow c;
  c.step = 4;
  c.where = "remote";
  c.state = "uncommitted";
  v.rows = {a, b, c};
  const std::string text = LsText(v, 0, "d");
  std::vector<std::string> lines;
  for (size_t i = 0, j; i < text.size(); i = j + 1) {
    j = text.find('\n', i);
    lines.push_back(text.substr(i, j - i));
  }
  ASSERT_EQ(lines.size(), 5u) << text;
  EXPECT_EQ(lines[0], "job the-job");
  EXPECT_EQ(lines[1].substr(0, 16), "step       where");
  EXPECT_EQ(lines[2],
            "7          ring   committed  1970-01-02T00:00:00Z  1.5 KiB    disk+peer peer@10.0.0.2:7\\x0a "
            "loss=0.25");
  EXPECT_NE(lines[3].find("10 B"), std::string::npos);
  EXPECT_EQ(lines[3].substr(lines[3].size() - 17), "no part of rank 1");
  EXPECT_EQ(lines[4].substr(0, 40), "4          remote uncommitted -         ");
  EXPECT_EQ(lines[4].back(), '-');  // no reason: nothing after the tiers' "-"
}

TEST(JobView, EveryTierOfEachStepAndTheRollbackWithoutANetwork) {
  Workflow w(FaultEnv::Create());
  for (auto& op : w.Ops()) ASSERT_TRUE(op().ok());
  auto v = View(w.env.get());
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v.value().job, "job-a");
  const std::vector<std::string> want = {
      "40/#5/ring/committed/disk+peer peer@10.0.0.2:7000",
      "30/#4/ring/committed/disk+remote remote@s3://bucket/job-a",
      "30/#3/ring/abandoned/",          // rolled back from: never committed again, on no tier
      "20/#2/remote/committed/remote remote@s3://bucket/job-a",
      "10/#1/ring/committed/disk+remote remote@s3://bucket/job-a",
  };
  // #2's ring slot was reused by #5: the remote still holds it (a row of its
  // own); #1's record is still in the ring (its data not verified by a
  // listing). The partner holds only its newest push (#5).
  EXPECT_EQ(Canon(v.value()), want) << Join(Canon(v.value()));
  for (const ViewRow& r : v.value().rows) {
    for (const ViewHolder& h : r.tiers) EXPECT_EQ(h.recorded, h.tier == "remote" || h.tier == "peer");
  }
}

TEST(JobView, ADamagedManifestIsADamagedRowAndTheDiskStillShows) {
  Workflow w(FaultEnv::Create());
  auto ops = w.Ops();
  for (size_t i = 0; i < 4; ++i) ASSERT_TRUE(ops[i]().ok());
  auto d = w.env->OpenDirectory("/job", false);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(WriteFileAtomic(*d.value(), JobDirNames::Manifest(0), "{\"format\": garbage").ok());
  auto v = View(w.env.get());
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  std::vector<std::string> want = {"20/#2/ring/committed/disk", "10/#1/ring/committed/disk",
                                   "-1/#0/manifest/damaged/"};
  EXPECT_EQ(Canon(v.value()), want) << Join(Canon(v.value()));
  EXPECT_TRUE(v.value().rows.back().unreadable);
  EXPECT_NE(v.value().rows.back().reason.find("manifest-rank-00000.json"), std::string::npos);
  // The next note replaces the damaged manifest.
  ASSERT_TRUE(w.Note("peer", "10.0.0.2:7000", {{20, 2}}).ok());
  v = View(w.env.get());
  ASSERT_TRUE(v.ok());
  want = {"20/#2/ring/committed/disk+peer peer@10.0.0.2:7000", "10/#1/ring/committed/disk"};
  EXPECT_EQ(Canon(v.value()), want) << Join(Canon(v.value()));
  // A manifest entry that contradicts the disk (another step at a counter
  // the disk holds) is not shown, and said.
  ASSERT_TRUE(w.Note("remote", "s3://x", {{99, 2}}).ok());
  v = View(w.env.get());
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(Canon(v.value()), want) << Join(Canon(v.value()));
  ASSERT_EQ(v.value().notes.size(), 1u);
  EXPECT_NE(v.value().notes[0].find("step 99"), std::string::npos) << v.value().notes[0];
}

TEST(JobView, ASetAsideRankFileTakesItsManifestAlong) {
  Workflow w(FaultEnv::Create());
  auto ops = w.Ops();
  for (size_t i = 0; i < 4; ++i) ASSERT_TRUE(ops[i]().ok());
  w.file.reset();
  auto moved = w.jd->SetAside(2);  // a restart with world size 2: world 1's files go to world-1/
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  ASSERT_EQ(moved.value(), std::vector<int>{1});
  auto top = w.env->OpenDirectory("/job", false);
  ASSERT_TRUE(top.ok());
  auto here = ReadJobManifest(*top.value(), 0);
  ASSERT_TRUE(here.ok());
  EXPECT_FALSE(here.value().has_value()) << "a manifest of world 1's counters left for world 2";
  auto there = w.env->OpenDirectory("/job/world-1", false);
  ASSERT_TRUE(there.ok());
  auto m = ReadJobManifest(*there.value(), 0);
  ASSERT_TRUE(m.ok() && m.value().has_value());
  EXPECT_EQ(m.value()->holders.size(), 2u);
}

TEST(JobView, CrashAtEveryCallOfCommitsRollbackAndManifestNotes) {
  const auto t0 = std::chrono::steady_clock::now();
  // The truth after k operations: the view of a run of the first k, no crash.
  size_t n_ops = 0;
  std::vector<std::vector<std::string>> truth;
  {
    Workflow w(FaultEnv::Create());
    auto ops = w.Ops();
    n_ops = ops.size();
    for (size_t k = 0; k <= n_ops; ++k) {
      auto v = View(w.env.get());
      ASSERT_TRUE(v.ok()) << v.status().ToString();
      truth.push_back(Canon(v.value()));
      if (k == n_ops) break;
      ASSERT_TRUE(ops[k]().ok()) << "op " << k;
    }
  }
  // Count the workflow's calls alone (no views in between).
  uint64_t total = 0;
  {
    Workflow w(FaultEnv::Create());
    const uint64_t base = w.env->calls();
    for (auto& op : w.Ops()) ASSERT_TRUE(op().ok());
    total = w.env->calls() - base;
  }
  ASSERT_GT(total, 30u);
  uint64_t points = 0, exact_before = 0, exact_after = 0, cut_commit = 0;
  // The counter each operation commits (0: not a commit).
  const std::vector<uint64_t> commit_counter = {1, 0, 2, 0, 3, 0, 0, 0, 4, 0, 5, 0};
  ASSERT_EQ(commit_counter.size(), n_ops);
  for (uint64_t n = 1; n <= total; ++n) {
    for (CrashMode mode : {CrashMode::kDropUnsynced, CrashMode::kTornUnsynced}) {
      Workflow w(FaultEnv::Create());
      w.env->CrashOnCall(n, mode, n * 7919 + static_cast<uint64_t>(mode));
      size_t done = 0;
      for (auto& op : w.Ops()) {
        if (!op().ok()) break;
        ++done;
      }
      ASSERT_LT(done, n_ops) << "call " << n << ": the crash did not stop the workflow";
      w.file.reset();
      w.jd.reset();
      w.env->ClearFaults();
      ++points;
      auto v = View(w.env.get());
      ASSERT_TRUE(v.ok()) << "call " << n << ": " << v.status().ToString();
      std::vector<std::string> got = Canon(v.value());
      // A commit cut before its sync may leave a torn record: damage, never
      // a committed checkpoint, and gone from the comparison.
      std::erase_if(got, [](const std::string& s) { return s.find("/damaged/") != std::string::npos &&
                                                            s.find("/manifest/") == std::string::npos; });
      // A commit cut after its data went into a reused slot: the slot's old
      // checkpoint is gone from the disk (a ring does that), the new one is
      // not committed: the truth after it without the new checkpoint.
      std::vector<std::string> after_but_new = truth[done + 1];
      if (commit_counter[done] != 0) {
        const std::string tag = "/#" + std::to_string(commit_counter[done]) + "/";
        std::erase_if(after_but_new, [&](const std::string& r) { return r.find(tag) != std::string::npos; });
      }
      if (got == truth[done]) {
        ++exact_before;
      } else if (got == truth[done + 1]) {
        ++exact_after;
      } else if (commit_counter[done] != 0 && got == after_but_new) {
        ++cut_commit;
      } else {
        ADD_FAILURE() << "call " << n << " (mode " << static_cast<int>(mode) << "), cut in op "
                      << done << ": the view\n"
                      << Join(got) << "is neither the truth before it\n"
                      << Join(truth[done]) << "nor after it\n"
                      << Join(truth[done + 1]);
        return;
      }
    }
  }
  EXPECT_GT(exact_before, 0u);
  EXPECT_GT(exact_after, 0u);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("job view crash points: %llu (%llu calls x 2 modes): %llu as before the cut op, "
              "%llu as after, %llu a cut commit whose reused slot lost its old checkpoint; "
              "%.2f s\n",
              static_cast<unsigned long long>(points), static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(exact_before),
              static_cast<unsigned long long>(exact_after),
              static_cast<unsigned long long>(cut_commit), secs);
}

// The one escaper for text shown on a terminal (`nonstop ls`, `nonstop
// inspect`): control characters as lowercase \xNN, the rest as is, and past
// a cap the rest cut with "...".
TEST(JobView, OneLineEscapesControlCharactersAndCutsPastItsCap) {
  EXPECT_EQ(OneLine(std::string("a\x1b[31m\nb\x7f\x00" "c", 11)), "a\\x1b[31m\\x0ab\\x7f\\x00c");
  EXPECT_EQ(OneLine("caf\xc3\xa9"), "caf\xc3\xa9");  // UTF-8 kept
  EXPECT_EQ(OneLine("abcdef", 4), "abcd...");
  EXPECT_EQ(OneLine("abcd", 4), "abcd");
  EXPECT_EQ(OneLine("\n\nxyz", 6), "\\x0a\\x0a...");  // an escape is never split
  EXPECT_EQ(OneLine(std::string(100 << 10, 'x'), 64 << 10).size(), (64u << 10) + 3);
}

}  // namespace
}  // namespace nonstop
