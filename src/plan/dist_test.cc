// The distributed restart's decisions (nonstop/dist.h) on gathered data
// alone: the common steps, the recover fallbacks, the memory tier's
// all-or-none choice, the reshard agreement's retries and its one error
// line, the byte layout of the replicated tensors and the FSDP2 reshard's;
// and the drivers of the rounds (Recover, ReshardTogether) on ranks
// simulated by threads.
#include "nonstop/dist.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "plan/rank_threads.h"

namespace nonstop::dist {
namespace {

TEST(DistTest, JoinErrorsOneLineOrPerRank) {
  EXPECT_TRUE(JoinErrors({std::nullopt, std::nullopt}).ok());
  Status one = JoinErrors({std::nullopt, RankError{StatusCode::kCorruption, "bad"}});
  EXPECT_EQ(one.code(), StatusCode::kCorruption);
  EXPECT_EQ(one.message(), "bad");
  Status same = JoinErrors({RankError{StatusCode::kNotFound, "x"},
                            RankError{StatusCode::kCorruption, "x"}});
  EXPECT_EQ(same.code(), StatusCode::kNotFound);
  EXPECT_EQ(same.message(), "x");
  Status two = JoinErrors({RankError{StatusCode::kIOError, "a"}, std::nullopt,
                           RankError{StatusCode::kCorruption, "b"}});
  EXPECT_EQ(two.code(), StatusCode::kIOError);
  EXPECT_EQ(two.message(), "rank 0: a; rank 2: b");
}

RoundOffer R(int64_t cand, int64_t committed, bool stopping = false, int64_t newest = -1) {
  RoundOffer r;
  r.offer.candidate = cand;
  r.offer.committed = committed;
  r.offer.started = committed;
  r.stopping = stopping;
  r.newest = newest;
  return r;
}

TEST(DistTest, AgreementRoundsPinOnceAimPastAnAgreedStepAndCount) {
  using K = AgreementRounds::Step::Kind;
  AgreementRounds a;
  auto s = a.OnRound({R(-1, -1), R(-1, -1)}, std::nullopt, 1.0);
  EXPECT_EQ(s.kind, K::kWait);
  s = a.OnRound({R(10, 10), R(10, 10)}, std::nullopt, 2.0);
  EXPECT_EQ(s.kind, K::kPin);
  a.Pinned(3.0);
  // Agreed already (this lineage): keep a newer one instead of pinning again.
  s = a.OnRound({R(10, 10), R(10, 10)}, 10, 4.0);
  EXPECT_EQ(s.kind, K::kAim);
  EXPECT_EQ(s.aim, 11);
  a.Dropped();
  a.Dropped();
  s = a.OnRound({R(20, 20), R(10, 20)}, 10, 5.0);  // rank 1 went past 20: aim after 20
  EXPECT_EQ(s.kind, K::kAim);
  EXPECT_EQ(s.aim, 21);
  a.Pinned(9.0);
  EXPECT_EQ(a.rounds, 4);
  EXPECT_EQ(a.agreements, 2);
  EXPECT_EQ(a.candidate_drops, 2);
  EXPECT_EQ(a.max_drops_in_row, 2);
  EXPECT_DOUBLE_EQ(a.MaxGap(std::nullopt), 6.0);   // 3.0 -> 9.0
  EXPECT_DOUBLE_EQ(a.MaxGap(20.0), 11.0);          // the gap still open
}

TEST(DistTest, AgreementRoundsCloseOnTheNewestEveryRankCommitted) {
  AgreementRounds a;
  auto s = a.OnRound({R(-1, 30, true, 30), R(-1, 30, false, -1)}, 20, 1.0);
  EXPECT_FALSE(s.close);  // rank 1 is not closing yet
  s = a.OnRound({R(-1, 30, true, 30), R(-1, 30, true, 30)}, 20, 2.0);
  EXPECT_TRUE(s.close);
  EXPECT_EQ(s.close_step, 30);
  s = a.OnRound({R(-1, 30, true, 30), R(-1, 30, true, 20)}, 10, 3.0);
  EXPECT_TRUE(s.close);
  EXPECT_EQ(s.close_step, -1);  // the ranks' newest differ
  // Pinned in this very round: nothing newer to record.
  s = a.OnRound({R(30, 30, true, 30), R(30, 30, true, 30)}, 20, 4.0);
  EXPECT_EQ(s.kind, AgreementRounds::Step::Kind::kPin);
  EXPECT_EQ(s.close_step, -1);
}

// The round driven on one rank whose engine is a record of the calls made
// (the other ranks' offers given as the gather's answer).
TEST(DistTest, AgreementRoundDrivesPinAimAndTheLastRecord) {
  AgreeOffer offer{10, 10, 10, 3};
  std::optional<std::pair<uint64_t, int64_t>> latest;
  std::optional<uint64_t> candidate = 3;
  std::vector<int64_t> other = {10, 10, 10, 0, -1}, sent;
  std::vector<std::string> calls;
  bool dropped = true;
  AgreementRounds::Hooks h;
  h.offer = [&]() -> Result<AgreeOffer> { return offer; };
  h.latest = [&]() -> Result<std::optional<std::pair<uint64_t, int64_t>>> { return latest; };
  h.gather = [&](const std::vector<int64_t>& mine)
      -> Result<std::vector<std::vector<int64_t>>> {
    sent = mine;
    return std::vector<std::vector<int64_t>>{mine, other};
  };
  h.pin = [&](uint64_t c) {
    calls.push_back("pin " + std::to_string(c));
    return Status::OK();
  };
  h.aim = [&](int64_t s) -> Result<bool> {
    calls.push_back("aim " + std::to_string(s));
    return dropped;
  };
  h.candidate = [&]() -> Result<std::optional<uint64_t>> { return candidate; };
  h.record = [&](uint64_t c, int64_t s) {
    calls.push_back("record " + std::to_string(c) + " " + std::to_string(s));
    return Status::OK();
  };
  double t = 0;
  h.now = [&] { return t += 1; };
  AgreementRounds a;
  EXPECT_EQ(a.Round(h, false, std::nullopt).value(), false);
  EXPECT_EQ(sent, (std::vector<int64_t>{10, 10, 10, 0, -1}));
  EXPECT_EQ(calls, (std::vector<std::string>{"pin 3", "record 3 10"}));
  EXPECT_EQ(a.agreements, 1);
  calls.clear();
  EXPECT_EQ(a.Round(h, false, 10).value(), false);  // agreed already: aim past it
  EXPECT_EQ(calls, (std::vector<std::string>{"aim 11"}));
  EXPECT_EQ(a.candidate_drops, 1);
  // Every rank closing on step 20, this rank's candidate (counter 5): pinned, recorded.
  calls.clear();
  offer = {-1, 20, 20, 0};
  latest = std::make_pair(uint64_t{5}, int64_t{20});
  candidate = 5;
  other = {-1, 20, 20, 1, 20};
  dropped = false;
  EXPECT_EQ(a.Round(h, true, 10).value(), true);
  EXPECT_EQ(sent, (std::vector<int64_t>{-1, 20, 20, 1, 20}));
  EXPECT_EQ(calls, (std::vector<std::string>{"pin 5", "record 5 20"}));  // no candidate: wait
  EXPECT_EQ(a.candidate_drops, 1);
  // Its candidate is another checkpoint: recorded, not pinned.
  calls.clear();
  candidate = 4;
  EXPECT_EQ(a.Round(h, true, 10).value(), true);
  EXPECT_EQ(calls, (std::vector<std::string>{"record 5 20"}));
  // A malformed offer, and a gather's error, as they are.
  other = {1, 2};
  EXPECT_EQ(a.Round(h, false, 10).status().code(), StatusCode::kInvalidArgument);
  h.gather = [](const std::vector<int64_t>&) -> Result<std::vector<std::vector<int64_t>>> {
    return Status::Aborted("gone");
  };
  EXPECT_EQ(a.Round(h, false, 10).status().message(), "gone");
}

TEST(DistTest, DTensorPlacementOnlyShard0OrReplicateOnAOneDMeshOfAllRanks) {
  EXPECT_EQ(DTensorPlacement("w", 1, {0, 1}, "[0, 1]", "S0", 2).value(), "S0");
  EXPECT_EQ(DTensorPlacement("w", 1, {0, 1, 2}, "[0, 1, 2]", "R", 3).value(), "R");
  Result<std::string> two_d = DTensorPlacement("w", 2, {0, 1, 2, 3}, "[[0, 1], [2, 3]]", "S0", 4);
  EXPECT_EQ(two_d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(two_d.status().message(),
            "tensor 'w' is a DTensor on mesh [[0, 1], [2, 3]]: nonstop handles DTensors on a 1-D "
            "mesh over all 4 ranks (FSDP2 fully_shard); HSDP and 2-D meshes are not supported yet");
  EXPECT_FALSE(DTensorPlacement("w", 1, {0}, "[0]", "S0", 2).ok());        // not every rank
  EXPECT_FALSE(DTensorPlacement("w", 1, {1, 0}, "[1, 0]", "S0", 2).ok());  // another order
  Result<std::string> other = DTensorPlacement("w", 1, {0, 1}, "[0, 1]", "Shard(dim=1)", 2);
  EXPECT_EQ(other.status().message(),
            "tensor 'w' is a DTensor placed Shard(dim=1): nonstop handles Shard(0) (FSDP2's "
            "default) and Replicate() placements only");
}

TEST(DistTest, CheckWorldRefusesAnotherReplicatedNoProcessGroupOrAnotherRank) {
  EXPECT_TRUE(CheckWorld("shard", 1, 2, true, 1, 2).ok());
  EXPECT_TRUE(CheckWorld("rank0", 0, 4, true, 0, 4).ok());
  Status s = CheckWorld("all", 0, 2, true, 0, 2);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "replicated must be one of shard, rank0, got 'all'");
  s = CheckWorld("shard", 0, 2, false, -1, -1);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "world_size=2 needs torch.distributed initialised "
                         "(torch.distributed.init_process_group, or run under torchrun)");
  s = CheckWorld("shard", 1, 2, true, 0, 2);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "rank 1 of world size 2 given, but torch.distributed says rank 0 of 2");
  EXPECT_FALSE(CheckWorld("shard", 0, 2, true, 0, 3).ok());
}

