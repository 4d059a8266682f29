// Crash consistency of the job directory (DESIGN.md invariants 1-3, 7, 9), on
// the fault-injecting Env: thousands of random crash points, each followed by
// a recovery through JobDir and the store and a content check.
//
// One episode, deterministic for its seed, runs what jobs do to a directory:
//   A. a job of world size 2: both ranks take their locks, create their slot
//      files (temp name, rename), commit a few steps each and write their
//      agreed records;
//   B. a job of world size 1 on the same directory: takes the lock (and a
//      second writer is refused), sets the world-2 rank files aside, reshards
//      from the newest step committed on both (SelectCommon), records that
//      (agreed record), creates its own slot file and trains: commits, keep
//      copies, rollbacks (restore of an older step: RecordRestore), slot-file
//      resizes (temp file, first commit, rename over), readers.
// The episode is run once to count its Env calls, then again with a crash
// (dropping or tearing everything not synced, files and directory entries
// alike) before a random one of them. Recovery then does what a restarted job
// does (a writer's open: lock, leftovers, interrupted keep copies redone; the
// set-aside; SelectCommon and Select), sometimes crashing once more on the way,
// and checks against what the episode was told:
//   - committed lost: a checkpoint reported committed (or the restored one)
//     is not recovered, or a newer one of its lineage is not;
//   - corrupt: a recovered checkpoint's bytes, table or metadata differ from
//     what was written for its step, or it belongs to an abandoned lineage;
//   - a keep copy reported made is lost, or a keep/ temp file survives a
//     writer's open.
// It prints `crash points: N, recovered: N, corrupt: 0, committed lost: 0`.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "crash_ckpt.h"
#include "env/fault_env.h"
#include "nonstop/jobdir.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

constexpr char kJob[] = "/job";
constexpr uint32_t kSlots = 3;  // one in flight, the newest, the protected one

int CrashPoints() {
  const char* env = std::getenv("NONSTOP_JOBDIR_CRASH_POINTS");
  return env ? std::atoi(env) : 5000;
}

using crash_ckpt::Ckpt;

// A small checkpoint whose every byte is a function of (step, rank, world).
Ckpt MakeUncached(int64_t step, int rank, int world) {
  return crash_ckpt::Make(crash_ckpt::Mix(static_cast<uint64_t>(step) * 1009 +
                                          static_cast<uint64_t>(rank) * 31 +
                                          static_cast<uint64_t>(world)),
                          3, "t", 300, 9000,
                          "{\"step\": " + std::to_string(step) + ", \"rank\": " +
                              std::to_string(rank) + ", \"world\": " + std::to_string(world) + "}");
}

// Make, remembered (the same steps recur in every episode).
const Ckpt& Make(int64_t step, int rank, int world) {
  static std::map<std::tuple<int64_t, int, int>, Ckpt> cache;
  auto key = std::make_tuple(step, rank, world);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, MakeUncached(step, rank, world)).first;
  return it->second;
}

Result<CheckpointInfo> CommitStep(SlotFile& f, uint32_t slot, uint64_t counter, int64_t step,
                                  int rank, int world) {
  return crash_ckpt::Commit(f, slot, counter, step, Make(step, rank, world));
}

// The recovered checkpoint holds exactly what was written for its step.
bool SameContent(SlotFile& f, const CheckpointInfo& info, int rank, int world, std::string* why) {
  const Ckpt& want = Make(info.step, rank, world);
  if (info.meta_json != want.meta || info.data_bytes != want.layout.data_bytes ||
      info.tensors.size() != want.layout.tensors.size()) {
    *why = "table or metadata of step " + std::to_string(info.step) + " differs";
    return false;
  }
  for (size_t i = 0; i < info.tensors.size(); ++i) {
    if (info.tensors[i].spec.name != want.layout.tensors[i].spec.name ||
        info.tensors[i].data_offset != want.layout.tensors[i].data_offset ||
        info.tensors[i].spec.nbytes != want.layout.tensors[i].spec.nbytes) {
      *why = "tensor table entry " + std::to_string(i) + " differs";
      return false;
    }
  }
  std::vector<uint8_t> got(info.data_bytes);
  Status st = f.ReadData(info, 0, got.data(), got.size(), true);
  if (!st.ok()) {
    *why = st.ToString();
    return false;
  }
  if (got != want.data) {
    *why = "bytes of step " + std::to_string(info.step) + " differ";
    return false;
  }
  return true;
}

