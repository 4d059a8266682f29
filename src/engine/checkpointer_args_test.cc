#include "engine/checkpointer_args.h"

#include <gtest/gtest.h>

#include "nonstop/store.h"

#include <string>
#include <vector>

namespace nonstop {
namespace {

// The message of CheckCheckpointerArgs(a), "" when a is legal.
std::string Why(const CheckpointerArgs& a) {
  Result<EngineChoices> r = CheckCheckpointerArgs(a);
  if (!r.ok()) {
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  return r.ok() ? "" : r.status().message();
}

EngineChoices Choices(const CheckpointerArgs& a) {
  Result<EngineChoices> r = CheckCheckpointerArgs(a);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? r.value() : EngineChoices{};
}

TEST(CheckpointerArgsTest, TheDefaultsAndEachModeAreLegal) {
  CheckpointerArgs a;
  EngineChoices e = Choices(a);
  EXPECT_EQ(e.disk_every, 1);
  EXPECT_EQ(e.keep_every, 0);
  EXPECT_FALSE(e.device_snapshot_bytes.has_value());
  EXPECT_EQ(e.memory_tier, "");
  EXPECT_EQ(e.layer_copy, "");
  for (const char* m : {"concurrent", "layerwise", "multistep", "auto"}) {
    a.mode = Arg::Text(m);
    EXPECT_EQ(Why(a), "") << m;
  }
  a.mode = Arg::Text("concurrent");
  a.every = Arg::Text("auto");
  a.keep = Arg::Int(3);
  a.device_snapshot_bytes = Arg::Int(0);
  a.tier = Arg::Text("memory");
  e = Choices(a);
  EXPECT_EQ(e.keep_every, 3);
  EXPECT_EQ(e.device_snapshot_bytes, 0);
  EXPECT_EQ(e.memory_tier, "memory");
}

TEST(CheckpointerArgsTest, OnlyTheConcurrentModesTakeDeviceSnapshotsOnlyLayerModesACopy) {
  CheckpointerArgs a;
  a.device_snapshot_bytes = Arg::Int(1 << 20);
  EXPECT_EQ(Choices(a).device_snapshot_bytes, 1 << 20);
  a.mode = Arg::Text("auto");
  a.copy = Arg::Text("device");
  EngineChoices e = Choices(a);
  EXPECT_EQ(e.device_snapshot_bytes, 1 << 20);
  EXPECT_EQ(e.layer_copy, "device");
  a = {};
  a.mode = Arg::Text("layerwise");
  e = Choices(a);
  EXPECT_EQ(e.device_snapshot_bytes, 0);  // never the engine's default
  EXPECT_EQ(e.layer_copy, "host");
  a.copy = Arg::Text("gpu");
  EXPECT_EQ(Why(a), "unknown copy 'gpu'; use host, direct or device");
  a.copy = Arg::Other("3");
  EXPECT_EQ(Why(a), "unknown copy 3; use host, direct or device");
  a = {};
  a.mode = Arg::Text("multistep");
  EXPECT_EQ(Choices(a).device_snapshot_bytes, 0);
  EXPECT_EQ(Choices(a).layer_copy, "");
}

TEST(CheckpointerArgsTest, EachBadValueIsNamedWithItsRepr) {
  struct Case {
    void (*set)(CheckpointerArgs*);
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](CheckpointerArgs* a) { a->mode = Arg::Text("fast"); },
       "mode 'fast' is not available in this version; use one of concurrent, layerwise, "
       "multistep, auto"},
      {[](CheckpointerArgs* a) { a->every = Arg::Int(0); },
       "every must be a positive integer or \"auto\", got 0"},
      {[](CheckpointerArgs* a) { a->every = Arg::Other("True"); },
       "every must be a positive integer or \"auto\", got True"},
      {[](CheckpointerArgs* a) { a->keep = Arg::Int(0); },
       "keep must be None or a positive integer, got 0"},
      {[](CheckpointerArgs* a) { a->keep = Arg::Real(2.5, "2.5"); },
       "keep must be None or a positive integer, got 2.5"},
      {[](CheckpointerArgs* a) { a->max_in_flight = Arg::Int(0); },
       "max_in_flight must be a positive integer, got 0"},
      {[](CheckpointerArgs* a) { a->tier = Arg::Text("ssd"); },
       "tier must be \"auto\", \"memory\" or \"disk\", got 'ssd'"},
      {[](CheckpointerArgs* a) { a->device_snapshot_bytes = Arg::Int(-1); },
       "device_snapshot_bytes must be None or a non-negative integer, got -1"},
      {[](CheckpointerArgs* a) { a->disk_every = Arg::Text("often"); },
       "disk_every must be a positive integer or \"auto\", got 'often'"},
      {[](CheckpointerArgs* a) { a->disk_every = Arg::Int(-2); },
       "disk_every must be a positive integer or \"auto\", got -2"},
  };
  for (const Case& c : cases) {
    CheckpointerArgs a;
    c.set(&a);
    EXPECT_EQ(Why(a), c.message);
  }
}

TEST(CheckpointerArgsTest, CombinationsOnlySomeModesTake) {
  CheckpointerArgs a;
  a.every = Arg::Text("auto");
  a.mode = Arg::Text("layerwise");
  EXPECT_EQ(Why(a), "every=\"auto\" works with mode=\"concurrent\" only (mode=\"auto\" compares "
                    "the modes over fixed windows: every=N)");
  a = {};
  a.copy = Arg::Text("device");
  EXPECT_EQ(Why(a), "copy= and clip_grad_norm= apply to mode='layerwise' (or 'auto') only");
  a.mode = Arg::Text("auto");
  EXPECT_EQ(Why(a), "");
  a = {};
  a.clip_grad_norm = true;
  EXPECT_EQ(Why(a), "copy= and clip_grad_norm= apply to mode='layerwise' (or 'auto') only");
  a = {};
  a.replay = Arg::Text("host");
  EXPECT_EQ(Why(a), "replay= applies to mode='multistep' only");
  a.mode = Arg::Text("multistep");
  EXPECT_EQ(Why(a), "");
  a.device_snapshot_bytes = Arg::Int(1 << 20);
  EXPECT_EQ(Why(a), "device_snapshot_bytes= applies to mode='auto' or mode='concurrent' only");
  a.device_snapshot_bytes = Arg::Int(0);  // off: any mode
  EXPECT_EQ(Why(a), "");
}

TEST(CheckpointerArgsTest, SeveralRanksRefuseSingleProcessModesAndTheTieredCadence) {
  CheckpointerArgs a;
  a.world_size = 2;
  EXPECT_EQ(Why(a), "");
  a.mode = Arg::Text("auto");
  EXPECT_EQ(Why(a), "mode='auto' is single-process only for now; with world_size > 1 choose "
                    "mode='concurrent' or 'layerwise'");
  a.mode = Arg::Text("multistep");
  EXPECT_EQ(Why(a), "mode 'multistep' is single-process only for now; use mode='concurrent' "
                    "with world_size > 1");
  a = {};
  a.world_size = 2;
  a.best = true;
  a.every = Arg::Text("auto");
  EXPECT_EQ(Why(a), "best= with world_size > 1 needs every=N: every rank must checkpoint the "
                    "same steps (their metrics are agreed at each checkpoint)");
  a.world_size = 1;
  EXPECT_EQ(Why(a), "");
  const std::string tiered =
      "disk_every != 1 needs the memory tier (tier='auto' or 'memory'), mode='concurrent', "
      "'layerwise' or 'auto', and world_size 1";
  a = {};
  a.disk_every = Arg::Text("auto");
  EXPECT_EQ(Choices(a).disk_every, 0);
  a.disk_every = Arg::Int(4);
  EXPECT_EQ(Choices(a).disk_every, 4);
  a.world_size = 2;
  EXPECT_EQ(Why(a), tiered);
  a.world_size = 1;
  a.tier = Arg::Text("disk");
  EXPECT_EQ(Why(a), tiered);
  a.tier = Arg::Text("auto");
  a.mode = Arg::Text("multistep");
  EXPECT_EQ(Why(a), tiered);
}

const std::vector<std::string> kKnown = {"every", "mode", "max_in_flight", "writers",
                                         "staging_bytes", "chunk_bytes", "medium",
                                         "copy_threads", "max_overhead"};

ConfigItem Item(const std::string& key, Arg v) { return {key, "'" + key + "'", std::move(v)}; }

std::string ConfigWhy(const std::vector<ConfigItem>& items) {
  auto r = CheckConfigFile("c.json", items, kKnown);
  return r.ok() ? "" : r.status().message();
}

TEST(CheckpointerArgsTest, AConfigFileSetsKnownSettingsAndSkipsRecords) {
  const std::vector<ConfigItem> items = {
      Item("format", Arg::Text(kConfigFormat)), Item("every", Arg::Int(75)),
      Item("tune", Arg::Other("{}")), Item("max_overhead", Arg::Int(0) /* replaced below */),
      Item("medium", Arg::Text("auto")), Item("writers", Arg())};
  std::vector<ConfigItem> good = items;
  good[3].value = Arg::Real(0.05, "0.05");
  auto r = CheckConfigFile("c.json", good, kKnown);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const std::vector<ConfigSetting>& s = r.value();
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].name, "every");
  EXPECT_EQ(s[0].item, 1u);
  EXPECT_EQ(s[1].name, "max_overhead");
  EXPECT_TRUE(s[1].real);
  EXPECT_EQ(s[2].name, "medium");
  EXPECT_FALSE(s[2].real);
  EXPECT_EQ(s[3].name, "writers");  // None: the default
  EXPECT_EQ(ConfigWhy(items),
            "config c.json: max_overhead must be a fraction in (0, 1), e.g. 0.03, got 0");
}

