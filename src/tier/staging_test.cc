// The remote tier's staging (tier/staging.h) on the fault-injecting Env: the
// one-slot copy of a committed checkpoint is made (and verified), a copy of
// the same counter is kept, another one or a planted link is replaced, the
// lineage comes from the checkpoint's metadata; old staged folders go.
#include "tier/staging.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "env/fault_env.h"
#include "nonstop/store.h"
#include "store_test_util.h"

namespace nonstop::tier {
namespace {

using namespace nonstop::testing;  // NOLINT: the store tests' helpers

// rank 0's slot file in /job with checkpoints of steps 3 (counter 1) and 4
// (counter 2); the second's metadata names run 77.
void MakeSlotFile(FaultEnv* env) {
  auto job = env->OpenDirectory("/job", true).value();
  auto m = job->CreateFile(SlotFileName(0), MediumKind::kBuffered, MediumOptions{}).value();
  StoreGeometry g;
  g.slots = 2;
  g.slot_bytes = kTestSlotBytes;
  auto f = SlotFile::Create(std::move(m), g).value();
  ASSERT_TRUE(WriteAndCommit(*f, MakeCheckpoint(3), 0, 1).ok());
  TestCheckpoint c = MakeCheckpoint(4);
  c.meta_json = "{\"step\": 4, \"dist\": {\"lineage\": 77, \"world\": 2}}";
  ASSERT_TRUE(WriteAndCommit(*f, c, 1, 2).ok());
}

TEST(Staging, CopiesKeepsAndReplacesTheStagedCopy) {
  auto env = FaultEnv::Create();
  MakeSlotFile(env.get());
  auto got = StageCopy(env.get(), "/job", 0, 2, 4);
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got.value().dir, "/job/remote/step-000000000004");
  EXPECT_EQ(got.value().name, "rank-00000.nsck");
  EXPECT_EQ(got.value().counter, 2u);
  EXPECT_EQ(got.value().lineage, 77);
  {  // a one-slot file holding exactly checkpoint 2
    auto d = env->OpenDirectory(got.value().dir, false).value();
    MediumOptions ro;
    ro.read_only = true;
    auto f = SlotFile::Open(d->OpenFile("rank-00000.nsck", MediumKind::kBuffered, ro).value());
    ASSERT_TRUE(f.ok());
    auto rep = f.value()->Scan();
    ASSERT_TRUE(rep.ok());
    ASSERT_EQ(rep.value().checkpoints.size(), 1u);
    EXPECT_EQ(rep.value().checkpoints[0].info.counter, 2u);
  }
  // staged again (a restart): kept, nothing copied (no file created)
  const uint64_t creates = env->calls(EnvOp::kCreateFile);
  ASSERT_TRUE(StageCopy(env.get(), "/job", 0, 2, 4).ok());
  EXPECT_EQ(env->calls(EnvOp::kCreateFile), creates);
  // the step's folder holds another counter's copy: replaced
  auto other = StageCopy(env.get(), "/job", 0, 1, 4);
  ASSERT_TRUE(other.ok()) << other.status().message();
  EXPECT_EQ(other.value().counter, 1u);
  EXPECT_EQ(other.value().lineage, 0);  // one process: no dist.lineage
  // a link planted at the copy's name: removed, never followed
  ASSERT_TRUE(env->OpenDirectory("/outside", true).ok());
  ASSERT_TRUE(env->OpenDirectory("/job/remote/step-000000000003", true).ok());
  ASSERT_TRUE(env->PlantSymlink("/job/remote/step-000000000003", "rank-00000.nsck",
                                "/outside/precious").ok());
  ASSERT_TRUE(StageCopy(env.get(), "/job", 0, 1, 3).ok());
  {  // exactly checkpoint 1: its tables, metadata and every tensor's bytes
    auto d = env->OpenDirectory("/job/remote/step-000000000003", false).value();
    MediumOptions ro;
    ro.read_only = true;
    auto f = SlotFile::Open(d->OpenFile("rank-00000.nsck", MediumKind::kBuffered, ro).value());
    ASSERT_TRUE(f.ok());
    auto rep = f.value()->Scan();
    ASSERT_TRUE(rep.ok() && rep.value().checkpoints.size() == 1u);
    Status same = CheckContent(*f.value(), rep.value().checkpoints[0].info);
    EXPECT_TRUE(same.ok()) << same.message();
  }
  EXPECT_NE(env->Dump().find("f job/remote/step-000000000003/rank-00000.nsck"),
            std::string::npos) << env->Dump();
  // a counter the slot file does not hold committed: NotFound, nothing left
  EXPECT_EQ(StageCopy(env.get(), "/job", 0, 9, 5).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(env->Dump().find("step-000000000005/rank-00000.nsck"), std::string::npos);

  // the older staged folders go, a link among them as a link
  ASSERT_TRUE(env->PlantSymlink("/job/remote", "step-000000000001", "/outside").ok());
  EXPECT_TRUE(DropStaged(env.get(), "/job", 4).empty());
  const std::string dump = env->Dump();
  EXPECT_EQ(dump.find("job/remote/step-000000000003"), std::string::npos) << dump;
  EXPECT_EQ(dump.find("job/remote/step-000000000001"), std::string::npos) << dump;
  EXPECT_NE(dump.find("job/remote/step-000000000004/rank-00000.nsck"), std::string::npos);
  EXPECT_NE(dump.find("d outside"), std::string::npos) << dump;
}

}  // namespace
}  // namespace nonstop::tier