TEST(DistTest, CommonStepsInRankZerosOrder) {
  EXPECT_EQ(CommonSteps({{30, 20, 10}, {10, 20}, {20, 10, 40}}), (std::vector<int64_t>{20, 10}));
  // Rank 0's order wins even when another rank lists the steps otherwise.
  EXPECT_EQ(CommonSteps({{9, 29}, {29, 9}}), (std::vector<int64_t>{9, 29}));
  EXPECT_TRUE(CommonSteps({{5}, {}}).empty());
  EXPECT_TRUE(CommonSteps({}).empty());
  EXPECT_EQ(CommonSteps({{7, 7, 3}}), (std::vector<int64_t>{7, 3}));
}

TEST(DistTest, NoCommonStepIsAFreshStartOnlyWhenNothingIsThere) {
  EXPECT_TRUE(NoCommonStep("/j", 0, std::nullopt, {{}, {}}).ok());
  Status s = NoCommonStep("/j", 1, std::nullopt, {{}, {9, 8}});
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no checkpoint committed on every rank of /j (rank 1 holds steps [9, 8])");
  s = NoCommonStep("/j", 0, 5, {{}, {}});
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(),
            "no checkpoint at step 5 committed on every rank of /j (rank 0 holds steps none)");
}

TEST(DistTest, CheckForeignRefusesWhenAnyRankSeesOldFiles) {
  EXPECT_TRUE(CheckForeign("/j", 2, {false, false}).ok());
  Status s = CheckForeign("/j", 2, {false, true});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("/j holds rank files written by a job of another world size; this "
                             "job has world size 2"),
            std::string::npos);
}

