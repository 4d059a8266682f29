// A tiny test harness for the GPU tests: the GPU machines have no
// GoogleTest, and nothing can be installed there, so these tests are plain
// executables. GPU_TEST(name) registers a test; GPU_CHECK* record a failure
// and return from it. GpuTestMain runs every test and exits 0 (all passed),
// 1 (a failure) or 77 (skipped: no usable device; CTest's SKIP_RETURN_CODE).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace nonstop::gputest {

struct TestCase {
  const char* name;
  std::function<void()> body;
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}

inline int& Failures() {
  static int failures = 0;
  return failures;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> body) {
    Registry().push_back({name, std::move(body)});
  }
};

inline void Fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++Failures();
}

// Runs every registered test (or those whose name contains argv[1]).
inline int GpuTestMain(int argc, char** argv, bool have_device, const std::string& skip_reason) {
  if (!have_device) {
    std::printf("SKIP: %s\n", skip_reason.c_str());
    return 77;
  }
  const char* filter = argc > 1 ? argv[1] : nullptr;
  int ran = 0;
  for (const TestCase& t : Registry()) {
    if (filter != nullptr && std::string(t.name).find(filter) == std::string::npos) continue;
    int before = Failures();
    std::printf("[ RUN  ] %s\n", t.name);
    std::fflush(stdout);
    t.body();
    std::printf("[ %s ] %s\n", Failures() == before ? " OK " : "FAIL", t.name);
    ++ran;
  }
  std::printf("%d test(s), %d failure(s)\n", ran, Failures());
  return Failures() == 0 ? 0 : 1;
}

}  // namespace nonstop::gputest

#define GPU_TEST(name)                                                              \
  static void GpuTest_##name();                                                     \
  static ::nonstop::gputest::Registrar gpu_test_registrar_##name(#name, GpuTest_##name); \
  static void GpuTest_##name()

#define GPU_CHECK(cond)                                                  \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ::nonstop::gputest::Fail(__FILE__, __LINE__, #cond);               \
      return;                                                            \
    }                                                                    \
  } while (0)

#define GPU_CHECK_MSG(cond, msg)                                                    \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      ::nonstop::gputest::Fail(__FILE__, __LINE__, std::string(#cond) + ": " + (msg)); \
      return;                                                                       \
    }                                                                               \
  } while (0)

#define GPU_CHECK_OK(expr)                                                                  \
  do {                                                                                      \
    ::nonstop::Status _gpu_st = (expr);                                                     \
    if (!_gpu_st.ok()) {                                                                    \
      ::nonstop::gputest::Fail(__FILE__, __LINE__, std::string(#expr) + ": " + _gpu_st.message()); \
      return;                                                                               \
    }                                                                                       \
  } while (0)

#define GPU_CHECK_CUDA(expr)                                                           \
  do {                                                                                 \
    cudaError_t _gpu_err = (expr);                                                     \
    if (_gpu_err != cudaSuccess) {                                                     \
      ::nonstop::gputest::Fail(__FILE__, __LINE__,                                     \
                               std::string(#expr) + ": " + cudaGetErrorString(_gpu_err)); \
      return;                                                                          \
    }                                                                                  \
  } while (0)
