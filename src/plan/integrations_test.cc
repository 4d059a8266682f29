// What the framework integrations decide (integrations.h): what each
// setting maps to, which loaders resume in order, and each refusal's line.
#include "plan/integrations.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace nonstop {
namespace {

IntOption Int(int64_t v) { return IntOption{true, v, std::to_string(v)}; }
IntOption Bad(const std::string& repr) { return IntOption{true, std::nullopt, repr}; }

std::string Error(const Status& s) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  return s.message();
}

TrainerArgs Metric(const std::string& m, std::optional<bool> higher = std::nullopt) {
  TrainerArgs a;
  a.metric_for_best_model = m;
  a.greater_is_better = higher;
  return a;
}

TrainerArgs Limit(IntOption n) {
  TrainerArgs a;
  a.save_total_limit = std::move(n);
  return a;
}

TEST(TrainerRetention, MetricBecomesBestWithTheTrainersPrefixAndDirection) {
  TrainerRetention r = TrainerRetentionOf(Metric("loss"), {}).value();
  ASSERT_TRUE(r.best);
  EXPECT_EQ(r.best->metric, "eval_loss");
  EXPECT_FALSE(r.best->higher);  // a loss: lower is better
  EXPECT_EQ(r.best->k, 1);
  EXPECT_FALSE(r.max_to_keep);
  r = TrainerRetentionOf(Metric("eval_accuracy"), {}).value();
  EXPECT_EQ(r.best->metric, "eval_accuracy");
  EXPECT_TRUE(r.best->higher);
  EXPECT_TRUE(TrainerRetentionOf(Metric("loss", true), {}).value().best->higher);
  EXPECT_FALSE(TrainerRetentionOf(Metric("acc", false), {}).value().best->higher);
  EXPECT_FALSE(TrainerRetentionOf(TrainerArgs{}, {"best"}).value().best);
}

TEST(TrainerRetention, SaveTotalLimitBecomesMaxToKeep) {
  TrainerRetention r = TrainerRetentionOf(Limit(Int(3)), {"every"}).value();
  EXPECT_EQ(r.max_to_keep, 3);
  EXPECT_FALSE(r.best);
  EXPECT_EQ(Error(TrainerRetentionOf(Limit(Int(0)), {}).status()),
            "save_total_limit must be a positive integer, got 0");
  EXPECT_EQ(Error(TrainerRetentionOf(Limit(Bad("'2'")), {}).status()),
            "save_total_limit must be a positive integer, got '2'");
}

TEST(TrainerRetention, ASettingGivenBothWaysIsRefused) {
  EXPECT_EQ(Error(TrainerRetentionOf(Metric("loss"), {"best"}).status()),
            "give TrainingArguments(metric_for_best_model=...) or NonstopCallback(best=...), "
            "not both");
  for (const char* k : {"keep", "max_to_keep"}) {
    EXPECT_EQ(Error(TrainerRetentionOf(Limit(Int(2)), {k}).status()),
              "give TrainingArguments(save_total_limit=...) or NonstopCallback(keep=, "
              "max_to_keep=), not both");
  }
}

TEST(TrainerRetention, ShardedRunsAndBestWithoutStepOrEpochSavesAreRefused) {
  TrainerArgs a;
  a.sharded = true;
  EXPECT_EQ(Error(TrainerRetentionOf(a, {}).status()),
            "NonstopCallback supports DDP Trainer runs (torchrun), not FSDP or DeepSpeed yet; "
            "see docs/HF.md");
  a = Metric("loss");
  a.load_best_model_at_end = true;
  for (const char* ok : {"steps", "epoch"}) {
    a.save_strategy = ok;
    EXPECT_TRUE(TrainerRetentionOf(a, {}).ok());
  }
  a.save_strategy = "no";
  EXPECT_EQ(Error(TrainerRetentionOf(a, {}).status()),
            "load_best_model_at_end with NonstopCallback: give save_strategy equal to "
            "eval_strategy ('steps' or 'epoch'); nonstop takes those saves");
  a.load_best_model_at_end = false;
  EXPECT_TRUE(TrainerRetentionOf(a, {}).ok());
}

LightningArgs Args() { return LightningArgs{}; }

TEST(LightningCadence, OneCadenceAtMostDefaultEveryTenSteps) {
  EXPECT_EQ(LightningCadenceOf(Args()).value().every, 10);
  LightningArgs a = Args();
  a.every_n_train_steps = Int(4);
  EXPECT_EQ(LightningCadenceOf(a).value().every, 4);
  a = Args();
  a.every_n_epochs = Int(2);
  LightningCadence c = LightningCadenceOf(a).value();
  EXPECT_FALSE(c.every);
  EXPECT_EQ(c.every_n_epochs, 2);
  a = Args();
  a.interval_given = true;
  a.interval_seconds = 2.5;
  EXPECT_FALSE(LightningCadenceOf(a).value().every);
}

TEST(LightningCadence, RefusalsNameTheOptions) {
  LightningArgs a = Args();
  a.every = Int(5);
  a.every_n_train_steps = Int(5);
  EXPECT_EQ(Error(LightningCadenceOf(a).status()),
            "give every= or every_n_train_steps= (the same option), not both");
  a = Args();
  a.every_n_train_steps = Int(5);
  a.every_n_epochs = Int(1);
  a.interval_given = true;
  a.interval_seconds = 60;
  a.interval_repr = "datetime.timedelta(seconds=60)";
  EXPECT_EQ(Error(LightningCadenceOf(a).status()),
            "every= (every_n_train_steps=), every_n_epochs= and train_time_interval= are "
            "mutually exclusive, as in ModelCheckpoint; got every=5, every_n_epochs=1, "
            "train_time_interval=datetime.timedelta(seconds=60)");
  a = Args();
  a.every_n_train_steps = Int(0);
  EXPECT_EQ(Error(LightningCadenceOf(a).status()), "every must be a positive integer, got 0");
  a = Args();
  a.every_n_epochs = Bad("True");
  EXPECT_EQ(Error(LightningCadenceOf(a).status()),
            "every_n_epochs must be a positive integer, got True");
  for (std::optional<double> s : {std::optional<double>(), std::optional<double>(0.0)}) {
    a = Args();
    a.interval_given = true;
    a.interval_seconds = s;
    a.interval_repr = "60";
    EXPECT_EQ(Error(LightningCadenceOf(a).status()),
              "train_time_interval must be a positive datetime.timedelta, got 60");
  }
}

