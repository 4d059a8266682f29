// LightCheck's three copy strategies on CUDA tensors (docs/LAYERWISE.md):
// how long the training thread waits for a layer's copy before its next
// update with copy=host (D2H into staging), direct (falls back to host for
// device memory) and device (D2D snapshot, asynchronous drain), and a check
// that every checkpoint still stored holds each tensor's bytes of its step.
// Plain executable (the GPU machines have no GoogleTest); exits 77 without a
// usable device.
//
//   layerwise_gpu_bench [--dir /dev/shm/x] [--layers 24] [--mib 16] [--steps 8]
//                       [--json out.json]
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "copy/cuda_copy_engine.h"
#include "nonstop/engine.h"
#include "nonstop/env.h"

namespace nonstop {
namespace {

using Clock = std::chrono::steady_clock;

uint8_t Byte(int64_t step, size_t t) { return static_cast<uint8_t>(step * 31 + t * 7 + 1); }

struct Result1 {
  std::string copy;
  double wait_ms_per_ckpt = 0, step_ms = 0;
  bool verified = false;
};

int Main(int argc, char** argv) {
  std::string dir = "/dev/shm/nonstop_layerwise_gpu", json;
  int layers = 24, steps = 8;
  uint64_t mib = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--dir") dir = v;
    else if (a == "--layers") layers = std::stoi(v);
    else if (a == "--mib") mib = std::stoull(v);
    else if (a == "--steps") steps = std::stoi(v);
    else if (a == "--json") json = v;
  }
  std::string why;
  if (CudaDeviceCount(&why) == 0) {
    std::printf("no CUDA device (%s): skipped\n", why.c_str());
    return 77;
  }
  const uint64_t bytes = mib << 20;
  std::vector<void*> dev(layers);
  for (auto& p : dev) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) return 1;
  }
  std::vector<Result1> results;
  for (LayerCopy copy : {LayerCopy::kHost, LayerCopy::kDirect, LayerCopy::kDevice}) {
    std::filesystem::remove_all(dir);
    EngineOptions o;
    o.dir = dir;
    o.medium = MediumKind::kMmap;
    o.max_in_flight = 2;
    o.writers = 4;
    o.layer_copy = copy;
    auto opened = Engine::Open(o);
    if (!opened.ok()) {
      std::fprintf(stderr, "%s\n", opened.status().ToString().c_str());
      return 1;
    }
    auto engine = std::move(opened).value();
    std::vector<TensorRef> refs;
    for (int t = 0; t < layers; ++t) {
      TensorRef r;
      r.spec.name = "layer" + std::to_string(t);
      r.spec.dtype = DType::kUInt8;
      r.spec.shape = {static_cast<int64_t>(bytes)};
      r.spec.nbytes = bytes;
      r.data = dev[t];
      r.device.kind = DeviceKind::kCuda;
      refs.push_back(r);
    }
    Status st = engine->Register(refs);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    double wait_s = 0;
    const auto t0 = Clock::now();
    for (int64_t step = 1; step <= steps; ++step) {
      auto c = engine->BeginCheckpoint(step);
      if (!c.ok()) return 1;
      for (int t = layers - 1; t >= 0; --t) {  // backward order
        const auto w0 = Clock::now();
        if (!engine->WaitTensorsCopied({static_cast<uint32_t>(t)}).ok()) return 1;
        wait_s += std::chrono::duration<double>(Clock::now() - w0).count();
        // The update of layer t, on the legacy default stream (the one registered).
        cudaMemsetAsync(dev[t], Byte(step, t), bytes, 0);
        if (!engine->CopyTensors(*c, {static_cast<uint32_t>(t)}).ok()) return 1;
      }
      if (!engine->EndCheckpoint(*c, step, "{}").ok()) return 1;
    }
    cudaDeviceSynchronize();
    const double total_s = std::chrono::duration<double>(Clock::now() - t0).count();
    st = engine->WaitCommitted(0);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    EngineStats stats = engine->Stats();
    (void)engine->Close();
    // Every checkpoint still stored holds every layer's bytes of its step.
    MediumOptions mo;
    auto file = SlotFile::Open(
        std::move(OpenMedium(dir + "/" + SlotFileName(0), MediumKind::kBuffered, mo)).value());
    bool ok = file.ok();
    int checked = 0;
    if (ok) {
      auto report = (*file)->Scan();
      ok = report.ok() && report->newest_valid >= 0;
      std::vector<uint8_t> buf(bytes);
      for (const auto& sc : ok ? report->checkpoints : std::vector<ScannedCheckpoint>{}) {
        if (sc.state != CheckpointState::kCommitted) continue;
        for (int t = 0; t < layers && ok; ++t) {
          ok = (*file)->ReadTensor(sc.info, t, buf.data()).ok();
          for (uint64_t i = 0; ok && i < bytes; ++i) ok = buf[i] == Byte(sc.info.step, t);
          if (!ok) std::fprintf(stderr, "step %ld layer %d differs\n", sc.info.step, t);
        }
        ++checked;
      }
    }
    Result1 r;
    r.copy = LayerCopyName(copy);
    r.wait_ms_per_ckpt = wait_s / steps * 1000;
    r.step_ms = total_s / steps * 1000;
    r.verified = ok && checked > 0;
    std::printf("copy=%-7s wait before updates %8.2f ms/ckpt, %8.2f ms/step, committed %lu, "
                "verified %d checkpoints: %s (%s)\n",
                r.copy.c_str(), r.wait_ms_per_ckpt, r.step_ms,
                static_cast<unsigned long>(stats.committed), checked, r.verified ? "OK" : "FAIL",
                stats.copy_engine.c_str());
    results.push_back(r);
  }
  std::filesystem::remove_all(dir);
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"layers\": " << layers << ", \"bytes_per_layer\": " << bytes << ", \"rows\": [";
    for (size_t i = 0; i < results.size(); ++i) {
      f << (i ? ", " : "") << "{\"copy\": \"" << results[i].copy
        << "\", \"wait_ms_per_ckpt\": " << results[i].wait_ms_per_ckpt
        << ", \"step_ms\": " << results[i].step_ms
        << ", \"verified\": " << (results[i].verified ? "true" : "false") << "}";
    }
    f << "]}\n";
  }
  for (void* p : dev) cudaFree(p);
  for (const auto& r : results) {
    if (!r.verified) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace nonstop

int main(int argc, char** argv) { return nonstop::Main(argc, argv); }
