// The CUDA copy engine on a real device: byte-exact copies, ordering after
// the caller's stream without synchronising it, device snapshots, direct
// copies into registered (mapped) host memory, errors. Exits 77 (skipped)
// where no device is usable.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "copy/cuda_copy_engine.h"
#include "gpu_check.h"
#include "nonstop/copy_engine.h"

namespace nonstop {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> Pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::unique_ptr<CudaCopyEngine> NewEngine(
    CudaCopyOptions::WaitMode mode = CudaCopyOptions::WaitMode::kPoll) {
  CudaCopyOptions options;
  options.wait_mode = mode;
  auto engine = MakeCudaCopyEngine(options, nullptr);
  if (!engine.ok()) {
    std::fprintf(stderr, "MakeCudaCopyEngine: %s\n", engine.status().message().c_str());
    return nullptr;
  }
  return std::move(engine).value();
}

// Device memory freed on scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
  }
  ~DeviceBuffer() { cudaFree(p); }
  void* p = nullptr;
  size_t bytes;
};

// Keeps `stream` busy for a while with device-to-device copies (no kernels
// needed): long enough that a copy which ignored the stream would race.
void Busy(cudaStream_t stream, DeviceBuffer& a, DeviceBuffer& b, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    cudaMemcpyAsync(b.p, a.p, a.bytes, cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(a.p, b.p, a.bytes, cudaMemcpyDeviceToDevice, stream);
  }
}

GPU_TEST(CopyToHostIsByteExact) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  for (size_t bytes : {size_t{1}, size_t{4095}, size_t{(1 << 20) + 3}, size_t{64} << 20}) {
    auto src = Pattern(bytes, static_cast<uint32_t>(bytes));
    DeviceBuffer dev(bytes + 64);
    GPU_CHECK(dev.p != nullptr);
    // An odd source offset: tensors are views, not always aligned.
    auto* dsrc = static_cast<uint8_t*>(dev.p) + 1;
    GPU_CHECK_CUDA(cudaMemcpy(dsrc, src.data(), bytes, cudaMemcpyHostToDevice));
    bool pinned = false;
    auto* host = static_cast<uint8_t*>(engine->AllocHost(bytes, &pinned));
    GPU_CHECK(host != nullptr && pinned);
    cudaPointerAttributes attr;
    GPU_CHECK_CUDA(cudaPointerGetAttributes(&attr, host + bytes - 1));
    GPU_CHECK_MSG(attr.type == cudaMemoryTypeHost, "AllocHost memory is not page-locked");
    std::vector<uint8_t> pageable(bytes);
    auto a = engine->Copy(dsrc, Device{DeviceKind::kCuda, 0, 0}, host, bytes);
    auto b = engine->Copy(dsrc, Device{DeviceKind::kCuda, 0, 0}, pageable.data(), bytes);
    GPU_CHECK_OK(a->Wait());
    GPU_CHECK_OK(b->Wait());
    GPU_CHECK(a->Ready() && b->Ready());
    GPU_CHECK(std::memcmp(host, src.data(), bytes) == 0);
    GPU_CHECK(std::memcmp(pageable.data(), src.data(), bytes) == 0);
    engine->FreeHost(host, bytes);
  }
}

