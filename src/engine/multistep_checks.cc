// What mode="multistep" accepts (nonstop/multistep.h, ChooseMultistep): the
// replay's assumptions checked against the optimizer the Python driver
// describes. replay="host" applies src/optim's kernels, bitwise torch's
// single-tensor CPU path: CPU tensors, no foreach/fused/capturable/
// differentiable kernel. replay="torch" (kRestore) replays with the training
// optimizer itself at restore: elementwise classes, numbers as
// hyperparameters (docs/MULTISTEP.md, "Why it is exact").
#include <algorithm>
#include <limits>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "jobdir/records.h"
#include "nonstop/multistep.h"

namespace nonstop {
namespace {

std::string Str(std::string_view s) { return std::string(s); }

std::string_view DeviceType(std::string_view device) {
  return device.substr(0, device.find(':'));
}

Status Refuse(const std::string& m) { return Status::InvalidArgument(m); }

// The class's algorithm: AdamW, or Adam with decoupled_weight_decay, is AdamW.
optim::Algorithm AlgorithmOf(const MultistepOptimizerDesc& opt) {
  if (opt.name == "SGD") return optim::Algorithm::kSgd;
  const bool decoupled = !opt.groups.empty() && opt.groups[0].decoupled_weight_decay;
  return opt.name == "AdamW" || decoupled ? optim::Algorithm::kAdamW : optim::Algorithm::kAdam;
}

bool Known(const MultistepOptimizerDesc& opt) {
  return opt.torch_class && (opt.name == "SGD" || opt.name == "Adam" || opt.name == "AdamW");
}

// replay="host": the single-tensor path of AdamW, Adam or SGD, one amsgrad
// and decoupled_weight_decay setting for every group.
Status CheckHostOptimizer(const MultistepOptimizerDesc& opt) {
  const std::string pre = "mode='multistep': " + opt.name + " ";
  if (!Known(opt)) {
    return Refuse("mode='multistep' replays torch.optim.AdamW, Adam and SGD on the CPU; the "
                  "optimizer " + opt.name + " is not supported: use mode='concurrent'");
  }
  const bool sgd = AlgorithmOf(opt) == optim::Algorithm::kSgd;
  for (size_t i = 0; i < opt.groups.size(); ++i) {
    const MultistepGroupDesc& g = opt.groups[i];
    const std::string group = pre + "param_groups[" + std::to_string(i) + "] has ";
    for (const auto& [flag, on] : {std::pair<const char*, bool>{"fused", g.fused},
                                   {"capturable", g.capturable},
                                   {"differentiable", g.differentiable}}) {
      if (on) {
        return Refuse(group + flag + "=True; replay matches the single-tensor path only: "
                      "construct it with " + flag + "=False");
      }
    }
    if (g.foreach.value_or(false)) {
      return Refuse(group + "foreach=True; replay matches the single-tensor path only: "
                    "construct it with foreach=False or None");
    }
    if (!g.foreach.has_value() && g.torch_picks_foreach) {
      return Refuse(group + "foreach=None and torch picks the foreach kernel for its tensors; "
                    "replay matches the single-tensor path only: use mode='concurrent' or "
                    "mode='layerwise'");
    }
    if (!sgd && g.amsgrad != opt.groups[0].amsgrad) {
      return Refuse(pre + "groups differ in amsgrad; use one setting");
    }
    if (!sgd && g.decoupled_weight_decay != opt.groups[0].decoupled_weight_decay) {
      return Refuse(pre + "groups differ in decoupled_weight_decay");
    }
  }
  return Status::OK();
}

// replay="torch": an elementwise class (no coupling between parameters), no
// autograd through the update, hyperparameters the log can hold as numbers.
Status CheckTorchOptimizer(const MultistepOptimizerDesc& opt) {
  if (!Known(opt)) {
    return Refuse("mode='multistep' replays torch.optim.AdamW, Adam and SGD (elementwise, no "
                  "coupling between parameters); the optimizer " + opt.name +
                  " is not supported: use mode='concurrent'");
  }
  for (size_t i = 0; i < opt.groups.size(); ++i) {
    const std::string group =
        "mode='multistep': " + opt.name + " param_groups[" + std::to_string(i) + "] ";
    if (opt.groups[i].differentiable) {
      return Refuse(group + "has differentiable=True; the replay runs under no_grad: construct "
                    "it with differentiable=False");
    }
    if (!opt.groups[i].tensor_hyperparameter.empty()) {
      return Refuse(group + "holds " + opt.groups[i].tensor_hyperparameter +
                    " as a tensor; the replay logs hyperparameters as numbers: use a float");
    }
  }
  return Status::OK();
}

std::string What(const MultistepTensorDesc& t) {
  const std::string param = "parameter " + std::to_string(t.param);
  return t.state.empty() ? param + " of the optimizer"
                         : "optimizer state '" + t.state + "' of " + param;
}

using jobdir_internal::Json;

// As Python's repr() prints a string, or a value (the messages name what
// was saved).
std::string Quote(std::string_view s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\\' || c == '\'') out += '\\';
    out += c;
  }
  return out + "'";
}