TEST(DistTest, DecideRecoverStepFallsBackTogetherAndNeverMixesRuns) {
  const std::vector<int64_t> order{20, 10};
  auto ok = DecideRecoverStep("/j", order, 0, {{std::nullopt, 7}, {std::nullopt, 7}});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, "");
  auto fail = DecideRecoverStep("/j", order, 0, {{std::nullopt, 7}, {"crc mismatch", 0}});
  ASSERT_TRUE(fail.ok());
  EXPECT_EQ(*fail, "nonstop: step 20 fails on rank 1: crc mismatch; all ranks fall back to step 10");
  auto runs = DecideRecoverStep("/j", order, 0, {{std::nullopt, 7}, {std::nullopt, 8}});
  ASSERT_TRUE(runs.ok());
  EXPECT_EQ(*runs, "nonstop: step 20 fails on rank 0: step 20 is of run 7; rank 1: step 20 is of "
                   "run 8; all ranks fall back to step 10");
  auto last = DecideRecoverStep("/j", order, 1, {{"gone", 0}, {std::nullopt, 7}});
  ASSERT_FALSE(last.ok());
  EXPECT_EQ(last.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(last.status().message(), "no checkpoint every rank of /j can verify: rank 0: gone");
}

TEST(DistTest, DecideMemoryIsAllOrNone) {
  EXPECT_TRUE(DecideMemory({"", ""}).use);
  EXPECT_TRUE(DecideMemory({"", std::nullopt}).use);  // a peer-replica rank takes no part
  EXPECT_FALSE(DecideMemory({std::nullopt, std::nullopt}).use);
  MemoryChoice c = DecideMemory({"", "no segment"});
  EXPECT_FALSE(c.use);
  EXPECT_EQ(c.unused, "rank 1: no segment");
}

ReshardAgreement::Pick P(int w, int64_t step, uint64_t run) {
  return {std::nullopt, ReshardKey{w, step, run}};
}

TEST(DistTest, ReshardAgreementRetriesBelowDifferentChoices) {
  ReshardAgreement a("/j", 3);
  // Different steps: again at or below the oldest.
  auto n = a.OnPicks({P(2, 20, 1), P(2, 10, 1), P(2, 20, 1)});
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, ReshardAgreement::Next::kRetry);
  EXPECT_EQ(a.max_step(), 10);
  // Same step, different runs: below it.
  n = a.OnPicks({P(2, 10, 1), P(2, 10, 2), P(2, 10, 1)});
  EXPECT_EQ(*n, ReshardAgreement::Next::kRetry);
  EXPECT_EQ(a.max_step(), 9);
  n = a.OnPicks({P(2, 8, 1), P(2, 8, 1), P(2, 8, 1)});
  EXPECT_EQ(*n, ReshardAgreement::Next::kProceed);
  EXPECT_EQ(a.key(), (ReshardKey{2, 8, 1}));
  n = a.OnPicks({{std::nullopt, std::nullopt}, {std::nullopt, std::nullopt}});
  EXPECT_EQ(*n, ReshardAgreement::Next::kNone);
}

TEST(DistTest, ReshardAgreementErrorsNameRanksAndWhatFailedBefore) {
  ReshardAgreement a("/j", 2);
  auto n = a.OnPicks({P(4, 8, 1), {std::nullopt, std::nullopt}});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(n.status().message(),
            "rank 0 finds a checkpoint of world size 4 in /j but rank 1 does not: resharding to "
            "world size 2 needs every old rank file visible to every rank (a shared file "
            "system, or copies)");
  ASSERT_EQ(a.OnPicks({P(4, 8, 1), P(4, 8, 1)}).value(), ReshardAgreement::Next::kProceed);
  auto r = a.OnRebuilt({{std::nullopt, std::nullopt}, {"bad crc", std::nullopt}}, "/j/world-4");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, ReshardAgreement::Next::kRetry);
  EXPECT_EQ(a.max_step(), 7);
  EXPECT_EQ(a.warning(), "nonstop: resharding step 8 of /j/world-4 fails on rank 1: bad crc; all "
                         "ranks fall back to an older step");
  n = a.OnPicks({{RankError{StatusCode::kNotFound, "nothing older"}, std::nullopt},
                 {RankError{StatusCode::kNotFound, "nothing older"}, std::nullopt}});
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(n.status().message(),
            "resharding step 8 of /j/world-4 fails on rank 1: bad crc; then: nothing older");
  // A failure that is not damage ends it at once.
  ASSERT_EQ(a.OnPicks({P(4, 6, 1), P(4, 6, 1)}).value(), ReshardAgreement::Next::kProceed);
  r = a.OnRebuilt({{std::nullopt, "rank-local"}, {"bad", std::nullopt}}, "/j/world-4");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(), "rank-local");
  EXPECT_EQ(a.OnRebuilt({{std::nullopt, std::nullopt}}, "/j/world-4").value(),
            ReshardAgreement::Next::kDone);
}

TEST(DistTest, CheckReshardableRefusesRankLocalAndLayoutlessZero) {
  EXPECT_TRUE(CheckReshardable("/a", 2, 2, {"opt"}, {}, {"z"}).ok());
  Status s = CheckReshardable("/a", 2, 3, {"opt"}, {}, {});
  EXPECT_EQ(s.message(), "cannot reshard /a (world size 2) to world size 3: state 'opt' is "
                         "rank-local (local=...), a partition only its own rank knows");
  EXPECT_TRUE(CheckReshardable("/a", 2, 3, {}, {"z"}, {"z"}).ok());
  s = CheckReshardable("/a", 2, 3, {}, {"z"}, {"z", "y"});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "cannot reshard the ZeroRedundancyOptimizer state 'y' of /a: it was "
                         "written without the layout resharding needs (an older nonstop)");
}

TEST(DistTest, LayOutSharedPlacesEveryPieceByGlobalOffset) {
  // b: 10 float32 cut in 4+4+2 elements over three ranks; a: 3 int64 whole on rank 1.
  std::vector<SharedTensor> shared{{"b", {2, 5}, "float32"}, {"a", {3}, "int64"}};
  std::vector<Piece> pieces{{0, 0, "b", 0, 16}, {1, 4, "b", 4, 16}, {2, 1, "b", 8, 8},
                            {1, 2, "a", 0, 24}, {2, 9, "own", 0, 4}};
  auto got = LayOutShared(shared, pieces, true, "/j/world-3", 8);
  ASSERT_TRUE(got.ok()) << got.status().message();
  ASSERT_EQ(got->tensors.size(), 2u);
  EXPECT_EQ(got->tensors[0].name, "a");  // by name
  EXPECT_EQ(got->tensors[0].offset, 0u);
  EXPECT_EQ(got->tensors[0].nbytes, 24u);
  EXPECT_EQ(got->tensors[1].offset, 64u);  // aligned to 64 bytes
  EXPECT_EQ(got->tensors[1].nbytes, 40u);
  EXPECT_EQ(got->total, 104u);
  ASSERT_EQ(got->copies.size(), 4u);  // "own" is not shared
  EXPECT_EQ(got->copies[1].rank, 1);
  EXPECT_EQ(got->copies[1].handle, 4u);
  EXPECT_EQ(got->copies[1].offset, 64u + 16u);
  EXPECT_EQ(got->copies[2].offset, 64u + 32u);
  EXPECT_EQ(got->copies[3].offset, 0u);
  // One rank's pieces only (the all_reduce of a restart): no coverage asked.
  EXPECT_TRUE(LayOutShared(shared, {pieces[1]}, false, "/j", 8).ok());
}

