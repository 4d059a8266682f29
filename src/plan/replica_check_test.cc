// The replica check's decisions on gathered names' counts and digests.
#include "plan/replica_check.h"

#include <gtest/gtest.h>

namespace nonstop::dist {
namespace {

TEST(ReplicaCheckTest, TheSameNamesOnEveryRank) {
  EXPECT_TRUE(CheckReplicaNames(1, {{3, 77}, {3, 77}, {3, 77}}).ok());
  Status s = CheckReplicaNames(0, {{3, 77}, {3, 77}, {4, 12}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "rank 0 and rank 2 hold different state: 3 and 4 tensors treated as replicated; every "
            "rank must give the same state (rank-local keys under local=)");
  // the same count, other names (crc)
  EXPECT_EQ(CheckReplicaNames(1, {{3, 77}, {3, 78}}).message().rfind("rank 1 and rank 0 ", 0), 0u);
  EXPECT_EQ(CheckReplicaNames(2, {{3, 77}}).code(), StatusCode::kInternal);
}

TEST(ReplicaCheckTest, TheFirstTensorThatDiffersIsNamedWithLocal) {
  const std::vector<std::string> names = {"model/w", "extra/seen", "step"};
  EXPECT_TRUE(CheckReplicaDigests(names, {{1, 2, 3}, {1, 2, 3}}).ok());
  EXPECT_TRUE(CheckReplicaDigests({}, {{0}, {0}}).ok());  // nothing replicated: a placeholder
  Status s = CheckReplicaDigests(names, {{1, 2, 3}, {1, 2, 3}, {1, 5, 4}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "state['extra']: tensor 'extra/seen' is treated as replicated but differs between "
            "rank 0 and rank 2; if it is rank-local state, pass local=['extra'] to the "
            "Checkpointer");
  EXPECT_NE(CheckReplicaDigests(names, {{1, 2, 3}, {1, 2, 9}}).message().find("state['step']"),
            std::string::npos);
  EXPECT_EQ(CheckReplicaDigests(names, {{1, 2, 3}, {1}}).code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace nonstop::dist
