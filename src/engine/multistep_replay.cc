// The CPU replay of a closed multi-step window (multistep_internal.h): part p
// (0-based) was copied at version N+p; the logged steps N+p+1..N+K-1 are
// applied to it with the CPU optimizer (nonstop/optim.h, bitwise as torch
// computes them), in place in the state buffers, so every part ends at the
// window's version N+K-1.
#include <algorithm>
#include <atomic>
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

}  // namespace nonstop::multistep_internal