// Restore's direction: pinned host memory into a device tensor at an odd
// offset, byte-exact, ordered after the work already on the tensor's stream
// (a memset there must not land over the restored bytes).
GPU_TEST(CopyToDeviceIsByteExactAndOrderedAfterTheStream) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  GPU_CHECK(engine->CanCopyToDevice(Device{DeviceKind::kCuda, 0, 0}));
  GPU_CHECK(!engine->CanCopyToDevice(Device{DeviceKind::kHost, 0, 0}));
  cudaStream_t s;
  GPU_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  constexpr size_t kBusy = size_t{512} << 20;
  DeviceBuffer a(kBusy), b(kBusy);
  GPU_CHECK(a.p && b.p);
  for (size_t bytes : {size_t{1}, size_t{(1 << 20) + 3}, size_t{64} << 20}) {
    auto want = Pattern(bytes, static_cast<uint32_t>(bytes) + 7);
    DeviceBuffer dev(bytes + 64);
    GPU_CHECK(dev.p != nullptr);
    auto* ddst = static_cast<uint8_t*>(dev.p) + 1;
    bool pinned = false;
    auto* host = static_cast<uint8_t*>(engine->AllocHost(bytes, &pinned));
    GPU_CHECK(host != nullptr && pinned);
    std::memcpy(host, want.data(), bytes);
    Busy(s, a, b, 4);
    GPU_CHECK_CUDA(cudaMemsetAsync(ddst, 0xEE, bytes, s));  // earlier work on the tensor
    auto done = engine->CopyToDevice(host, ddst, Device{DeviceKind::kCuda, 0,
                                                        reinterpret_cast<uintptr_t>(s)}, bytes);
    GPU_CHECK_OK(done->Wait());
    GPU_CHECK(done->Ready());
    std::vector<uint8_t> got(bytes);
    GPU_CHECK_CUDA(cudaStreamSynchronize(s));
    GPU_CHECK_CUDA(cudaMemcpy(got.data(), ddst, bytes, cudaMemcpyDeviceToHost));
    GPU_CHECK_MSG(got == want, "CopyToDevice bytes differ (" + std::to_string(bytes) + " B)");
    engine->FreeHost(host, bytes);
  }
  cudaStreamDestroy(s);
}

// The copy must see what the caller's stream wrote last, and the call must
// neither wait for that stream nor make it wait.
void CheckOrderedAfter(cudaStream_t caller) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  constexpr size_t kBusy = size_t{512} << 20, kBytes = size_t{32} << 20;
  DeviceBuffer a(kBusy), b(kBusy), src(kBytes);
  GPU_CHECK(a.p && b.p && src.p);
  GPU_CHECK_CUDA(cudaMemset(src.p, 0x11, kBytes));
  GPU_CHECK_CUDA(cudaDeviceSynchronize());  // test setup only
  auto* host = static_cast<uint8_t*>(engine->AllocHost(kBytes, nullptr));
  GPU_CHECK(host != nullptr);
  std::memset(host, 0, kBytes);

  Busy(caller, a, b, 8);  // ~8 GiB of device traffic: milliseconds
  GPU_CHECK_CUDA(cudaMemsetAsync(src.p, 0xAB, kBytes, caller));  // the "update"
  auto t0 = Clock::now();
  auto done = engine->Copy(src.p, Device{DeviceKind::kCuda, 0, reinterpret_cast<uintptr_t>(caller)},
                           host, kBytes);
  double call_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  cudaError_t q = cudaStreamQuery(caller);
  std::printf("  Copy() returned in %.3f ms; caller stream still busy: %s\n", call_ms,
              q == cudaErrorNotReady ? "yes" : "no");
  GPU_CHECK_MSG(q == cudaErrorNotReady, "the caller's stream finished before Copy() returned");
  GPU_CHECK(!done->Ready());
  GPU_CHECK_OK(done->Wait());
  for (size_t i = 0; i < kBytes; i += 4099) GPU_CHECK_MSG(host[i] == 0xAB, std::to_string(i));
  GPU_CHECK(host[kBytes - 1] == 0xAB);
  engine->FreeHost(host, kBytes);
}

GPU_TEST(CopyIsOrderedAfterANonBlockingCallerStream) {
  cudaStream_t s;
  GPU_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CheckOrderedAfter(s);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
}

// torch's default current_stream() is the legacy default stream, handle 0.
GPU_TEST(CopyIsOrderedAfterTheLegacyDefaultStream) { CheckOrderedAfter(nullptr); }

