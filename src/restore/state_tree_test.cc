// State tree rewrites (state_tree.h): a ZeRO optimizer's shards consolidated
// into global parameter order with its tensors renamed, refused with one
// line when malformed; DDP's "module." keys removed and added back.
#include "restore/state_tree.h"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

namespace nonstop {
namespace {

using Renames = std::vector<std::tuple<int, std::string, std::string>>;

TEST(StateTreeTest, ConsolidateZeroNumbersStateGloballyAndRenamesTensors) {
  // Rank 0 holds global parameters 0 and 2 (local ids 0, 1), rank 1 holds 1.
  const std::string t0 =
      R"({"state":{"__dict__":[[1,{"step":3,"exp_avg":{"__tensor__":"opt/state/1/exp_avg"}}],)"
      R"([0,{"step":3,"exp_avg":{"__tensor__":"opt/state/0/exp_avg"}}]]},)"
      R"("param_groups":[{"lr":0.1,"params":[0],"betas":{"__tuple__":[0.9,0.999]}},)"
      R"({"params":[1],"lr":1e-05}]})";
  const std::string t1 =
      R"({"state":{"__dict__":[[0,{"step":3,"exp_avg":{"__tensor__":"opt/state/0/exp_avg"}}]]},)"
      R"("param_groups":[{"lr":0.5,"params":[0]},{"params":[],"lr":0.5}]})";
  Result<TreeRewrite> got = ConsolidateZero(
      "opt", {t0, t1},
      {R"({"index":[0,2],"groups":[2,1]})", R"({"index":[1],"groups":[2,1]})"},
      {{"opt/state/0/exp_avg", "opt/state/1/exp_avg"}, {"opt/state/0/exp_avg"}});
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got->tree,
            R"({"state":{"__dict__":[[0,{"step":3,"exp_avg":{"__tensor__":"opt#zero/0/opt/state/0/exp_avg"}}],)"
            R"([1,{"step":3,"exp_avg":{"__tensor__":"opt#zero/1/opt/state/0/exp_avg"}}],)"
            R"([2,{"step":3,"exp_avg":{"__tensor__":"opt#zero/0/opt/state/1/exp_avg"}}]]},)"
            R"("param_groups":[{"lr":0.1,"betas":{"__tuple__":[0.9,0.999]},"params":[0,1]},)"
            R"({"lr":1e-05,"params":[2]}],"nonstop_consolidated_zero":1})");
  EXPECT_EQ(got->renames,
            (Renames{{0, "opt/state/1/exp_avg", "opt#zero/0/opt/state/1/exp_avg"},
                     {0, "opt/state/0/exp_avg", "opt#zero/0/opt/state/0/exp_avg"},
                     {1, "opt/state/0/exp_avg", "opt#zero/1/opt/state/0/exp_avg"}}));
  // No state yet (before the first step): {}.
  got = ConsolidateZero("opt", {R"({"state":{},"param_groups":[{"params":[0]}]})"},
                        {R"({"index":[0],"groups":[1]})"}, {{}});
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got->tree, R"({"state":{},"param_groups":[{"params":[0]}],"nonstop_consolidated_zero":1})");
}

TEST(StateTreeTest, ConsolidateZeroRefusesMalformedRecordsWithOneLine) {
  const std::string layout = R"({"index":[0],"groups":[1]})";
  auto refused = [&](const std::string& tree, const std::string& lay,
                     const std::vector<std::string>& names) {
    Result<TreeRewrite> got = ConsolidateZero("opt", {tree}, {lay}, {names});
    EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << tree;
    return got.status().message();
  };
  EXPECT_EQ(refused(R"({"state":{},"param_groups":[]})", R"({"index":"x"})", {}),
            "the ZeRO optimizer state 'opt' of rank 0: its layout is not {\"index\": [...], "
            "\"groups\": [...]}");
  EXPECT_EQ(refused(R"([1])", layout, {}),
            "the ZeRO optimizer state 'opt' of rank 0: not an optimizer state_dict (state, "
            "param_groups)");
  EXPECT_EQ(refused(R"({"state":{"a":1},"param_groups":[{"params":[0]}]})", layout, {}),
            "the ZeRO optimizer state 'opt' of rank 0: its state is not keyed by parameter ids");
  EXPECT_EQ(refused(R"({"state":{},"param_groups":[{"params":"x"}]})", layout, {}),
            "the ZeRO optimizer state 'opt' of rank 0: a param_group has no list of parameter ids");
  // An id no group holds: ZeroGlobalIds' line.
  EXPECT_NE(refused(R"({"state":{"__dict__":[[5,{}]]},"param_groups":[{"params":[0]}]})", layout,
                    {}).find("names parameter 5, which no param_group holds"),
            std::string::npos);
  EXPECT_EQ(refused(R"({"state":{"__dict__":[[0,{"__tensor__":"gone"}]]},)"
                    R"("param_groups":[{"params":[0]}]})", layout, {"other"}),
            "the ZeRO optimizer state 'opt' of rank 0 refers to tensor \"gone\", which its "
            "checkpoint does not hold");
  EXPECT_EQ(refused("{", layout, {}).empty(), false);
}

TEST(StateTreeTest, RenameModuleKeysBothWays) {
  const std::string ddp =
      R"({"module.w":{"__tensor__":"m/module.w"},"module.n":3,"b":{"__tensor__":"m/b"}})";
  Result<TreeRewrite> got = RenameModuleKeys("m", ddp, false, {"m/module.w", "m/b"});
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->tree, R"({"w":{"__tensor__":"m/w"},"n":3,"b":{"__tensor__":"m/b"}})");
  EXPECT_EQ(got->renames, (Renames{{0, "m/module.w", "m/w"}}));
  got = RenameModuleKeys("m", got->tree, true, {"m/w", "m/b"});
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->tree,
            R"({"module.w":{"__tensor__":"m/module.w"},"module.n":3,)"
            R"("module.b":{"__tensor__":"m/module.b"}})");
  EXPECT_EQ(got->renames, (Renames{{0, "m/w", "m/module.w"}, {0, "m/b", "m/module.b"}}));
  // A name already taken stays where it is; a tree that is not an object as it is.
  got = RenameModuleKeys("m", R"({"module.w":{"__tensor__":"x"}})", false, {"x", "m/w"});
  EXPECT_EQ(got->tree, R"({"w":{"__tensor__":"x"}})");
  EXPECT_TRUE(got->renames.empty());
  EXPECT_EQ(RenameModuleKeys("m", "[1,2.50]", true, {})->tree, "[1,2.50]");
}

}  // namespace
}  // namespace nonstop
