// The multi-step schedule against a reference trajectory: "training" applies
// each step to live buffers with the same CPU optimizer; the checkpoint that
// MultistepCheckpoint persists (parts copied at different versions, replayed)
// must equal the live state at its version bit for bit.
#include "nonstop/multistep.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "engine/counting_copy_engine.h"
#include "engine/engine_internal.h"
#include "engine/multistep_internal.h"
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using multistep_internal::PlanParts;

// SetOutputs is handed every tensor of the state as bytes: those that are a
// window tensor's own (float32, same pointer, same size, a role this
// optimizer keeps) become reconstructed buffers; everything else is copied.
// A buffered engine in `dir` with small chunks and staging (the multistep
// tests' states are a few KB).
Result<std::unique_ptr<Engine>> OpenSmallEngine(const fs::path& dir) {
  EngineOptions eo;
  eo.dir = dir.string();
  eo.medium = MediumKind::kBuffered;
  eo.chunk_bytes = 64 << 10;
  eo.staging_bytes = 1 << 20;
  return Engine::Open(eo);
}

TEST(MatchOutputsTest, TheOptimizersOwnTensorsBecomeReconstructedBuffers) {
  std::vector<float> p0(8), m0(8), v0(8), vmax0(8), p1(3), buf(8), other(8);
  std::vector<OptimizerTensor> tensors(2);
  tensors[0].numel = 8;
  tensors[0].param = p0.data();
  tensors[0].exp_avg = m0.data();
  tensors[0].exp_avg_sq = v0.data();
  tensors[0].max_exp_avg_sq = vmax0.data();
  tensors[0].momentum_buffer = buf.data();  // not a role of Adam: never matched
  tensors[1].numel = 3;
  tensors[1].param = p1.data();
  const auto out = [](const void* data, uint64_t nbytes, DType dtype = DType::kFloat32) {
    OutputTensor o;
    o.spec.dtype = dtype;
    o.spec.nbytes = nbytes;
    o.data = data;
    o.device = Device{DeviceKind::kHost, 0, 0};
    return o;
  };
  std::vector<OutputTensor> outputs = {
      out(p0.data(), 32), out(v0.data(), 32), out(p1.data(), 12),
      out(vmax0.data(), 32),  // not kept without amsgrad
      out(buf.data(), 32), out(other.data(), 32),
      out(p0.data(), 16),                  // a view: part of p0's bytes
      out(m0.data(), 32, DType::kInt32),  // the same bytes as another dtype
      out(p1.data(), 0)};                 // empty
  optim::OptimizerConfig adam;
  adam.algorithm = optim::Algorithm::kAdam;
  multistep_internal::MatchOutputs(adam, tensors, &outputs);
  const std::vector<std::pair<int, StateRole>> want = {
      {0, StateRole::kParam}, {0, StateRole::kExpAvgSq}, {1, StateRole::kParam}};
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (i < want.size()) {
      EXPECT_EQ(outputs[i].tensor, want[i].first) << i;
      EXPECT_EQ(outputs[i].role, want[i].second) << i;
      EXPECT_EQ(outputs[i].data, nullptr) << i;
    } else {
      EXPECT_EQ(outputs[i].tensor, -1) << i;  // copied as bytes
      EXPECT_NE(outputs[i].data, nullptr) << i;
    }
  }
  // amsgrad keeps max_exp_avg_sq; SGD keeps the momentum buffer only.
  adam.amsgrad = true;
  outputs = {out(vmax0.data(), 32), out(buf.data(), 32)};
  multistep_internal::MatchOutputs(adam, tensors, &outputs);
  EXPECT_EQ(outputs[0].tensor, 0);
  EXPECT_EQ(outputs[0].role, StateRole::kMaxExpAvgSq);
  EXPECT_EQ(outputs[1].tensor, -1);
  optim::OptimizerConfig sgd;
  sgd.algorithm = optim::Algorithm::kSgd;
  outputs = {out(buf.data(), 32), out(m0.data(), 32)};
  multistep_internal::MatchOutputs(sgd, tensors, &outputs);
  EXPECT_EQ(outputs[0].tensor, 0);
  EXPECT_EQ(outputs[0].role, StateRole::kMomentumBuffer);
  EXPECT_EQ(outputs[1].tensor, -1);
}