std::string Repr(const Json* v) {
  if (v == nullptr || v->type == Json::Type::kNull) return "None";
  if (v->type == Json::Type::kBool) return v->b ? "True" : "False";
  if (v->type == Json::Type::kNumber) return v->text;
  if (v->type != Json::Type::kString) return v->type == Json::Type::kArray ? "[...]" : "{...}";
  return Quote(v->text);
}

}  // namespace

Status CheckMultistepDevice(std::string_view what, std::string_view device,
                            MultistepReplay replay) {
  const std::string_view type = DeviceType(device);
  if (type == "cpu" || (type == "cuda" && replay == MultistepReplay::kRestore)) {
    return Status::OK();
  }
  if (replay == MultistepReplay::kRestore) {
    return Refuse("mode='multistep' copies CPU and CUDA tensors, but " + Str(what) + " is on " +
                  Str(device) + ": use mode='concurrent'");
  }
  return Refuse("mode='multistep' with replay='host' replays the optimizer on the CPU and needs "
                "CPU tensors, but " + Str(what) + " is on " + Str(device) +
                ": use replay='torch' (or 'auto') for GPU training");
}

Result<MultistepChoice> ChooseMultistep(const MultistepOptimizerDesc& opt,
                                        std::string_view replay) {
  MultistepChoice c;
  if (replay == "torch") {
    c.replay = MultistepReplay::kRestore;
  } else if (replay == "auto") {
    // The host's kernels where they match training, else torch's own.
    const bool cpu = std::all_of(opt.tensors.begin(), opt.tensors.end(), [](const auto& t) {
      return !t.state.empty() || DeviceType(t.device) == "cpu";
    });
    c.replay = cpu && CheckHostOptimizer(opt).ok() ? MultistepReplay::kHost
                                                   : MultistepReplay::kRestore;
  } else if (replay != "host") {
    return Refuse("replay must be one of auto, host, torch, got '" + Str(replay) + "'");
  }
  // Devices first: a GPU run gets the one line that says what to use.
  std::set<std::string> devices;
  std::vector<std::string> param_device;
  for (const MultistepTensorDesc& t : opt.tensors) {
    if (!t.state.empty()) continue;
    NONSTOP_RETURN_IF_ERROR(CheckMultistepDevice(What(t), t.device, c.replay));
    devices.insert(t.device);
    if (t.param >= 0) {
      param_device.resize(std::max<size_t>(param_device.size(), t.param + 1));
      param_device[t.param] = t.device;
    }
  }
  if (devices.size() > 1) {
    std::string all;
    for (const std::string& d : devices) all += (all.empty() ? "" : ", ") + d;
    return Refuse("mode='multistep' needs every parameter of the optimizer on one device, "
                  "found " + all);
  }
  if (!devices.empty()) c.device = *devices.begin();
  // States (created or loaded since: checked at each window's start too).
  // Adam's step counter may stay on the CPU (torch's default).
  for (const MultistepTensorDesc& t : opt.tensors) {
    if (t.state.empty()) continue;
    NONSTOP_RETURN_IF_ERROR(CheckMultistepDevice(What(t), t.device, c.replay));
    const bool known = t.param >= 0 && static_cast<size_t>(t.param) < param_device.size();
    if (c.replay == MultistepReplay::kRestore && t.state != "step" && known &&
        t.device != param_device[t.param]) {
      return Refuse("mode='multistep': " + What(t) + " is on " + t.device +
                    ", its parameter on " + param_device[t.param]);
    }
  }
  NONSTOP_RETURN_IF_ERROR(c.replay == MultistepReplay::kHost ? CheckHostOptimizer(opt)
                                                             : CheckTorchOptimizer(opt));
  c.algorithm = AlgorithmOf(opt);
  c.amsgrad = !opt.groups.empty() && opt.groups[0].amsgrad;
  for (const MultistepTensorDesc& t : opt.tensors) {
    if (t.state.empty() && (t.dtype != "float32" || !t.contiguous)) {
      return Refuse("mode='multistep' needs contiguous float32 master parameters; " + What(t) +
                    " is " + t.dtype + (t.contiguous ? "" : " (not contiguous)"));
    }
  }
  return c;
}

