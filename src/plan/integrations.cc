// What the framework integrations decide (integrations.h): options checked
// and mapped to the Checkpointer's, and the data loaders' order; every
// error one line.
#include "plan/integrations.h"

#include <algorithm>
#include <tuple>

namespace nonstop {
namespace {

bool Given(const std::vector<std::string>& given, const char* name) {
  return std::find(given.begin(), given.end(), name) != given.end();
}

// `o`'s value when it is given and a positive int; else InvalidArgument.
Result<int64_t> Positive(const char* name, const IntOption& o) {
  if (!o.value || *o.value < 1) {
    return Status::InvalidArgument(std::string(name) + " must be a positive integer, got " +
                                   o.repr);
  }
  return *o.value;
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

Result<TrainerRetention> TrainerRetentionOf(const TrainerArgs& a,
                                            const std::vector<std::string>& given) {
  if (a.sharded) {
    return Status::InvalidArgument(
        "NonstopCallback supports DDP Trainer runs (torchrun), not FSDP or DeepSpeed yet; see "
        "docs/HF.md");
  }
  TrainerRetention out;
  const std::string& metric = a.metric_for_best_model;
  if (!metric.empty()) {
    if (Given(given, "best")) {
      return Status::InvalidArgument(
          "give TrainingArguments(metric_for_best_model=...) or NonstopCallback(best=...), "
          "not both");
    }
    const bool higher = a.greater_is_better.value_or(!EndsWith(metric, "loss"));
    out.best = BestOption{metric.rfind("eval_", 0) == 0 ? metric : "eval_" + metric, higher, 1};
  }
  if (a.save_total_limit.given) {
    if (Given(given, "keep") || Given(given, "max_to_keep")) {
      return Status::InvalidArgument(
          "give TrainingArguments(save_total_limit=...) or NonstopCallback(keep=, "
          "max_to_keep=), not both");
    }
    NONSTOP_ASSIGN_OR_RETURN(out.max_to_keep, Positive("save_total_limit", a.save_total_limit));
  }
  if (a.load_best_model_at_end && a.save_strategy != "steps" && a.save_strategy != "epoch") {
    return Status::InvalidArgument(
        "load_best_model_at_end with NonstopCallback: give save_strategy equal to "
        "eval_strategy ('steps' or 'epoch'); nonstop takes those saves");
  }
  return out;
}

Result<LightningCadence> LightningCadenceOf(const LightningArgs& a) {
  if (a.every.given && a.every_n_train_steps.given) {
    return Status::InvalidArgument(
        "give every= or every_n_train_steps= (the same option), not both");
  }
  const IntOption& every = a.every.given ? a.every : a.every_n_train_steps;
  std::string got;
  int cadences = 0;
  for (const auto& [name, given, repr] :
       {std::tuple<const char*, bool, std::string>{"every", every.given, every.repr},
        {"every_n_epochs", a.every_n_epochs.given, a.every_n_epochs.repr},
        {"train_time_interval", a.interval_given, a.interval_repr}}) {
    if (!given) continue;
    got += std::string(cadences++ ? ", " : "") + name + "=" + repr;
  }
  if (cadences > 1) {
    return Status::InvalidArgument(
        "every= (every_n_train_steps=), every_n_epochs= and train_time_interval= are mutually "
        "exclusive, as in ModelCheckpoint; got " + got);
  }
  LightningCadence out;
  if (every.given) {
    NONSTOP_ASSIGN_OR_RETURN(out.every, Positive("every", every));
  }
  if (a.every_n_epochs.given) {
    NONSTOP_ASSIGN_OR_RETURN(out.every_n_epochs, Positive("every_n_epochs", a.every_n_epochs));
  }
  if (a.interval_given && !(a.interval_seconds && *a.interval_seconds > 0)) {
    return Status::InvalidArgument("train_time_interval must be a positive datetime.timedelta, "
                                   "got " + a.interval_repr);
  }
  if (cadences == 0) out.every = 10;
  // monitor=/mode=/save_top_k= as ModelCheckpoint's: nonstop's best= (the
  // k best kept copies by that logged metric, JobDir retention).
  if (a.mode != "min" && a.mode != "max") {
    return Status::InvalidArgument(
        "mode must be 'min' or 'max' (the monitored metric's direction, as ModelCheckpoint's), "
        "got " + a.mode_repr + "; NonstopCheckpoint always checkpoints in the Checkpointer's "
        "concurrent mode");
  }
  if (a.monitor) {
    if (a.best_given) {
      return Status::InvalidArgument("give monitor=/mode=/save_top_k= or best=, not both");
    }
    int64_t k = 1;
    if (a.save_top_k.given) {
      NONSTOP_ASSIGN_OR_RETURN(k, Positive("save_top_k", a.save_top_k));
    }
    out.best = BestOption{*a.monitor, a.mode == "max", k};
  } else if (a.save_top_k.given) {
    return Status::InvalidArgument("save_top_k= needs monitor= (the metric it ranks by)");
  }
  return out;
}

Status CheckLoaderOrder(const LoaderFacts& f) {
  static const std::string kFixSampler =
      "sampler=torchdata.stateful_dataloader.sampler.RandomSampler(dataset, "
      "generator=torch.Generator().manual_seed(SEED))";
  if (f.ddp_wrapped) {
    return Status::InvalidArgument(
        f.where + ": under DDP Lightning wraps its " + *f.ddp_wrapped +
        " in a DistributedSamplerWrapper, whose state no loader saves (a checkpoint in epoch "
        ">= 2 would resume with another order); give the loader "
        "sampler=torch.utils.data.RandomSampler(dataset) (Lightning then uses a "
        "DistributedSampler, whose order is a function of seed and epoch: exact) "
        "(docs/LIGHTNING.md)");
  }
  if (!f.stateful) return Status::OK();
  for (const LoaderSampler& s : f.samplers) {
    if (s.positional_only) {
      return Status::InvalidArgument(
          f.where + ": " + f.type + " restores the position of a " + s.type +
          ", not its permutation (a checkpoint in epoch >= 2 would resume with epoch 1's "
          "order); use " + kFixSampler + " (docs/EXACT_RESUME.md)");
    }
    if (s.shares_generator) {
      return Status::InvalidArgument(
          f.where + ": the sampler draws from the loader's own generator (shuffle=True, "
          "generator=g), so a restored loader's next epoch has another order; give the "
          "sampler its own: " + kFixSampler + " (docs/EXACT_RESUME.md)");
    }
  }
  if (!f.has_generator) {
    return Status::InvalidArgument(
        f.where + ": " + f.type + " has no generator=, so each iter() draws from the global "
        "RNG (once more after a restart: dropout and every later draw shift); give it "
        "generator=torch.Generator().manual_seed(SEED2) (docs/EXACT_RESUME.md)");
  }
  return Status::OK();
}

}  // namespace nonstop
