// The layout and commit rules of a remote checkpoint (jobdir/remote_layout.h):
// names, a manifest's round trip, hostile manifests and markers refused with
// one Corruption (sizes checked before anything is allocated), the commit
// rule, retention and the deletion order.
#include "jobdir/remote_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace nonstop::remote {
namespace {

Manifest Sample(uint32_t rank = 0, uint32_t world = 2, int64_t lineage = 7) {
  Manifest m;
  m.step = 42;
  m.counter = 5;
  m.rank = rank;
  m.world_size = world;
  m.lineage = lineage;
  m.bytes = 10000;
  m.part_bytes = 4096;
  m.part_crc32 = {1, 0xffffffffu, 3};
  return m;
}

std::string Doc_(const std::string& fields) {
  return "{\"format\": \"nonstop.remote/1\", \"step\": 42, \"world_size\": 2, \"lineage\": 7" +
         fields + "}";
}

TEST(RemoteLayout, Names) {
  EXPECT_EQ(StepDir(42), "step-000000000042");
  EXPECT_EQ(PartKey(42, 3), "step-000000000042/rank-00003.nsck");
  EXPECT_EQ(ManifestKey(42, 3), "step-000000000042/rank-00003.json");
  EXPECT_EQ(MarkerKey(42), "step-000000000042/COMMITTED");
  EXPECT_EQ(LeadKey(42), "step-000000000042/LEAD");
  EXPECT_EQ(SkipKey(42, 1), "step-000000000042/rank-00001.skip");
  for (const std::string& k : {PartKey(9, 3), ManifestKey(9, 3), MarkerKey(9), LeadKey(9),
                               SkipKey(9, 3)}) {
    auto p = ParseKey(k);
    ASSERT_TRUE(p.has_value()) << k;
    EXPECT_EQ(p->step, 9);
    EXPECT_NE(p->kind, Key::Kind::kOther) << k;
  }
  EXPECT_EQ(ParseKey(PartKey(9, 3))->kind, Key::Kind::kPart);
  EXPECT_EQ(ParseKey(PartKey(9, 3))->rank, 3u);
  EXPECT_EQ(ParseKey("step-000000000009/rank-00003.nsck.tmp")->kind, Key::Kind::kOther);
  EXPECT_EQ(ParseKey("step-000000000009/rank-0000x.json")->kind, Key::Kind::kOther);
  EXPECT_FALSE(ParseKey("step-9/COMMITTED").has_value());
  EXPECT_FALSE(ParseKey("step-000000000009").has_value());
  EXPECT_FALSE(ParseKey("step-000000000009/a/COMMITTED").has_value());
  EXPECT_FALSE(ParseKey("other/COMMITTED").has_value());
  EXPECT_FALSE(ParseKey("step-00000000000x/COMMITTED").has_value());
}

TEST(RemoteLayout, ChecksumUnitBoundsTheListLength) {
  EXPECT_EQ(ChecksumUnit(1000, 8 << 20), 8u << 20);
  EXPECT_EQ(ChecksumUnit(1000, 1), kMinPartBytes);
  const uint64_t huge = 1ull << 40;  // 1 TiB: 8 MiB units would be 131072 checksums
  const uint64_t unit = ChecksumUnit(huge, 8 << 20);
  EXPECT_LE((huge + unit - 1) / unit, kMaxParts);
  EXPECT_EQ(ChecksumUnit(~0ull, 8 << 20), kMaxPartBytes);
}

TEST(RemoteLayout, ManifestRoundTrip) {
  const Manifest m = Sample(1);
  Result<Manifest> got = DecodeManifest(EncodeManifest(m, 1.5), "m");
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got.value().step, 42);
  EXPECT_EQ(got.value().counter, 5u);
  EXPECT_EQ(got.value().rank, 1u);
  EXPECT_EQ(got.value().world_size, 2u);
  EXPECT_EQ(got.value().lineage, 7);
  EXPECT_EQ(got.value().bytes, 10000u);
  EXPECT_EQ(got.value().part_crc32, m.part_crc32);
  // an empty part: no checksum at all
  Manifest e = Sample();
  e.bytes = 0;
  e.part_crc32.clear();
  ASSERT_TRUE(DecodeManifest(EncodeManifest(e, 0), "m").ok());
}