TEST(DistTest, LayOutSharedRefusesGapsOverlapsAndPiecesOutside) {
  std::vector<SharedTensor> shared{{"b", {10}, "float32"}};
  auto gap = LayOutShared(shared, {{0, 0, "b", 0, 16}, {2, 1, "b", 8, 8}}, true, "/w", 8);
  ASSERT_FALSE(gap.ok());
  EXPECT_EQ(gap.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(gap.status().message(),
            "tensor 'b': the old rank files of /w hold 24 of its 40 bytes at step 8");
  auto over = LayOutShared(shared, {{0, 0, "b", 0, 24}, {1, 1, "b", 4, 24}}, true, "/w", 8);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("overlap"), std::string::npos);
  auto outside = LayOutShared(shared, {{0, 0, "b", 8, 12}}, false, "/w", 8);
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("lies outside its 40 bytes"), std::string::npos);
  auto partial = LayOutShared(shared, {{0, 0, "b", 0, 6}}, false, "/w", 8);
  EXPECT_FALSE(partial.ok());  // not whole elements
  auto dtype = LayOutShared({{"c", {2}, "float128"}}, {}, true, "/w", 8);
  ASSERT_FALSE(dtype.ok());
  EXPECT_EQ(dtype.status().message(), "unknown dtype 'float128' in a distributed checkpoint");
  auto huge = LayOutShared({{"h", {1LL << 40, 1LL << 40}, "float32"}}, {}, true, "/w", 8);
  EXPECT_FALSE(huge.ok());
}

// Shard: equal runs of ceil(n / world) cut in order, the last short or
// empty; small, non-contiguous and rank0 tensors whole on one rank each.
TEST(DistTest, ShardCutsEqualRunsAndGivesSmallTensorsToOneRank) {
  const std::vector<ShardInput> in = {{"big", 2050, false, true},
                                      {"small", 10, false, true},
                                      {"strided", 5000, false, false},
                                      {"buf", 5000, true, true},
                                      {"tail", 1024, false, true}};
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> got;
  std::map<std::string, int> owners;
  for (int r = 0; r < 3; ++r) {
    for (const ShardRange& s : Shard(in, r, 3)) {
      got[s.name].emplace_back(s.begin, s.end);
      if (s.whole) {
        EXPECT_EQ(s.begin, 0u);
        ++owners[s.name];
      }
    }
  }
  using R = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(got["big"], (R{{0, 684}, {684, 1368}, {1368, 2050}}));
  EXPECT_EQ(got["tail"], (R{{0, 342}, {342, 684}, {684, 1024}}));
  EXPECT_EQ(got["buf"], (R{{0, 5000}}));
  EXPECT_EQ(owners, (std::map<std::string, int>{{"buf", 1}, {"small", 1}, {"strided", 1}}));
  EXPECT_EQ(Shard(in, 0, 3).front().name, "big");  // in input order
  // 1025 elements over 4 ranks: runs of 257, the last rank 254.
  EXPECT_EQ(Shard({{"t", 1025, false, true}}, 3, 4).front().begin, 771u);
  // 1024 elements over 1000 ranks: runs of 2, ranks past 511 write nothing.
  EXPECT_TRUE(Shard({{"t", 1024, false, true}}, 600, 1000).empty());
}

// ZeroGlobalIds: a state id's global index is the index of its place among
// the sorted local ids; a layout that does not match is one line.
TEST(DistTest, ZeroGlobalIdsMapsLocalIdsAndRefusesMismatches) {
  auto g = ZeroGlobalIds({7, 2, 9}, {5, 3, 8}, {8, 3}, "w/rank-0");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g.value(), (std::vector<int64_t>{9, 7}));
  auto bad = ZeroGlobalIds({7, 2}, {5, 3, 8}, {3}, "w/rank-0");
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("w/rank-0"), std::string::npos);
  EXPECT_EQ(ZeroGlobalIds({1, 2}, {3, 3}, {3}, "x").status().code(), StatusCode::kCorruption);
  auto stray = ZeroGlobalIds({7, 2}, {5, 3}, {4}, "x");
  EXPECT_EQ(stray.status().code(), StatusCode::kCorruption);
  EXPECT_NE(stray.status().message().find("parameter 4"), std::string::npos);
}

// ShardRows: torch.chunk's split of dim 0 (ceil(d0 / world) rows each, the
// last ranks short or empty).
TEST(DistTest, ShardRowsFollowTorchChunk) {
  using R = std::pair<int64_t, int64_t>;
  EXPECT_EQ(ShardRows(67, 0, 2), (R{0, 34}));
  EXPECT_EQ(ShardRows(67, 1, 2), (R{34, 67}));
  EXPECT_EQ(ShardRows(5, 2, 4), (R{4, 5}));
  EXPECT_EQ(ShardRows(5, 3, 4), (R{5, 5}));  // torch.chunk(5, 4): 2, 2, 1 and none
  EXPECT_EQ(ShardRows(0, 1, 3), (R{0, 0}));
  EXPECT_EQ(ShardRows(1024, 600, 1000), (R{1024, 1024}));
  EXPECT_EQ(ShardRows(7, 0, 1), (R{0, 7}));
}

