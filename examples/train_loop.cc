// A C++ training loop that checkpoints through nonstop::Engine and recovers
// through nonstop::JobDir, the job directory's one owner. No Python, no
// torch: a tiny linear model y = W x + b fitted by SGD with momentum on
// synthetic data. It shows the whole path a C++ user takes:
//
//   Engine::Open -> Register(tensors) -> per step: WaitCopied() before the
//   update, Checkpoint(step) after it -> Close; later, in a "new process":
//   Engine::Open (the writer: it holds the directory's lock) ->
//   JobDir::OpenForRead -> Select() (the one recovery selection: newest
//   committed checkpoint no rollback abandoned whose data verifies, with a
//   line for each newer one skipped) -> read its tensors by name ->
//   Register -> Engine::AdoptRestored(counter) (the engine keeps that
//   checkpoint until a newer one commits, and records a rollback before
//   writing when newer ones exist) -> continue.
// (Engine::Restore() does the same selection and read in one call; a caller
// that reads with its own code, as the Python front end does, uses JobDir.)
//
// It trains 40 steps without interruption (the reference), then 40 steps
// again with a checkpoint every 5 steps, "crashes" after step 27 (drops the
// engine and the model without closing cleanly), restores the newest
// checkpoint into freshly allocated tensors and finishes. The final weights
// must be bitwise identical to the reference's.
//
//   usage: nonstop_example_train_loop [dir]   (default: a fresh temp dir)
#include <nonstop/engine.h>
#include <nonstop/jobdir.h>
#include <nonstop/store.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

constexpr int kIn = 64, kOut = 32, kBatch = 16, kSteps = 40, kEvery = 5, kCrashAfter = 27;

// The model and its optimizer state: everything a checkpoint must hold.
struct Model {
  std::vector<float> w = std::vector<float>(kIn * kOut, 0.0f);
  std::vector<float> b = std::vector<float>(kOut, 0.0f);
  std::vector<float> w_momentum = std::vector<float>(kIn * kOut, 0.0f);
  std::vector<float> b_momentum = std::vector<float>(kOut, 0.0f);
  int64_t step = 0;  // saved in the checkpoint's metadata
};

