// Layer-wise checkpoints (BeginCheckpoint / CopyTensors / WaitTensorsCopied /
// EndCheckpoint): the unit plan, crc combination, and the consistency rule
// under random concurrency: every tensor in the checkpoint of step s holds
// its step-s value, whatever order tensors are updated and copied in, for
// every copy strategy. Run under TSan by `make test-tsan` (label: concurrency).
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <numeric>
#include <random>
#include <thread>

#include "engine/engine_internal.h"
#include "engine/layerwise_plan.h"
#include "media/fault_medium.h"
#include "nonstop/engine.h"

namespace nonstop {
namespace {

TEST(Crc32cCombineTest, EqualsTheCrcOfTheConcatenation) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<uint8_t> a(rng() % 9000), b(rng() % 9000);
    for (auto& x : a) x = static_cast<uint8_t>(rng());
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    std::vector<uint8_t> ab(a);
    ab.insert(ab.end(), b.begin(), b.end());
    EXPECT_EQ(Crc32cCombine(Crc32c(a.data(), a.size()), Crc32c(b.data(), b.size()), b.size()),
              Crc32c(ab.data(), ab.size()));
  }
}

TensorSpec Spec(const std::string& name, int64_t n) {
  TensorSpec s;
  s.name = name;
  s.dtype = DType::kUInt8;
  s.shape = {n};
  s.nbytes = static_cast<uint64_t>(n);
  return s;
}

TEST(LayerPlanTest, UnitsTileTheRegionAlignedAndOneTensorEach) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 100; ++round) {
    std::vector<TensorSpec> specs;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int t = 0; t < n; ++t) {
      const int64_t bytes = rng() % 2 ? 1 + rng() % 70000 : 65536 + rng() % 400000;
      specs.push_back(Spec("t" + std::to_string(t), bytes));
    }
    auto layout = SlotLayout::Plan(specs);
    ASSERT_TRUE(layout.ok());
    const uint64_t chunk = 4096 * (1 + rng() % 40);
    const LayerPlan plan = LayerPlan::Build(*layout, chunk);
    uint64_t at = 0;
    for (const LayerUnit& u : plan.units) {
      EXPECT_EQ(u.slot_offset, at);
      EXPECT_EQ(u.slot_offset % 4096, 0u);
      EXPECT_EQ(u.bytes % 4096, 0u);
      EXPECT_EQ(u.chunk, u.slot_offset / chunk);
      EXPECT_LE(u.slot_offset + u.bytes, (u.chunk + 1) * chunk);
      if (u.tensor >= 0) {
        const TensorEntry& e = layout->tensors[u.tensor];
        EXPECT_EQ(u.slot_offset, e.data_offset + u.tensor_offset);
        EXPECT_LE(u.tensor_offset + u.tensor_bytes, e.spec.nbytes);
        // Only the last unit of a tensor carries padding.
        if (u.tensor_bytes < u.bytes) {
          EXPECT_EQ(u.tensor_offset + u.tensor_bytes, e.spec.nbytes);
        }
      } else {
        EXPECT_GE(u.slot_offset, plan.small_begin);
      }
      at += u.bytes;
    }
    EXPECT_EQ(at, layout->data_bytes);
    // The combined unit crcs are the chunk crcs of the whole region.
    std::vector<uint8_t> region(layout->data_bytes);
    for (auto& x : region) x = static_cast<uint8_t>(rng());
    std::vector<uint32_t> unit_crcs;
    for (const LayerUnit& u : plan.units) {
      unit_crcs.push_back(Crc32c(region.data() + u.slot_offset, u.bytes));
    }
    const std::vector<uint32_t> crcs = plan.ChunkCrcs(unit_crcs);
    ASSERT_EQ(crcs.size(), (layout->data_bytes + chunk - 1) / chunk);
    for (size_t j = 0; j < crcs.size(); ++j) {
      const uint64_t len = std::min<uint64_t>(chunk, layout->data_bytes - j * chunk);
      EXPECT_EQ(crcs[j], Crc32c(region.data() + j * chunk, len)) << "chunk " << j;
    }
  }
}