Status CheckMultistepRestore(std::string_view record_json, std::string_view plan_json,
                             const MultistepRun& run, const std::string& where) {
  // Bounded by the text (already in memory): a plan holds a few elements per
  // parameter and logged step, more than a job directory's record.
  const jobdir_internal::JsonLimits limits{plan_json.size() + record_json.size(),
                                           std::numeric_limits<size_t>::max(), 8};
  Result<Json> rec = jobdir_internal::ParseJson(record_json, where, limits);
  Result<Json> plan = jobdir_internal::ParseJson(plan_json, where, limits);
  if (!rec.ok() || !plan.ok() || rec->type != Json::Type::kObject ||
      plan->type != Json::Type::kObject) {
    return Status::Corruption(where + ": its multistep replay record is malformed");
  }
  const std::pair<const char*, const std::string*> now[] = {
      {"torch", &run.torch},
      {"device", &run.device},
      {"device_name", &run.device_name},
      {"optimizer", &run.optimizer}};
  const char* what[] = {"torch", "device type", "device", "optimizer"};
  for (size_t k = 0; k < 4; ++k) {
    const Json* saved = rec->Get(now[k].first);
    if (saved == nullptr || saved->type != Json::Type::kString || saved->text != *now[k].second) {
      return Status::InvalidArgument(
          where + " is replayed at restore with the training optimizer's own arithmetic; it "
          "was saved with " + what[k] + " " + Repr(saved) + ", this run has " +
          Quote(*now[k].second) + ": restore it where it was trained");
    }
  }
  const Json* steps = plan->Get("steps");
  if (steps == nullptr || steps->type != Json::Type::kArray) {
    return Status::Corruption(where + ": its multistep plan has no steps");
  }
  for (const Json& s : steps->items) {
    const Json* groups = s.Get("groups");  // (null unless s is an object)
    const size_t n = groups == nullptr ? 0 : groups->items.size();
    if (s.type != Json::Type::kObject ||
        (groups != nullptr && groups->type != Json::Type::kArray) ||
        (n != 0 && n != run.groups)) {
      return Status::Corruption(where + ": its multistep plan does not fit the optimizer");
    }
    const Json* updates = s.Get("updates");
    if (updates == nullptr) continue;
    if (updates->type != Json::Type::kArray) {
      return Status::Corruption(where + ": its multistep plan does not fit the optimizer");
    }
    for (const Json& u : updates->items) {
      const Json* t = u.Get("tensor");
      const Json* e = u.Get("elements");
      uint64_t ti = 0, elements = 0;
      if (t == nullptr || e == nullptr || !t->AsUint64(&ti) || !e->AsUint64(&elements) ||
          ti >= run.param_numel.size() || elements == 0 || elements > run.param_numel[ti]) {
        return Status::Corruption(
            where + ": its multistep plan names elements the optimizer does not have");
      }
      const Json* g = u.Get("gradient");
      const bool named = g != nullptr && g->type == Json::Type::kString;
      const auto logged = named ? run.tensors.find(g->text) : run.tensors.end();
      if (logged == run.tensors.end() || logged->second != elements) {
        return Status::Corruption(where + ": its multistep gradient log lacks " + Repr(g));
      }
    }
  }
  return Status::OK();
}

}  // namespace nonstop