TEST(RemoteLayout, HostileManifestsAreOneCorruption) {
  const std::string crcs = ", \"counter\": 5, \"rank\": 1, \"part_bytes\": 4096";
  const std::vector<std::string> bad = {
      "",
      "[]",
      "{\"format\": \"nonstop.remote/1\"",                              // cut short
      "{\"format\": \"other\", \"step\": 42, \"world_size\": 2, \"lineage\": 7}",
      Doc_(crcs + ", \"bytes\": 10000, \"part_crc32\": [1, 2]"),         // one checksum short
      Doc_(crcs + ", \"bytes\": 10000, \"part_crc32\": [1, 2, 3, 4]"),   // one too many
      Doc_(crcs + ", \"bytes\": 10000, \"part_crc32\": [1, 2, 4294967296]"),  // not a crc32
      Doc_(crcs + ", \"bytes\": 10000, \"part_crc32\": [1, 2, -3]"),
      Doc_(crcs + ", \"bytes\": 10000, \"part_crc32\": [1, 2, \"3\"]"),
      Doc_(crcs + ", \"bytes\": 10000, \"part_crc32\": {}"),
      Doc_(crcs + ", \"bytes\": -1, \"part_crc32\": []"),
      // a size that would need 2^50 checksums: refused before any list is read
      Doc_(crcs + ", \"bytes\": 4611686018427387904, \"part_crc32\": []"),
      Doc_(crcs + ", \"bytes\": 18446744073709551616, \"part_crc32\": []"),  // > 2^64
      Doc_(", \"counter\": 5, \"rank\": 1, \"part_bytes\": 100, \"bytes\": 0, \"part_crc32\": []"),
      Doc_(", \"counter\": 5, \"rank\": 1, \"part_bytes\": 4294967296000, \"bytes\": 0, "
           "\"part_crc32\": []"),
      Doc_(", \"counter\": 5, \"rank\": 2, \"part_bytes\": 4096, \"bytes\": 0, \"part_crc32\": []"),
      Doc_(", \"counter\": -5, \"rank\": 1, \"part_bytes\": 4096, \"bytes\": 0, \"part_crc32\": []"),
      Doc_(", \"rank\": 1, \"part_bytes\": 4096, \"bytes\": 0, \"part_crc32\": []"),  // no counter
      "{\"format\": \"nonstop.remote/1\", \"step\": -1, \"world_size\": 2, \"lineage\": 7}",
      "{\"format\": \"nonstop.remote/1\", \"step\": 1e3, \"world_size\": 2, \"lineage\": 7}",
      "{\"format\": \"nonstop.remote/1\", \"step\": 42, \"world_size\": 0, \"lineage\": 7}",
      "{\"format\": \"nonstop.remote/1\", \"step\": 42, \"world_size\": 65537, \"lineage\": 7}",
      "{\"format\": \"nonstop.remote/1\", \"step\": 42, \"world_size\": 2, \"lineage\": true}",
      "{\"format\": \"nonstop.remote/1\", \"step\": 42, \"world_size\": 2}",
      std::string(100000, '[') + std::string(100000, ']'),  // deeper than the parser goes
  };
  for (const std::string& text : bad) {
    Result<Manifest> got = DecodeManifest(text, "rank-00001.json");
    ASSERT_FALSE(got.ok()) << text.substr(0, 200);
    EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << text.substr(0, 200);
    EXPECT_EQ(got.status().message().find('\n'), std::string::npos);
    EXPECT_NE(got.status().message().find("rank-00001.json"), std::string::npos)
        << got.status().message();
  }
}

TEST(RemoteLayout, OversizedDocumentRefusedByLengthFirst) {
  // a list of 300000 checksums (2 MB): refused for its length, not parsed
  std::string list;
  for (int i = 0; i < 300000; ++i) list += i ? ",1" : "1";
  const std::string text = Doc_(", \"counter\": 5, \"rank\": 1, \"part_bytes\": 4096, "
                                "\"bytes\": 1228800000, \"part_crc32\": [" + list + "]");
  Result<Manifest> got = DecodeManifest(text, "m");
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("more than a nonstop remote document"), std::string::npos)
      << got.status().message();
  EXPECT_FALSE(DecodeDoc(text, "d").ok());
}