// Delays each write by a random time so units and checkpoints finish out of
// order, and copies lag behind the training thread.
class DelayMedium final : public Medium {
 public:
  DelayMedium(std::unique_ptr<Medium> inner, uint64_t seed) : inner_(std::move(inner)), seed_(seed) {}
  Status Write(uint64_t offset, const void* buf, size_t n) override {
    thread_local std::mt19937_64 rng(seed_ ^
                                     std::hash<std::thread::id>()(std::this_thread::get_id()));
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 32 == 0 ? 5000 : rng() % 300));
    return inner_->Write(offset, buf, n);
  }
  Status Read(uint64_t offset, void* buf, size_t n) override { return inner_->Read(offset, buf, n); }
  Status Sync() override { return inner_->Sync(); }
  Status Resize(uint64_t size) override { return inner_->Resize(size); }
  uint64_t Size() const override { return inner_->Size(); }
  size_t Alignment() const override { return inner_->Alignment(); }
  MediumKind kind() const override { return inner_->kind(); }
  std::string Describe() const override { return "delayed " + inner_->Describe(); }

 private:
  std::unique_ptr<Medium> inner_;
  const uint64_t seed_;
};

EngineMedia Media(const std::shared_ptr<FaultDisk>& disk, uint64_t seed) {
  EngineMedia m;
  m.open = [disk, seed](const std::string& path, bool create) -> Result<std::unique_ptr<Medium>> {
    if (!create && disk->size() == 0) return Status::NotFound(path + " does not exist");
    return std::unique_ptr<Medium>(std::make_unique<DelayMedium>(disk->Open(), seed));
  };
  m.rename = [](const std::string&, const std::string&) { return Status::OK(); };
  return m;
}

