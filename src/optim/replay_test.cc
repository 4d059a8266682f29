#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "nonstop/optim.h"
#include "optim/kernels.h"

namespace nonstop::optim {
namespace {

// A part with every buffer an optimizer may use, filled reproducibly.
struct Part {
  explicit Part(size_t n, uint32_t seed = 1)
      : param(n), exp_avg(n), exp_avg_sq(n), max_exp_avg_sq(n), momentum_buffer(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      param[i] = normal(rng);
      exp_avg[i] = 0.1f * normal(rng);
      exp_avg_sq[i] = 0.01f * std::abs(normal(rng));
      max_exp_avg_sq[i] = exp_avg_sq[i] * 1.5f;
      momentum_buffer[i] = 0.1f * normal(rng);
    }
  }
  PartState View(double step = 5, bool has_buffer = true) {
    PartState s;
    s.numel = param.size();
    s.param = param.data();
    s.exp_avg = exp_avg.data();
    s.exp_avg_sq = exp_avg_sq.data();
    s.max_exp_avg_sq = max_exp_avg_sq.data();
    s.momentum_buffer = momentum_buffer.data();
    s.step = step;
    s.has_momentum_buffer = has_buffer;
    return s;
  }
  bool BitwiseEqual(const Part& o) const {
    auto eq = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
    };
    return eq(param, o.param) && eq(exp_avg, o.exp_avg) && eq(exp_avg_sq, o.exp_avg_sq) &&
           eq(max_exp_avg_sq, o.max_exp_avg_sq) && eq(momentum_buffer, o.momentum_buffer);
  }
  std::vector<float> param, exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer;
};

std::vector<std::vector<float>> Grads(size_t steps, size_t n, uint32_t seed = 7) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<std::vector<float>> g(steps, std::vector<float>(n));
  for (auto& s : g)
    for (auto& x : s) x = normal(rng);
  return g;
}

std::vector<StepRecord> Log(const std::vector<std::vector<float>>& grads,
                            const StepHyperparameters& h) {
  std::vector<StepRecord> log;
  for (size_t i = 0; i < grads.size(); ++i) {
    StepRecord r;
    r.hyper = h;
    r.hyper.lr = h.lr * (1.0 + 0.1 * static_cast<double>(i));  // a schedule
    r.grad.data = grads[i].data();
    log.push_back(r);
  }
  return log;
}

struct Case {
  const char* name;
  OptimizerConfig config;
  StepHyperparameters hyper;
  bool has_buffer;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  StepHyperparameters adam;
  adam.lr = 1e-3;
  adam.weight_decay = 0.01;
  OptimizerConfig adamw{Algorithm::kAdamW, false, FirstMoment::kLerp,
                        BiasCorrection2Sqrt::kPowHalf};
  cases.push_back({"adamw", adamw, adam, true});
  OptimizerConfig adamw_ams = adamw;
  adamw_ams.amsgrad = true;
  StepHyperparameters adam_max = adam;
  adam_max.maximize = true;
  cases.push_back({"adamw_amsgrad_maximize", adamw_ams, adam_max, true});
  OptimizerConfig adam_l2{Algorithm::kAdam, false, FirstMoment::kLerp,
                          BiasCorrection2Sqrt::kPowHalf};
  cases.push_back({"adam_l2", adam_l2, adam, true});
  StepHyperparameters small_beta = adam;
  small_beta.beta1 = 0.3;  // lerp weight >= 0.5 takes lerp's other branch
  cases.push_back({"adam_lerp_large_weight", adam_l2, small_beta, true});
  OptimizerConfig legacy{Algorithm::kAdamW, false, FirstMoment::kMulAdd,
                         BiasCorrection2Sqrt::kSqrt};
  cases.push_back({"adamw_torch1x", legacy, adam, true});
  StepHyperparameters sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  sgd.weight_decay = 1e-4;
  sgd.nesterov = true;
  OptimizerConfig sgd_config{Algorithm::kSgd, false, FirstMoment::kLerp,
                             BiasCorrection2Sqrt::kPowHalf};
  cases.push_back({"sgd_nesterov_wd", sgd_config, sgd, false});
  StepHyperparameters sgd_damp = sgd;
  sgd_damp.nesterov = false;
  sgd_damp.dampening = 0.1;
  sgd_damp.maximize = true;
  cases.push_back({"sgd_dampening_maximize", sgd_config, sgd_damp, true});
  StepHyperparameters plain = sgd;
  plain.momentum = 0;
  plain.nesterov = false;
  cases.push_back({"sgd_plain", sgd_config, plain, false});
  return cases;
}

