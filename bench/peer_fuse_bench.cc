// The peer wire's two checks of a DATA frame (crc32c and the tag's GHASH,
// peer_wire.h) as two passes over each 256 KiB frame against one fused
// pass (block by block, each block's crc32c then its GHASH while it is in
// L1), in thread CPU seconds per GB. The frames are walked over a source
// larger than the last-level cache (as a replica's pages are), the ways'
// order rotating per round; medians. Prints a table, writes JSON.
//
//   build/bench/peer_fuse_bench [--gb 2] [--rounds 5] [--source-mib 256]
//       [--json bench/peer_fuse_bench_s16.json]
//
// Ways: "separate" (the sender before session 16: Crc32c of the frame,
// then DataFrameHash of it), "fused" (DataFrameChecks: the shipped block,
// kFuseBytes), and "fused_<K>k" (the same loop by hand with K KiB blocks,
// to choose kFuseBytes).
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/crc32c_combine.h"
#include "nonstop/crc32c.h"
#include "tier/peer_wire.h"

namespace {

namespace w = nonstop::peer::wire;
namespace crypto = nonstop::crypto;

double ThreadCpu() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  double gb = 2;
  int rounds = 5;
  size_t source_mib = 256;
  std::string json = "bench/peer_fuse_bench_s16.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--gb") gb = std::atof(argv[i + 1]);
    else if (a == "--rounds") rounds = std::atoi(argv[i + 1]);
    else if (a == "--source-mib") source_mib = static_cast<size_t>(std::atoll(argv[i + 1]));
    else if (a == "--json") json = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  const size_t frame = w::kDataPiece;
  const size_t source = source_mib << 20;
  std::vector<char> buf(source);
  std::mt19937_64 rng(16);
  for (size_t i = 0; i < source; i += 8) {
    const uint64_t v = rng();
    std::memcpy(buf.data() + i, &v, 8);
  }
  w::Socket s;
  auto ss = std::make_unique<w::Session>();
  crypto::Block key;
  for (auto& b : key) b = static_cast<uint8_t>(rng());
  ss->send_hash = crypto::Ghash(key.data());
  s.SetSession(std::move(ss));
  const uint64_t frames = static_cast<uint64_t>(gb * 1e9) / frame;
  const double bytes = static_cast<double>(frames * frame);

  const std::vector<std::string> ways = {"separate", "fused", "fused_4k", "fused_8k", "fused_16k",
                                         "fused_64k", "fused_256k"};
  uint64_t sink = 0;
  const auto run = [&](const std::string& way) {
    const double c0 = ThreadCpu();
    size_t at = 0;
    for (uint64_t f = 0; f < frames; ++f, at = (at + frame) % source) {
      const std::string_view p(buf.data() + at, frame);
      uint32_t crc = 0;
      crypto::Block hash{};
      if (way == "separate") {
        crc = nonstop::Crc32c(p.data(), p.size());
        hash = w::DataFrameHash(s, p, crc);
      } else if (way == "fused") {
        (void)w::DataFrameChecks(
            s, p,
            [](std::string_view b, uint32_t* c) {
              *c = nonstop::Crc32c(b.data(), b.size());
              return nonstop::Status::OK();
            },
            &crc, &hash);
      } else {
        const size_t block = static_cast<size_t>(std::atoi(way.c_str() + 6)) << 10;
        w::DataHashRun r(s.session()->send_hash);
        for (size_t o = 0; o < p.size(); o += block) {
          const size_t n = std::min(block, p.size() - o);
          crc = nonstop::Crc32cCombine(crc, nonstop::Crc32c(p.data() + o, n), n);
          r.Update(p.data() + o, n);
        }
        uint8_t h[w::kHeaderBytes] = {};
        std::memcpy(h, &crc, 4);
        hash = r.Final(h);
      }
      sink += crc + hash[0];
    }
    return ThreadCpu() - c0;
  };
  std::vector<std::vector<double>> cpu(ways.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < ways.size(); ++k) {
      const size_t i = (k + static_cast<size_t>(r)) % ways.size();
      cpu[i].push_back(run(ways[i]) / (bytes / 1e9));
    }
  }
  double load[3] = {0, 0, 0};
  (void)getloadavg(load, 3);
  std::printf("%-12s %10s %10s %12s\n", "way", "CPU s/GB", "GB/CPU s", "x separate");
  const double base = Median(cpu[0]);
  std::ofstream out(json);
  out << "{\n \"command\": \"build/bench/peer_fuse_bench --gb " << gb << " --rounds " << rounds
      << " --source-mib " << source_mib << " --json " << json << "\",\n \"frame_bytes\": " << frame
      << ",\n \"fuse_bytes\": " << w::kFuseBytes << ",\n \"bytes_per_round\": " << frames * frame
      << ",\n \"load_avg\": [" << load[0] << ", " << load[1] << ", " << load[2] << "],\n \"ghash_impl\": "
      << static_cast<int>(crypto::Ghash().impl()) << ",\n \"ways\": {";
  for (size_t i = 0; i < ways.size(); ++i) {
    const double m = Median(cpu[i]);
    std::printf("%-12s %10.3f %10.2f %12.2f\n", ways[i].c_str(), m, 1 / m, m / base);
    out << (i ? ",\n" : "\n") << "  \"" << ways[i] << "\": {\"median_cpu_s_per_GB\": " << m
        << ", \"ratio_to_separate\": " << m / base << ", \"rounds_cpu_s_per_GB\": [";
    for (size_t r = 0; r < cpu[i].size(); ++r) out << (r ? ", " : "") << cpu[i][r];
    out << "]}";
  }
  out << "\n }\n}\n";
  std::printf("wrote %s (checksum %llu)\n", json.c_str(), static_cast<unsigned long long>(sink % 7));
  return 0;
}