// Where the episode is (to show how the crash points spread over the operations).
const char* g_phase = "";

// What the episode was told (only calls that returned OK count).
struct Model {
  // The world-2 job.
  int64_t floor2 = 0;  // newest step committed on both ranks
  // The world-1 job (rank 0).
  std::map<uint64_t, int64_t> step_of;  // every counter it started
  uint64_t floor = 0;                   // newest committed of its lineage, or the restored one
  std::set<uint64_t> abandoned;         // by a RecordRestore that returned OK
  uint64_t pending_restore = 0;         // a RecordRestore under way
  uint64_t floor_before_restore = 0;
  std::map<int64_t, uint64_t> kept;     // step -> counter of a Keep that returned OK
};

Result<std::unique_ptr<SlotFile>> NewSlotFile(JobDir& jd, int world, uint64_t slot_bytes,
                                              bool publish) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<Medium> m, jd.CreateTempSlot(MediumKind::kBuffered));
  StoreGeometry g;
  g.slots = kSlots;
  g.slot_bytes = slot_bytes;
  g.rank = static_cast<uint32_t>(jd.rank());
  g.world_size = static_cast<uint32_t>(world);
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> sf, SlotFile::Create(std::move(m), g));
  if (publish) NONSTOP_RETURN_IF_ERROR(jd.PublishTempSlot());
  return sf;
}