TEST(OptimReplayTest, ThreadAndBlockSplitsAreBitwiseEqual) {
  const size_t n = 100003;  // not a multiple of any vector width
  const auto grads = Grads(4, n);
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    const auto log = Log(grads, c.hyper);
    Part reference(n);
    PartState rs = reference.View(5, c.has_buffer);
    ASSERT_TRUE(Replay(c.config, log, &rs, {.num_threads = 1, .block_elements = 0}).ok());
    for (int threads : {2, 3, 7}) {
      for (size_t block : {size_t{0}, size_t{1000}, size_t{8192}, size_t{33}}) {
        Part part(n);
        PartState s = part.View(5, c.has_buffer);
        ASSERT_TRUE(Replay(c.config, log, &s, {.num_threads = threads, .block_elements = block})
                        .ok());
        EXPECT_TRUE(part.BitwiseEqual(reference)) << threads << " threads, block " << block;
        EXPECT_EQ(s.step, rs.step);
      }
    }
  }
}

// Stands in for MKL's vmsSqrt: correctly rounded, so the split path must give
// exactly the bits of the fused one.
void ExactSqrt(int n, const float* a, float* r, int64_t mode) {
  EXPECT_EQ(mode, kAtenVmlMode);
  for (int i = 0; i < n; ++i) r[i] = std::sqrt(a[i]);
}

TEST(OptimReplayTest, ExternalSqrtPathMatchesTheFusedKernel) {
  const size_t n = 70001;
  const auto grads = Grads(3, n);
  for (const Case& c : Cases()) {
    if (c.config.algorithm == Algorithm::kSgd) continue;
    SCOPED_TRACE(c.name);
    const auto log = Log(grads, c.hyper);
    Part fused(n), split(n);
    PartState fs = fused.View(), ss = split.View();
    ASSERT_TRUE(Replay(c.config, log, &fs, {.num_threads = 2}).ok());
    ASSERT_TRUE(Replay(c.config, log, &ss,
                       {.num_threads = 3, .block_elements = 5000, .mkl_vms_sqrt = &ExactSqrt})
                    .ok());
    EXPECT_TRUE(fused.BitwiseEqual(split));
  }
}

TEST(OptimReplayTest, EveryKernelVariantGivesTheSameBits) {
  size_t count = 0;
  const internal::KernelTable* const* tables = internal::AllKernelTables(&count);
  ASSERT_GE(count, 1u);
  for (size_t n : {size_t{1}, size_t{7}, size_t{31}, size_t{33}, size_t{1000}, size_t{4099}}) {
    const auto grads = Grads(1, n);
    internal::AdamCoeffs adam;
    adam.weight_decay = internal::WeightDecay::kDecoupled;
    adam.decay = 0.99999f;
    adam.amsgrad = true;
    internal::SgdCoeffs sgd;
    sgd.momentum_rule = internal::SgdMomentum::kUpdate;
    sgd.weight_decay = true;
    sgd.wd = 1e-4f;
    sgd.nesterov = true;
    sgd.momentum = 0.9f;
    Part want(n);
    tables[0]->adam(adam, grads[0].data(), want.param.data(), want.exp_avg.data(),
                    want.exp_avg_sq.data(), want.max_exp_avg_sq.data(), n);
    tables[0]->sgd(sgd, grads[0].data(), want.param.data(), want.momentum_buffer.data(), n);
    for (size_t t = 1; t < count; ++t) {
      SCOPED_TRACE(tables[t]->isa);
      Part got(n);
      tables[t]->adam(adam, grads[0].data(), got.param.data(), got.exp_avg.data(),
                      got.exp_avg_sq.data(), got.max_exp_avg_sq.data(), n);
      tables[t]->sgd(sgd, grads[0].data(), got.param.data(), got.momentum_buffer.data(), n);
      EXPECT_TRUE(got.BitwiseEqual(want)) << "n=" << n;
    }
  }
}

