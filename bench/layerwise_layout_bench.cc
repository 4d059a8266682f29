// Layout benchmark (LightCheck §III-C; docs/LAYERWISE.md): the time to
// persist one checkpoint when
//   separated  tensor data is laid out apart from the metadata, large tensors
//              4 KiB-aligned and contiguous, small ones packed (SlotLayout,
//              what nonstop writes), metadata written once at the end;
//   interleaved  each tensor's metadata record is followed by its bytes at
//              whatever offset that gives (a pickle-like stream, as torch.save
//              writes): unaligned writes, one small write per tensor.
// Both write from the tensors' own memory (no staging) and end with one Sync,
// on the pmem medium (libpmem2; on /dev/shm it is page granularity + msync)
// and on disk (buffered pwrite + fdatasync; O_DIRECT for the aligned layout).
//
//   layerwise_layout_bench --pmem-dir /dev/shm/x --disk-dir runs/x [--mib 256]
//                          [--repeat 5] [--json out.json]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "nonstop/env.h"
#include "nonstop/medium.h"
#include "nonstop/store.h"

namespace nonstop {
namespace {

using Clock = std::chrono::steady_clock;

struct Source {
  TensorSpec spec;
  std::byte* data = nullptr;  // 4 KiB-aligned, rounded up to 4 KiB, pre-faulted
  uint64_t alloc = 0;
};

std::vector<Source> MakeTensors(uint64_t total_bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Source> out;
  uint64_t have = 0;
  int i = 0;
  // A transformer-like mix: large matrices of uneven sizes (not multiples of
  // 4 KiB) and many small vectors (biases, norms, step counters).
  while (have < total_bytes) {
    Source s;
    const bool small = rng() % 3 == 0;
    const uint64_t elems = small ? 1 + rng() % 4096 : (64 << 10) + rng() % (1 << 20);
    s.spec.name = (small ? "layers." : "layers.w") + std::to_string(i++) + ".weight";
    s.spec.dtype = DType::kFloat32;
    s.spec.shape = {static_cast<int64_t>(elems)};
    s.spec.nbytes = elems * 4;
    s.alloc = (s.spec.nbytes + 4095) / 4096 * 4096;
    s.data = static_cast<std::byte*>(
        mmap(nullptr, s.alloc, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    for (uint64_t k = 0; k < s.alloc; ++k) s.data[k] = static_cast<std::byte>(rng());
    have += s.spec.nbytes;
    out.push_back(s);
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Separated + aligned: data region first (large tensors at 4 KiB boundaries,
// one write each, rounded up to 4 KiB: the padding is part of the source
// allocation), small tensors packed and written as one piece, then the
// metadata table, then one Sync.
Status PersistSeparated(Medium& m, const std::vector<Source>& ts, const SlotLayout& layout,
                        std::byte* small, uint64_t meta_bytes) {
  uint64_t small_begin = layout.data_bytes;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].spec.nbytes < kLargeTensorBytes) {
      small_begin = std::min(small_begin, layout.tensors[i].data_offset / 4096 * 4096);
    }
  }
  for (size_t i = 0; i < ts.size(); ++i) {
    const uint64_t off = layout.tensors[i].data_offset;
    if (ts[i].spec.nbytes >= kLargeTensorBytes) {
      NONSTOP_RETURN_IF_ERROR(m.Write(off, ts[i].data, ts[i].alloc));
    } else {
      std::memcpy(small + (off - small_begin), ts[i].data, ts[i].spec.nbytes);
    }
  }
  if (layout.data_bytes > small_begin) {
    NONSTOP_RETURN_IF_ERROR(
        m.Write(small_begin, small, layout.data_bytes - small_begin));
  }
  // The table: its content does not matter here, only that it is one more write.
  NONSTOP_RETURN_IF_ERROR(m.Write(layout.data_bytes, small, meta_bytes));
  return m.Sync();
}

// Interleaved + unaligned: [record][bytes][record][bytes]..., then one Sync.
Status PersistInterleaved(Medium& m, const std::vector<Source>& ts) {
  uint64_t off = 0;
  std::vector<char> rec(256);
  for (const Source& s : ts) {
    const size_t n = std::min<size_t>(rec.size(), 48 + s.spec.name.size());
    std::memcpy(rec.data(), s.spec.name.data(), std::min(rec.size(), s.spec.name.size()));
    NONSTOP_RETURN_IF_ERROR(m.Write(off, rec.data(), n));
    off += n;
    NONSTOP_RETURN_IF_ERROR(m.Write(off, s.data, s.spec.nbytes));
    off += s.spec.nbytes;
  }
  return m.Sync();
}

struct Row {
  std::string target, layout, medium;
  double seconds = 0, gbps = 0, min_s = 0, max_s = 0;
};

int Main(int argc, char** argv) {
  std::string pmem_dir = "/dev/shm/nonstop_layout_bench", disk_dir = "runs/layout_bench", json;
  uint64_t mib = 256;
  int repeat = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--pmem-dir") pmem_dir = v;
    else if (a == "--disk-dir") disk_dir = v;
    else if (a == "--mib") mib = std::stoull(v);
    else if (a == "--repeat") repeat = std::stoi(v);
    else if (a == "--json") json = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::vector<Source> ts = MakeTensors(mib << 20, 42);
  std::vector<TensorSpec> specs;
  uint64_t total = 0;
  for (const Source& s : ts) {
    specs.push_back(s.spec);
    total += s.spec.nbytes;
  }
  auto layout = SlotLayout::Plan(specs);
  if (!layout.ok()) {
    std::fprintf(stderr, "%s\n", layout.status().ToString().c_str());
    return 1;
  }
  const uint64_t meta_bytes = 64 << 10;
  // Page-aligned (O_DIRECT) and pre-faulted, like the engine's staging.
  const uint64_t small_bytes = std::max<uint64_t>(layout->data_bytes, meta_bytes);
  auto* small = static_cast<std::byte*>(
      mmap(nullptr, small_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  std::memset(small, 1, small_bytes);
  const uint64_t file_bytes = layout->data_bytes + (1 << 20) + total / 64;

  struct Config {
    std::string target, dir;
    MediumKind kind;
    bool separated;
  };
  const std::vector<Config> configs = {
      {"pmem (/dev/shm)", pmem_dir, MediumKind::kPmem, true},
      {"pmem (/dev/shm)", pmem_dir, MediumKind::kPmem, false},
      {"disk", disk_dir, MediumKind::kDirect, true},
      {"disk", disk_dir, MediumKind::kBuffered, true},
      {"disk", disk_dir, MediumKind::kBuffered, false},
  };
  std::vector<std::vector<double>> times(configs.size());
  std::vector<std::string> desc(configs.size());
  // Interleaved rounds, the order reversed every other round (A B C, C B A,
  // ...), after one unmeasured round: drift and "who runs after whom" on a
  // noisy machine hit every configuration alike.
  for (int r = -1; r < repeat; ++r) {
    for (size_t k = 0; k < configs.size(); ++k) {
      const size_t c = r % 2 == 0 ? configs.size() - 1 - k : k;
      const Config& cfg = configs[c];
      std::filesystem::create_directories(cfg.dir);
      const std::string path = cfg.dir + "/layout.bin";
      std::filesystem::remove(path);
      MediumOptions mo;
      mo.create = true;
      auto m = OpenMedium(path, cfg.kind, mo);
      if (!m.ok()) {
        std::fprintf(stderr, "%s: %s\n", cfg.target.c_str(), m.status().ToString().c_str());
        return 1;
      }
      Status st = (*m)->Resize(file_bytes);
      if (st.ok()) st = (*m)->Sync();
      desc[c] = (*m)->Describe();
      const auto t0 = Clock::now();
      if (st.ok()) {
        st = cfg.separated ? PersistSeparated(**m, ts, *layout, small, meta_bytes)
                           : PersistInterleaved(**m, ts);
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!st.ok()) {
        std::fprintf(stderr, "%s %s: %s\n", cfg.target.c_str(), desc[c].c_str(),
                     st.ToString().c_str());
        return 1;
      }
      if (r >= 0) times[c].push_back(s);
      m->reset();
      std::filesystem::remove(path);
    }
  }
  std::vector<Row> rows;
  std::printf("layout benchmark: %zu tensors, %.1f MiB, median of %d interleaved rounds\n",
              ts.size(), total / 1048576.0, repeat);
  std::printf("%-16s %-34s %-12s %9s %8s %9s\n", "target", "medium", "layout", "seconds", "GB/s",
              "vs interl.");
  for (size_t c = 0; c < configs.size(); ++c) {
    Row row;
    row.target = configs[c].target;
    row.medium = desc[c];
    row.layout = configs[c].separated ? "separated" : "interleaved";
    row.seconds = Median(times[c]);
    row.min_s = *std::min_element(times[c].begin(), times[c].end());
    row.max_s = *std::max_element(times[c].begin(), times[c].end());
    row.gbps = total / row.seconds / 1e9;
    rows.push_back(row);
  }
  for (const Row& row : rows) {
    double interleaved = 0;
    for (const Row& o : rows) {
      if (o.target == row.target && o.layout == "interleaved") interleaved = o.seconds;
    }
    std::printf("%-16s %-34.34s %-12s %9.4f %8.2f %8.2fx\n", row.target.c_str(),
                row.medium.c_str(), row.layout.c_str(), row.seconds, row.gbps,
                interleaved > 0 ? interleaved / row.seconds : 0.0);
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"tensors\": " << ts.size() << ", \"bytes\": " << total << ", \"repeat\": " << repeat
      << ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << (i ? ", " : "") << "{\"target\": \"" << r.target << "\", \"medium\": \"" << r.medium
        << "\", \"layout\": \"" << r.layout << "\", \"median_s\": " << r.seconds
        << ", \"min_s\": " << r.min_s << ", \"max_s\": " << r.max_s << ", \"GBps\": " << r.gbps
        << "}";
    }
    f << "]}\n";
  }
  for (Source& s : ts) munmap(s.data, s.alloc);
  munmap(small, small_bytes);
  return 0;
}

}  // namespace
}  // namespace nonstop

int main(int argc, char** argv) { return nonstop::Main(argc, argv); }