TEST(RemoteLayout, DocsAndTheCommitRule) {
  Doc marker;
  marker.step = 42;
  marker.world_size = 2;
  marker.lineage = 7;
  marker.counter = 5;
  const std::vector<Manifest> both = {Sample(0), Sample(1)};
  Result<Doc> got = DecodeDoc(EncodeMarker(marker, both, 2.0), "COMMITTED");
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got.value().step, 42);
  EXPECT_EQ(got.value().world_size, 2u);
  EXPECT_EQ(got.value().lineage, 7);
  EXPECT_EQ(got.value().counter, 5u);
  EXPECT_TRUE(Committed(got.value(), both));
  EXPECT_FALSE(Committed(got.value(), {Sample(0)}));                 // a rank missing
  EXPECT_FALSE(Committed(got.value(), {Sample(0), Sample(0)}));      // the same rank twice
  EXPECT_FALSE(Committed(got.value(), {Sample(0), Sample(1, 2, 8)}));  // another lineage
  EXPECT_FALSE(Committed(got.value(), {Sample(0, 3), Sample(1, 3)}));  // another world
  Doc skip = marker;
  skip.counter.reset();
  skip.rank = 1;
  Result<Doc> s = DecodeDoc(EncodeSkip(skip, 0), "skip");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s.value().rank, 1u);
  EXPECT_TRUE(DecodeDoc(EncodeLead(skip, 0), "lead").ok());
  EXPECT_FALSE(DecodeDoc(Doc_(", \"rank\": 2"), "skip").ok());  // rank beyond the world

  EXPECT_TRUE(CheckFetch(marker, Sample(1), 42, 1, "w").ok());
  EXPECT_FALSE(CheckFetch(marker, Sample(1), 43, 1, "w").ok());
  EXPECT_FALSE(CheckFetch(marker, Sample(0), 42, 1, "w").ok());
  EXPECT_FALSE(CheckFetch(marker, Sample(1, 2, 8), 42, 1, "w").ok());
  EXPECT_FALSE(CheckFetch(marker, Sample(1), 42, 2, "w").ok());
}

std::vector<StepState> States(std::vector<std::tuple<int64_t, bool, uint64_t>> v) {
  std::vector<StepState> out;
  for (auto& [step, committed, counter] : v) out.push_back({step, committed, counter});
  return out;
}

TEST(RemoteLayout, Retention) {
  // nothing committed: nothing goes, not even abandoned uploads
  EXPECT_TRUE(StepsToDelete(States({{1, false, 1}, {2, false, 2}}), {1, 0, 0}).empty());
  // the newest max_to_keep committed stay; an older uncommitted goes, a newer stays
  auto s = States({{1, true, 1}, {2, false, 2}, {3, true, 3}, {4, true, 4}, {5, false, 5}});
  EXPECT_EQ(StepsToDelete(s, {2, 0, 0}), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(StepsToDelete(s, {1, 0, 0}), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(StepsToDelete(s, {9, 0, 0}), (std::vector<int64_t>{2}));
  // keep=3: counters 3, 6, 9 stay; keep_max=2: only the newest two of them
  std::vector<StepState> k;
  for (int64_t i = 1; i <= 10; ++i) k.push_back({i * 10, true, static_cast<uint64_t>(i)});
  EXPECT_EQ(StepsToDelete(k, {1, 3, 0}), (std::vector<int64_t>{10, 20, 40, 50, 70, 80}));
  EXPECT_EQ(StepsToDelete(k, {1, 3, 2}), (std::vector<int64_t>{10, 20, 30, 40, 50, 70, 80}));
  // a committed step whose counter is unknown is not periodic
  k[8].counter.reset();  // step 90
  EXPECT_EQ(StepsToDelete(k, {1, 3, 0}), (std::vector<int64_t>{10, 20, 40, 50, 70, 80, 90}));
}

TEST(RemoteLayout, DeleteBatchesPutTheMarkerFirstAndThePartsLast) {
  const std::vector<std::string> keys = {PartKey(5, 0), ManifestKey(5, 1), MarkerKey(5),
                                         PartKey(5, 1), LeadKey(5), "step-000000000005/x.tmp",
                                         ManifestKey(5, 0), SkipKey(5, 1)};
  auto b = DeleteBatches(keys);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], std::vector<std::string>{MarkerKey(5)});
  EXPECT_EQ(b[1], (std::vector<std::string>{ManifestKey(5, 1), LeadKey(5), ManifestKey(5, 0),
                                            SkipKey(5, 1)}));
  EXPECT_EQ(b[2], (std::vector<std::string>{PartKey(5, 0), PartKey(5, 1),
                                            "step-000000000005/x.tmp"}));
  // no marker (an abandoned upload): the documents, then the parts
  auto c = DeleteBatches({PartKey(5, 0), ManifestKey(5, 0)});
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0], std::vector<std::string>{ManifestKey(5, 0)});
}

}  // namespace
}  // namespace nonstop::remote