TEST(OptimReplayTest, AdamWFirstStepFollowsTheFormula) {
  // From zero moments, step 1: m = 0.1 g, v = 0.001 g^2, the bias-corrected
  // update is lr * g / (|g| + eps') ~ lr * sign(g).
  const size_t n = 37;
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n);
  for (size_t i = 0; i < n; ++i) g[i] = (i % 2 ? 1.0f : -2.0f) * static_cast<float>(i + 1);
  PartState s;
  s.numel = n;
  s.param = p.data();
  s.exp_avg = m.data();
  s.exp_avg_sq = v.data();
  StepRecord r;
  r.hyper.lr = 1e-2;
  r.hyper.weight_decay = 0.1;
  r.hyper.step = 1;
  r.grad.data = g.data();
  ASSERT_TRUE(Replay({}, std::span(&r, 1), &s).ok());
  EXPECT_EQ(s.step, 1.0);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(p[i], 0.999f - 0.01f * (g[i] > 0 ? 1.0f : -1.0f), 1e-5f);
    EXPECT_NEAR(m[i], 0.1f * g[i], 1e-6f * std::abs(g[i]));
  }
}

TEST(OptimReplayTest, SkippedStepsApplyNothingAndKeepTheStepCount) {
  const size_t n = 1000;
  const auto grads = Grads(3, n);
  OptimizerConfig config;
  StepHyperparameters h;
  h.weight_decay = 0.01;
  auto with_skips = Log(grads, h);
  StepRecord skipped;
  skipped.hyper = h;
  skipped.hyper.skipped = true;  // no gradient: GradScaler found an inf
  with_skips.insert(with_skips.begin() + 1, skipped);
  with_skips.push_back(skipped);
  auto without = Log(grads, h);

  Part a(n), b(n);
  PartState sa = a.View(10), sb = b.View(10);
  ASSERT_TRUE(Replay(config, with_skips, &sa).ok());
  ASSERT_TRUE(Replay(config, without, &sb).ok());
  EXPECT_TRUE(a.BitwiseEqual(b));
  EXPECT_EQ(sa.step, 13.0);

  Part c(n), untouched(n);
  PartState sc = c.View(10);
  ASSERT_TRUE(Replay(config, std::span(&skipped, 1), &sc).ok());
  EXPECT_TRUE(c.BitwiseEqual(untouched));
  EXPECT_EQ(sc.step, 10.0);
}

TEST(OptimReplayTest, LowPrecisionGradientsReplayAsTheirExactUpcast) {
  const size_t n = 4099;
  const auto grads = Grads(2, n);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<std::vector<uint16_t>> low(2, std::vector<uint16_t>(n));
    std::vector<std::vector<float>> up(2, std::vector<float>(n));
    for (size_t s = 0; s < 2; ++s) {
      for (size_t i = 0; i < n; ++i) {
        // Round to the low-precision format by truncation: exact to upcast.
        float x = grads[s][i];
        uint32_t bits;
        std::memcpy(&bits, &x, 4);
        if (dtype == DType::kBFloat16) {
          low[s][i] = static_cast<uint16_t>(bits >> 16);
          bits &= 0xffff0000u;
        } else {
          // Use a value exactly representable in fp16: k * 2^-10, |k| < 2048.
          const int k = static_cast<int>(std::lround(x * 256.0f)) % 2048;
          const float v = static_cast<float>(k) / 1024.0f;
          low[s][i] = 0;
          std::memcpy(&bits, &v, 4);
          // Encode v as fp16 by hand (normal or zero only here).
          if (k != 0) {
            const uint32_t sign = (bits >> 16) & 0x8000u;
            const uint32_t exponent = ((bits >> 23) & 0xffu) - 112u;
            const uint32_t mantissa = (bits >> 13) & 0x3ffu;
            low[s][i] = static_cast<uint16_t>(sign | (exponent << 10) | mantissa);
          } else {
            low[s][i] = static_cast<uint16_t>((bits >> 16) & 0x8000u);
          }
        }
        std::memcpy(&up[s][i], &bits, 4);
      }
    }
    OptimizerConfig config;
    StepHyperparameters h;
    auto log_up = Log(up, h);
    auto log_low = Log(up, h);
    for (size_t s = 0; s < 2; ++s) log_low[s].grad = {low[s].data(), dtype};
    Part a(n), b(n);
    PartState sa = a.View(), sb = b.View();
    ASSERT_TRUE(Replay(config, log_up, &sa, {.num_threads = 2, .block_elements = 1000}).ok());
    ASSERT_TRUE(Replay(config, log_low, &sb, {.num_threads = 2, .block_elements = 1000}).ok());
    EXPECT_TRUE(a.BitwiseEqual(b)) << DTypeName(dtype);
  }
}

