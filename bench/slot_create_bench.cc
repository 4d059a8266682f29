// SlotFile::Create on /dev/shm (tmpfs): with the zero-fill of the slots
// (what every medium got before Medium::InMemory) against without it (now),
// interleaved rounds in one process, each scheme on a fresh file. Prints a
// table, writes JSON.
//
//   build/bench/slot_create_bench [--gib 2] [--rounds 5] [--dir /dev/shm]
//       [--kind buffered|mmap] [--json bench/slot_create_shm.json]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/store.h"

namespace {

using nonstop::Medium;

// The medium the Env opened, told to claim it is not in memory: the old path.
class NotInMemory final : public Medium {
 public:
  explicit NotInMemory(std::unique_ptr<Medium> m) : m_(std::move(m)) {}
  nonstop::Status Write(uint64_t o, const void* b, size_t n) override { return m_->Write(o, b, n); }
  nonstop::Status Read(uint64_t o, void* b, size_t n) override { return m_->Read(o, b, n); }
  nonstop::Status Sync() override { return m_->Sync(); }
  nonstop::Status Resize(uint64_t s) override { return m_->Resize(s); }
  uint64_t Size() const override { return m_->Size(); }
  size_t Alignment() const override { return m_->Alignment(); }
  nonstop::MediumKind kind() const override { return m_->kind(); }
  std::string Describe() const override { return m_->Describe(); }
  bool InMemory() const override { return false; }

 private:
  std::unique_ptr<Medium> m_;
};

double CreateOnce(nonstop::Directory& dir, nonstop::MediumKind kind, uint64_t bytes, bool zero) {
  const std::string name = "slot-create-bench.nsck";
  (void)dir.Unlink(name);
  auto m = dir.CreateFile(name, kind, nonstop::MediumOptions{});
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
    std::exit(1);
  }
  std::unique_ptr<Medium> medium = std::move(m).value();
  if (zero) medium = std::make_unique<NotInMemory>(std::move(medium));
  nonstop::StoreGeometry g;
  g.slots = 2;
  g.slot_bytes = bytes / 2 / 4096 * 4096;
  const auto t0 = std::chrono::steady_clock::now();
  auto f = nonstop::SlotFile::Create(std::move(medium), g);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!f.ok()) {
    std::fprintf(stderr, "%s\n", f.status().ToString().c_str());
    std::exit(1);
  }
  f = nonstop::Status::Internal("closed");
  (void)dir.Unlink(name);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  double gib = 2;
  int rounds = 5;
  std::string dir_path = "/dev/shm", kind_name = "buffered", json;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--gib") gib = std::atof(argv[i + 1]);
    else if (a == "--rounds") rounds = std::atoi(argv[i + 1]);
    else if (a == "--dir") dir_path = argv[i + 1];
    else if (a == "--kind") kind_name = argv[i + 1];
    else if (a == "--json") json = argv[i + 1];
  }
  nonstop::MediumKind kind;
  if (!nonstop::ParseMediumKind(kind_name, &kind)) return 2;
  const std::string sub = dir_path + "/nonstop-slot-create-" + std::to_string(::getpid());
  auto dir = nonstop::DefaultEnv()->OpenDirectory(sub, true);
  if (!dir.ok()) {
    std::fprintf(stderr, "%s\n", dir.status().ToString().c_str());
    return 1;
  }
  const uint64_t bytes = static_cast<uint64_t>(gib * (1ull << 30));
  std::vector<double> zero, skip;
  for (int r = 0; r < rounds; ++r) {  // interleaved, alternating which goes first
    if (r % 2 == 0) {
      zero.push_back(CreateOnce(**dir, kind, bytes, true));
      skip.push_back(CreateOnce(**dir, kind, bytes, false));
    } else {
      skip.push_back(CreateOnce(**dir, kind, bytes, false));
      zero.push_back(CreateOnce(**dir, kind, bytes, true));
    }
  }
  dir->reset();
  ::rmdir(sub.c_str());
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double mz = median(zero), ms = median(skip);
  std::printf("SlotFile::Create, %.2f GiB on %s (%s), %d interleaved rounds\n", gib,
              dir_path.c_str(), kind_name.c_str(), rounds);
  std::printf("%-28s %10s\n", "scheme", "median s");
  std::printf("%-28s %10.3f\n", "zero-fill (before)", mz);
  std::printf("%-28s %10.3f\n", "no zero-fill on tmpfs (now)", ms);
  std::printf("ratio before/now: %.1fx\n", ms > 0 ? mz / ms : 0.0);
  if (!json.empty()) {
    std::ofstream o(json);
    o << "{\"bench\": \"slot_create_bench\", \"dir\": \"" << dir_path << "\", \"kind\": \""
      << kind_name << "\", \"gib\": " << gib << ", \"rounds\": " << rounds
      << ", \"zero_fill_s\": [";
    for (size_t i = 0; i < zero.size(); ++i) o << (i ? ", " : "") << zero[i];
    o << "], \"no_zero_fill_s\": [";
    for (size_t i = 0; i < skip.size(); ++i) o << (i ? ", " : "") << skip[i];
    o << "], \"median_zero_fill_s\": " << mz << ", \"median_no_zero_fill_s\": " << ms << "}\n";
  }
  return 0;
}