TEST(PlanPartsTest, CoversEveryElementOnceInBlocksAndParts) {
  const std::vector<size_t> numels = {3000, 17, 1, 5000, 0, 1023};
  for (int parts : {1, 3, 7, 40}) {
    auto plan = PlanParts(numels, 1024, parts);
    ASSERT_EQ(plan.size(), static_cast<size_t>(parts));
    std::vector<std::vector<int>> seen(numels.size());
    for (size_t t = 0; t < numels.size(); ++t) seen[t].assign(numels[t], 0);
    size_t flat = 0;
    for (const auto& part : plan) {
      EXPECT_EQ(part.flat_begin, flat);
      size_t in_part = 0;
      for (const auto& block : part.blocks) {
        size_t in_block = 0;
        for (const auto& pc : block.pieces) {
          ASSERT_LT(pc.begin, pc.end);
          for (size_t i = pc.begin; i < pc.end; ++i) ++seen[pc.tensor][i];
          in_block += pc.end - pc.begin;
        }
        EXPECT_LE(in_block, 1024u);
        in_part += in_block;
      }
      EXPECT_EQ(part.flat_end - part.flat_begin, in_part);
      flat = part.flat_end;
    }
    for (size_t t = 0; t < numels.size(); ++t) {
      for (int c : seen[t]) ASSERT_EQ(c, 1) << "tensor " << t << " parts " << parts;
    }
  }
}


uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // truncation: any bf16 value will do
}

// A model of a few tensors with an optimizer, trained by optim::Replay one
// step at a time (the reference), checkpointed by MultistepCheckpoint.
struct Trainer {
  optim::OptimizerConfig config;
  std::vector<size_t> numels;
  std::vector<std::vector<float>> param, m, v, mom;
  std::vector<double> step;
  std::vector<bool> has_mom;
  std::mt19937 rng{7};

  Trainer(optim::Algorithm algo, std::vector<size_t> n) : numels(std::move(n)) {
    config.algorithm = algo;
    for (size_t s : numels) {
      std::vector<float> p(s);
      std::normal_distribution<float> d;
      for (auto& x : p) x = d(rng);
      param.push_back(p);
      m.emplace_back(s, 0.f);
      v.emplace_back(s, 0.f);
      mom.emplace_back(s, 0.f);
    }
    step.assign(numels.size(), 0);
    has_mom.assign(numels.size(), false);
  }

  std::vector<OptimizerTensor> Tensors() {
    std::vector<OptimizerTensor> out;
    for (size_t t = 0; t < numels.size(); ++t) {
      OptimizerTensor o;
      o.name = "w" + std::to_string(t);
      o.numel = numels[t];
      o.group = static_cast<int>(t % 2);
      o.param = param[t].data();
      const bool adam = config.algorithm != optim::Algorithm::kSgd;
      const bool fresh = adam ? step[t] == 0 : !has_mom[t];
      o.exp_avg = adam && !fresh ? m[t].data() : nullptr;
      o.exp_avg_sq = adam && !fresh ? v[t].data() : nullptr;
      o.momentum_buffer = !adam && !fresh ? mom[t].data() : nullptr;
      o.step = step[t];
      out.push_back(o);
    }
    return out;
  }

  std::vector<optim::StepHyperparameters> Groups(int i) {
    std::vector<optim::StepHyperparameters> g(2);
    for (int k = 0; k < 2; ++k) {
      g[k].lr = 1e-2 * (1 + 0.1 * i) * (k + 1);  // a schedule, different per group
      g[k].weight_decay = 0.01 * k;
      g[k].momentum = 0.9;
      g[k].nesterov = k == 1;
    }
    return g;
  }

  // One training step: gradients (bf16 for tensor 1), maybe skipped, maybe
  // without a gradient for tensor 2 (unused parameter).
  // Gradients stay alive and unchanged until the next step's backward
  // (GoCkpt-O copies them while the update and the next forward run).
  std::vector<std::vector<float>> g32;
  std::vector<std::vector<uint16_t>> g16;