TEST(OptimReplayTest, Fp16UpcastIsExactForEveryValue) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(all.size());
  size_t count = 0;
  const internal::KernelTable* const* tables = internal::AllKernelTables(&count);
  for (size_t t = 0; t < count; ++t) {
    tables[t]->upcast(all.data(), DType::kFloat16, out.data(), out.size());
    for (size_t i = 0; i < all.size(); ++i) {
      const int exponent = static_cast<int>((i >> 10) & 0x1f);
      const int mantissa = static_cast<int>(i & 0x3ff);
      const float sign = (i & 0x8000) ? -1.0f : 1.0f;
      if (exponent == 31) {
        if (mantissa == 0) {
          ASSERT_EQ(out[i], sign * INFINITY) << i;
        } else {
          ASSERT_TRUE(std::isnan(out[i])) << i;
        }
        continue;
      }
      const float want = exponent == 0 ? sign * std::ldexp(static_cast<float>(mantissa), -24)
                                       : sign * std::ldexp(1.0f + mantissa / 1024.0f,
                                                           exponent - 15);
      ASSERT_EQ(std::signbit(out[i]), std::signbit(want)) << i;
      ASSERT_EQ(out[i], want) << tables[t]->isa << " " << i;
    }
  }
}

TEST(OptimReplayTest, BadInputLeavesTheStateUntouched) {
  const size_t n = 100;
  const auto grads = Grads(3, n);
  OptimizerConfig config;
  StepHyperparameters h;
  auto log = Log(grads, h);
  log[2].hyper.step = 99;  // not the count the part reaches
  Part part(n), untouched(n);
  PartState s = part.View(5);
  Status st = Replay(config, log, &s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(part.BitwiseEqual(untouched));
  EXPECT_EQ(s.step, 5.0);

  log[2].hyper.step = 0;
  log[1].grad.data = nullptr;
  EXPECT_EQ(Replay(config, log, &s).code(), StatusCode::kInvalidArgument);
  log[1].grad = {grads[1].data(), DType::kInt32};
  EXPECT_EQ(Replay(config, log, &s).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(part.BitwiseEqual(untouched));

  config.amsgrad = true;
  s.max_exp_avg_sq = nullptr;
  log[1].grad = {grads[1].data(), DType::kFloat32};
  EXPECT_EQ(Replay(config, log, &s).code(), StatusCode::kInvalidArgument);
}

TEST(OptimReplayTest, SgdFirstMomentumStepCopiesTheGradient) {
  const size_t n = 50;
  const auto grads = Grads(1, n);
  OptimizerConfig config{Algorithm::kSgd};
  StepHyperparameters h;
  h.lr = 0.1;
  h.momentum = 0.9;
  h.dampening = 0.5;  // ignored on the first step, as torch ignores it
  auto log = Log(grads, h);
  Part part(n);
  PartState s = part.View(0, /*has_buffer=*/false);
  ASSERT_TRUE(Replay(config, log, &s).ok());
  EXPECT_TRUE(s.has_momentum_buffer);
  EXPECT_EQ(0, std::memcmp(part.momentum_buffer.data(), grads[0].data(), n * 4));
}

}  // namespace
}  // namespace nonstop::optim