// One episode; returns the first error (the crash). Fails the test on a
// wrong answer while no crash has happened.
Status Episode(uint64_t seed, Env* env, Model& m) {
  std::mt19937_64 rng(seed);
  // ---- A: a job of world size 2 ----
  {
    g_phase = "lock + leftovers";
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> w0, JobDir::OpenForWrite(kJob, 0, 2, env));
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> w1, JobDir::OpenForWrite(kJob, 1, 2, env));
    g_phase = "create slot file (temp, rename)";
    NONSTOP_ASSIGN_OR_RETURN(auto f0, NewSlotFile(*w0, 2, 32 << 10, true));
    NONSTOP_ASSIGN_OR_RETURN(auto f1, NewSlotFile(*w1, 2, 32 << 10, true));
    const int steps = 1 + static_cast<int>(rng() % 3);
    for (int s = 1; s <= steps; ++s) {
      const uint32_t slot = static_cast<uint32_t>(s % kSlots);
      g_phase = "commit";
      NONSTOP_RETURN_IF_ERROR(CommitStep(*f0, slot, s, s, 0, 2).status());
      NONSTOP_RETURN_IF_ERROR(CommitStep(*f1, slot, s, s, 1, 2).status());
      m.floor2 = s;
      g_phase = "agreed record";
      AgreedRecord a;
      a.step = s;
      a.counter = s;
      a.world_size = 2;
      a.rank = 0;
      NONSTOP_RETURN_IF_ERROR(w0->WriteAgreed(a));
      a.rank = 1;
      NONSTOP_RETURN_IF_ERROR(w1->WriteAgreed(a));
    }
    if (rng() % 2) {  // rank 0 alone got one more step
      NONSTOP_RETURN_IF_ERROR(CommitStep(*f0, (steps + 1) % kSlots, steps + 1, steps + 1, 0, 2).status());
    }
  }
  // ---- B: a job of world size 1 ----
  g_phase = "lock + leftovers";
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> jd, JobDir::OpenForWrite(kJob, 0, 1, env));
  {
    Result<std::unique_ptr<JobDir>> second = JobDir::OpenForWrite(kJob, 0, 1, env);
    if (second.ok()) return Status::Internal("a second writer was not refused");
    if (second.status().code() != StatusCode::kFailedPrecondition) return second.status();
  }
  g_phase = "set-aside";
  NONSTOP_RETURN_IF_ERROR(jd->SetAside(1).status());
  g_phase = "reshard (select common, agreed record)";
  NONSTOP_ASSIGN_OR_RETURN(CommonSelection cs, jd->SelectCommon(2, {}, 2));
  if (cs.step < m.floor2) return Status::Internal("reshard lost step " + std::to_string(m.floor2));
  AgreedRecord a;
  a.step = cs.step;
  a.counter = -1;
  a.resharded_from = JobDirNames::World(2);
  a.resharded_from_world = 2;
  NONSTOP_RETURN_IF_ERROR(jd->WriteAgreed(a));

  uint64_t slot_bytes = 32 << 10;
  g_phase = "create slot file (temp, rename)";
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> sf, NewSlotFile(*jd, 1, slot_bytes, true));
  NONSTOP_ASSIGN_OR_RETURN(uint64_t counter, jd->NextCounter(0));
  int64_t step = cs.step;
  int newest_slot = -1, protected_slot = -1;  // -1: none
  std::optional<uint64_t> protected_counter;
  const int ops = 5 + static_cast<int>(rng() % 6);
  for (int op = 0; op < ops; ++op) {
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 5 || m.floor == 0) {  // commit (and maybe keep)
      uint32_t slot = 0;
      while (static_cast<int>(slot) == newest_slot || static_cast<int>(slot) == protected_slot) ++slot;
      ++step;
      m.step_of[counter] = step;
      g_phase = "commit";
      NONSTOP_ASSIGN_OR_RETURN(CheckpointInfo info, CommitStep(*sf, slot, counter, step, 0, 1));
      m.floor = counter;
      newest_slot = static_cast<int>(slot);
      protected_slot = -1;  // a newer checkpoint of this lineage committed
      protected_counter.reset();
      ++counter;
      if (rng() % 2) {
        g_phase = "keep copy";
        NONSTOP_RETURN_IF_ERROR(jd->Keep(*sf, info));
        m.kept[info.step] = info.counter;
      }
    } else if (kind < 7) {  // restore an older step: a rollback
      g_phase = "lineage (restore an older step)";
      NONSTOP_ASSIGN_OR_RETURN(std::vector<ListedCheckpoint> list, jd->List(0));
      std::vector<int64_t> older;
      for (const auto& l : list) {
        if (l.state == ListedCheckpoint::State::kCommitted && l.counter < m.floor) older.push_back(l.step);
      }
      if (older.empty()) continue;
      SelectOptions o;
      o.step = older[rng() % older.size()];
      Result<Selection> got = jd->Select(0, o);
      // A listed record whose slot was reused since (data overwritten) does
      // not verify: nothing to restore there.
      if (!got.ok() && got.status().code() == StatusCode::kCorruption) continue;
      NONSTOP_ASSIGN_OR_RETURN(Selection sel, std::move(got));
      if (!sel.chosen) return Status::Internal("a listed step cannot be selected");
      const CheckpointInfo& info = sel.chosen->info;
      m.pending_restore = info.counter;
      m.floor_before_restore = m.floor;
      NONSTOP_RETURN_IF_ERROR(jd->RecordRestore(0, info.counter));
      for (const auto& [c, s] : m.step_of) {
        if (c > info.counter) m.abandoned.insert(c);
      }
      m.pending_restore = 0;
      m.floor = info.counter;
      step = info.step;
      NONSTOP_ASSIGN_OR_RETURN(counter, jd->NextCounter(0));
      // The engine keeps the restored checkpoint's slot until a newer one commits.
      newest_slot = -1;
      protected_slot = sel.chosen->location.keep ? -1 : static_cast<int>(info.slot);
      protected_counter = info.counter;
    } else if (kind < 9 && !protected_counter) {  // a slot-file resize
      g_phase = "resize (temp file, commit, rename over)";
      slot_bytes = slot_bytes == (32u << 10) ? (48u << 10) : (32u << 10);
      NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<SlotFile> nf, NewSlotFile(*jd, 1, slot_bytes, false));
      ++step;
      m.step_of[counter] = step;
      NONSTOP_RETURN_IF_ERROR(CommitStep(*nf, 0, counter, step, 0, 1).status());
      NONSTOP_RETURN_IF_ERROR(jd->PublishTempSlot());  // the first commit makes it the file
      m.floor = counter;
      ++counter;
      newest_slot = 0;
      sf = std::move(nf);
    } else {  // a reader (an evaluation process) meanwhile
      g_phase = "reader";
      NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> rd, JobDir::OpenForRead(kJob, env));
      NONSTOP_ASSIGN_OR_RETURN(Selection sel, rd->Select(0));
      if (!sel.chosen || sel.chosen->info.counter != m.floor) {
        return Status::Internal("a reader did not see checkpoint #" + std::to_string(m.floor));
      }
    }
  }
  return Status::OK();
}

