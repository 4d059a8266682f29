// What the framework integrations decide: the Checkpointer options they
// derive from the framework's own settings (nonstop.hf's TrainingArguments,
// nonstop.lightning's ModelCheckpoint keywords), and whether a data loader
// resumes in the exact order (nonstop._data, from its types). Pure; every
// error is one InvalidArgument line (CheckpointMismatchError in Python).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "nonstop/status.h"

namespace nonstop {

// An integer keyword as the caller got it: absent (!given), a plain int
// (value), or anything else (no value; `repr` names it in the error).
struct IntOption {
  bool given = false;
  std::optional<int64_t> value;
  std::string repr;
};

// best=(metric, "max" if higher else "min", k).
struct BestOption {
  std::string metric;
  bool higher = false;
  int64_t k = 1;
};

// TrainingArguments -> NonstopCallback's options (docs/HF.md "Retention and
// the best model from the TrainingArguments"): metric_for_best_model (the
// Trainer's key, "eval_" prefixed as it logs it; empty: none) and
// greater_is_better (nullopt: the Trainer's default, higher unless the name
// ends in "loss") become best=(key, "max"|"min", 1); save_total_limit=N
// becomes keep=1, max_to_keep=N. `given`: the keywords NonstopCallback got;
// a setting given both ways (best=; keep= or max_to_keep=) is refused, as
// are an FSDP or DeepSpeed run (`sharded`) and load_best_model_at_end with
// a save_strategy other than "steps" or "epoch" (nonstop takes those saves).
struct TrainerArgs {
  std::string metric_for_best_model;
  std::optional<bool> greater_is_better;
  IntOption save_total_limit;
  bool sharded = false;
  bool load_best_model_at_end = false;
  std::string save_strategy;
};
struct TrainerRetention {
  std::optional<BestOption> best;
  std::optional<int64_t> max_to_keep;  // with keep=1
};
Result<TrainerRetention> TrainerRetentionOf(const TrainerArgs& a,
                                            const std::vector<std::string>& given);

// NonstopCheckpoint's keywords (docs/LIGHTNING.md "What it does"): every=
// (or its alias every_n_train_steps=, not both), every_n_epochs= and
// train_time_interval= (given: `interval_given`; `interval_seconds` its
// total_seconds() when it is a datetime.timedelta, `interval_repr` for the
// error) are mutually exclusive, as in ModelCheckpoint; none given: every
// 10 steps. mode= "min"|"max"; monitor= makes best=(monitor, mode,
// save_top_k or 1), not beside best= (`best_given`); save_top_k= needs it.
struct LightningArgs {
  IntOption every, every_n_train_steps, every_n_epochs, save_top_k;
  bool interval_given = false;
  std::optional<double> interval_seconds;
  std::string interval_repr;
  std::string mode = "min";  // (mode_repr: as the caller gave it, for the error)
  std::string mode_repr = "'min'";
  std::optional<std::string> monitor;
  bool best_given = false;
};
struct LightningCadence {
  std::optional<int64_t> every;
  std::optional<int64_t> every_n_epochs;
  std::optional<BestOption> best;
};
Result<LightningCadence> LightningCadenceOf(const LightningArgs& a);

// A data loader as nonstop._data sees it (docs/EXACT_RESUME.md "Data
// loaders"), its samplers and batch samplers outermost first.
struct LoaderSampler {
  std::string type;                // module.Class
  bool positional_only = false;    // a random sampler of torch's, not stateful
  bool shares_generator = false;   // draws from the loader's own generator=
};
struct LoaderFacts {
  std::string where;               // "state['data']", "train dataloader 0"
  std::string type;                // the loader's class
  bool stateful = false;           // a DataLoader with state_dict/load_state_dict
  std::vector<LoaderSampler> samplers;
  bool has_generator = false;
  // Under DDP: the sampler Lightning wrapped in a DistributedSamplerWrapper
  // (anything but torch's RandomSampler or SequentialSampler), whose state no
  // loader saves.
  std::optional<std::string> ddp_wrapped;
};
// InvalidArgument naming the fix when the restored loader's order (or the
// global RNG after it) would differ from the uninterrupted run's: a
// ddp_wrapped sampler; then, for a stateful loader, a positional-only
// sampler, a sampler sharing the loader's generator, no generator=.
Status CheckLoaderOrder(const LoaderFacts& f);

}  // namespace nonstop