uint64_t Word(int64_t step, size_t tensor, size_t i) {
  uint64_t x = static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull ^ (tensor << 40) ^ i;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

struct Model {
  std::vector<std::vector<uint64_t>> tensors;
  std::vector<bool> at_checkpoint;  // copy_at_checkpoint (changed outside the updates)

  void Fill(size_t t, int64_t step) {
    for (size_t i = 0; i < tensors[t].size(); ++i) tensors[t][i] = Word(step, t, i);
  }
  std::vector<TensorRef> Refs() {
    std::vector<TensorRef> refs;
    for (size_t t = 0; t < tensors.size(); ++t) {
      TensorRef r;
      r.spec.name = "t" + std::to_string(t);
      r.spec.dtype = DType::kUInt64;
      r.spec.shape = {static_cast<int64_t>(tensors[t].size())};
      r.spec.nbytes = tensors[t].size() * 8;
      r.data = tensors[t].data();
      r.copy_at_checkpoint = at_checkpoint[t];
      refs.push_back(r);
    }
    return refs;
  }
};

struct Case {
  LayerCopy copy;
  size_t alignment;  // of the medium: 4096 makes kDirect fall back to staging
};

class LayerwiseConsistencyTest : public ::testing::TestWithParam<Case> {};

// The training thread updates tensors in a random order each step, waiting
// only for each tensor's own copy; checkpoints are begun at random steps,
// copies requested right after each update (or left to EndCheckpoint), and
// writes are randomly delayed. Every checkpoint still stored must hold, for
// every tensor, exactly its value at the checkpoint's step (the synchronous
// reference: Word(step, t, i)).
TEST_P(LayerwiseConsistencyTest, EveryTensorHoldsItsStepValue) {
  const Case param = GetParam();
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::mt19937_64 rng(99 + round * 31 + static_cast<int>(param.copy));
    FaultDiskOptions fo;
    fo.alignment = param.alignment;
    auto disk = FaultDisk::Create(fo);
    Model m;
    const int n = 2 + static_cast<int>(rng() % 10);
    for (int t = 0; t < n; ++t) {
      const size_t words = rng() % 3 == 0 ? 1 + rng() % 1000 : 8192 + rng() % 30000;
      m.tensors.emplace_back(words);
      m.at_checkpoint.push_back(t == 0 || rng() % 8 == 0);
      m.Fill(t, 0);
    }
    EngineOptions o;
    o.dir = (std::filesystem::temp_directory_path() / "nonstop_layerwise_test").string();
    o.max_in_flight = 1 + static_cast<int>(rng() % 3);
    o.writers = 1 + static_cast<int>(rng() % 3);
    o.chunk_bytes = 4096 * (4 + rng() % 16);
    o.staging_bytes = (o.writers + 2 + rng() % 6) * o.chunk_bytes;
    o.layer_copy = param.copy;
    auto opened = OpenEngine(o, Media(disk, rng()));
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    auto engine = std::move(opened).value();
    ASSERT_TRUE(engine->Register(m.Refs()).ok());

    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    int64_t last_ckpt = -1;
    for (int64_t step = 1; step <= 24; ++step) {
      // Tensors not driven by updates change "in the forward pass".
      for (int t = 0; t < n; ++t) {
        if (m.at_checkpoint[t]) m.Fill(t, step);
      }
      const bool ckpt = rng() % 2 == 0;
      uint64_t c = 0;
      if (ckpt) {
        auto begun = engine->BeginCheckpoint(step);
        ASSERT_TRUE(begun.ok()) << begun.status().ToString();
        c = *begun;
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (uint32_t t : order) {
        if (m.at_checkpoint[t]) continue;
        ASSERT_TRUE(engine->WaitTensorsCopied({t}).ok());
        m.Fill(t, step);  // the update of step `step`
        if (ckpt && rng() % 10 != 0) {
          ASSERT_TRUE(engine->CopyTensors(c, {t}).ok());
        }
        if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 500));
      }
      if (ckpt) {
        Status st = engine->EndCheckpoint(c, step, "{\"step\":" + std::to_string(step) + "}");
        ASSERT_TRUE(st.ok()) << st.ToString();
        last_ckpt = step;
      }
    }
    ASSERT_TRUE(engine->WaitCommitted(0).ok());
    if (last_ckpt >= 0) {
      auto latest = engine->Latest();
      ASSERT_TRUE(latest.has_value());
      EXPECT_EQ(latest->step, last_ckpt);
    }
    EngineStats stats = engine->Stats();
    EXPECT_EQ(stats.failed, 0u);
    ASSERT_TRUE(engine->Close().ok());
    if (last_ckpt < 0) continue;

    // Every checkpoint still stored, read back through the store (crcs checked).
    auto file = SlotFile::Open(disk->Open());
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ScanOptions so;
    so.verify_all = true;
    auto report = (*file)->Scan(so);
    ASSERT_TRUE(report.ok());
    int verified = 0;
    for (const ScannedCheckpoint& sc : report->checkpoints) {
      if (sc.state != CheckpointState::kCommitted) {
        // An older record whose slot a newer (maybe superseded) checkpoint
        // took: not a defect, as long as the newest one is intact.
        ASSERT_GE(report->newest_valid, 0);
        EXPECT_LT(sc.info.counter, report->checkpoints[report->newest_valid].info.counter)
            << sc.reason;
        continue;
      }
      const CheckpointInfo& info = sc.info;
      EXPECT_EQ(info.meta_json, "{\"step\":" + std::to_string(info.step) + "}");
      for (int t = 0; t < n; ++t) {
        std::vector<uint64_t> got(m.tensors[t].size());
        ASSERT_TRUE((*file)->ReadTensor(info, info.FindTensor("t" + std::to_string(t)),
                                        got.data()).ok());
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], Word(info.step, t, i))
              << "tensor " << t << " word " << i << " of the checkpoint of step " << info.step;
        }
      }
      ++verified;
    }
    EXPECT_GE(verified, 1);
    EXPECT_EQ(report->checkpoints.front().info.step, last_ckpt);

    // And Restore through a new engine returns the last one.
    Model back = m;
    for (auto& t : back.tensors) std::fill(t.begin(), t.end(), 0);
    auto reopened = OpenEngine(o, Media(disk, 1));
    ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
    ASSERT_TRUE((*reopened)->Register(back.Refs()).ok());
    auto restored = (*reopened)->Restore();
    ASSERT_TRUE(restored.ok()) << restored.status().ToString();
    EXPECT_EQ(restored->step, last_ckpt);
    for (int t = 0; t < n; ++t) {
      for (size_t i = 0; i < back.tensors[t].size(); ++i) {
        ASSERT_EQ(back.tensors[t][i], Word(last_ckpt, t, i));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, LayerwiseConsistencyTest,
                         ::testing::Values(Case{LayerCopy::kHost, 1}, Case{LayerCopy::kHost, 4096},
                                           Case{LayerCopy::kDirect, 1},
                                           Case{LayerCopy::kDirect, 4096},
                                           Case{LayerCopy::kDevice, 1},
                                           Case{LayerCopy::kDevice, 4096}),
                         [](const auto& info) {
                           return std::string(LayerCopyName(info.param.copy)) + "_align" +
                                  std::to_string(info.param.alignment);
                         });

class LayerwiseEngineTest : public ::testing::Test {
 protected:
  std::unique_ptr<Engine> Open(const std::shared_ptr<FaultDisk>& disk, int max_in_flight = 2) {
    EngineOptions o;
    o.dir = (std::filesystem::temp_directory_path() / "nonstop_layerwise_test").string();
    o.max_in_flight = max_in_flight;
    o.writers = 2;
    o.chunk_bytes = 64 << 10;
    o.staging_bytes = 8 * o.chunk_bytes;
    auto e = OpenEngine(o, Media(disk, 3));
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(e).value();
  }
  Model TwoTensors() {
    Model m;
    m.tensors = {std::vector<uint64_t>(20000), std::vector<uint64_t>(10)};
    m.at_checkpoint = {false, false};
    m.Fill(0, 1);
    m.Fill(1, 1);
    return m;
  }
};

TEST_F(LayerwiseEngineTest, OpenCheckpointsAreRefusedWhereTheyWouldDeadlock) {
  auto disk = FaultDisk::Create();
  Model m = TwoTensors();
  auto engine = Open(disk, 2);
  ASSERT_TRUE(engine->Register(m.Refs()).ok());
  auto a = engine->BeginCheckpoint(1);
  auto b = engine->BeginCheckpoint(2);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(engine->BeginCheckpoint(3).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->Checkpoint(3, "{}").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->Register(m.Refs()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->WaitCommitted(0).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->CopyTensors(*a, {7}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->CopyTensors(12345, {0}).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine->EndCheckpoint(*a, 1, "{}").ok());
  EXPECT_EQ(engine->EndCheckpoint(*a, 1, "{}").code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine->WaitCommitted(*a).ok());
  // Closing with b still open abandons it quietly; a stays the newest.
  EXPECT_TRUE(engine->Close().ok());
  auto file = SlotFile::Open(disk->Open());
  ASSERT_TRUE(file.ok());
  auto report = (*file)->Scan();
  ASSERT_TRUE(report.ok());
  ASSERT_GE(report->newest_valid, 0);
  EXPECT_EQ(report->checkpoints[report->newest_valid].info.step, 1);
}

TEST_F(LayerwiseEngineTest, WriteErrorsAreReturnedAndTheEngineStaysUsable) {
  auto disk = FaultDisk::Create();
  Model m = TwoTensors();
  auto engine = Open(disk, 1);
  ASSERT_TRUE(engine->Register(m.Refs()).ok());
  auto c1 = engine->BeginCheckpoint(1);
  ASSERT_TRUE(c1.ok());
  ASSERT_TRUE(engine->EndCheckpoint(*c1, 1, "{}").ok());
  ASSERT_TRUE(engine->WaitCommitted(*c1).ok());

  disk->InjectError(FaultOp::kWrite, 1, EIO);
  m.Fill(0, 2);
  auto c2 = engine->BeginCheckpoint(2);
  ASSERT_TRUE(c2.ok());
  ASSERT_TRUE(engine->CopyTensors(*c2, {0}).ok());
  ASSERT_TRUE(engine->EndCheckpoint(*c2, 2, "{}").ok());
  Status st = engine->WaitCommitted(*c2);
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_EQ(engine->Latest()->step, 1);

  auto c3 = engine->BeginCheckpoint(3);
  ASSERT_TRUE(c3.ok()) << c3.status().ToString();
  ASSERT_TRUE(engine->EndCheckpoint(*c3, 3, "{}").ok());
  ASSERT_TRUE(engine->WaitCommitted(*c3).ok());
  EXPECT_EQ(engine->Latest()->step, 3);
  EXPECT_TRUE(engine->Close().ok());
}

}  // namespace
}  // namespace nonstop