  void Step(int i, bool skipped, MultistepCheckpoint* ms, int64_t global_step) {
    ASSERT_TRUE(ms->OnBackwardBegin().ok());
    g32.assign(numels.size(), {});
    g16.assign(numels.size(), {});
    std::vector<GradRef> refs(numels.size());
    std::normal_distribution<float> d;
    for (size_t t = 0; t < numels.size(); ++t) {
      g32[t].resize(numels[t]);
      for (auto& x : g32[t]) x = d(rng);
      if (t == 1) {
        g16[t].resize(numels[t]);
        for (size_t e = 0; e < numels[t]; ++e) {
          g16[t][e] = ToBf16(g32[t][e]);
          uint32_t u = static_cast<uint32_t>(g16[t][e]) << 16;
          std::memcpy(&g32[t][e], &u, 4);  // the exact upcast the optimizer consumes
        }
        refs[t] = {g16[t].data(), DType::kBFloat16, {}};
      } else if (t == 2 && i % 3 == 1) {
        refs[t] = {};  // no gradient this step
      } else {
        refs[t] = {g32[t].data(), DType::kFloat32, {}};
      }
    }
    auto groups = Groups(i);
    ASSERT_TRUE(ms->OnUpdateBegin(global_step, groups, skipped, refs).ok());
    if (!skipped) {
      for (size_t t = 0; t < numels.size(); ++t) {
        if (refs[t].data == nullptr) continue;
        optim::StepRecord rec;
        rec.hyper = groups[t % 2];
        rec.grad = {g32[t].data(), DType::kFloat32};
        optim::PartState st;
        st.numel = numels[t];
        st.param = param[t].data();
        st.exp_avg = m[t].data();
        st.exp_avg_sq = v[t].data();
        st.momentum_buffer = mom[t].data();
        st.step = step[t];
        st.has_momentum_buffer = has_mom[t];
        ASSERT_TRUE(optim::Replay(config, {&rec, 1}, &st).ok());
        step[t] = st.step;
        has_mom[t] = st.has_momentum_buffer;
      }
    }
    auto now = Tensors();
    ASSERT_TRUE(ms->OnUpdateEnd(global_step, now).ok());
  }
};

// Reads each checkpoint of `truth` back and compares it with the live state
// at its version, bit for bit.
void ExpectPersistedEqualsLive(const EngineOptions& eo, optim::Algorithm algo,
                               const std::vector<std::pair<int64_t, Trainer>>& truth) {
  // Newest first: each Restore is a rollback, durable at once (issue 23),
  // which abandons the versions above it.
  for (auto it = truth.rbegin(); it != truth.rend(); ++it) {
    const auto& [version, want] = *it;
    auto reader = Engine::Open(eo);
    ASSERT_TRUE(reader.ok());
    Trainer got = want;
    std::vector<TensorRef> refs;
    const bool adam = algo != optim::Algorithm::kSgd;
    auto add = [&](size_t t, const char* role, std::vector<float>& buf) {
      std::fill(buf.begin(), buf.end(), -1.f);
      TensorRef r;
      r.spec.name = "w" + std::to_string(t) + "/" + role;
      r.spec.dtype = DType::kFloat32;
      r.spec.shape = {static_cast<int64_t>(buf.size())};
      r.spec.nbytes = buf.size() * 4;
      r.data = buf.data();
      refs.push_back(r);
    };
    for (size_t t = 0; t < got.numels.size(); ++t) {
      add(t, "param", got.param[t]);
      if (adam) {
        add(t, "exp_avg", got.m[t]);
        add(t, "exp_avg_sq", got.v[t]);
      } else {
        add(t, "momentum_buffer", got.mom[t]);
      }
    }
    ASSERT_TRUE((*reader)->Register(refs).ok());
    auto info = (*reader)->Restore(version);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    for (size_t t = 0; t < got.numels.size(); ++t) {
      const size_t bytes = got.numels[t] * 4;
      EXPECT_EQ(std::memcmp(got.param[t].data(), want.param[t].data(), bytes), 0)
          << "param " << t << " version " << version;
      if (adam) {
        EXPECT_EQ(std::memcmp(got.m[t].data(), want.m[t].data(), bytes), 0) << "exp_avg " << t;
        EXPECT_EQ(std::memcmp(got.v[t].data(), want.v[t].data(), bytes), 0) << "exp_avg_sq " << t;
      } else {
        EXPECT_EQ(std::memcmp(got.mom[t].data(), want.mom[t].data(), bytes), 0) << "momentum " << t;
      }
    }
    ASSERT_TRUE((*reader)->Close().ok());
  }
}

