// LayerwiseBook: the copy bookkeeping of mode="layerwise" (docs/LAYERWISE.md,
// "What the Python side does"). The Python driver numbers the optimized
// parameters 0..n-1 and reports each update; this says which engine tensors
// to hand to CopyTensors now and which copies to wait for before an update.
// Pure index arithmetic: it calls no engine (the driver issues the GIL-free
// calls, WaitTensorsCopiedOnStream with the current CUDA stream).
//
// A parameter's group is its engine tensors: itself and its optimizer
// state's tensors (this rank's pieces). Updated groups are batched and
// handed over together once they hold group_bytes (or at Flush); a group
// handed over is pending until its next update waits for it; the seal copies
// every group not handed over, so all of them are pending after it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace nonstop {

class LayerwiseBook {
 public:
  // devices[i]: parameter i's CUDA device index, -1 for host memory.
  LayerwiseBook(uint64_t group_bytes, std::vector<int> devices);

  // Prepares the groups of the next checkpoints: parameter i's are the
  // indices of the registered tensors (ref_ptrs: each one's data pointer, in
  // registration order) whose pointer is one of param_ptrs[i].
  void Plan(const std::vector<uint64_t>& ref_ptrs,
            const std::vector<std::vector<uint64_t>>& param_ptrs);
  // A checkpoint opens with the planned groups.
  void Open();

  // Before updating `ids`: `copy`, the batch to hand over first when one of
  // them is in it (updated twice in one step); `waits`, the tensors whose
  // copies must end before their update, per device (-1: the host waits),
  // host first. Those parameters are no longer pending.
  struct Before {
    std::vector<uint32_t> copy;
    std::vector<std::pair<int, std::vector<uint32_t>>> waits;
  };
  Before Update(const std::vector<uint32_t>& ids);
  // Parameter `id` was updated (`bytes`: it and its optimizer state): the
  // tensors to hand over now, once the batch holds group_bytes; none while
  // no checkpoint is open or the parameter has no engine tensors.
  std::vector<uint32_t> Updated(uint32_t id, uint64_t bytes);
  // The batch's tensors, to hand over now; they become pending.
  std::vector<uint32_t> Flush();
  // The open checkpoint is sealed: every group is pending, the batch dropped.
  void Seal();
  // A restore or a new start: nothing open, pending, batched or planned.
  void Reset();

 private:
  uint64_t group_bytes_;
  std::vector<int> devices_;
  std::vector<std::vector<uint32_t>> plan_;    // per parameter; empty: no plan
  std::vector<std::vector<uint32_t>> groups_;  // the open (or last) checkpoint's
  std::vector<bool> pending_, batched_;
  std::vector<uint32_t> batch_;  // in update order
  uint64_t batch_bytes_ = 0;
  bool open_ = false;
};

}  // namespace nonstop