// ShardPieceOf: rank 1 of 2 holds rows 34..67 of a [67, 32] tensor, its
// first element the 34 * 32-th; a live piece of another shape is refused
// with one line naming the tensor, the shapes and the rows.
TEST(DistTest, ShardPieceOfGivesTheShapeAndOffsetAndRefusesAnotherSplit) {
  auto p = ShardPieceOf("w", {67, 32}, 1, 2, std::vector<int64_t>{33, 32});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->shape, (std::vector<int64_t>{33, 32}));
  EXPECT_EQ(p->offset, 34u * 32u);
  p = ShardPieceOf("b", {5}, 3, 4);  // torch.chunk(5, 4): none for rank 3
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->shape, (std::vector<int64_t>{0}));
  EXPECT_EQ(p->offset, 5u);
  p = ShardPieceOf("w", {67, 32}, 1, 2, std::vector<int64_t>{34, 32});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.status().message(),
            "tensor 'w': rank 1's Shard(0) piece has shape [34, 32], not [33, 32] (rows 34..67 "
            "of [67, 32]): nonstop expects torch.chunk's split of dim 0");
  EXPECT_FALSE(ShardPieceOf("s", {}, 0, 2).ok());
}

// PlanDTensorReshard: a [67, 32] Shard(0) tensor saved by 2 ranks (rows
// 0..34 and 34..67), read by rank 1 of 3 (rows 23..46): the tail of old
// rank 0's piece and the head of old rank 1's; a Replicate() one whole.
TEST(DistTest, PlanDTensorReshardCopiesTheOverlappingBytes) {
  const std::vector<DTensorDoc> doc = {{"w", {67, 32}, "float32", "S0"},
                                       {"r", {3}, "float64", "R"}};
  const std::vector<Piece> pieces = {{0, 4, "w", 0, 34 * 32 * 4}, {0, 5, "r", 0, 16},
                                     {1, 7, "w", 34 * 32, 33 * 32 * 4}, {1, 2, "r", 2, 8},
                                     {1, 3, "other", 0, 4}};
  auto got = PlanDTensorReshard(doc, pieces, 1, 3, "/j/world-2", 11);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  const DTensorReshard& p = got.value();
  ASSERT_EQ(p.tensors.size(), 2u);
  EXPECT_EQ(p.tensors[0].name, "w");
  EXPECT_EQ(p.tensors[0].shape, (std::vector<int64_t>{23, 32}));
  EXPECT_EQ(p.tensors[0].offset, 0u);
  EXPECT_EQ(p.tensors[0].nbytes, 23u * 32 * 4);
  EXPECT_EQ(p.tensors[1].shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(p.tensors[1].offset % 64, 0u);
  EXPECT_GE(p.tensors[1].offset, 23u * 32 * 4);
  EXPECT_EQ(p.total, p.tensors[1].offset + 24);
  ASSERT_EQ(p.copies.size(), 4u);
  auto eq = [](const DTensorReshard::Copy& c, int rank, size_t handle, uint64_t src,
               uint64_t dst, uint64_t n) {
    return c.rank == rank && c.handle == handle && c.src == src && c.dst == dst && c.nbytes == n;
  };
  EXPECT_TRUE(eq(p.copies[0], 0, 4, 23 * 32 * 4, 0, 11 * 32 * 4));  // rows 23..34
  EXPECT_TRUE(eq(p.copies[1], 0, 5, 0, p.tensors[1].offset, 16));
  EXPECT_TRUE(eq(p.copies[2], 1, 7, 0, 11 * 32 * 4, 12 * 32 * 4));  // rows 34..46
  EXPECT_TRUE(eq(p.copies[3], 1, 2, 0, p.tensors[1].offset + 16, 8));
  // Rank 2 of 3: rows 46..67, old rank 1's only; rank 0 of 1: both whole.
  auto last = PlanDTensorReshard({doc[0]}, pieces, 2, 3, "/j", 11);
  ASSERT_TRUE(last.ok());
  ASSERT_EQ(last.value().copies.size(), 1u);
  EXPECT_TRUE(eq(last.value().copies[0], 1, 7, 12 * 32 * 4, 0, 21 * 32 * 4));
  auto one = PlanDTensorReshard({doc[0]}, pieces, 0, 1, "/j", 11);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one.value().copies.size(), 2u);
  EXPECT_EQ(one.value().tensors[0].shape, (std::vector<int64_t>{67, 32}));
  // More new ranks than rows: an empty piece and no copy.
  auto empty = PlanDTensorReshard({{"v", {2}, "int64", "S0"}}, {{0, 0, "v", 0, 16}}, 3, 4, "/j", 1);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty.value().tensors[0].shape, (std::vector<int64_t>{0}));
  EXPECT_TRUE(empty.value().copies.empty());
}