TEST(CheckpointerArgsTest, ATuneJsonOutputSetsEveryFromItsInterval) {
  auto r = CheckConfigFile("t.json",
                           std::vector<ConfigItem>{Item("max_in_flight", Arg::Int(2)),
                                                   Item("chunks", Arg::Int(9)),
                                                   Item("interval", Arg::Int(12))},
                           kKnown);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r.value().size(), 2u);
  EXPECT_EQ(r.value()[1].name, "every");
  EXPECT_EQ(r.value()[1].item, 2u);
  // without `interval` it is a config file, where `chunks` is unknown
  EXPECT_EQ(ConfigWhy({Item("max_in_flight", Arg::Int(2)), Item("chunks", Arg::Int(9))}),
            "config c.json: unknown setting 'chunks'; known: every, mode, max_in_flight, "
            "writers, staging_bytes, chunk_bytes, medium, copy_threads, max_overhead");
}

TEST(CheckpointerArgsTest, AConfigFileRefusesWrongFormatsTypesAndRanges) {
  auto r = CheckConfigFile("c.json", std::nullopt, kKnown);
  EXPECT_EQ(r.status().message(), "config c.json: expected a JSON object");
  EXPECT_EQ(ConfigWhy({Item("format", Arg::Text("other/2"))}),
            "config c.json: format 'other/2' is not 'nonstop.config/1'");
  EXPECT_EQ(ConfigWhy({Item("every", Arg::Int(0))}),
            "config c.json: every must be a positive integer or \"auto\", got 0");
  EXPECT_EQ(ConfigWhy({Item("every", Arg::Text("often"))}),
            "config c.json: every must be a positive integer or \"auto\", got 'often'");
  EXPECT_EQ(ConfigWhy({Item("every", Arg::Text("auto"))}), "");
  EXPECT_EQ(ConfigWhy({Item("writers", Arg::Int(-1))}),
            "config c.json: writers must be a non-negative integer, got -1");
  EXPECT_EQ(ConfigWhy({Item("copy_threads", Arg::Other("True"))}),
            "config c.json: copy_threads must be a non-negative integer, got True");
  EXPECT_EQ(ConfigWhy({Item("mode", Arg::Int(3))}), "config c.json: mode must be a string, got 3");
  EXPECT_EQ(ConfigWhy({Item("max_overhead", Arg::Int(3))}),
            "config c.json: max_overhead must be a fraction in (0, 1), e.g. 0.03, got 3");
}