struct Tally {
  int corrupt = 0;
  int lost = 0;
  std::vector<std::string> failures;
};

// A restarted job's view: returns an error only for a crash during recovery.
Status Recover(Env* env, FaultEnv* fenv, const Model& m, Tally& t, const std::string& where) {
  auto fail = [&](int& count, const std::string& why) {
    ++count;
    if (t.failures.size() < 10) t.failures.push_back(where + ": " + why);
  };
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<JobDir> jd, JobDir::OpenForWrite(kJob, 0, 1, env));
  // Leftovers are gone and interrupted keep copies redone.
  const std::string dump = fenv->Dump();
  {
    size_t b = 0;
    while (b < dump.size()) {
      size_t e = dump.find('\n', b);
      if (e == std::string::npos) e = dump.size();
      const std::string line = dump.substr(b, e - b);
      b = e + 1;
      if (line.rfind("f job/keep/", 0) == 0 && line.find(".tmp") != std::string::npos) {
        fail(t.lost, "a keep temp file survives a writer's open: " + line);
      }
      if (line.rfind("f job/rank-00000.nsck.tmp", 0) == 0) {
        fail(t.lost, "the temp slot file survives a writer's open");
      }
      if (line.rfind("d job/keep/step-", 0) == 0) {
        const std::string dir = line.substr(2);
        if (dump.find("f " + dir + "/rank-00000.nsck ") == std::string::npos) {
          fail(t.lost, "half-made keep dir survives: " + dir);
        }
      }
    }
  }
  NONSTOP_RETURN_IF_ERROR(jd->SetAside(1).status());
  std::string why;
  // The world-2 checkpoint committed on both ranks (set aside by now).
  if (m.floor2 > 0) {
    Result<CommonSelection> cs = jd->SelectCommon(2, {}, 2);
    if (!cs.ok()) {
      if (cs.status().message().find("device crashed") != std::string::npos) return cs.status();
      fail(t.lost, "world-2 step " + std::to_string(m.floor2) + ": " + cs.status().ToString());
    } else if (cs.value().step < m.floor2) {
      fail(t.lost, "world-2 step " + std::to_string(m.floor2) + " lost, got " +
                       std::to_string(cs.value().step));
    } else {
      for (int r = 0; r < 2; ++r) {
        Selected& s = cs.value().ranks[r];
        if (!SameContent(*s.file, s.info, r, 2, &why)) fail(t.corrupt, "world-2 rank " + std::to_string(r) + ": " + why);
      }
    }
  }
  // The world-1 job's newest checkpoint of its lineage.
  if (m.floor > 0 || m.pending_restore) {
    Result<Selection> sel = jd->Select(0);
    if (!sel.ok()) {
      if (sel.status().message().find("device crashed") != std::string::npos) return sel.status();
      fail(t.lost, "checkpoint #" + std::to_string(m.floor) + ": " + sel.status().ToString());
    } else if (!sel.value().chosen) {
      fail(t.lost, "checkpoint #" + std::to_string(m.floor) + ": nothing found");
    } else {
      const Selected& c = *sel.value().chosen;
      const uint64_t got = c.info.counter;
      const bool ok_floor = got >= m.floor ||
                            (m.pending_restore && got == m.pending_restore) ||
                            (m.pending_restore && got >= m.floor_before_restore);
      if (m.abandoned.count(got)) {
        fail(t.corrupt, "checkpoint #" + std::to_string(got) + " of an abandoned lineage came back");
      } else if (!ok_floor) {
        fail(t.lost, "checkpoint #" + std::to_string(m.floor) + " lost, got #" + std::to_string(got));
      } else if (!m.step_of.count(got) || m.step_of.at(got) != c.info.step) {
        fail(t.corrupt, "checkpoint #" + std::to_string(got) + " was never written");
      } else if (!SameContent(*c.file, c.info, 0, 1, &why)) {
        fail(t.corrupt, "checkpoint #" + std::to_string(got) + ": " + why);
      }
    }
  }
  // The listing (the planner's Classify) never shows an abandoned checkpoint
  // as committed: `nonstop ls` and the exports agree with the selection.
  if (m.floor > 0 || m.pending_restore) {
    Result<std::vector<ListedCheckpoint>> listed = jd->List(0);
    if (!listed.ok()) {
      if (listed.status().message().find("device crashed") != std::string::npos) {
        return listed.status();
      }
      fail(t.corrupt, "List after recovery: " + listed.status().ToString());
    } else {
      for (const ListedCheckpoint& l : listed.value()) {
        if (l.state == ListedCheckpoint::State::kCommitted && m.abandoned.count(l.counter)) {
          fail(t.corrupt, "List shows abandoned #" + std::to_string(l.counter) + " committed");
        }
      }
    }
  }
  // The keep copies reported made (of the live lineage): the newest and the oldest.
  std::vector<std::pair<int64_t, uint64_t>> kept;
  for (const auto& [step, counter] : m.kept) {
    if (m.abandoned.count(counter) || (m.pending_restore && counter > m.pending_restore)) continue;
    kept.emplace_back(step, counter);
  }
  if (kept.size() > 2) kept.erase(kept.begin() + 1, kept.end() - 1);
  for (const auto& [step, counter] : kept) {
    SelectOptions o;
    o.step = step;
    Result<Selection> sel = jd->Select(0, o);
    if (!sel.ok() || !sel.value().chosen) {
      if (!sel.ok() && sel.status().message().find("device crashed") != std::string::npos) {
        return sel.status();
      }
      fail(t.lost, "kept step " + std::to_string(step) + ": " +
                       (sel.ok() ? std::string("nothing") : sel.status().ToString()));
      continue;
    }
    const Selected& c = *sel.value().chosen;
    if (c.info.counter < counter) {
      fail(t.lost, "kept step " + std::to_string(step) + " #" + std::to_string(counter) +
                       " lost, got #" + std::to_string(c.info.counter));
    } else if (m.abandoned.count(c.info.counter)) {
      fail(t.corrupt, "kept step " + std::to_string(step) + ": abandoned #" +
                          std::to_string(c.info.counter) + " came back");
    } else if (!SameContent(*c.file, c.info, 0, 1, &why)) {
      fail(t.corrupt, "kept step " + std::to_string(step) + ": " + why);
    }
  }
  // The agreed record is either missing or whole.
  Result<std::optional<AgreedRecord>> agreed = jd->ReadAgreed(0);
  if (!agreed.ok()) {
    if (agreed.status().message().find("device crashed") != std::string::npos) return agreed.status();
    fail(t.corrupt, "agreed record: " + agreed.status().ToString());
  }
  return Status::OK();
}

