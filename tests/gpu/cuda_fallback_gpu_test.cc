// A CUDA build on a machine where no device is usable (no driver, as on CI,
// or CUDA_VISIBLE_DEVICES=-1, as CTest sets for this test on a GPU machine)
// must start, pick the host engine and say why. Runs everywhere.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "copy/cuda_copy_engine.h"
#include "gpu_check.h"
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

GPU_TEST(NoUsableDeviceMeansHostCopiesAndANote) {
  std::string error;
  GPU_CHECK(CudaDeviceCount(&error) == 0);
  GPU_CHECK_MSG(error.rfind("cudaGetDeviceCount: ", 0) == 0, error);
  std::string note;
  auto engine = MakeBestCopyEngine(2, &note);
  std::printf("  note: %s\n", note.c_str());
  GPU_CHECK(engine != nullptr);
  GPU_CHECK(dynamic_cast<CudaCopyEngine*>(engine.get()) == nullptr);
  GPU_CHECK_MSG(note.find("built with CUDA but no usable device: cudaGetDeviceCount: ") !=
                    std::string::npos, note);
  GPU_CHECK_MSG(note.find("; using host copies") != std::string::npos, note);

  std::vector<char> src(1 << 16, 'x');
  bool pinned = false;  // mlock'ed by the host engine where RLIMIT_MEMLOCK allows
  char* dst = static_cast<char*>(engine->AllocHost(src.size(), &pinned));
  GPU_CHECK(dst != nullptr);
  auto c = engine->Copy(src.data(), Device{}, dst, src.size());
  GPU_CHECK_OK(c->Wait());
  GPU_CHECK(std::memcmp(dst, src.data(), src.size()) == 0);
  engine->FreeHost(dst, src.size());

  auto cuda = MakeCudaCopyEngine(CudaCopyOptions{}, nullptr);
  GPU_CHECK(!cuda.ok() && cuda.status().code() == StatusCode::kUnavailable);
}

}  // namespace
}  // namespace nonstop

int main(int argc, char** argv) {
  return nonstop::gputest::GpuTestMain(argc, argv, true, "");
}