// Hostile metadata is one line before anything is allocated; a missing
// old rank file says how much of the range it holds.
TEST(DistTest, PlanDTensorReshardRefusesBadMetadataAndMissingPieces) {
  const std::vector<DTensorDoc> doc = {{"w", {10}, "float32", "S0"}};
  auto code = [&](const std::vector<DTensorDoc>& d, const std::vector<Piece>& p, int rank,
                  int world) { return PlanDTensorReshard(d, p, rank, world, "/a", 4).status(); };
  Status missing = code(doc, {{0, 0, "w", 0, 20}}, 0, 1);
  EXPECT_EQ(missing.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(missing.message(), "tensor 'w': the old rank files hold 5 of elements 0..10 in /a at "
                               "step 4; some rank file is missing or incomplete");
  // Rank 1 of 2 wants 5..10, old rank 0 holds 0..5 and old rank 1's file is gone.
  EXPECT_NE(code(doc, {{0, 0, "w", 0, 20}}, 1, 2).message().find("hold 0 of elements 5..10"),
            std::string::npos);
  Status over = code(doc, {{0, 0, "w", 0, 24}, {1, 0, "w", 5, 20}}, 0, 1);
  EXPECT_EQ(over.code(), StatusCode::kCorruption);
  EXPECT_NE(over.message().find("overlap"), std::string::npos);
  Status outside = code(doc, {{0, 0, "w", 8, 12}}, 0, 1);
  EXPECT_EQ(outside.code(), StatusCode::kCorruption);
  EXPECT_NE(outside.message().find("lies outside its 10 elements"), std::string::npos);
  EXPECT_EQ(code(doc, {{0, 0, "w", 0, 6}}, 0, 1).code(), StatusCode::kCorruption);  // 1.5 floats
  EXPECT_EQ(code({{"w", {10}, "float128", "S0"}}, {}, 0, 1).message(),
            "FSDP2 DTensor 'w': unknown dtype 'float128' in /a at step 4");
  EXPECT_EQ(code({{"w", {10}, "float32", "S1"}}, {}, 0, 1).code(), StatusCode::kCorruption);
  EXPECT_EQ(code({{"w", {}, "float32", "S0"}}, {}, 0, 1).code(), StatusCode::kCorruption);
  EXPECT_EQ(code({{"w", {-1}, "float32", "S0"}}, {}, 0, 1).code(), StatusCode::kCorruption);
  Status huge = code({{"h", {1LL << 40, 1LL << 40}, "float32", "R"}}, {}, 0, 1);
  EXPECT_NE(huge.message().find("shape out of range"), std::string::npos);
  EXPECT_NE(code({doc[0], doc[0]}, {}, 0, 1).message().find("listed twice"), std::string::npos);
  EXPECT_EQ(code(doc, {}, 2, 2).code(), StatusCode::kInvalidArgument);
  Status odd = code({{"a\nb'c", {2}, "float32", "X"}}, {}, 0, 1);
  EXPECT_EQ(odd.message().find('\n'), std::string::npos);
  EXPECT_NE(odd.message().find("'a?b?c'"), std::string::npos);
}

// PlanDTensorRestore: rank 1 of 2 restores a Shard(0) [67, 32] tensor (its
// rows 34..67) on its live parameter's mesh and a Replicate() one whole on
// the parameters' one mesh (an optimizer's state before its first step).
TEST(DistTest, PlanDTensorRestoreShapesEachPieceAndPicksItsMesh) {
  const std::vector<DTensorDoc> doc = {{"w", {67, 32}, "float32", "S0"},
                                       {"m", {3}, "float32", "R"}};
  auto got = PlanDTensorRestore(doc, 1, 2, {"w"}, true, 1, true);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 2u);
  const DTensorRestore& w = (*got)[0];
  EXPECT_TRUE(w.live && w.shard && !w.plain);
  EXPECT_EQ(w.shape, (std::vector<int64_t>{67, 32}));
  EXPECT_EQ(w.local, (std::vector<int64_t>{33, 32}));
  const DTensorRestore& m = (*got)[1];
  EXPECT_TRUE(!m.live && !m.shard && !m.plain);
  EXPECT_EQ(m.local, (std::vector<int64_t>{3}));
  // One process without fully_shard: each tensor whole, as it is.
  got = PlanDTensorRestore(doc, 0, 1, {}, false, 0, true);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE((*got)[0].plain && (*got)[1].plain);
  EXPECT_EQ((*got)[0].local, (std::vector<int64_t>{67, 32}));
  // One process with fully_shard: a mesh of one, every row its own.
  got = PlanDTensorRestore(doc, 0, 1, {"w"}, true, 1, true);
  ASSERT_TRUE(got.ok());
  EXPECT_FALSE((*got)[0].plain);
  EXPECT_EQ((*got)[0].local, (std::vector<int64_t>{67, 32}));
}

TEST(DistTest, PlanDTensorRestoreRefusesWhatHasNoMeshOrNoPlacement) {
  const std::vector<DTensorDoc> doc = {{"m", {3}, "float32", "S0"}};
  Status none = PlanDTensorRestore(doc, 0, 2, {}, true, 0, true).status();
  EXPECT_EQ(none.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(none.message(),
            "tensor 'm' was saved as an FSDP2 DTensor, but the state to restore has no DTensor "
            "parameters on a 1-D mesh of 2 ranks: apply fully_shard before restore()");
  Status two = PlanDTensorRestore(doc, 0, 2, {}, true, 2, false).status();
  EXPECT_EQ(two.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(two.message(), "tensor 'm': the state to restore has DTensors on 2 different meshes; "
                           "nonstop cannot tell which one this tensor belongs to");
  EXPECT_TRUE(PlanDTensorRestore(doc, 0, 2, {"m"}, true, 2, false).ok());  // its own mesh
  EXPECT_EQ(PlanDTensorRestore({{"s", {}, "float32", "S0"}}, 0, 2, {"s"}, true, 1, true)
                .status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanDTensorRestore({{"x", {3}, "float32", "S1"}}, 0, 1, {}, false, 0, true)
                .status().code(), StatusCode::kCorruption);
}

// One rank of a Recover test: its job directory and what its hooks do.
struct FakeRank {
  RecoverRequest req;
  std::map<int64_t, std::string> bad_open, bad_disk;  // step -> error line
  std::map<int64_t, uint64_t> run;                    // step -> run id (7 otherwise)
  std::string memory_why = "no segment";              // "" : the segment holds the step
  std::string bad_memory;                             // the memory read's error, if any
  bool reshard = false;                               // a set-aside checkpoint to reshard
  // What happened.
  Status status;
  RecoverOutcome out;
  std::vector<std::string> reads;  // "disk 5", "memory 5", "peer 3"
  int reshards = 0;
};

void RunRecover(std::vector<FakeRank>& ranks) {
  RankThreads g(static_cast<int>(ranks.size()));
  g.Run([&](int r, const Gather& gather) {
    FakeRank& me = ranks[r];
    me.req.dir = "/j";
    me.req.rank = r;
    RecoverHooks h;
    h.gather = gather;
    h.reshard = [&]() -> Result<bool> {
      ++me.reshards;
      return me.reshard;
    };
    bool peer_open = false;
    h.open = [&](int64_t s, bool peer) -> Result<uint64_t> {
      peer_open = peer;
      if (me.bad_open.count(s)) return Status::Corruption(me.bad_open[s]);
      return me.run.count(s) ? me.run[s] : 7;
    };
    h.probe_memory = [&](int64_t) -> Result<std::string> { return me.memory_why; };
    h.read = [&](int64_t s, bool memory) -> Status {
      me.reads.push_back((memory ? "memory " : peer_open ? "peer " : "disk ") + std::to_string(s));
      if (memory && !me.bad_memory.empty()) return Status::IOError(me.bad_memory);
      if (!memory && me.bad_disk.count(s)) return Status::Corruption(me.bad_disk[s]);
      return Status::OK();
    };
    me.status = Recover(me.req, h, &me.out);
  });
}

std::vector<FakeRank> Fakes(const std::vector<std::vector<int64_t>>& mine) {
  std::vector<FakeRank> out(mine.size());
  for (size_t r = 0; r < mine.size(); ++r) out[r].req.mine = mine[r];
  return out;
}

TEST(DistTest, RecoverAgreesOnTheNewestCommonStepAndFallsBackTogether) {
  // Disagreement: rank 0 holds 9 too; the common steps are 5, 3. Step 5
  // fails on rank 1 alone: every rank falls back to 3, with one warning.
  auto ranks = Fakes({{9, 5, 3}, {5, 3, 1}, {5, 3}});
  ranks[1].bad_disk[5] = "crc mismatch";
  ranks[0].req.agreed = 5;
  RunRecover(ranks);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const FakeRank& f = ranks[r];
    ASSERT_TRUE(f.status.ok()) << f.status.ToString();
    EXPECT_EQ(f.out.kind, RecoverOutcome::Kind::kRestored);
    EXPECT_EQ(f.out.step, 3);
    EXPECT_EQ(f.out.source, "disk");
    EXPECT_EQ(f.out.sources, (std::vector<std::string>{"disk", "disk", "disk"}));
    EXPECT_EQ(f.reads, (std::vector<std::string>{"disk 5", "disk 3"}));
    EXPECT_EQ(f.out.memory_unused, "rank 0: no segment; rank 1: no segment; rank 2: no segment");
    std::vector<std::string> warnings{
        "nonstop: step 5 fails on rank 1: crc mismatch; all ranks fall back to step 3"};
    if (r == 0) warnings.push_back("nonstop: rank 0 restores step 3, older than the agreed step 5");
    EXPECT_EQ(f.out.warnings, warnings);
  }
  // The ranks' checkpoints of a step are of different runs: never mixed.
  ranks = Fakes({{5, 3}, {5, 3}});
  ranks[1].run[5] = 8;
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    ASSERT_TRUE(f.status.ok());
    EXPECT_EQ(f.out.step, 3);
    EXPECT_EQ(f.out.warnings, (std::vector<std::string>{
                                  "nonstop: step 5 fails on rank 0: step 5 is of run 7; rank 1: "
                                  "step 5 is of run 8; all ranks fall back to step 3"}));
  }
}