GPU_TEST(SnapshotFreesTheSourceBeforeTheDrain) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  constexpr size_t kBytes = (size_t{16} << 20) + 12;
  auto want = Pattern(kBytes, 3);
  DeviceBuffer src(kBytes);
  void* snap = engine->AllocDevice(0, kBytes);
  GPU_CHECK(src.p != nullptr && snap != nullptr);
  GPU_CHECK_CUDA(cudaMemcpy(src.p, want.data(), kBytes, cudaMemcpyHostToDevice));
  cudaStream_t train;
  GPU_CHECK_CUDA(cudaStreamCreateWithFlags(&train, cudaStreamNonBlocking));
  Device dev{DeviceKind::kCuda, 0, reinterpret_cast<uintptr_t>(train)};
  auto s = engine->SnapshotToDevice(src.p, dev, snap, kBytes);
  GPU_CHECK_OK(s->Wait());
  // The next update may overwrite the tensor now; the snapshot keeps step s.
  GPU_CHECK_CUDA(cudaMemsetAsync(src.p, 0, kBytes, train));
  std::vector<uint8_t> host(kBytes);
  auto d = engine->DrainToHost(snap, 0, host.data(), kBytes);
  GPU_CHECK_OK(d->Wait());
  GPU_CHECK(host == want);
  cudaStreamSynchronize(train);
  cudaStreamDestroy(train);
  engine->FreeDevice(0, snap);
  // A host source is refused: there is no device memory to snapshot.
  auto bad = engine->SnapshotToDevice(want.data(), Device{}, host.data(), 16);
  GPU_CHECK(!bad->Wait().ok());
}

// LightCheck's rule "before t's update in step s+1, wait until t is copied",
// enforced on the GPU: the update is enqueued at once and runs after the copy.
GPU_TEST(StreamWaitForOrdersTheNextUpdateWithoutBlocking) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  constexpr size_t kBytes = size_t{256} << 20;
  DeviceBuffer src(kBytes);
  GPU_CHECK(src.p != nullptr);
  GPU_CHECK_CUDA(cudaMemset(src.p, 0x5A, kBytes));
  GPU_CHECK_CUDA(cudaDeviceSynchronize());
  cudaStream_t train;
  GPU_CHECK_CUDA(cudaStreamCreateWithFlags(&train, cudaStreamNonBlocking));
  Device dev{DeviceKind::kCuda, 0, reinterpret_cast<uintptr_t>(train)};
  // Pageable destination: the slowest copy, the widest window for a race.
  std::vector<uint8_t> host(kBytes, 0);
  auto copy = engine->Copy(src.p, dev, host.data(), kBytes);
  auto t0 = Clock::now();
  GPU_CHECK_OK(engine->StreamWaitFor(copy.get(), dev));
  GPU_CHECK_CUDA(cudaMemsetAsync(src.p, 0, kBytes, train));  // the next update
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::printf("  StreamWaitFor + enqueue of the update took %.3f ms on the host\n", ms);
  GPU_CHECK_OK(copy->Wait());
  GPU_CHECK_CUDA(cudaStreamSynchronize(train));
  for (size_t i = 0; i < kBytes; i += 4093) GPU_CHECK_MSG(host[i] == 0x5A, std::to_string(i));
  cudaStreamDestroy(train);
}

// Copies into a region pinned with RegisterHostRegion, as LightCheck-D does
// with the mapped medium.
void CheckRegisteredRegion(CudaCopyEngine* engine, void* region, size_t bytes, const char* what) {
  Status st = engine->RegisterHostRegion(region, bytes);
  std::printf("  RegisterHostRegion(%s): %s\n", what, st.ok() ? "ok" : st.message().c_str());
  auto want = Pattern(bytes, 9);
  DeviceBuffer dev(bytes);
  GPU_CHECK(dev.p != nullptr);
  GPU_CHECK_CUDA(cudaMemcpy(dev.p, want.data(), bytes, cudaMemcpyHostToDevice));
  auto c = engine->Copy(dev.p, Device{DeviceKind::kCuda, 0, 0}, region, bytes);
  GPU_CHECK_OK(c->Wait());
  GPU_CHECK(std::memcmp(region, want.data(), bytes) == 0);
  if (st.ok()) GPU_CHECK_OK(engine->UnregisterHostRegion(region));
}