// Deterministic data for step s (a fixed "true" model plus noise).
float Data(uint64_t s, uint64_t i) {
  uint64_t x = (s * 0x9E3779B97F4A7C15ull) ^ (i * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<float>(x % 20001) / 10000.0f - 1.0f;
}

// One SGD-with-momentum step; returns the loss.
float TrainStep(Model& m, int64_t step) {
  std::vector<float> gw(kIn * kOut, 0.0f), gb(kOut, 0.0f);
  float loss = 0;
  for (int n = 0; n < kBatch; ++n) {
    float x[kIn];
    for (int i = 0; i < kIn; ++i) x[i] = Data(step, n * kIn + i);
    for (int o = 0; o < kOut; ++o) {
      float target = 0.1f * o, y = m.b[o];
      for (int i = 0; i < kIn; ++i) {
        target += x[i] * (0.01f * ((i + o) % 7) - 0.03f);
        y += m.w[o * kIn + i] * x[i];
      }
      float err = y - target;
      loss += err * err / kBatch;
      gb[o] += 2 * err / kBatch;
      for (int i = 0; i < kIn; ++i) gw[o * kIn + i] += 2 * err * x[i] / kBatch;
    }
  }
  const float lr = 0.002f, mu = 0.9f;
  for (size_t k = 0; k < gw.size(); ++k) {
    m.w_momentum[k] = mu * m.w_momentum[k] + gw[k];
    m.w[k] -= lr * m.w_momentum[k];
  }
  for (size_t k = 0; k < gb.size(); ++k) {
    m.b_momentum[k] = mu * m.b_momentum[k] + gb[k];
    m.b[k] -= lr * m.b_momentum[k];
  }
  m.step = step;
  return loss;
}

nonstop::TensorRef Ref(const std::string& name, const std::vector<float>& v,
                       std::vector<int64_t> shape) {
  nonstop::TensorRef r;
  r.spec.name = name;
  r.spec.dtype = nonstop::DType::kFloat32;
  r.spec.shape = std::move(shape);
  r.spec.nbytes = v.size() * sizeof(float);
  r.data = v.data();
  return r;
}

std::vector<nonstop::TensorRef> Tensors(const Model& m) {
  return {Ref("w", m.w, {kOut, kIn}), Ref("b", m.b, {kOut}),
          Ref("w_momentum", m.w_momentum, {kOut, kIn}), Ref("b_momentum", m.b_momentum, {kOut})};
}

#define CHECK_OK(expr)                                                            \
  do {                                                                            \
    ::nonstop::Status _s = (expr);                                                \
    if (!_s.ok()) {                                                               \
      std::fprintf(stderr, "%s failed: %s\n", #expr, _s.ToString().c_str());      \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

std::unique_ptr<nonstop::Engine> Open(const std::string& dir) {
  nonstop::EngineOptions opts;
  opts.dir = dir;
  opts.max_in_flight = 2;
  auto engine = nonstop::Engine::Open(opts);
  if (!engine.ok()) {
    std::fprintf(stderr, "Engine::Open(%s): %s\n", dir.c_str(),
                 engine.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(engine).value();
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::string dir = argc > 1 ? argv[1]
                             : (fs::temp_directory_path() /
                                ("nonstop-example-" + std::to_string(::getpid())))
                                   .string();
  fs::remove_all(dir);

  // 1. The reference: no checkpoints, no crash.
  Model ref;
  for (int64_t s = 0; s < kSteps; ++s) TrainStep(ref, s);

  // 2. Train with a checkpoint every kEvery steps, and "crash".
  {
    auto model = std::make_unique<Model>();
    auto engine = Open(dir);
    CHECK_OK(engine->Register(Tensors(*model)));
    for (int64_t s = 0; s <= kCrashAfter; ++s) {
      CHECK_OK(engine->WaitCopied());  // the update below changes registered tensors
      float loss = TrainStep(*model, s);
      if ((s + 1) % kEvery == 0) {
        auto counter = engine->Checkpoint(s, "{\"step\":" + std::to_string(s) + "}");
        CHECK_OK(counter.status());
        std::printf("step %2lld  loss %.5f  checkpoint %llu started\n", (long long)s, loss,
                    (unsigned long long)counter.value());
      }
    }
    CHECK_OK(engine->WaitCommitted());
    auto latest = engine->Latest();
    std::printf("crash after step %d; newest committed checkpoint: step %lld\n", kCrashAfter,
                latest ? (long long)latest->step : -1LL);
    // The "crash": the model is lost. (A real kill -9 is tested from Python.)
  }

  // 3. A new process: fresh memory, recover through the job directory, finish.
  Model model;
  {
    auto engine = Open(dir);  // the writer first: nothing else writes from here on
    auto jd = nonstop::JobDir::OpenForRead(dir);
    CHECK_OK(jd.status());
    auto sel = (*jd)->Select(/*rank=*/0);  // verifies every chunk crc of the chosen one
    CHECK_OK(sel.status());
    for (const std::string& line : sel->skipped) std::printf("skipped: %s\n", line.c_str());
    int64_t start = 0;
    if (sel->chosen) {  // empty: no checkpoint at all, a fresh start
      nonstop::Selected& c = *sel->chosen;
      std::vector<nonstop::TensorRef> want = Tensors(model);
      for (size_t t = 0; t < c.info.tensors.size(); ++t) {
        const nonstop::TensorSpec& spec = c.info.tensors[t].spec;
        bool found = false;
        for (const nonstop::TensorRef& r : want) {
          if (r.spec.name != spec.name) continue;
          if (r.spec.nbytes != spec.nbytes) {
            std::fprintf(stderr, "tensor %s: %llu bytes stored, %llu expected\n",
                         spec.name.c_str(), (unsigned long long)spec.nbytes,
                         (unsigned long long)r.spec.nbytes);
            return 1;
          }
          CHECK_OK(c.file->ReadTensor(c.info, static_cast<int>(t), const_cast<void*>(r.data),
                                      /*verify=*/true));
          found = true;
        }
        if (!found) {
          std::fprintf(stderr, "checkpoint holds an unknown tensor %s\n", spec.name.c_str());
          return 1;
        }
      }
      start = c.info.step + 1;
      std::printf("recovered %s: checkpoint %llu (step %lld, %zu tensors, meta %s)\n",
                  c.location.where.c_str(), (unsigned long long)c.info.counter,
                  (long long)c.info.step, c.info.tensors.size(), c.info.meta_json.c_str());
    }
    CHECK_OK(engine->Register(Tensors(model)));
    if (sel->chosen) CHECK_OK(engine->AdoptRestored(sel->chosen->info.counter));
    for (int64_t s = start; s < kSteps; ++s) {
      CHECK_OK(engine->WaitCopied());
      TrainStep(model, s);
      if ((s + 1) % kEvery == 0) CHECK_OK(engine->Checkpoint(s, "{}").status());
    }
    nonstop::EngineStats st = engine->Stats();
    std::printf("engine: %llu checkpoints committed, stall %.3f ms total, medium %s\n",
                (unsigned long long)st.committed, st.stall_s_total * 1e3, st.medium.c_str());
    CHECK_OK(engine->Close());
  }

  bool same = std::memcmp(model.w.data(), ref.w.data(), model.w.size() * 4) == 0 &&
              std::memcmp(model.b.data(), ref.b.data(), model.b.size() * 4) == 0 &&
              std::memcmp(model.w_momentum.data(), ref.w_momentum.data(),
                          model.w_momentum.size() * 4) == 0 &&
              std::memcmp(model.b_momentum.data(), ref.b_momentum.data(),
                          model.b_momentum.size() * 4) == 0;
  if (argc <= 1) fs::remove_all(dir);
  std::printf("%s: resumed weights and momentum are %s the uninterrupted run's\n",
              same ? "PASS" : "FAIL", same ? "bitwise identical to" : "DIFFERENT from");
  return same ? 0 : 1;
}