TEST(DistTest, RecoverFailsTogetherWithOneLine) {
  // Every step fails somewhere: the same error on every rank.
  auto ranks = Fakes({{5, 3}, {5, 3}});
  ranks[0].bad_disk[5] = "torn";
  ranks[1].bad_open[3] = "gone";
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    EXPECT_EQ(f.status.code(), StatusCode::kCorruption);
    EXPECT_EQ(f.status.message(), "no checkpoint every rank of /j can verify: rank 1: gone");
    EXPECT_EQ(f.out.warnings, (std::vector<std::string>{
                                  "nonstop: step 5 fails on rank 0: torn; all ranks fall back to "
                                  "step 3"}));
  }
  EXPECT_EQ(ranks[1].reads, (std::vector<std::string>{"disk 5"}));  // 3 never opened
  // A rank that cannot read its job directory: one line, on every rank.
  ranks = Fakes({{5}, {5}});
  ranks[1].req.error = "slot-1: bad header";
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    EXPECT_EQ(f.status.code(), StatusCode::kCorruption);
    EXPECT_EQ(f.status.message(), "slot-1: bad header");
    EXPECT_TRUE(f.reads.empty());
  }
  // Rank files of another world size not set aside.
  ranks = Fakes({{5}, {5}});
  ranks[0].req.foreign = true;
  RunRecover(ranks);
  for (const FakeRank& f : ranks) EXPECT_EQ(f.status.code(), StatusCode::kFailedPrecondition);
  // A step asked for that not every rank holds, and nothing to reshard.
  ranks = Fakes({{5}, {3}});
  for (FakeRank& f : ranks) f.req.step = 5;
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    EXPECT_EQ(f.status.code(), StatusCode::kNotFound);
    EXPECT_EQ(f.reshards, 1);
  }
  EXPECT_EQ(ranks[1].status.message(),
            "no checkpoint at step 5 committed on every rank of /j (rank 1 holds steps [3])");
}

TEST(DistTest, RecoverFreshReshardPeerAndMemory) {
  auto ranks = Fakes({{}, {}});
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    ASSERT_TRUE(f.status.ok());
    EXPECT_EQ(f.out.kind, RecoverOutcome::Kind::kFresh);
  }
  ranks = Fakes({{4}, {}});
  for (FakeRank& f : ranks) f.reshard = true;
  RunRecover(ranks);
  for (const FakeRank& f : ranks) EXPECT_EQ(f.out.kind, RecoverOutcome::Kind::kResharded);
  // A partner's replica of step 6 counts as rank 1's own (it takes no part
  // in the memory tier's choice); every other rank's segment holds 6.
  ranks = Fakes({{6, 2}, {2}, {6, 2}});
  ranks[1].req.peer_step = 6;
  ranks[0].memory_why = ranks[2].memory_why = "";
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    ASSERT_TRUE(f.status.ok()) << f.status.ToString();
    EXPECT_EQ(f.out.step, 6);
    EXPECT_EQ(f.out.sources, (std::vector<std::string>{"memory", "peer", "memory"}));
    EXPECT_EQ(f.out.memory_unused, "");
  }
  EXPECT_EQ(ranks[0].reads, (std::vector<std::string>{"memory 6"}));
  EXPECT_EQ(ranks[1].reads, (std::vector<std::string>{"peer 6"}));
  // One rank's memory read fails: every rank reads its disk.
  ranks = Fakes({{6}, {6}});
  ranks[0].memory_why = ranks[1].memory_why = "";
  ranks[1].bad_memory = "chunk 3: crc mismatch";
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    ASSERT_TRUE(f.status.ok());
    EXPECT_EQ(f.out.sources, (std::vector<std::string>{"disk", "disk"}));
    EXPECT_EQ(f.out.memory_unused, "rank 1: chunk 3: crc mismatch");
    EXPECT_EQ(f.reads, (std::vector<std::string>{"memory 6", "disk 6"}));
  }
  // A step asked for (the planner lists only it): no memory tier; the peer
  // replica of another step is not used.
  ranks = Fakes({{2}, {2}});
  for (FakeRank& f : ranks) f.req.step = 2, f.memory_why = "";
  ranks[1].req.peer_step = 6;
  RunRecover(ranks);
  for (const FakeRank& f : ranks) {
    ASSERT_TRUE(f.status.ok());
    EXPECT_EQ(f.out.step, 2);
    EXPECT_EQ(f.reads, (std::vector<std::string>{"disk 2"}));
  }
}