GPU_TEST(DirectCopyIntoRegisteredMappings) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  constexpr size_t kBytes = size_t{64} << 20;
  void* anon = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  GPU_CHECK(anon != MAP_FAILED);
  GPU_CHECK_OK(engine->RegisterHostRegion(anon, kBytes));
  GPU_CHECK_OK(engine->UnregisterHostRegion(anon));
  CheckRegisteredRegion(engine.get(), anon, kBytes, "anonymous");
  munmap(anon, kBytes);
  GPU_CHECK(engine->pin_stats().register_bytes >= kBytes);

  // A shared file mapping, as the mmap and pmem media make: on /dev/shm
  // (tmpfs, the pmem stand-in) and on a disk file system.
  for (const char* dir : {"/dev/shm", "/tmp"}) {
    std::string path = std::string(dir) + "/nonstop-gpu-test-" + std::to_string(getpid());
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) continue;
    GPU_CHECK(ftruncate(fd, kBytes) == 0);
    void* map = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    GPU_CHECK(map != MAP_FAILED);
    CheckRegisteredRegion(engine.get(), map, kBytes, path.c_str());
    munmap(map, kBytes);
    close(fd);
    unlink(path.c_str());
  }
  // Registering twice is the caller's error, reported, not a crash.
  void* p = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  GPU_CHECK_OK(engine->RegisterHostRegion(p, 1 << 20));
  Status again = engine->RegisterHostRegion(p, 1 << 20);
  GPU_CHECK(!again.ok());
  GPU_CHECK_OK(engine->UnregisterHostRegion(p));
  munmap(p, 1 << 20);
}

GPU_TEST(BlockingSyncWaitModeCopies) {
  auto engine = NewEngine(CudaCopyOptions::WaitMode::kBlockingSync);
  GPU_CHECK(engine != nullptr);
  constexpr size_t kBytes = size_t{8} << 20;
  auto want = Pattern(kBytes, 5);
  DeviceBuffer dev(kBytes);
  GPU_CHECK_CUDA(cudaMemcpy(dev.p, want.data(), kBytes, cudaMemcpyHostToDevice));
  std::vector<uint8_t> host(kBytes);
  auto c = engine->Copy(dev.p, Device{DeviceKind::kCuda, 0, 0}, host.data(), kBytes);
  while (!c->Ready()) std::this_thread::yield();
  GPU_CHECK_OK(c->Wait());
  GPU_CHECK(host == want);
}

GPU_TEST(HostSourcesAreCopiedOnTheHost) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  auto want = Pattern(12345, 6);
  std::vector<uint8_t> got(want.size());
  auto c = engine->Copy(want.data(), Device{}, got.data(), want.size());
  GPU_CHECK_OK(c->Wait());
  GPU_CHECK(got == want);
}