TEST(CheckpointerArgsTest, TheFirstCheckpointEstimatePadsTensorsAndAddsFreshMoments) {
  EXPECT_EQ(EstimateFirstCheckpointBytes({}, {}), 0u);
  EXPECT_EQ(EstimateFirstCheckpointBytes({100, 8}, {}), 108u + 2 * kStoreAlign);
  // Adam: two moments of each parameter and a `step`; SGD with momentum: one
  EXPECT_EQ(EstimateFirstCheckpointBytes({100}, {{2, {100, 40}}}),
            100 + kStoreAlign + 2 * (100 + kStoreAlign) + 64 + 2 * (40 + kStoreAlign) + 64);
  EXPECT_EQ(EstimateFirstCheckpointBytes({}, {{1, {40}}, {0, {8, 8}}}), 40 + kStoreAlign + 3 * 64);
}


// The first misfit between a live state and a checkpoint, "" when it fits.
std::string Misfit(const std::vector<std::string>& keys, const std::vector<LiveState>& live,
                   const std::vector<TensorDesc>& saved) {
  const Status s = CheckStateFits("checkpoint step 3 in /d", 3, "/d", keys, live, saved);
  if (!s.ok()) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  }
  return s.ok() ? "" : s.message();
}

TEST(CheckpointerArgsTest, TheStateFitsACheckpointOrTheFirstMisfitIsNamed) {
  const TensorDesc w{"model/w", "float32", {32, 16}};
  const TensorDesc b{"model/b", "float32", {16}};
  const TensorDesc m{"optim/state/0/exp_avg", "float32", {32, 16}};
  LiveState model{"model", "'model'", {w, b}, true, {}, {}};
  LiveState optim{"optim", "'optim'", {m}, false, {2}, {2}};
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {w, b, m}), "");
  // An optimizer's state may lack a tensor (no step yet); a module's may not.
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {w, b}), "");
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {w, m}),
            "tensor 'model/b' is not in checkpoint step 3 in /d");
  EXPECT_EQ(Misfit({"model"}, {model, optim}, {w, b, m}),
            "checkpoint step 3 in /d has no state 'optim' (it has model)");
  EXPECT_EQ(Misfit({}, {model}, {}),
            "checkpoint step 3 in /d has no state 'model' (it has nothing)");
  // A key is missing before any tensor differs.
  EXPECT_EQ(Misfit({"model"}, {model, optim}, {{"model/w", "float16", {32, 16}}, b}),
            "checkpoint step 3 in /d has no state 'optim' (it has model)");
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {{"model/w", "float32", {32, 8}}, b, m}),
            "tensor 'model/w': checkpoint step 3 has float32[32, 8], the state has "
            "float32[32, 16]");
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {{"model/w", "bfloat16", {32, 16}}, b, m}),
            "tensor 'model/w': checkpoint step 3 has bfloat16[32, 16], the state has "
            "float32[32, 16]");
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {w, {"model/b", "float32", {}}, m}),
            "tensor 'model/b': checkpoint step 3 has float32[], the state has float32[16]");
  // An optimizer's state tensor that differs is a misfit too.
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {w, b, {m.name, "float32", {16, 32}}}),
            "tensor 'optim/state/0/exp_avg': checkpoint step 3 has float32[16, 32], the state "
            "has float32[32, 16]");
  optim.saved_groups = {1, 1};
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {w, b, m}),
            "checkpoint step 3 in /d: optimizer 'optim' has parameter groups of sizes [1, 1], "
            "the live optimizer [2]");
  // Keys in order: the model's misfit is named before the optimizer's.
  EXPECT_EQ(Misfit({"model", "optim"}, {model, optim}, {w, m}),
            "tensor 'model/b' is not in checkpoint step 3 in /d");
}