TEST(LightningCadence, MonitorModeSaveTopKBecomeBest) {
  LightningArgs a = Args();
  a.monitor = "val_loss";
  LightningCadence c = LightningCadenceOf(a).value();
  ASSERT_TRUE(c.best);
  EXPECT_EQ(c.best->metric, "val_loss");
  EXPECT_FALSE(c.best->higher);
  EXPECT_EQ(c.best->k, 1);
  a.mode = "max";
  a.save_top_k = Int(3);
  c = LightningCadenceOf(a).value();
  EXPECT_TRUE(c.best->higher);
  EXPECT_EQ(c.best->k, 3);
  EXPECT_FALSE(LightningCadenceOf(Args()).value().best);
  a.save_top_k = Int(0);
  EXPECT_EQ(Error(LightningCadenceOf(a).status()),
            "save_top_k must be a positive integer, got 0");
  a.save_top_k = {};
  a.best_given = true;
  EXPECT_EQ(Error(LightningCadenceOf(a).status()),
            "give monitor=/mode=/save_top_k= or best=, not both");
  a = Args();
  a.save_top_k = Int(2);
  EXPECT_EQ(Error(LightningCadenceOf(a).status()),
            "save_top_k= needs monitor= (the metric it ranks by)");
  a = Args();
  a.mode = "";
  a.mode_repr = "'maximum'";
  EXPECT_EQ(Error(LightningCadenceOf(a).status()),
            "mode must be 'min' or 'max' (the monitored metric's direction, as "
            "ModelCheckpoint's), got 'maximum'; NonstopCheckpoint always checkpoints in the "
            "Checkpointer's concurrent mode");
}

LoaderFacts Loader() {
  LoaderFacts f;
  f.where = "state['data']";
  f.type = "StatefulDataLoader";
  f.stateful = true;
  f.has_generator = true;
  return f;
}

TEST(LoaderOrder, TheExactRecipeAndNonLoadersPass) {
  LoaderFacts f = Loader();
  f.samplers = {{"torchdata.stateful_dataloader.sampler.RandomSampler", false, false},
                {"torch.utils.data.sampler.BatchSampler", false, false}};
  EXPECT_TRUE(CheckLoaderOrder(f).ok());
  LoaderFacts other;  // not a stateful loader: nothing to check
  other.samplers = {{"torch.utils.data.sampler.RandomSampler", true, true}};
  EXPECT_TRUE(CheckLoaderOrder(other).ok());
}

TEST(LoaderOrder, EachTrapIsRefusedWithItsFix) {
  LoaderFacts f = Loader();
  f.samplers = {{"torch.utils.data.sampler.BatchSampler", false, false},
                {"torch.utils.data.sampler.RandomSampler", true, true}};
  EXPECT_EQ(Error(CheckLoaderOrder(f)),
            "state['data']: StatefulDataLoader restores the position of a "
            "torch.utils.data.sampler.RandomSampler, not its permutation (a checkpoint in epoch "
            ">= 2 would resume with epoch 1's order); use "
            "sampler=torchdata.stateful_dataloader.sampler.RandomSampler(dataset, "
            "generator=torch.Generator().manual_seed(SEED)) (docs/EXACT_RESUME.md)");
  f.samplers = {{"torchdata.stateful_dataloader.sampler.RandomSampler", false, true}};
  EXPECT_EQ(Error(CheckLoaderOrder(f)),
            "state['data']: the sampler draws from the loader's own generator (shuffle=True, "
            "generator=g), so a restored loader's next epoch has another order; give the "
            "sampler its own: sampler=torchdata.stateful_dataloader.sampler.RandomSampler("
            "dataset, generator=torch.Generator().manual_seed(SEED)) (docs/EXACT_RESUME.md)");
  f.samplers = {};
  f.has_generator = false;
  EXPECT_EQ(Error(CheckLoaderOrder(f)),
            "state['data']: StatefulDataLoader has no generator=, so each iter() draws from the "
            "global RNG (once more after a restart: dropout and every later draw shift); give it "
            "generator=torch.Generator().manual_seed(SEED2) (docs/EXACT_RESUME.md)");
}

TEST(LoaderOrder, ASamplerLightningWrapsUnderDdpIsRefusedFirst) {
  LoaderFacts f;  // refused even when the loader is not a stateful one
  f.where = "train dataloader 0";
  f.ddp_wrapped = "RandomSampler";
  EXPECT_EQ(Error(CheckLoaderOrder(f)),
            "train dataloader 0: under DDP Lightning wraps its RandomSampler in a "
            "DistributedSamplerWrapper, whose state no loader saves (a checkpoint in epoch >= 2 "
            "would resume with another order); give the loader "
            "sampler=torch.utils.data.RandomSampler(dataset) (Lightning then uses a "
            "DistributedSampler, whose order is a function of seed and epoch: exact) "
            "(docs/LIGHTNING.md)");
}

}  // namespace
}  // namespace nonstop
