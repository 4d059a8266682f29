// ChooseMultistep and CheckMultistepDevice: which optimizers, devices and
// replays mode="multistep" accepts, and the one line that says why not.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "nonstop/multistep.h"

namespace nonstop {
namespace {

// An optimizer of `name` with `groups` groups of one CPU float32 parameter each.
MultistepOptimizerDesc Opt(const std::string& name, int groups = 1) {
  MultistepOptimizerDesc d;
  d.name = name;
  d.torch_class = true;
  for (int i = 0; i < groups; ++i) {
    d.groups.emplace_back();
    d.groups.back().foreach = false;
    d.tensors.push_back({i, "", "cpu", "float32", true});
  }
  return d;
}

// The refusal's message; "" when accepted.
std::string Refusal(const MultistepOptimizerDesc& d, const std::string& replay) {
  Result<MultistepChoice> r = ChooseMultistep(d, replay);
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
  return r.status().message();
}

bool Has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(MultistepChecksTest, AlgorithmFollowsTheClassAndDecoupledWeightDecay) {
  EXPECT_EQ(ChooseMultistep(Opt("SGD"), "host").value().algorithm, optim::Algorithm::kSgd);
  EXPECT_EQ(ChooseMultistep(Opt("AdamW"), "host").value().algorithm, optim::Algorithm::kAdamW);
  MultistepOptimizerDesc adam = Opt("Adam");
  EXPECT_EQ(ChooseMultistep(adam, "host").value().algorithm, optim::Algorithm::kAdam);
  adam.groups[0].decoupled_weight_decay = true;
  adam.groups[0].amsgrad = true;
  const MultistepChoice c = ChooseMultistep(adam, "torch").value();
  EXPECT_EQ(c.algorithm, optim::Algorithm::kAdamW);
  EXPECT_TRUE(c.amsgrad);
  EXPECT_EQ(c.replay, MultistepReplay::kRestore);
  EXPECT_EQ(c.device, "cpu");
}

TEST(MultistepChecksTest, OtherClassesAndSubclassesAreRefusedByName) {
  for (const std::string replay : {"host", "torch", "auto"}) {
    const std::string m = Refusal(Opt("RMSprop"), replay);
    EXPECT_TRUE(Has(m, "the optimizer RMSprop is not supported: use mode='concurrent'")) << m;
    MultistepOptimizerDesc sub = Opt("AdamW");
    sub.torch_class = false;  // a subclass of AdamW may change step()
    EXPECT_TRUE(Has(Refusal(sub, replay), "AdamW is not supported")) << replay;
  }
  EXPECT_TRUE(Has(Refusal(Opt("Adagrad"), "torch"), "elementwise, no coupling"));
  EXPECT_TRUE(Has(Refusal(Opt("Adagrad"), "host"), "on the CPU; the optimizer Adagrad"));
}

TEST(MultistepChecksTest, HostNeedsTheSingleTensorPath) {
  auto refused = [](void (*set)(MultistepGroupDesc&), const std::string& part) {
    MultistepOptimizerDesc d = Opt("AdamW", 2);
    set(d.groups[1]);
    const std::string m = Refusal(d, "host");
    EXPECT_TRUE(Has(m, "AdamW param_groups[1] has " + part)) << m;
    EXPECT_EQ(ChooseMultistep(d, "auto").value().replay, MultistepReplay::kRestore) << part;
  };
  refused([](MultistepGroupDesc& g) { g.fused = true; }, "fused=True");
  refused([](MultistepGroupDesc& g) { g.capturable = true; }, "capturable=True");
  refused([](MultistepGroupDesc& g) { g.foreach = true; }, "foreach=True");
  refused(
      [](MultistepGroupDesc& g) {
        g.foreach.reset();
        g.torch_picks_foreach = true;
      },
      "foreach=None and torch picks the foreach kernel");
  MultistepOptimizerDesc d = Opt("AdamW", 2);
  d.groups[1].foreach.reset();  // None, and torch picks the single-tensor kernel
  EXPECT_TRUE(ChooseMultistep(d, "host").ok());
  EXPECT_EQ(ChooseMultistep(d, "auto").value().replay, MultistepReplay::kHost);
  d.groups[1].amsgrad = true;
  EXPECT_TRUE(Has(Refusal(d, "host"), "AdamW groups differ in amsgrad"));
  d.groups[1].amsgrad = false;
  d.groups[1].decoupled_weight_decay = true;
  EXPECT_TRUE(Has(Refusal(d, "host"), "groups differ in decoupled_weight_decay"));
  MultistepOptimizerDesc sgd = Opt("SGD", 2);  // SGD has neither
  sgd.groups[1].amsgrad = true;
  EXPECT_TRUE(ChooseMultistep(sgd, "host").ok());
}

TEST(MultistepChecksTest, TorchReplayTakesFlagsButNotDifferentiableOrTensorHyperparameters) {
  MultistepOptimizerDesc d = Opt("AdamW");
  d.groups[0].fused = true;
  d.groups[0].foreach = true;
  EXPECT_TRUE(ChooseMultistep(d, "torch").ok());
  d.groups[0].tensor_hyperparameter = "lr";
  EXPECT_TRUE(Has(Refusal(d, "torch"), "param_groups[0] holds lr as a tensor"));
  d.groups[0].differentiable = true;  // checked first
  EXPECT_TRUE(Has(Refusal(d, "torch"), "differentiable=True; the replay runs under no_grad"));
  EXPECT_TRUE(Has(Refusal(d, "host"), "fused=True"));
}

TEST(MultistepChecksTest, DevicesDecideAutoAndAreCheckedFirst) {
  MultistepOptimizerDesc d = Opt("RMSprop");  // refused too, but the device is named first
  d.tensors[0].device = "cuda:0";
  std::string m = Refusal(d, "host");
  EXPECT_TRUE(Has(m, "parameter 0 of the optimizer is on cuda:0: use replay='torch'")) << m;
  d.tensors[0].device = "meta";
  m = Refusal(d, "torch");
  EXPECT_TRUE(Has(m, "copies CPU and CUDA tensors, but parameter 0 of the optimizer is on "
                     "meta: use mode='concurrent'")) << m;
  MultistepOptimizerDesc g = Opt("AdamW", 2);
  g.tensors[0].device = g.tensors[1].device = "cuda:1";
  const MultistepChoice c = ChooseMultistep(g, "auto").value();
  EXPECT_EQ(c.replay, MultistepReplay::kRestore);
  EXPECT_EQ(c.device, "cuda:1");
  g.tensors[1].device = "cuda:0";
  EXPECT_TRUE(Has(Refusal(g, "auto"), "on one device, found cuda:0, cuda:1"));
  EXPECT_TRUE(Has(Refusal(Opt("AdamW"), "gpu"), "replay must be one of auto, host, torch"));
}

TEST(MultistepChecksTest, StatesAreBesideTheirParameterExceptAdamsStepCounter) {
  MultistepOptimizerDesc d = Opt("AdamW");
  d.tensors[0].device = "cuda:0";
  d.tensors.push_back({0, "step", "cpu", "", true});
  d.tensors.push_back({0, "exp_avg", "cuda:0", "", true});
  EXPECT_TRUE(ChooseMultistep(d, "torch").ok());
  d.tensors.push_back({0, "exp_avg_sq", "cpu", "", true});
  EXPECT_TRUE(Has(Refusal(d, "torch"),
                  "optimizer state 'exp_avg_sq' of parameter 0 is on cpu, its parameter on "
                  "cuda:0"));
  MultistepOptimizerDesc h = Opt("AdamW");
  h.tensors.push_back({0, "exp_avg", "meta", "", true});
  EXPECT_TRUE(Has(Refusal(h, "host"), "optimizer state 'exp_avg' of parameter 0 is on meta"));
  // auto picks host by the parameters; their states are checked for it
  EXPECT_TRUE(Has(Refusal(h, "auto"), "is on meta: use replay='torch' (or 'auto')"));
}

TEST(MultistepChecksTest, ParametersAreContiguousFloat32) {
  MultistepOptimizerDesc d = Opt("SGD");
  d.tensors[0].dtype = "bfloat16";
  EXPECT_TRUE(Has(Refusal(d, "host"), "float32 master parameters; parameter 0 of the optimizer "
                                      "is bfloat16"));
  d.tensors[0].dtype = "float32";
  d.tensors[0].contiguous = false;
  EXPECT_TRUE(Has(Refusal(d, "torch"), "is float32 (not contiguous)"));
}

TEST(MultistepChecksTest, DeviceCheckAlone) {
  EXPECT_TRUE(CheckMultistepDevice("x", "cpu", MultistepReplay::kHost).ok());
  EXPECT_TRUE(CheckMultistepDevice("x", "cuda:3", MultistepReplay::kRestore).ok());
  EXPECT_FALSE(CheckMultistepDevice("x", "cuda:3", MultistepReplay::kHost).ok());
  EXPECT_FALSE(CheckMultistepDevice("x", "mps:0", MultistepReplay::kRestore).ok());
  EXPECT_FALSE(CheckMultistepDevice("x", "cudax", MultistepReplay::kRestore).ok());
}

// ---- CheckMultistepRestore: replay="torch" checkpoints at restore --------

const char* kRecord =
    R"({"torch":"2.13.0+cpu","device":"cpu","device_name":"cpu/AVX512","optimizer":"AdamW",)"
    R"("replay":"torch","groups":[{"foreach":true}]})";

// Two logged steps (the second skipped) over parameters of 8 and 4 elements.
std::string Plan(const std::string& update) {
  return R"({"parts":3,"begin":4,"version":6,"steps":[)"
         R"({"step":5,"skipped":false,"groups":[{"lr":0.001}],"updates":[)" + update +
         R"(]},{"step":6,"skipped":true,"groups":[],"updates":[]}]})";
}

MultistepRun SavedRun() {
  MultistepRun r{"2.13.0+cpu", "cpu", "cpu/AVX512", "AdamW", 1, {8, 4}, {}};
  r.tensors = {{"model/w", 8}, {"multistep_replay/g1/0", 5}};
  return r;
}

const char* kUpdate =
    R"({"tensor":0,"elements":5,"gradient":"multistep_replay/g1/0","count":5,"fresh":false})";

Status Restore(const std::string& record, const std::string& plan, const MultistepRun& run) {
  return CheckMultistepRestore(record, plan, run, "checkpoint step 6 in /d");
}

TEST(MultistepChecksTest, RestoreAcceptsTheRunItWasSavedWith) {
  EXPECT_TRUE(Restore(kRecord, Plan(kUpdate), SavedRun()).ok());
  EXPECT_TRUE(Restore(kRecord, Plan(""), SavedRun()).ok());
}

TEST(MultistepChecksTest, RestoreRefusesAnotherTorchDeviceOrOptimizerInOneLine) {
  const std::pair<std::string MultistepRun::*, std::string> cases[] = {
      {&MultistepRun::torch, "torch '2.13.0+cpu', this run has '2.0.0+other'"},
      {&MultistepRun::device, "device type 'cpu', this run has '2.0.0+other'"},
      {&MultistepRun::device_name, "device 'cpu/AVX512', this run has '2.0.0+other'"},
      {&MultistepRun::optimizer, "optimizer 'AdamW', this run has '2.0.0+other'"}};
  for (const auto& [field, part] : cases) {
    MultistepRun run = SavedRun();
    run.*field = "2.0.0+other";
    const Status s = Restore(kRecord, Plan(kUpdate), run);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Has(s.message(), "checkpoint step 6 in /d is replayed at restore with the "
                                 "training optimizer's own arithmetic; it was saved with " +
                                     part + ": restore it where it was trained"))
        << s.message();
  }
  const Status s = Restore(R"({"torch":null,"device":"cpu"})", Plan(kUpdate), SavedRun());
  EXPECT_TRUE(Has(s.message(), "saved with torch None, this run has '2.13.0+cpu'")) << s.message();
}

TEST(MultistepChecksTest, RestoreRefusesAPlanThatDoesNotFitAsCorruption) {
  auto corrupt = [](const std::string& record, const std::string& plan, const std::string& part,
                    const MultistepRun& run = SavedRun()) {
    const Status s = Restore(record, plan, run);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << part;
    EXPECT_TRUE(Has(s.message(), "checkpoint step 6 in /d: its multistep " + part))
        << s.message();
  };
  corrupt("null", Plan(kUpdate), "replay record is malformed");
  corrupt(kRecord, "[1]", "replay record is malformed");
  corrupt(kRecord, "{\"steps\":", "replay record is malformed");
  corrupt(kRecord, "{\"parts\":3}", "plan has no steps");
  corrupt(kRecord, "{\"steps\":[1]}", "plan does not fit the optimizer");
  MultistepRun two_groups = SavedRun();
  two_groups.groups = 2;
  corrupt(kRecord, Plan(kUpdate), "plan does not fit the optimizer", two_groups);
  corrupt(kRecord, "{\"steps\":[{\"updates\":{}}]}", "plan does not fit the optimizer");
  for (const std::string bad : {R"({"tensor":2,"elements":1})", R"({"tensor":0,"elements":9})",
                                R"({"tensor":0,"elements":0})", R"({"tensor":-1,"elements":1})",
                                R"({"tensor":0.5,"elements":1})", R"({"elements":1})", "7"}) {
    corrupt(kRecord, Plan(bad), "plan names elements the optimizer does not have");
  }
  corrupt(kRecord, Plan(R"({"tensor":0,"elements":5,"gradient":"multistep_replay/g9/0"})"),
          "gradient log lacks 'multistep_replay/g9/0'");
  corrupt(kRecord, Plan(R"({"tensor":0,"elements":4,"gradient":"multistep_replay/g1/0"})"),
          "gradient log lacks 'multistep_replay/g1/0'");
  corrupt(kRecord, Plan(R"({"tensor":0,"elements":4})"), "gradient log lacks None");
}

TEST(MultistepChecksTest, RestoreReadsPlansLargerThanAJobDirectoryRecord) {
  // 30000 updates (a large model's plan): more elements than a record of the
  // job directory may hold, bounded by the text itself.
  MultistepRun run = SavedRun();
  std::string updates;
  for (int i = 0; i < 30000; ++i) updates += std::string(i ? "," : "") + kUpdate;
  EXPECT_TRUE(Restore(kRecord, Plan(updates), run).ok());
}

}  // namespace
}  // namespace nonstop