// CheckOptionNames's message, "" when every name is known.
std::string Names(const std::vector<std::string>& given, const std::vector<std::string>& known) {
  const Status s = CheckOptionNames("W", given, known, {"dir", "state"});
  return s.ok() ? "" : s.message();
}

TEST(CheckpointerArgsTest, AnIntegrationsUnknownOrOwnOptionIsNamedWithTheClosestKnownOne) {
  const std::vector<std::string> known = {"every", "mode", "max_in_flight", "keep", "tier",
                                          "max_to_keep", "peer_every", "replicas", "best"};
  EXPECT_EQ(Names({"keep", "tier"}, known), "");
  EXPECT_EQ(Names({"keep", "state"}, known), "W sets state= itself");
  const std::string tail = "; the options are nonstop.Checkpointer's (docs/PYTHON.md)";
  // What Python's difflib.get_close_matches(name, known, n=1) answers.
  EXPECT_EQ(Names({"kep"}, known), "W: unknown option kep= (did you mean keep=?)" + tail);
  EXPECT_EQ(Names({"max_in_fligth"}, known),
            "W: unknown option max_in_fligth= (did you mean max_in_flight=?)" + tail);
  EXPECT_EQ(Names({"maxtokeep"}, known),
            "W: unknown option maxtokeep= (did you mean max_to_keep=?)" + tail);
  EXPECT_EQ(Names({"peer_evry"}, known),
            "W: unknown option peer_evry= (did you mean peer_every=?)" + tail);
  EXPECT_EQ(Names({"replica"}, known),
            "W: unknown option replica= (did you mean replicas=?)" + tail);
  EXPECT_EQ(Names({"bst"}, known), "W: unknown option bst= (did you mean best=?)" + tail);
  EXPECT_EQ(Names({"xyz"}, known), "W: unknown option xyz=" + tail);
  // Ties go to the greater name; a ratio of exactly 0.6 is close enough, below is not.
  EXPECT_EQ(Names({"a"}, {"ab", "ba"}), "W: unknown option a= (did you mean ba=?)" + tail);
  EXPECT_EQ(Names({"a"}, {"ba", "ab"}), "W: unknown option a= (did you mean ba=?)" + tail);
  EXPECT_EQ(Names({"abc"}, {"abcwxyz"}), "W: unknown option abc= (did you mean abcwxyz=?)" + tail);
  EXPECT_EQ(Names({"abc"}, {"abwxyzz", "abxy"}), "W: unknown option abc=" + tail);
  // The first bad name is reported.
  EXPECT_EQ(Names({"keep", "kep", "dir"}, known),
            "W: unknown option kep= (did you mean keep=?)" + tail);
}
}  // namespace
}  // namespace nonstop