TEST(DistTest, ReshardTogetherRetriesFallsBackAndFailsTogether) {
  struct R {
    std::map<int64_t, std::string> bad;  // step -> damage line
    std::string fatal;
    bool stop_pick = false, stop_rebuild = false;  // the hook stops (Aborted: a bug, an interrupt)
    std::optional<std::string> missing;
    std::vector<std::optional<int64_t>> asked;  // max_step of each pick
    Result<std::optional<ReshardKey>> got = Status::Internal("not run");
    std::vector<std::string> warnings;
  };
  // Steps 8 and 6 of world 4, but rank 1's copy of 8 is missing: it picks 6.
  auto run = [](std::vector<R>& rs, const std::vector<std::vector<int64_t>>& steps) {
    RankThreads g(static_cast<int>(rs.size()));
    g.Run([&](int r, const Gather& gather) {
      R& me = rs[r];
      ReshardHooks h;
      h.gather = gather;
      h.missing = me.missing;
      h.pick = [&](std::optional<int64_t> max) -> Result<std::optional<ReshardPick>> {
        me.asked.push_back(max);
        if (me.stop_pick && max) return Status::Aborted("KeyboardInterrupt");
        for (int64_t s : steps[r]) {
          if (!max || s <= *max) return std::optional<ReshardPick>(ReshardPick{{4, s, 1}, "/j/world-4"});
        }
        if (steps[r].empty()) return std::optional<ReshardPick>();
        return Status::NotFound("nothing older");
      };
      h.rebuild = [&](const ReshardPick& p) -> Status {
        if (me.stop_rebuild) return Status::Aborted("KeyError: 'w'");
        if (!me.fatal.empty()) return Status::FailedPrecondition(me.fatal);
        if (me.bad.count(p.key.step)) return Status::Corruption(me.bad[p.key.step]);
        return Status::OK();
      };
      me.got = ReshardTogether("/j", 2, h, &me.warnings);
    });
  };
  std::vector<R> rs(2);
  rs[0].bad[6] = "bad crc";
  run(rs, {{8, 6, 4}, {6, 4}});
  for (const R& r : rs) {
    ASSERT_TRUE(r.got.ok()) << r.got.status().ToString();
    EXPECT_EQ(r.got.value(), (ReshardKey{4, 4, 1}));
    EXPECT_EQ(r.asked, (std::vector<std::optional<int64_t>>{std::nullopt, 6, 5}));
    EXPECT_EQ(r.warnings, (std::vector<std::string>{
                              "nonstop: resharding step 6 of /j/world-4 fails on rank 0: bad crc; "
                              "all ranks fall back to an older step"}));
  }
  rs.assign(2, R{});
  rs[1].fatal = "cannot reshard: rank-local";
  run(rs, {{8}, {8}});
  for (const R& r : rs) {
    EXPECT_EQ(r.got.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(r.got.status().message(), "cannot reshard: rank-local");
  }
  rs.assign(2, R{});
  rs[0].bad[8] = rs[1].bad[8] = "torn";
  run(rs, {{8}, {8}});
  for (const R& r : rs) {
    EXPECT_EQ(r.got.status().code(), StatusCode::kNotFound);
    EXPECT_EQ(r.got.status().message(),
              "resharding step 8 of /j/world-4 fails on rank 0: torn; rank 1: torn; then: "
              "nothing older");
  }
  // From peers' memory: rank 1 found old rank 3's file on no peer (a
  // warning there); the error names it on every rank.
  rs.assign(2, R{});
  rs[0].bad[8] = "torn";
  rs[0].missing = "";
  rs[1].missing = "old rank 3: on no peer";
  run(rs, {{8}, {8}});
  for (const R& r : rs) {
    EXPECT_EQ(r.got.status().code(), StatusCode::kNotFound);
    EXPECT_EQ(r.got.status().message(),
              "resharding step 8 of /j/world-4 fails on rank 0: torn; then: nothing older; not "
              "on any surviving peer either: rank 1: old rank 3: on no peer");
  }
  EXPECT_EQ(rs[1].warnings.front(),
            "nonstop: resharding from peers' memory: old rank 3: on no peer; the reshard reads "
            "the disk for them");
  EXPECT_EQ(rs[0].warnings.size(), 1u);  // the fallback's line only
  rs.assign(2, R{});
  run(rs, {{}, {}});
  for (const R& r : rs) {
    ASSERT_TRUE(r.got.ok());
    EXPECT_FALSE(r.got->has_value());
  }
  // A hook that stops on one rank (a bug, an interrupt) stops every rank in
  // the same round: that rank returns its own (Aborted: its exception is
  // raised), the others an error naming it; none waits for a round the
  // stopped rank never takes part in (before, rank 0 waited forever here).
  rs.assign(2, R{});
  rs[1].stop_rebuild = true;
  run(rs, {{8}, {8}});
  EXPECT_EQ(rs[1].got.status().code(), StatusCode::kAborted);
  EXPECT_EQ(rs[1].got.status().message(), "KeyError: 'w'");
  EXPECT_EQ(rs[0].got.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(rs[0].got.status().message(), "the reshard stopped on another rank: KeyError: 'w'");
  // The same in a pick (the second: after a fallback from step 8).
  rs.assign(2, R{});
  rs[0].bad[8] = "torn";
  rs[0].stop_pick = true;
  run(rs, {{8, 6}, {8, 6}});
  EXPECT_EQ(rs[0].got.status().code(), StatusCode::kAborted);
  EXPECT_EQ(rs[0].got.status().message(), "KeyboardInterrupt");
  EXPECT_EQ(rs[1].got.status().code(), StatusCode::kInternal);
  EXPECT_EQ(rs[1].got.status().message(),
            "resharding step 8 of /j/world-4 fails on rank 0: torn; then: the reshard stopped on "
            "another rank: KeyboardInterrupt");
}

}  // namespace
}  // namespace nonstop::dist
