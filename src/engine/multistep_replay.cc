// The CPU replay of a closed multi-step window (multistep_internal.h): part p
// (0-based) was copied at version N+p; the logged steps N+p+1..N+K-1 are
// applied to it with the CPU optimizer (nonstop/optim.h, bitwise as torch
// computes them), in place in the state buffers, so every part ends at the
// window's version N+K-1. Or, for MultistepReplay::kRestore, the plan of
// that replay for a restorer that applies it with torch's own optimizer.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "engine/multistep_internal.h"

namespace nonstop::multistep_internal {

// Slices of up to kSlice elements spread over the replay threads (the
// kernels are elementwise: slicing does not change a bit).
Status ReplayWindow(const ReplayInput& in, const StateBuffers& state) {
  static constexpr size_t kSlice = 1 << 18;
  const std::vector<Part>& parts = *in.parts;
  const std::vector<OptimizerTensor>& tensors = *in.tensors;
  const std::vector<LoggedStep>& log = *in.log;
  const int k = static_cast<int>(parts.size());
  struct Work {
    int part;
    size_t piece_index;  // in the part's block order
    Piece piece;
    size_t lo, hi;       // element range within the tensor
  };
  std::vector<Work> work;
  for (int p = 0; p + 1 < k; ++p) {  // the last part is already at the version
    size_t idx = 0;
    for (const Block& block : parts[p].blocks) {
      for (const Piece& pc : block.pieces) {
        for (size_t lo = pc.begin; lo < pc.end; lo += kSlice) {
          work.push_back({p, idx, pc, lo, std::min(pc.end, lo + kSlice)});
        }
        ++idx;
      }
    }
  }
  if (work.empty()) return Status::OK();
  int threads = in.threads > 0 ? in.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::clamp<int>(threads, 1, static_cast<int>(work.size()));
  std::atomic<size_t> next{0};
  Mutex err_mu;
  Status first;
  auto run = [&] {
    std::vector<optim::StepRecord> steps;
    for (size_t w = next++; w < work.size(); w = next++) {
      const Work& wk = work[w];
      const int t = wk.piece.tensor;
      const int group = tensors[t].group;
      steps.clear();
      // Part p (0-based) was copied at version N+p: it needs steps N+p+1..N+K-1.
      for (int j = wk.part + 1; j < k; ++j) {
        const LoggedStep& e = log[j - 1];
        optim::StepRecord rec;
        if (!e.skipped && group < static_cast<int>(e.groups.size())) rec.hyper = e.groups[group];
        rec.hyper.skipped = e.skipped || !e.has_grad[t];
        rec.hyper.step = 0;  // the count is carried in PartState
        if (!rec.hyper.skipped) {
          const size_t esize = DTypeSize(e.grad_dtype[t]);
          rec.grad.data = in.gradients->Gradient(j, t) + wk.lo * esize;
          rec.grad.dtype = e.grad_dtype[t];
        }
        steps.push_back(rec);
      }
      optim::PartState st;
      st.numel = wk.hi - wk.lo;
      auto buf = [&](StateRole r) {
        float* b = state.Role(t, r);
        return b == nullptr ? nullptr : b + wk.lo;
      };
      st.param = buf(StateRole::kParam);
      st.exp_avg = buf(StateRole::kExpAvg);
      st.exp_avg_sq = buf(StateRole::kExpAvgSq);
      st.max_exp_avg_sq = buf(StateRole::kMaxExpAvgSq);
      st.momentum_buffer = buf(StateRole::kMomentumBuffer);
      st.step = (*in.piece_step)[wk.part][wk.piece_index];
      st.has_momentum_buffer = (*in.piece_has_momentum)[wk.part][wk.piece_index] != 0;
      optim::ReplayOptions ro;
      ro.num_threads = 1;
      ro.mkl_vms_sqrt = in.mkl_vms_sqrt;
      Status s = optim::Replay(*in.config, steps, &st, ro);
      if (!s.ok()) {
        MutexLock lock(&err_mu);
        if (first.ok()) {
          first = Status(s.code(), "multistep replay of '" + tensors[t].name + "': " + s.message());
        }
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(run);
  run();
  for (auto& th : pool) th.join();
  return first;
}

namespace {

// A double that reads back to the same bits (JSON has no inf/nan: null).
std::string Num(double v) {
  if (v != v || v - v != 0) return "null";
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

const char* Bool(bool b) { return b ? "true" : "false"; }

std::string GroupJson(const optim::OptimizerConfig& config, const optim::StepHyperparameters& h) {
  std::string s = "{\"lr\":" + Num(h.lr) + ",\"weight_decay\":" + Num(h.weight_decay) +
                  ",\"maximize\":" + Bool(h.maximize);
  if (config.algorithm == optim::Algorithm::kSgd) {
    s += ",\"momentum\":" + Num(h.momentum) + ",\"dampening\":" + Num(h.dampening) +
         ",\"nesterov\":" + Bool(h.nesterov);
  } else {
    s += ",\"betas\":[" + Num(h.beta1) + "," + Num(h.beta2) + "],\"eps\":" + Num(h.eps);
  }
  return s + "}";
}

}  // namespace

std::string RestorePlan(const ReplayInput& in, GradientLog* log, int64_t begin,
                        const std::vector<double>& begin_step,
                        const std::vector<uint8_t>& begin_state,
                        std::vector<OutputTensor>* gradients) {
  const std::vector<OptimizerTensor>& tensors = *in.tensors;
  const std::vector<LoggedStep>& steps = *in.log;
  const int k = static_cast<int>(in.parts->size());
  std::vector<int64_t> applied(tensors.size(), 0);  // updates since Begin, per tensor
  std::string s = "{\"parts\":" + std::to_string(k) + ",\"begin\":" + std::to_string(begin) +
                  ",\"version\":" + std::to_string(begin + k - 1) + ",\"steps\":[";
  // Step N+j takes the elements of parts 1..j (a prefix of the flattened
  // tensors): part p was copied at version N+p-1 and needs N+p..N+K-1. The
  // steps go in order, each on the elements that are one step behind it.
  for (int j = 1; j < k; ++j) {
    const LoggedStep& e = steps[j - 1];
    if (j > 1) s += ",";
    s += "{\"step\":" + std::to_string(begin + j) + ",\"skipped\":" + Bool(e.skipped) +
         ",\"groups\":[";
    for (size_t g = 0; g < e.groups.size(); ++g) {
      s += (g ? "," : "") + GroupJson(*in.config, e.groups[g]);
    }
    s += "],\"updates\":[";
    bool first = true;
    for (size_t t = 0; t < tensors.size() && !e.skipped; ++t) {
      const size_t covered = log->Covered(j, static_cast<int>(t));
      if (!e.has_grad[t] || covered == 0) continue;
      OutputTensor o;
      o.spec.name = "multistep_replay/g" + std::to_string(j) + "/" + std::to_string(t);
      o.spec.dtype = e.grad_dtype[t];
      o.spec.shape = {static_cast<int64_t>(covered)};
      o.spec.nbytes = covered * DTypeSize(e.grad_dtype[t]);
      uint8_t* data = log->MutableGradient(j, static_cast<int>(t));
      ZeroStagedTail(data, o.spec.nbytes);  // a low-precision gradient fills part of its room
      o.data = data;
      gradients->push_back(o);
      s += std::string(first ? "" : ",") + "{\"tensor\":" + std::to_string(t) +
           ",\"elements\":" + std::to_string(covered) + ",\"gradient\":\"" + o.spec.name +
           "\",\"count\":" + Num(begin_step[t] + static_cast<double>(applied[t])) +
           ",\"fresh\":" + Bool(begin_state[t] == 0 && applied[t] == 0) + "}";
      first = false;
    }
    s += "]}";
    if (!e.skipped) {
      for (size_t t = 0; t < tensors.size(); ++t) applied[t] += e.has_grad[t];
    }
  }
  return s + "]}";
}

std::string AddToMeta(const std::string& meta, const std::string& key,
                      const std::string& value_json) {
  const size_t open = meta.find('{');
  const std::string member = "\"" + key + "\":" + value_json;
  if (open == std::string::npos) return "{" + member + "}";
  const size_t next = meta.find_first_not_of(" \t\r\n", open + 1);
  const bool empty = next == std::string::npos || meta[next] == '}';
  return meta.substr(0, open + 1) + member + (empty ? "" : ",") + meta.substr(open + 1);
}

}  // namespace nonstop::multistep_internal