// Blocks the stream it is enqueued on until *flag is set.
void CUDART_CB BlockUntilSet(void* flag) {
  auto* f = static_cast<std::atomic<bool>*>(flag);
  while (!f->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// A copy ordered after a stream that never gets there: the poll wait gives
// up after wait_timeout_s with an error naming the copy, instead of hanging.
GPU_TEST(PollWaitIsBoundedWhenTheCallerStreamIsStuck) {
  CudaCopyOptions options;
  options.wait_timeout_s = 0.5;
  auto made = MakeCudaCopyEngine(options, nullptr);
  GPU_CHECK(made.ok());
  auto engine = std::move(made).value();
  cudaStream_t stuck = nullptr;
  GPU_CHECK_CUDA(cudaStreamCreateWithFlags(&stuck, cudaStreamNonBlocking));
  std::atomic<bool> release{false};
  GPU_CHECK_CUDA(cudaLaunchHostFunc(stuck, BlockUntilSet, &release));
  const size_t bytes = 1 << 20;
  DeviceBuffer dev(bytes);
  GPU_CHECK(dev.p != nullptr);
  std::vector<uint8_t> host(bytes);
  auto c = engine->Copy(dev.p, Device{DeviceKind::kCuda, 0, reinterpret_cast<uintptr_t>(stuck)},
                        host.data(), bytes);
  const auto t0 = Clock::now();
  Status st = c->Wait();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  release.store(true);
  // Let the stuck copy land before `host` goes away.
  cudaStreamSynchronize(stuck);
  cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(engine->CopyStream(0)));
  cudaStreamDestroy(stuck);
  std::printf("  stuck copy: %s after %.3f s\n", st.ToString().c_str(), s);
  GPU_CHECK(!st.ok());
  GPU_CHECK_MSG(st.message().find("not complete after") != std::string::npos, st.message());
  GPU_CHECK(s >= 0.5 && s < 10);
  // The engine goes on.
  auto again = engine->Copy(dev.p, Device{DeviceKind::kCuda, 0, 0}, host.data(), bytes);
  GPU_CHECK_OK(again->Wait());
}

GPU_TEST(BadInputIsAnErrorAndTheEngineGoesOn) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  std::vector<uint8_t> host(4096);
  auto bad_device = engine->Copy(host.data(), Device{DeviceKind::kCuda, 99, 0}, host.data(), 16);
  Status st = bad_device->Wait();
  GPU_CHECK(st.code() == StatusCode::kInvalidArgument);
  std::printf("  device 99: %s\n", st.message().c_str());
  // Zero bytes is a finished copy, whatever the pointers. (Bad device
  // pointers are not tried: the driver may turn them into a sticky error
  // that poisons the whole context, which no engine can report and go on.)
  DeviceBuffer dev(4096);
  auto empty = engine->Copy(nullptr, Device{DeviceKind::kCuda, 0, 0}, nullptr, 0);
  GPU_CHECK(empty->Ready());
  GPU_CHECK_OK(empty->Wait());
  // Still usable.
  auto ok = engine->Copy(dev.p, Device{DeviceKind::kCuda, 0, 0}, host.data(), 4096);
  GPU_CHECK_OK(ok->Wait());
}

GPU_TEST(ConcurrentCopiesFromManyThreads) {
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  constexpr int kThreads = 8, kCopies = 32;
  constexpr size_t kBytes = size_t{1} << 20;
  auto want = Pattern(kBytes * kThreads, 8);
  DeviceBuffer dev(want.size());
  GPU_CHECK_CUDA(cudaMemcpy(dev.p, want.data(), want.size(), cudaMemcpyHostToDevice));
  std::vector<uint8_t> host(want.size());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto* d = static_cast<uint8_t*>(dev.p) + t * kBytes;
      for (int i = 0; i < kCopies; ++i) {
        auto c = engine->Copy(d, Device{DeviceKind::kCuda, 0, 0}, host.data() + t * kBytes, kBytes);
        if (!c->Wait().ok()) failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  GPU_CHECK(failures == 0);
  GPU_CHECK(host == want);
}

GPU_TEST(TheCallersCurrentDeviceIsKept) {
  int count = 0;
  GPU_CHECK_CUDA(cudaGetDeviceCount(&count));
  int last = count - 1;
  GPU_CHECK_CUDA(cudaSetDevice(last));
  auto engine = NewEngine();
  GPU_CHECK(engine != nullptr);
  DeviceBuffer dev(4096);  // on `last`
  std::vector<uint8_t> host(4096);
  auto c = engine->Copy(dev.p, Device{DeviceKind::kCuda, last, 0}, host.data(), 4096);
  GPU_CHECK_OK(c->Wait());
  GPU_CHECK(engine->CopyStream(0) != 0);
  int now = -1;
  GPU_CHECK_CUDA(cudaGetDevice(&now));
  GPU_CHECK(now == last);
  GPU_CHECK_CUDA(cudaSetDevice(0));
}

GPU_TEST(MakeBestCopyEnginePicksCuda) {
  std::string note;
  auto engine = MakeBestCopyEngine(2, &note);
  std::printf("  %s\n", note.c_str());
  GPU_CHECK(dynamic_cast<CudaCopyEngine*>(engine.get()) != nullptr);
  GPU_CHECK(BuiltWithCuda());
}

}  // namespace
}  // namespace nonstop

int main(int argc, char** argv) {
  std::string why;
  bool have = nonstop::CudaDeviceCount(&why) > 0;
  return nonstop::gputest::GpuTestMain(argc, argv, have, "no usable CUDA device (" + why + ")");
}