class MultistepTest : public ::testing::TestWithParam<std::tuple<optim::Algorithm, int, bool>> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nonstop_multistep_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_P(MultistepTest, PersistedStateEqualsLiveStateAtItsVersion) {
  const auto [algo, parts, overlap] = GetParam();
  EngineOptions eo;
  eo.dir = dir_.string();
  eo.medium = MediumKind::kBuffered;
  eo.chunk_bytes = 64 << 10;
  eo.staging_bytes = 1 << 20;
  auto engine = Engine::Open(eo);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  MultistepOptions mo;
  mo.parts = parts;
  mo.block_bytes = 4096;
  mo.overlap_gradients = overlap;
  mo.replay_threads = 2;
  auto ms = MultistepCheckpoint::Create(engine->get(), mo);
  ASSERT_TRUE(ms.ok());
  Trainer tr(algo, {3000, 1500, 777, 9, 4100});
  // Steps 0..1 before the first window: step 0 skipped (states stay fresh
  // until step 1), one window started after step 2, one after step 2+parts+1.
  int64_t s = 0;
  std::vector<std::pair<int64_t, Trainer>> truth;
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 3; ++i, ++s) tr.Step(static_cast<int>(s), s == 0, ms->get(), s);
    ASSERT_TRUE((*ms)->Begin(s - 1, tr.config, tr.Tensors()).ok());
    const int64_t version = (*ms)->version();
    EXPECT_EQ(version, s - 1 + parts - 1);
    if (parts == 1) truth.emplace_back(version, tr);
    for (int j = 1; j <= parts; ++j, ++s) {
      tr.Step(static_cast<int>(s), /*skipped=*/j == 2, ms->get(), s);
      if (s == version) truth.emplace_back(version, tr);
    }
    EXPECT_FALSE((*ms)->active());
  }
  ASSERT_TRUE((*ms)->Wait().ok());
  auto stats = (*ms)->Stats();
  EXPECT_EQ(stats.persisted, 2u);
  ASSERT_TRUE((*ms)->Close().ok());
  ASSERT_TRUE((*engine)->Close().ok());

  // Read both checkpoints back and compare with the live state at their versions.
  ExpectPersistedEqualsLive(eo, algo, truth);
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, MultistepTest,
    ::testing::Values(std::make_tuple(optim::Algorithm::kAdamW, 7, true),
                      std::make_tuple(optim::Algorithm::kAdamW, 4, false),
                      std::make_tuple(optim::Algorithm::kAdam, 3, true),
                      std::make_tuple(optim::Algorithm::kSgd, 7, false),
                      std::make_tuple(optim::Algorithm::kSgd, 1, true)));

