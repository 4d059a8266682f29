// keep_every: every k-th committed checkpoint is also kept forever as its own
// job directory under DIR/keep/, with exactly its bytes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "nonstop/engine.h"
#include "nonstop/env.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;

TEST(KeepTest, EveryKthCheckpointIsKeptWithItsBytes) {
  const fs::path dir = fs::temp_directory_path() / ("nonstop-keep-" + std::to_string(getpid()));
  fs::remove_all(dir);
  EngineOptions o;
  o.dir = dir.string();
  o.max_in_flight = 2;
  o.keep_every = 2;
  o.medium = MediumKind::kBuffered;
  auto engine = Engine::Open(o).value();
  std::vector<float> w(100000);
  TensorRef r;
  r.spec.name = "w";
  r.spec.dtype = DType::kFloat32;
  r.spec.shape = {static_cast<int64_t>(w.size())};
  r.spec.nbytes = w.size() * sizeof(float);
  r.data = w.data();
  ASSERT_TRUE(engine->Register({r}).ok());
  std::vector<uint64_t> counters;
  for (int step = 1; step <= 4; ++step) {
    ASSERT_TRUE(engine->WaitCopied().ok());
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(step * 1000003 + i);
    auto c = engine->Checkpoint(step, "{}");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    counters.push_back(c.value());
    ASSERT_TRUE(engine->WaitCommitted(c.value()).ok());
  }
  ASSERT_TRUE(engine->Close().ok());
  int kept = 0;
  for (size_t k = 0; k < counters.size(); ++k) {
    const int step = static_cast<int>(k) + 1;
    char name[40];
    std::snprintf(name, sizeof(name), "step-%012d", step);
    const fs::path file = dir / "keep" / name / SlotFileName(0);
    if (counters[k] % 2 != 0) {
      EXPECT_FALSE(fs::exists(file)) << file;
      continue;
    }
    ++kept;
    auto m = OpenMedium(file.string(), MediumKind::kBuffered, {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    auto sf = SlotFile::Open(std::move(m).value()).value();
    auto rep = sf->Scan().value();
    ASSERT_EQ(rep.newest_valid, 0);
    const CheckpointInfo& info = rep.checkpoints[0].info;
    EXPECT_EQ(info.step, step);
    std::vector<float> got(w.size());
    ASSERT_TRUE(sf->ReadTensor(info, info.FindTensor("w"), got.data()).ok());
    for (size_t i = 0; i < got.size(); i += 997) {
      ASSERT_EQ(got[i], static_cast<float>(step * 1000003 + i));
    }
  }
  EXPECT_EQ(kept, 2);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nonstop