TEST(JobDirCrashTest, RandomCrashPointsRecoverEveryCommittedCheckpoint) {
  const int points = CrashPoints();
  std::mt19937_64 rng(20261124);
  Tally t;
  int recovered = 0, second_crashes = 0;
  std::map<std::string, int> crashed_in;  // op name -> count, to show the spread
  const auto t0 = std::chrono::steady_clock::now();
  // Episodes: each is run once without a crash to count its calls (and to
  // check its answers), then crashed at kPointsPerEpisode random calls.
  constexpr int kPointsPerEpisode = 10;
  uint64_t seed = 0, total = 0;
  for (int i = 0; i < points; ++i) {
    if (i % kPointsPerEpisode == 0) {
      seed = rng();
      auto env = FaultEnv::Create();
      Model m;
      Status s = Episode(seed, env.get(), m);
      ASSERT_TRUE(s.ok()) << "episode " << seed << " without a crash: " << s.ToString();
      total = env->calls();
    }
    auto env = FaultEnv::Create();
    const uint64_t nth = 1 + rng() % total;
    const CrashMode mode = rng() % 2 ? CrashMode::kTornUnsynced : CrashMode::kDropUnsynced;
    env->CrashOnCall(nth, mode, rng());
    Model m;
    Status s = Episode(seed, env.get(), m);
    // The crash happened (a step may have gone on with handles opened after
    // it, as a new process would, and failed or not).
    ASSERT_EQ(env->crashes(), 1u) << "no crash at call " << nth << " of " << total;
    ASSERT_TRUE(s.ok() || s.message().find("device crashed") != std::string::npos ||
                s.code() == StatusCode::kInternal)
        << "episode " << seed << " call " << nth << ": " << s.ToString();
    crashed_in[g_phase]++;
    env->ClearFaults();
    const int before = t.corrupt + t.lost;
    const std::string where = "seed " + std::to_string(seed) + " crash at call " +
                              std::to_string(nth) + "/" + std::to_string(total);
    // Sometimes a second crash during the recovery itself.
    if (rng() % 3 == 0) {
      env->CrashOnCall(1 + rng() % 120, rng() % 2 ? CrashMode::kTornUnsynced : CrashMode::kDropUnsynced,
                       rng());
      Tally ignored;
      Status r = Recover(env.get(), env.get(), m, ignored, where + " (first recovery)");
      if (!r.ok()) {
        ASSERT_NE(r.message().find("device crashed"), std::string::npos) << r.ToString();
        ++second_crashes;
      } else {
        t.corrupt += ignored.corrupt;
        t.lost += ignored.lost;
        t.failures.insert(t.failures.end(), ignored.failures.begin(), ignored.failures.end());
      }
      env->ClearFaults();
    }
    Status r = Recover(env.get(), env.get(), m, t, where);
    ASSERT_TRUE(r.ok()) << where << ": recovery failed: " << r.ToString();
    if (t.corrupt + t.lost == before) ++recovered;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("crash points: %d, recovered: %d, corrupt: %d, committed lost: %d\n", points,
              recovered, t.corrupt, t.lost);
  std::printf("(%.1f s; %d second crashes during recovery)\n", secs, second_crashes);
  for (const auto& [phase, n] : crashed_in) std::printf("  crashed in %-40s %5d\n", phase.c_str(), n);
  for (const auto& f : t.failures) std::printf("  %s\n", f.c_str());
  EXPECT_GE(points, 1);
  EXPECT_EQ(recovered, points);
  EXPECT_EQ(t.corrupt, 0);
  EXPECT_EQ(t.lost, 0);
}

}  // namespace
}  // namespace nonstop