// The state is copied once, device to host, into buffers that are the
// checkpoint's staging: the Engine writes them as they are, its copy engine
// moves none of their bytes (it used to copy all of them host to host), and
// its staging pool is not sized for them. Tensors of 64 KiB and more, on
// buffered and O_DIRECT media.
TEST(MultistepStagingTest, TheStateIsCopiedOnceAndWrittenFromItsHostBuffers) {
  for (MediumKind medium : {MediumKind::kBuffered, MediumKind::kDirect}) {
    const fs::path dir =
        fs::temp_directory_path() / ("nonstop_multistep_staged_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    EngineOptions eo;
    eo.dir = dir.string();
    eo.medium = medium;
    eo.chunk_bytes = 64 << 10;
    eo.max_in_flight = 1;
    eo.memory_tier = "disk";
    auto copied = std::make_shared<std::atomic<uint64_t>>(0);
    EngineMedia media;
    media.copy = [copied](int threads) -> std::unique_ptr<CopyEngine> {
      return std::make_unique<CountingCopyEngine>(threads, copied);
    };
    auto engine = OpenEngine(eo, media);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    MultistepOptions mo;
    mo.parts = 3;
    mo.block_bytes = 64 << 10;
    mo.replay_threads = 2;
    auto ms = MultistepCheckpoint::Create(engine->get(), mo);
    ASSERT_TRUE(ms.ok());
    Trainer tr(optim::Algorithm::kAdamW, {70000, 20000, 33001, 9, 17000});
    uint64_t state_bytes = 0;
    for (size_t n : tr.numels) state_bytes += 3 * 4 * n;
    int64_t s = 0;
    std::vector<std::pair<int64_t, Trainer>> truth;
    for (int i = 0; i < 2; ++i, ++s) tr.Step(static_cast<int>(s), false, ms->get(), s);
    ASSERT_TRUE((*ms)->Begin(s - 1, tr.config, tr.Tensors()).ok());
    const int64_t version = (*ms)->version();
    for (int j = 1; j <= mo.parts; ++j, ++s) {
      tr.Step(static_cast<int>(s), false, ms->get(), s);
      if (s == version) truth.emplace_back(version, tr);
    }
    ASSERT_TRUE((*ms)->Wait().ok());
    EXPECT_EQ((*ms)->Stats().persisted, 1u);
    EXPECT_EQ(copied->load(), 0u) << MediumKindName(medium)
                                  << ": the engine copied the replayed state again";
    EXPECT_LT((*engine)->Stats().staging_bytes, state_bytes) << MediumKindName(medium);
    ASSERT_TRUE((*ms)->Close().ok());
    ASSERT_TRUE((*engine)->Close().ok());
    eo.medium = MediumKind::kBuffered;
    ExpectPersistedEqualsLive(eo, tr.config.algorithm, truth);
    fs::remove_all(dir);
  }
}

// MultistepReplay::kRestore: nothing is replayed here; the checkpoint holds
// each part at the version it was copied at, the gradient log and the plan
// ("multistep_plan"). Applying the plan as the Python restorer does (per step
// in order, each listed tensor's prefix of `elements`, its logged gradient,
// the step count `count`, momentum absent when `fresh`) with the reference
// kernels must give the live state at the version bit for bit: the plan says
// everything the restorer needs. Also: without the replay the state differs.
TEST(MultistepRestorePlanTest, ThePlanReplayedGivesTheLiveStateAtItsVersion) {
  for (optim::Algorithm algo : {optim::Algorithm::kAdamW, optim::Algorithm::kSgd}) {
    const fs::path dir =
        fs::temp_directory_path() / ("nonstop_multistep_plan_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    EngineOptions eo;
    eo.dir = dir.string();
    eo.medium = MediumKind::kBuffered;
    eo.chunk_bytes = 64 << 10;
    auto engine = Engine::Open(eo);
    ASSERT_TRUE(engine.ok());
    MultistepOptions mo;
    mo.parts = 4;
    mo.block_bytes = 4096;
    mo.replay = MultistepReplay::kRestore;
    auto ms = MultistepCheckpoint::Create(engine->get(), mo);
    ASSERT_TRUE(ms.ok());
    Trainer tr(algo, {3000, 1500, 777, 9, 4100});
    int64_t s = 0;
    // Step 0 skipped: the state is fresh when the window begins after step 0.
    tr.Step(0, true, ms->get(), s++);
    ASSERT_TRUE((*ms)->Begin(0, tr.config, tr.Tensors()).ok());
    const int64_t version = (*ms)->version();
    Trainer truth = tr;
    for (int j = 1; j <= mo.parts; ++j, ++s) {
      tr.Step(static_cast<int>(s), /*skipped=*/j == 2, ms->get(), s);
      if (s == version) truth = tr;
    }
    ASSERT_TRUE((*ms)->Wait().ok());
    ASSERT_TRUE((*ms)->Close().ok());
    ASSERT_TRUE((*engine)->Close().ok());

    // The state as written, and the plan.
    const bool adam = algo != optim::Algorithm::kSgd;
    Trainer got = truth;
    std::vector<TensorRef> refs;
    auto add = [&](const std::string& name, DType dtype, void* data, size_t n) {
      TensorRef r;
      r.spec.name = name;
      r.spec.dtype = dtype;
      r.spec.shape = {static_cast<int64_t>(n)};
      r.spec.nbytes = n * DTypeSize(dtype);
      r.data = data;
      refs.push_back(r);
    };
    for (size_t t = 0; t < got.numels.size(); ++t) {
      const std::string w = "w" + std::to_string(t) + "/";
      add(w + "param", DType::kFloat32, got.param[t].data(), got.numels[t]);
      add(w + (adam ? "exp_avg" : "momentum_buffer"), DType::kFloat32,
          adam ? got.m[t].data() : got.mom[t].data(), got.numels[t]);
      if (adam) add(w + "exp_avg_sq", DType::kFloat32, got.v[t].data(), got.numels[t]);
    }
    auto reader = Engine::Open(eo);
    ASSERT_TRUE(reader.ok());
    ASSERT_TRUE((*reader)->Register(refs).ok());
    auto info = (*reader)->Restore(version);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    const std::string meta = info->meta_json;
    ASSERT_TRUE((*reader)->Close().ok());  // one engine per job directory at a time
    ASSERT_NE(meta.find("\"multistep_plan\":{\"parts\":4,\"begin\":0,\"version\":3"),
              std::string::npos) << meta;
    bool differs = false;
    for (size_t t = 0; t < got.numels.size(); ++t) {
      differs |= std::memcmp(got.param[t].data(), truth.param[t].data(), got.numels[t] * 4) != 0;
    }
    EXPECT_TRUE(differs) << "the parts were replayed before they were written";

    // Apply the plan: steps in order, each a list of updates.
    struct Update {
      int tensor;
      size_t elements;
      std::string gradient;
      double count;
      bool fresh;
    };
    const std::regex step_re(R"re(\{"step":(\d+),"skipped":(true|false),)re");
    const std::regex update_re(
        R"re(\{"tensor":(\d+),"elements":(\d+),"gradient":"([^"]+)","count":([0-9.e+-]+),)re"
        R"re("fresh":(true|false)\})re");
    std::vector<std::pair<int64_t, std::vector<Update>>> plan;
    size_t at = meta.find("\"steps\":[");
    ASSERT_NE(at, std::string::npos);
    std::smatch m;
    std::string rest = meta.substr(at);
    std::vector<std::string> gradient_names;
    int skipped_steps = 0;
    while (std::regex_search(rest, m, step_re)) {
      const int64_t step = std::stoll(m[1]);
      const bool skipped = m[2] == "true";
      skipped_steps += skipped;
      rest = m.suffix();
      const size_t end = rest.find("]}");
      std::string updates = rest.substr(0, end);
      std::vector<Update> ups;
      std::smatch u;
      while (std::regex_search(updates, u, update_re)) {
        ups.push_back({std::stoi(u[1]), std::stoul(u[2]), u[3], std::stod(u[4]), u[5] == "true"});
        gradient_names.push_back(u[3]);
        updates = u.suffix();
      }
      EXPECT_TRUE(!skipped || ups.empty());
      plan.emplace_back(step, std::move(ups));
      rest = rest.substr(end);
    }
    ASSERT_EQ(plan.size(), 3u);  // steps 1..K-1
    EXPECT_EQ(skipped_steps, 1);
    ASSERT_FALSE(gradient_names.empty());
    // The logged gradients (bf16 for tensor 1), read by their names.
    std::vector<std::vector<uint8_t>> grads(gradient_names.size());
    std::vector<TensorRef> grefs;
    refs.swap(grefs);
    size_t gi = 0;
    for (const auto& [step, ups] : plan) {
      for (const auto& up : ups) {
        const DType d = up.tensor == 1 ? DType::kBFloat16 : DType::kFloat32;
        grads[gi].resize(up.elements * DTypeSize(d));
        add(up.gradient, d, grads[gi].data(), up.elements);
        ++gi;
      }
    }
    auto greader = Engine::Open(eo);
    ASSERT_TRUE(greader.ok());
    ASSERT_TRUE((*greader)->Register(refs).ok());
    ASSERT_TRUE((*greader)->Restore(version).ok());
    gi = 0;
    for (const auto& [step, ups] : plan) {
      const auto groups = Trainer(algo, {}).Groups(static_cast<int>(step));
      for (const auto& up : ups) {
        const int t = up.tensor;
        optim::StepRecord rec;
        rec.hyper = groups[t % 2];
        rec.grad = {grads[gi++].data(), t == 1 ? DType::kBFloat16 : DType::kFloat32};
        optim::PartState st;
        st.numel = up.elements;  // the prefix one step behind
        st.param = got.param[t].data();
        st.exp_avg = got.m[t].data();
        st.exp_avg_sq = got.v[t].data();
        st.momentum_buffer = got.mom[t].data();
        st.step = up.count;
        st.has_momentum_buffer = !up.fresh;
        ASSERT_TRUE(optim::Replay(tr.config, {&rec, 1}, &st).ok());
      }
    }
    for (size_t t = 0; t < got.numels.size(); ++t) {
      const size_t bytes = got.numels[t] * 4;
      EXPECT_EQ(std::memcmp(got.param[t].data(), truth.param[t].data(), bytes), 0) << "param " << t;
      if (adam) {
        EXPECT_EQ(std::memcmp(got.m[t].data(), truth.m[t].data(), bytes), 0) << "exp_avg " << t;
        EXPECT_EQ(std::memcmp(got.v[t].data(), truth.v[t].data(), bytes), 0) << "exp_avg_sq " << t;
      } else {
        EXPECT_EQ(std::memcmp(got.mom[t].data(), truth.mom[t].data(), bytes), 0) << "momentum " << t;
      }
    }
    ASSERT_TRUE((*greader)->Close().ok());
    fs::remove_all(dir);
  }
}

TEST(MultistepRestorePlanTest, AddToMetaPutsTheMemberFirst) {
  using multistep_internal::AddToMeta;
  EXPECT_EQ(AddToMeta("{}", "k", "[1]"), "{\"k\":[1]}");
  EXPECT_EQ(AddToMeta(" { } ", "k", "2"), " {\"k\":2 } ");
  EXPECT_EQ(AddToMeta("{\"a\":1}", "k", "{}"), "{\"k\":{},\"a\":1}");
}

TEST(MultistepErrorTest, AFailedCopyFailsTheWindowAndTheNextOneWorks) {
  const fs::path dir =
      fs::temp_directory_path() / ("nonstop_multistep_err_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto engine = OpenSmallEngine(dir);
  ASSERT_TRUE(engine.ok());
  MultistepOptions mo;
  mo.parts = 2;
  mo.block_bytes = 4096;
  auto ms = MultistepCheckpoint::Create(engine->get(), mo, MakeHostCopyEngine(1));
  ASSERT_TRUE(ms.ok());
  Trainer tr(optim::Algorithm::kSgd, {2000, 3000});
  auto tensors = tr.Tensors();
  tensors[1].device.kind = DeviceKind::kCuda;  // the host copy engine refuses it
  ASSERT_TRUE((*ms)->Begin(0, tr.config, tensors).ok());
  std::vector<optim::StepHyperparameters> groups(2);
  std::vector<GradRef> grads(2);
  std::vector<float> g(3000, 1.f);
  grads[0].data = grads[1].data = g.data();
  Status s = (*ms)->OnUpdateBegin(1, groups, false, grads);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_FALSE((*ms)->active());
  EXPECT_EQ((*ms)->Stats().failed, 1u);
  // A later window with readable tensors is persisted.
  ASSERT_TRUE((*ms)->Begin(5, tr.config, tr.Tensors()).ok());
  ASSERT_TRUE((*ms)->OnUpdateBegin(6, groups, false, grads).ok());
  ASSERT_TRUE((*ms)->OnUpdateEnd(6).ok());
  ASSERT_TRUE((*ms)->OnUpdateBegin(7, groups, false, grads).ok());
  EXPECT_FALSE((*ms)->active());
  ASSERT_TRUE((*ms)->Wait().ok());
  auto latest = (*ms)->Latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 6);
  ASSERT_TRUE((*ms)->Close().ok());
  ASSERT_TRUE((*engine)->Close().ok());
  fs::remove_all(dir);
}

// The driver's steps (the Python front end's hooks): which step an update
// belongs to, a step without an update logged as skipped, a checkpoint due
// while a window is open begun at the first step after it closed, the
// outputs due after the version's update, two updates in one step refused.
TEST(MultistepDriverTest, MarkStepDecidesWindowsSkipsAndOutputs) {
  const fs::path dir =
      fs::temp_directory_path() / ("nonstop_multistep_driver_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto engine = OpenSmallEngine(dir);
  ASSERT_TRUE(engine.ok());
  MultistepOptions mo;
  mo.parts = 3;
  mo.block_bytes = 4096;
  auto created = MultistepCheckpoint::Create(engine->get(), mo);
  ASSERT_TRUE(created.ok());
  MultistepCheckpoint* ms = created->get();
  Trainer tr(optim::Algorithm::kSgd, {2000, 3000});
  const auto outputs = [&] {  // w0 as bytes: SetOutputs finds it is the window's
    OutputTensor o;
    o.spec.name = "w0";
    o.spec.dtype = DType::kFloat32;
    o.spec.shape = {2000};
    o.spec.nbytes = 2000 * sizeof(float);
    o.data = tr.param[0].data();
    return std::vector<OutputTensor>{o};
  };
  const auto update = [&](int64_t s) {  // CountUpdate, then the hooks (Trainer::Step)
    ASSERT_TRUE(ms->CountUpdate().ok());
    ASSERT_EQ(ms->next_step(), s);
    tr.Step(static_cast<int>(s), /*skipped=*/false, ms, s);
  };
  EXPECT_EQ(ms->next_step(), 0);
  update(0);
  EXPECT_FALSE(ms->MarkStep(0, /*due=*/false).value());
  update(1);
  ASSERT_TRUE(ms->MarkStep(1, /*due=*/true).value());  // begin now: no window is open
  ASSERT_TRUE(ms->Begin(1, tr.config, tr.Tensors()).ok());
  EXPECT_FALSE(ms->outputs_due());
  EXPECT_FALSE(ms->RequestCheckpoint());  // save() while open: after it closes
  update(2);
  Status twice = ms->CountUpdate();  // a second update before ckpt.step(2)
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("one optimizer.step() per ckpt.step()"), std::string::npos);
  EXPECT_FALSE(ms->MarkStep(2, /*due=*/false).value());
  EXPECT_FALSE(ms->outputs_due());
  // Step 3 without an update: logged as skipped, and the version (3) is done.
  EXPECT_FALSE(ms->MarkStep(3, /*due=*/false).value());
  EXPECT_EQ(ms->Stats().recent.back().skipped_steps, 1);
  EXPECT_TRUE(ms->outputs_due());
  ASSERT_TRUE(ms->SetOutputs(outputs(), "{}").ok());
  EXPECT_FALSE(ms->outputs_due());
  update(4);  // closes the window
  EXPECT_FALSE(ms->active());
  EXPECT_TRUE(ms->MarkStep(4, /*due=*/false).value());  // save()'s checkpoint, now
  Status begun = ms->Begin(4, tr.config, tr.Tensors());
  ASSERT_TRUE(begun.ok()) << begun.ToString();
  EXPECT_FALSE(ms->MarkStep(5, /*due=*/false).value());  // step 5 skipped
  EXPECT_FALSE(ms->MarkStep(6, /*due=*/false).value());
  ASSERT_TRUE(ms->SetOutputs(outputs(), "{}").ok());
  EXPECT_FALSE(ms->MarkStep(7, /*due=*/false).value());  // closes it (a skipped last step)
  EXPECT_FALSE(ms->active());
  ASSERT_TRUE(ms->Wait().ok());
  EXPECT_EQ(ms->Stats().persisted, 2u);
  ASSERT_TRUE(ms->Close().ok());
  ASSERT_TRUE((*engine)->Close().ok());
  fs::remove_all(dir);
}

// needs_refresh: while a tensor of the open window has no first state (SGD's
// momentum buffer, made at its first update), OnUpdateEnd wants the
// refreshed pointers; once they are all known, or no window is open, not.
TEST(MultistepDriverTest, NeedsRefreshUntilEveryFirstStateIsKnown) {
  const fs::path dir =
      fs::temp_directory_path() / ("nonstop_multistep_refresh_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto engine = OpenSmallEngine(dir);
  ASSERT_TRUE(engine.ok());
  MultistepOptions mo;
  mo.parts = 3;
  mo.block_bytes = 4096;
  auto created = MultistepCheckpoint::Create(engine->get(), mo);
  ASSERT_TRUE(created.ok());
  MultistepCheckpoint* ms = created->get();
  EXPECT_TRUE(ms->CountUpdate(/*scaler_inside=*/true).ok());  // replay kHost: no log to miss
  Trainer tr(optim::Algorithm::kSgd, {2000, 3000});
  EXPECT_FALSE(ms->needs_refresh());  // no window
  ASSERT_TRUE(ms->Begin(0, tr.config, tr.Tensors()).ok());
  EXPECT_TRUE(ms->needs_refresh());  // no momentum buffer yet
  ASSERT_TRUE(ms->OnUpdateBegin(1, tr.Groups(1), /*skipped=*/true, {}).ok());
  ASSERT_TRUE(ms->OnUpdateEnd(1).ok());
  EXPECT_TRUE(ms->needs_refresh());  // a skipped step made none
  tr.Step(2, /*skipped=*/false, ms, 2);  // passes the buffers its update made
  EXPECT_FALSE(ms->needs_refresh());
  OutputTensor w0;  // as bytes: SetOutputs finds it is the window's
  w0.spec.name = "w0";
  w0.spec.dtype = DType::kFloat32;
  w0.spec.shape = {2000};
  w0.spec.nbytes = 2000 * sizeof(float);
  w0.data = tr.param[0].data();
  ASSERT_TRUE(ms->SetOutputs({w0}, "{}").ok());
  ASSERT_TRUE(ms->OnUpdateBegin(3, tr.Groups(3), /*skipped=*/true, {}).ok());  // closes it
  EXPECT_FALSE(ms->active());
  ASSERT_TRUE(ms->Wait().ok());
  ASSERT_TRUE(ms->Close().ok());
  ASSERT_TRUE((*engine)->Close().ok());
  fs::remove_all(dir);
}

// With replay kRestore the log must see what the update applies: GradScaler
// stepping a fused optimizer itself (unscaling and skipping inside) is refused.
TEST(MultistepDriverTest, GradScalerInsideAFusedOptimizerIsRefusedForTheTorchReplay) {
  const fs::path dir =
      fs::temp_directory_path() / ("nonstop_multistep_scaler_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto engine = OpenSmallEngine(dir);
  ASSERT_TRUE(engine.ok());
  MultistepOptions mo;
  mo.replay = MultistepReplay::kRestore;
  auto ms = MultistepCheckpoint::Create(engine->get(), mo);
  ASSERT_TRUE(ms.ok());
  const Status s = (*ms)->CountUpdate(/*scaler_inside=*/true);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("use fused=False with GradScaler"), std::string::npos) << s.ToString();
  EXPECT_TRUE((*ms)->CountUpdate().ok());
  ASSERT_TRUE((*ms)->Close().ok());
  ASSERT_TRUE((*engine)->Close().ok());
  fs::remove_all(dir);
}

TEST(MultistepCreateTest, RejectsBadOptions) {
  MultistepOptions mo;
  mo.parts = 0;
  EXPECT_FALSE(MultistepCheckpoint::Create(nullptr, mo).ok());
}

}  // namespace
}  // namespace nonstop
