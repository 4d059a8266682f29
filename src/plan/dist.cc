// The decisions of a distributed restart (include/nonstop/dist.h): pure, on
// the data the ranks gathered.
#include "nonstop/dist.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <set>
#include <utility>

#include "nonstop/crc32c.h"
#include "nonstop/types.h"

namespace nonstop::dist {
namespace {

// "rank 0: a; rank 2: b" of the ranks that have a line.
std::string PerRank(const std::vector<std::optional<std::string>>& lines) {
  std::string out;
  for (size_t r = 0; r < lines.size(); ++r) {
    if (!lines[r]) continue;
    if (!out.empty()) out += "; ";
    out += "rank " + std::to_string(r) + ": " + *lines[r];
  }
  return out;
}

// Python's repr of a plain name: 'name'.
std::string Quoted(const std::string& s) { return "'" + s + "'"; }

// A name a hostile file wrote, quoted on one line: control characters and
// quotes become '?', and at most 200 bytes are kept.
std::string Printable(const std::string& s) {
  std::string out = s.substr(0, 200);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == '\'' || c == 0x7f) c = '?';
  }
  return Quoted(out) + (s.size() > 200 ? "..." : "");
}

std::string StepList(const std::vector<int64_t>& steps) {
  if (steps.empty()) return "none";
  std::string out = "[";
  for (size_t i = 0; i < steps.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(steps[i]);
  }
  return out + "]";
}

// A gathered text: its fields, each null ("-") or "+LEN:BYTES" (any bytes).
std::string Encode(const Fields& fields) {
  std::string out;
  for (const auto& f : fields) out += f ? "+" + std::to_string(f->size()) + ":" + *f : "-";
  return out;
}

Result<Fields> Decode(const std::string& text, size_t n) {
  Fields out;
  size_t at = 0;
  while (at < text.size() && out.size() < n) {
    if (text[at] == '-') {
      out.emplace_back(), ++at;
      continue;
    }
    const size_t colon = text.find(':', at);
    if (text[at] != '+' || colon == std::string::npos || colon == at + 1 || colon - at > 20) break;
    const std::string digits = text.substr(at + 1, colon - at - 1);
    if (digits.find_first_not_of("0123456789") != std::string::npos) break;
    const uint64_t len = std::stoull(digits);
    if (len > text.size() - colon - 1) break;
    out.push_back(text.substr(colon + 1, len));
    at = colon + 1 + len;
  }
  if (out.size() != n || at != text.size()) {
    return Status::Corruption("a rank's gathered text does not parse: " +
                              text.substr(0, std::min<size_t>(text.size(), 80)));
  }
  return out;
}

// An unsigned number of a gathered field (a run id).
Result<uint64_t> NumberOf(const std::optional<std::string>& f) {
  if (!f || f->empty() || f->size() > 20 || f->find_first_not_of("0123456789") != std::string::npos) {
    return Status::Corruption("a rank's gathered number does not parse");
  }
  errno = 0;
  const unsigned long long v = std::strtoull(f->c_str(), nullptr, 10);
  if (errno != 0) return Status::Corruption("a rank's gathered number does not parse");
  return v;
}

}  // namespace

Result<std::vector<Fields>> GatherFields(const Gather& gather, const Fields& mine) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> texts, gather(Encode(mine)));
  std::vector<Fields> every;
  for (const std::string& t : texts) {
    NONSTOP_ASSIGN_OR_RETURN(Fields f, Decode(t, mine.size()));
    every.push_back(std::move(f));
  }
  return every;
}

std::optional<std::string> ErrorLine(const Status& s) {
  if (s.ok()) return std::nullopt;
  return s.message().empty() ? s.ToString() : s.message();
}

// What the other ranks are told of a hook that stopped on this one.
std::string StoppedLine(const Status& s) {
  return "the reshard stopped on another rank: " + *ErrorLine(s);
}

std::string StepsText(const std::vector<int64_t>& steps) {
  std::string out;
  for (int64_t s : steps) out += (out.empty() ? "" : " ") + std::to_string(s);
  return out;
}

Result<std::vector<int64_t>> StepsOf(const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(' ', at);
    if (end == std::string::npos) end = text.size();
    const std::string one = text.substr(at, end - at);
    char* stop = nullptr;
    errno = 0;
    const long long v = std::strtoll(one.c_str(), &stop, 10);
    if (one.empty() || *stop != '\0' || errno != 0) {
      return Status::Corruption("a rank's gathered steps do not parse: " + one);
    }
    out.push_back(v);
    at = end + 1;
  }
  return out;
}

Status JoinErrors(const std::vector<std::optional<RankError>>& every) {
  const RankError* first = nullptr;
  bool same = true;
  std::vector<std::optional<std::string>> lines(every.size());
  for (size_t r = 0; r < every.size(); ++r) {
    if (!every[r]) continue;
    if (!first) first = &*every[r];
    same = same && every[r]->message == first->message;
    lines[r] = every[r]->message;
  }
  if (!first) return Status::OK();
  return Status(first->code, same ? first->message : PerRank(lines));
}

AgreementRounds::Step AgreementRounds::OnRound(const std::vector<RoundOffer>& every,
                                               std::optional<int64_t> agreed, double now_s) {
  ++rounds;
  if (!last_t_) last_t_ = now_s;
  Step out;
  std::vector<AgreeOffer> offers;
  bool closing = !every.empty();
  for (const RoundOffer& r : every) {
    offers.push_back(r.offer);
    closing = closing && r.stopping;
  }
  const AgreeDecision d = DecideAgreement(offers);
  if (d.kind == AgreeDecision::Kind::kPin) {
    if (!agreed || d.step > *agreed) {
      out.kind = Step::Kind::kPin;
      agreed = d.step;
    } else {  // agreed already: keep a newer one
      out.kind = Step::Kind::kAim;
      out.aim = d.step + 1;
    }
  } else if (d.kind == AgreeDecision::Kind::kAim) {
    out.kind = Step::Kind::kAim;
    out.aim = d.step;
  }
  if (closing) {
    // Nothing is in flight and nothing more will be written, so the newest
    // checkpoint every rank committed stays intact even where its slot was
    // not kept: agree on it.
    out.close = true;
    const int64_t last = every.front().newest;
    bool same = true;
    for (const RoundOffer& r : every) same = same && r.newest == last;
    if (same && last >= 0 && last > agreed.value_or(-1)) out.close_step = last;
  }
  return out;
}

Result<bool> AgreementRounds::Round(const Hooks& h, bool stopping,
                                    std::optional<int64_t> agreed) {
  NONSTOP_ASSIGN_OR_RETURN(const AgreeOffer offer, h.offer());
  std::optional<std::pair<uint64_t, int64_t>> newest;
  if (stopping) {
    NONSTOP_ASSIGN_OR_RETURN(newest, h.latest());
  }
  Result<std::vector<std::vector<int64_t>>> got =
      h.gather({offer.candidate, offer.committed, offer.started, stopping ? 1 : 0,
                newest ? newest->second : -1});
  if (!got.ok()) return got.status();
  std::vector<RoundOffer> every;
  for (const std::vector<int64_t>& g : got.value()) {
    if (g.size() != 5) return Status::InvalidArgument("a round offer has 5 fields");
    RoundOffer r;
    r.offer.candidate = g[0];
    r.offer.committed = g[1];
    r.offer.started = g[2];
    r.stopping = g[3] != 0;
    r.newest = g[4];
    every.push_back(r);
  }
  const Step s = OnRound(every, agreed, h.now());
  if (s.kind == Step::Kind::kPin) {
    if (Status st = h.pin(offer.counter); !st.ok()) return st;
    if (Status st = h.record(offer.counter, offer.candidate); !st.ok()) return st;
    Pinned(h.now());
  } else if (s.kind == Step::Kind::kAim) {
    Result<bool> dropped = h.aim(s.aim);
    if (!dropped.ok()) return dropped.status();
    if (dropped.value()) Dropped();
  }
  if (!s.close) return false;
  if (s.close_step >= 0 && newest) {  // every rank is closing: record the newest all committed
    NONSTOP_ASSIGN_OR_RETURN(const std::optional<uint64_t> cand, h.candidate());
    if (cand == newest->first) {
      if (Status st = h.pin(newest->first); !st.ok()) return st;
    }
    if (Status st = h.record(newest->first, s.close_step); !st.ok()) return st;
  }
  return true;
}

void AgreementRounds::Pinned(double now_s) {
  ++agreements;
  drops_in_row_ = 0;
  if (last_t_) max_gap_s_ = std::max(max_gap_s_, now_s - *last_t_);
  last_t_ = now_s;
}

void AgreementRounds::Dropped() {
  ++candidate_drops;
  max_drops_in_row = std::max(max_drops_in_row, ++drops_in_row_);
}

double AgreementRounds::MaxGap(std::optional<double> now_s) {
  if (now_s && last_t_) max_gap_s_ = std::max(max_gap_s_, *now_s - *last_t_);
  return max_gap_s_;
}

Status CheckWorld(const std::string& replicated, int rank, int world, bool initialized,
                  int dist_rank, int dist_world) {
  if (replicated != "shard" && replicated != "rank0") {
    return Status::InvalidArgument("replicated must be one of shard, rank0, got " +
                                   Printable(replicated));
  }
  if (!initialized) {
    return Status::Unavailable("world_size=" + std::to_string(world) +
                               " needs torch.distributed initialised "
                               "(torch.distributed.init_process_group, or run under torchrun)");
  }
  if (dist_world != world || dist_rank != rank) {
    return Status::InvalidArgument(
        "rank " + std::to_string(rank) + " of world size " + std::to_string(world) +
        " given, but torch.distributed says rank " + std::to_string(dist_rank) + " of " +
        std::to_string(dist_world));
  }
  return Status::OK();
}

std::vector<ShardRange> Shard(const std::vector<ShardInput>& tensors, int rank, int world) {
  std::vector<ShardRange> out;
  const auto r = static_cast<uint64_t>(rank), w = static_cast<uint64_t>(std::max(world, 1));
  for (const ShardInput& t : tensors) {
    if (t.rank0 || t.numel < kMinShardNumel || !t.contiguous) {
      const uint64_t owner = t.rank0 ? 0 : Crc32c(t.name.data(), t.name.size()) % w;
      if (owner == r) out.push_back({t.name, 0, t.numel, true});
      continue;
    }
    const uint64_t per = (t.numel + w - 1) / w;
    const uint64_t begin = std::min(r * per, t.numel), end = std::min((r + 1) * per, t.numel);
    if (begin < end) out.push_back({t.name, begin, end, false});
  }
  return out;
}

Result<std::vector<int64_t>> ZeroGlobalIds(const std::vector<int64_t>& index,
                                           const std::vector<int64_t>& params,
                                           const std::vector<int64_t>& state_ids,
                                           const std::string& where) {
  std::vector<int64_t> sorted = params;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.size() != index.size() ||
      std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return Status::Corruption(where + ": the ZeRO layout indexes " + std::to_string(index.size()) +
                              " parameters, the saved optimizer has " +
                              std::to_string(params.size()) + " (or repeats one)");
  }
  std::vector<int64_t> out;
  for (int64_t id : state_ids) {
    auto it = std::lower_bound(sorted.begin(), sorted.end(), id);
    if (it == sorted.end() || *it != id) {
      return Status::Corruption(where + ": the saved optimizer state names parameter " +
                                std::to_string(id) + ", which no param_group holds");
    }
    out.push_back(index[static_cast<size_t>(it - sorted.begin())]);
  }
  return out;
}

std::vector<int64_t> CommonSteps(const std::vector<std::vector<int64_t>>& every) {
  std::vector<int64_t> out;
  if (every.empty()) return out;
  std::vector<std::set<int64_t>> held;
  for (size_t r = 1; r < every.size(); ++r) held.emplace_back(every[r].begin(), every[r].end());
  std::set<int64_t> seen;
  for (int64_t s : every[0]) {
    if (!seen.insert(s).second) continue;
    if (std::all_of(held.begin(), held.end(), [&](const auto& h) { return h.count(s) > 0; })) {
      out.push_back(s);
    }
  }
  return out;
}

Status NoCommonStep(const std::string& dir, int rank, std::optional<int64_t> step,
                    const std::vector<std::vector<int64_t>>& every) {
  const bool any = std::any_of(every.begin(), every.end(), [](const auto& e) { return !e.empty(); });
  if (!any && !step) return Status::OK();
  const std::vector<int64_t> none;
  const auto& mine = rank >= 0 && static_cast<size_t>(rank) < every.size() ? every[rank] : none;
  return Status::NotFound(
      "no " + (step ? "checkpoint at step " + std::to_string(*step) : std::string("checkpoint")) +
      " committed on every rank of " + dir + " (rank " + std::to_string(rank) + " holds steps " +
      StepList(mine) + ")");
}

Status CheckForeign(const std::string& dir, int world, const std::vector<bool>& every) {
  if (std::none_of(every.begin(), every.end(), [](bool b) { return b; })) return Status::OK();
  return Status::FailedPrecondition(
      dir + " holds rank files written by a job of another world size; this job has world size " +
      std::to_string(world) +
      " and the old rank files were not set aside for resharding: open the directory with "
      "nonstop.Checkpointer (it moves them to world-W/ and restore() reshards), restart with "
      "their world size, or reshard through DCP (nonstop export --format dcp)");
}

Result<std::string> DecideRecoverStep(const std::string& dir, const std::vector<int64_t>& order,
                                      size_t n, const std::vector<StepRead>& every) {
  if (n >= order.size()) return Status::Internal("DecideRecoverStep: no step #" + std::to_string(n));
  const int64_t s = order[n];
  std::vector<std::optional<std::string>> bad(every.size());
  bool any = false;
  for (size_t r = 0; r < every.size(); ++r) {
    if (every[r].error) bad[r] = every[r].error, any = true;
  }
  if (!any) {
    bool mixed = false;
    for (const StepRead& e : every) mixed = mixed || e.run_id != every.front().run_id;
    if (!mixed) return std::string();
    // Same step, different runs (a rank crashed before recording a rollback
    // the others recorded): never mixed.
    for (size_t r = 0; r < every.size(); ++r) {
      bad[r] = "step " + std::to_string(s) + " is of run " + std::to_string(every[r].run_id);
    }
  }
  const std::string where = PerRank(bad);
  if (n + 1 == order.size()) {
    return Status::Corruption("no checkpoint every rank of " + dir + " can verify: " + where);
  }
  return "nonstop: step " + std::to_string(s) + " fails on " + where +
         "; all ranks fall back to step " + std::to_string(order[n + 1]);
}

MemoryChoice DecideMemory(const std::vector<std::optional<std::string>>& whys) {
  MemoryChoice c;
  bool taking_part = false;
  std::vector<std::optional<std::string>> lines(whys.size());
  for (size_t r = 0; r < whys.size(); ++r) {
    if (!whys[r]) continue;
    if (whys[r]->empty()) {
      taking_part = true;
    } else {
      lines[r] = whys[r];
    }
  }
  c.unused = PerRank(lines);
  c.use = taking_part && c.unused.empty();
  return c;
}

Result<ReshardAgreement::Next> ReshardAgreement::OnPicks(const std::vector<Pick>& every) {
  std::vector<std::optional<RankError>> errs;
  for (const Pick& p : every) errs.push_back(p.error);
  Status st = JoinErrors(errs);
  if (!st.ok()) {
    if (failed_.empty()) return st;
    std::string then;
    for (const auto& f : failed_) then += (then.empty() ? "" : "; ") + f;
    return Status(st.code(), then + "; then: " + st.message());
  }
  const Pick* seen = nullptr;
  std::optional<size_t> blind;
  for (size_t r = 0; r < every.size(); ++r) {
    if (every[r].key && !seen) seen = &every[r];
    if (!every[r].key && !blind) blind = r;
  }
  if (!seen) {
    if (failed_.empty()) return Next::kNone;
    // Cannot happen: an older step that is gone is an error above.
    std::string all;
    for (const auto& f : failed_) all += (all.empty() ? "" : "; ") + f;
    return Status::Corruption(all);
  }
  if (blind) {
    return Status::FailedPrecondition(
        "rank " + std::to_string(seen - every.data()) + " finds a checkpoint of world size " +
        std::to_string(seen->key->old_world) + " in " + dir_ + " but rank " +
        std::to_string(*blind) + " does not: resharding to world size " + std::to_string(world_) +
        " needs every old rank file visible to every rank (a shared file system, or copies)");
  }
  int64_t low = seen->key->step;
  bool same = true, steps_differ = false;
  for (const Pick& p : every) {
    low = std::min(low, p.key->step);
    same = same && *p.key == *seen->key;
  }
  if (!same) {
    // The ranks see different choices (their copies differ): all try again
    // at or below the oldest one, then below it.
    for (const Pick& p : every) steps_differ = steps_differ || p.key->step != low;
    max_step_ = steps_differ ? low : low - 1;
    return Next::kRetry;
  }
  key_ = *seen->key;
  return Next::kProceed;
}

Result<ReshardAgreement::Next> ReshardAgreement::OnRebuilt(const std::vector<Rebuilt>& every,
                                                           const std::string& archive) {
  warning_.clear();
  std::vector<std::optional<std::string>> bad(every.size());
  bool any = false;
  for (size_t r = 0; r < every.size(); ++r) {
    if (every[r].fatal) return Status::FailedPrecondition(*every[r].fatal);
    if (every[r].error) bad[r] = every[r].error, any = true;
  }
  if (!any) return Next::kDone;
  const std::string line = "resharding step " + std::to_string(key_.step) + " of " + archive +
                           " fails on " + PerRank(bad);
  failed_.push_back(line);
  warning_ = "nonstop: " + line + "; all ranks fall back to an older step";
  max_step_ = key_.step - 1;
  return Next::kRetry;
}

Status CheckReshardable(const std::string& archive, int old_world, int world,
                        const std::vector<std::string>& local,
                        const std::vector<std::string>& zero_keys,
                        const std::vector<std::string>& live_zero) {
  if (old_world == world) return Status::OK();
  if (!local.empty()) {
    return Status::FailedPrecondition(
        "cannot reshard " + archive + " (world size " + std::to_string(old_world) +
        ") to world size " + std::to_string(world) + ": state " + Quoted(local.front()) +
        " is rank-local (local=...), a partition only its own rank knows");
  }
  for (const std::string& k : live_zero) {
    if (std::find(zero_keys.begin(), zero_keys.end(), k) != zero_keys.end()) continue;
    return Status::FailedPrecondition(
        "cannot reshard the ZeroRedundancyOptimizer state " + Quoted(k) + " of " + archive +
        ": it was written without the layout resharding needs (an older nonstop)");
  }
  return Status::OK();
}

Result<SharedLayout> LayOutShared(const std::vector<SharedTensor>& shared,
                                  const std::vector<Piece>& pieces, bool complete,
                                  const std::string& where, int64_t step) {
  constexpr uint64_t kMaxBytes = uint64_t{1} << 62;
  constexpr uint64_t kAlign = 64;  // every tensor's offset: a view of any dtype fits
  const std::string at = " at step " + std::to_string(step);
  struct Info {
    size_t index;
    uint64_t itemsize;
  };
  std::vector<const SharedTensor*> sorted;
  for (const SharedTensor& t : shared) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const SharedTensor* a, const SharedTensor* b) { return a->name < b->name; });
  SharedLayout out;
  std::map<std::string, Info> by_name;
  for (const SharedTensor* t : sorted) {
    DType dt;
    if (!ParseDType(t->dtype, &dt)) {
      return Status::FailedPrecondition("unknown dtype " + Quoted(t->dtype) +
                                        " in a distributed checkpoint");
    }
    uint64_t n = DTypeSize(dt);
    for (int64_t d : t->shape) {
      if (d < 0 || (d > 0 && n > kMaxBytes / static_cast<uint64_t>(d))) {
        return Status::Corruption("tensor " + Quoted(t->name) + ": shape out of range in " +
                                  where + at);
      }
      n *= static_cast<uint64_t>(d);
    }
    if (out.total > kMaxBytes - n || !by_name.emplace(t->name, Info{out.tensors.size(),
                                                                     DTypeSize(dt)}).second) {
      return Status::Corruption("tensor " + Quoted(t->name) + ": size out of range in " + where +
                                at);
    }
    out.total = (out.total + kAlign - 1) / kAlign * kAlign;
    out.tensors.push_back({t->name, out.total, n});
    out.total += n;
  }
  // Per tensor: its pieces' byte ranges, to check they neither overlap nor leave a gap.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ranges(out.tensors.size());
  for (const Piece& p : pieces) {
    auto it = by_name.find(p.name);
    if (it == by_name.end()) continue;
    const SharedLayout::Tensor& t = out.tensors[it->second.index];
    const uint64_t item = it->second.itemsize;
    if (p.nbytes % item != 0 || p.global_offset > t.nbytes / item ||
        p.nbytes > t.nbytes - p.global_offset * item) {
      return Status::Corruption("tensor " + Quoted(p.name) + ": rank " + std::to_string(p.rank) +
                                "'s piece (" + std::to_string(p.nbytes) + " bytes at element " +
                                std::to_string(p.global_offset) + ") lies outside its " +
                                std::to_string(t.nbytes) + " bytes in " + where + at);
    }
    const uint64_t off = p.global_offset * item;
    if (p.nbytes) ranges[it->second.index].emplace_back(off, off + p.nbytes);
    out.copies.push_back({p.rank, p.handle, t.offset + off, p.nbytes});
  }
  for (size_t i = 0; i < ranges.size(); ++i) {
    auto& rs = ranges[i];
    std::sort(rs.begin(), rs.end());
    uint64_t held = 0, reach = 0;
    for (const auto& [b, e] : rs) {
      if (b < reach) {
        return Status::Corruption("tensor " + Quoted(out.tensors[i].name) +
                                  ": pieces of the rank files of " + where + " overlap" + at);
      }
      held += e - b;
      reach = e;
    }
    if (complete && held != out.tensors[i].nbytes) {
      return Status::Corruption("tensor " + Quoted(out.tensors[i].name) +
                                ": the old rank files of " + where + " hold " +
                                std::to_string(held) + " of its " +
                                std::to_string(out.tensors[i].nbytes) + " bytes" + at);
    }
  }
  return out;
}

std::pair<int64_t, int64_t> ShardRows(int64_t d0, int rank, int world) {
  if (d0 <= 0 || world <= 0 || rank < 0 || rank >= world) return {0, 0};
  const int64_t per = d0 / world + (d0 % world != 0);
  return {std::min<int64_t>(rank * per, d0), std::min<int64_t>((rank + 1) * per, d0)};
}

Result<std::string> DTensorPlacement(const std::string& name, int mesh_ndim,
                                     const std::vector<int64_t>& mesh_ranks,
                                     const std::string& mesh_text, const std::string& placement,
                                     int world) {
  bool all = mesh_ndim == 1 && mesh_ranks.size() == static_cast<size_t>(std::max(world, 0));
  for (size_t r = 0; all && r < mesh_ranks.size(); ++r) all = mesh_ranks[r] == static_cast<int64_t>(r);
  if (!all) {
    return Status::InvalidArgument(
        "tensor " + Printable(name) + " is a DTensor on mesh " + mesh_text.substr(0, 200) +
        ": nonstop handles DTensors on a 1-D mesh over all " + std::to_string(world) +
        " ranks (FSDP2 fully_shard); HSDP and 2-D meshes are not supported yet");
  }
  if (placement != "S0" && placement != "R") {
    return Status::InvalidArgument("tensor " + Printable(name) + " is a DTensor placed " +
                                   placement.substr(0, 80) +
                                   ": nonstop handles Shard(0) (FSDP2's default) and Replicate() "
                                   "placements only");
  }
  return placement;
}

Result<ShardPiece> ShardPieceOf(const std::string& name, const std::vector<int64_t>& shape,
                                int rank, int world,
                                const std::optional<std::vector<int64_t>>& local) {
  auto list = [](const std::vector<int64_t>& v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "]";
  };
  if (shape.empty()) {
    return Status::InvalidArgument("tensor " + Printable(name) +
                                   ": a Shard(0) DTensor of no dimension");
  }
  const auto [begin, end] = ShardRows(shape[0], rank, world);
  ShardPiece p{shape, 0};
  p.shape[0] = end - begin;
  uint64_t row = 1;
  for (size_t i = 1; i < shape.size(); ++i) {
    row *= static_cast<uint64_t>(std::max<int64_t>(shape[i], 0));
  }
  p.offset = static_cast<uint64_t>(begin) * row;
  if (local && *local != p.shape) {
    return Status::InvalidArgument(
        "tensor " + Printable(name) + ": rank " + std::to_string(rank) +
        "'s Shard(0) piece has shape " + list(*local) + ", not " + list(p.shape) + " (rows " +
        std::to_string(begin) + ".." + std::to_string(end) + " of " + list(shape) +
        "): nonstop expects torch.chunk's split of dim 0");
  }
  return p;
}

Result<DTensorReshard> PlanDTensorReshard(const std::vector<DTensorDoc>& doc,
                                          const std::vector<Piece>& pieces, int rank, int world,
                                          const std::string& where, int64_t step) {
  constexpr uint64_t kMaxBytes = uint64_t{1} << 62;
  constexpr uint64_t kAlign = 64;
  const std::string at = " in " + where + " at step " + std::to_string(step);
  if (world <= 0 || rank < 0 || rank >= world) {
    return Status::InvalidArgument("cannot reshard to rank " + std::to_string(rank) +
                                   " of world size " + std::to_string(world));
  }
  struct Info {
    uint64_t item = 0, numel = 0;
    uint64_t begin = 0, end = 0;  // this rank's elements
    std::vector<std::pair<uint64_t, uint64_t>> held;  // the old pieces' elements
    uint64_t filled = 0;
  };
  DTensorReshard out;
  std::vector<Info> info(doc.size());
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < doc.size(); ++i) {
    const DTensorDoc& d = doc[i];
    const std::string what = "FSDP2 DTensor " + Printable(d.name);
    DType dt;
    if (!ParseDType(d.dtype, &dt)) {
      return Status::Corruption(what + ": unknown dtype " + Printable(d.dtype) + at);
    }
    const bool s0 = d.placement == "S0";
    if (!s0 && d.placement != "R") {
      return Status::Corruption(what + ": unknown placement " + Printable(d.placement) +
                                " (not S0 or R)" + at);
    }
    if (s0 && d.shape.empty()) return Status::Corruption(what + ": Shard(0) of a 0-dim tensor" + at);
    Info& t = info[i];
    t.item = DTypeSize(dt);
    t.numel = 1;
    for (int64_t n : d.shape) {
      if (n < 0 || (n > 0 && t.numel > kMaxBytes / t.item / static_cast<uint64_t>(n))) {
        return Status::Corruption(what + ": shape out of range" + at);
      }
      t.numel *= static_cast<uint64_t>(n);
    }
    if (!by_name.emplace(d.name, i).second) return Status::Corruption(what + " listed twice" + at);
    std::vector<int64_t> shape = d.shape;
    t.end = t.numel;
    if (s0) {
      const auto [b, e] = ShardRows(shape[0], rank, world);
      const uint64_t inner = shape[0] ? t.numel / static_cast<uint64_t>(shape[0]) : 0;
      t.begin = static_cast<uint64_t>(b) * inner;
      t.end = static_cast<uint64_t>(e) * inner;
      shape[0] = e - b;
    }
    const uint64_t nbytes = (t.end - t.begin) * t.item;
    out.total = (out.total + kAlign - 1) / kAlign * kAlign;
    if (out.total > kMaxBytes - nbytes) return Status::Corruption(what + ": size out of range" + at);
    out.tensors.push_back({d.name, d.dtype, std::move(shape), out.total, nbytes});
    out.total += nbytes;
  }
  for (const Piece& p : pieces) {
    auto it = by_name.find(p.name);
    if (it == by_name.end()) continue;
    Info& t = info[it->second];
    if (p.nbytes % t.item != 0 || p.global_offset > t.numel ||
        p.nbytes / t.item > t.numel - p.global_offset) {
      return Status::Corruption("FSDP2 DTensor " + Printable(p.name) + ": rank " +
                                std::to_string(p.rank) + "'s piece (" + std::to_string(p.nbytes) +
                                " bytes at element " + std::to_string(p.global_offset) +
                                ") lies outside its " + std::to_string(t.numel) + " elements" + at);
    }
    const uint64_t g0 = p.global_offset, g1 = g0 + p.nbytes / t.item;
    if (g0 < g1) t.held.emplace_back(g0, g1);
    const uint64_t lo = std::max(t.begin, g0), hi = std::min(t.end, g1);
    if (lo >= hi) continue;
    t.filled += hi - lo;
    out.copies.push_back({p.rank, p.handle, (lo - g0) * t.item,
                          out.tensors[it->second].offset + (lo - t.begin) * t.item,
                          (hi - lo) * t.item});
  }
  for (size_t i = 0; i < doc.size(); ++i) {
    Info& t = info[i];
    std::sort(t.held.begin(), t.held.end());
    for (size_t k = 1; k < t.held.size(); ++k) {
      if (t.held[k].first < t.held[k - 1].second) {
        return Status::Corruption("FSDP2 DTensor " + Printable(doc[i].name) +
                                  ": pieces of the old rank files overlap" + at);
      }
    }
    if (t.filled != t.end - t.begin) {
      return Status::FailedPrecondition(
          "tensor " + Printable(doc[i].name) + ": the old rank files hold " +
          std::to_string(t.filled) + " of elements " + std::to_string(t.begin) + ".." +
          std::to_string(t.end) + at + "; some rank file is missing or incomplete");
    }
  }
  return out;
}

Result<std::vector<DTensorRestore>> PlanDTensorRestore(const std::vector<DTensorDoc>& doc,
                                                       int rank, int world,
                                                       const std::vector<std::string>& live,
                                                       bool any_mesh, int meshes, bool same) {
  const std::set<std::string> on_live(live.begin(), live.end());
  std::vector<DTensorRestore> out;
  for (const DTensorDoc& d : doc) {
    DTensorRestore r{d.name, false, on_live.count(d.name) > 0, d.placement == "S0", d.shape,
                     d.shape};
    if (!r.shard && d.placement != "R") {
      return Status::Corruption("FSDP2 DTensor " + Printable(d.name) + ": unknown placement " +
                                Printable(d.placement) + " (not S0 or R)");
    }
    r.plain = world == 1 && !any_mesh && !r.live;
    if (!r.plain && !r.live && meshes == 0) {
      return Status::InvalidArgument(
          "tensor " + Printable(d.name) + " was saved as an FSDP2 DTensor, but the state to "
          "restore has no DTensor parameters on a 1-D mesh of " + std::to_string(world) +
          " ranks: apply fully_shard before restore()");
    }
    if (!r.plain && !r.live && !same) {
      return Status::InvalidArgument("tensor " + Printable(d.name) + ": the state to restore "
                                     "has DTensors on " + std::to_string(meshes) +
                                     " different meshes; nonstop cannot tell which one this "
                                     "tensor belongs to");
    }
    if (r.shard && !r.plain) {
      NONSTOP_ASSIGN_OR_RETURN(ShardPiece p, ShardPieceOf(d.name, d.shape, rank, world));
      r.local = p.shape;
    }
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

std::vector<std::optional<std::string>> Column(const std::vector<Fields>& every, size_t i) {
  std::vector<std::optional<std::string>> out;
  for (const Fields& f : every) out.push_back(f[i]);
  return out;
}

bool Aborted(const Status& s) { return s.code() == StatusCode::kAborted; }

}  // namespace

Result<std::vector<std::vector<int64_t>>> GatherPlannedSteps(
    const Gather& gather, const std::string& dir, const std::optional<std::string>& error,
    bool foreign, const std::vector<int64_t>& mine) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<Fields> first,
                           GatherFields(gather, {error, foreign ? "1" : "0", StepsText(mine)}));
  std::vector<std::optional<RankError>> errors;
  std::vector<bool> foreigns;
  std::vector<std::vector<int64_t>> every;
  for (const Fields& f : first) {
    errors.push_back(f[0] ? std::optional<RankError>(RankError{StatusCode::kCorruption, *f[0]})
                          : std::nullopt);
    foreigns.push_back(f[1] == "1");
    NONSTOP_ASSIGN_OR_RETURN(std::vector<int64_t> steps, StepsOf(f[2].value_or("")));
    every.push_back(std::move(steps));
  }
  NONSTOP_RETURN_IF_ERROR(JoinErrors(errors));
  NONSTOP_RETURN_IF_ERROR(CheckForeign(dir, static_cast<int>(first.size()), foreigns));
  return every;
}

Status Recover(const RecoverRequest& req, const RecoverHooks& hooks, RecoverOutcome* result) {
  RecoverOutcome& out = *result;
  out = RecoverOutcome{};
  // A partner's replica counts as this rank's own step, in the planner's
  // order (newest first), unless the job directory holds that step too.
  std::vector<int64_t> mine = req.mine;
  std::optional<int64_t> peer = req.peer_step;
  if (peer && ((req.step && *req.step != *peer) ||
               std::find(mine.begin(), mine.end(), *peer) != mine.end())) {
    peer.reset();
  }
  if (peer) {
    mine.insert(std::find_if(mine.begin(), mine.end(), [&](int64_t m) { return m < *peer; }),
                *peer);
  }
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::vector<int64_t>> every,
                           GatherPlannedSteps(hooks.gather, req.dir, req.error, req.foreign, mine));
  if (hooks.check) NONSTOP_RETURN_IF_ERROR(hooks.check());
  const std::vector<int64_t> order = CommonSteps(every);
  if (order.empty()) {
    // Nothing this world size committed on every rank: a set-aside
    // checkpoint of another world size, resharded; or a fresh start.
    NONSTOP_ASSIGN_OR_RETURN(bool resharded, hooks.reshard());
    if (!resharded) NONSTOP_RETURN_IF_ERROR(NoCommonStep(req.dir, req.rank, req.step, every));
    out.kind = resharded ? RecoverOutcome::Kind::kResharded : RecoverOutcome::Kind::kFresh;
    return Status::OK();
  }
  for (size_t n = 0; n < order.size(); ++n) {
    const int64_t s = order[n];
    const bool from_peer = peer && s == *peer;
    Result<uint64_t> opened = hooks.open(s, from_peer);
    if (Aborted(opened.status())) return opened.status();
    std::optional<std::string> err = ErrorLine(opened.status());
    std::string source = from_peer ? "peer" : "disk";
    if (n == 0 && !req.step) {  // every rank takes this branch, or none
      // The memory tier, all or none: every rank's segment holds exactly
      // the checkpoint of step s the job directory selects, and every rank
      // read it; else every rank reads its disk (never mixed). A rank that
      // restores a partner's replica takes no part.
      std::optional<std::string> why;
      if (!from_peer && err) {
        why = "the disk's checkpoint of step " + std::to_string(s) + ": " + *err;
      } else if (!from_peer) {
        Result<std::string> probed = hooks.probe_memory(s);
        if (Aborted(probed.status())) return probed.status();
        why = probed.ok() ? probed.value() : *ErrorLine(probed.status());
      }
      NONSTOP_ASSIGN_OR_RETURN(std::vector<Fields> whys, GatherFields(hooks.gather, {why}));
      MemoryChoice c = DecideMemory(Column(whys, 0));
      if (c.use) {
        if (why && why->empty()) {
          Status read = hooks.read(s, true);
          if (Aborted(read)) return read;
          if (!read.ok()) why = *ErrorLine(read);
        }
        NONSTOP_ASSIGN_OR_RETURN(whys, GatherFields(hooks.gather, {why}));
        c = DecideMemory(Column(whys, 0));
      }
      out.memory_unused = c.unused;
      if (!from_peer && c.use) source = "memory";
    }
    if (!err && source != "memory") {
      Status read = hooks.read(s, false);
      if (Aborted(read)) return read;
      err = ErrorLine(read);
    }
    NONSTOP_ASSIGN_OR_RETURN(
        std::vector<Fields> outcomes,
        GatherFields(hooks.gather,
                     {err, std::to_string(opened.ok() ? opened.value() : 0), source}));
    std::vector<StepRead> reads;
    std::vector<std::string> sources;
    for (const Fields& f : outcomes) {
      NONSTOP_ASSIGN_OR_RETURN(uint64_t run, NumberOf(f[1]));
      reads.push_back({f[0], run});
      sources.push_back(f[2].value_or(""));
    }
    // Restore it, or all fall back to the next step (a rank failed, or the
    // ranks' checkpoints are of different runs), or none left.
    NONSTOP_ASSIGN_OR_RETURN(std::string warning, DecideRecoverStep(req.dir, order, n, reads));
    if (!warning.empty()) {
      out.warnings.push_back(std::move(warning));
      continue;
    }
    out.kind = RecoverOutcome::Kind::kRestored;
    out.step = s;
    out.source = source;
    out.sources = std::move(sources);
    if (req.agreed && s < *req.agreed) {
      out.warnings.push_back("nonstop: rank " + std::to_string(req.rank) + " restores step " +
                             std::to_string(s) + ", older than the agreed step " +
                             std::to_string(*req.agreed));
    }
    return Status::OK();
  }
  return Status::Internal("Recover: no common step decided");  // DecideRecoverStep fails the last
}

namespace {

Result<std::optional<ReshardKey>> ReshardRounds(const std::string& dir, int world,
                                                const ReshardHooks& hooks,
                                                std::vector<std::string>* warnings) {
  ReshardAgreement agree(dir, world);
  while (true) {
    Result<std::optional<ReshardPick>> pick = hooks.pick(agree.max_step());
    // A hook that stopped (a bug, an interrupt: Aborted) still takes part in
    // this round's gather, as an error, so that no other rank waits for it
    // until the process group's timeout; this rank then returns its own.
    const bool stopped = Aborted(pick.status());
    Fields mine(3);
    if (stopped) {
      mine[0] = std::to_string(static_cast<int>(StatusCode::kInternal));
      mine[1] = StoppedLine(pick.status());
    } else if (!pick.ok()) {
      mine[0] = std::to_string(static_cast<int>(pick.status().code()));
      mine[1] = pick.status().message();
    } else if (pick.value()) {
      const ReshardKey& k = pick.value()->key;
      mine[2] = std::to_string(k.old_world) + " " + std::to_string(k.step) + " " +
                std::to_string(k.run_id);
    }
    Result<std::vector<Fields>> gathered = GatherFields(hooks.gather, mine);
    if (stopped) return pick.status();
    NONSTOP_ASSIGN_OR_RETURN(std::vector<Fields> every, std::move(gathered));
    std::vector<ReshardAgreement::Pick> picks;
    for (const Fields& f : every) {
      ReshardAgreement::Pick p;
      if (f[0]) {
        NONSTOP_ASSIGN_OR_RETURN(uint64_t code, NumberOf(f[0]));
        p.error = RankError{code <= static_cast<uint64_t>(StatusCode::kInternal)
                                ? static_cast<StatusCode>(code)
                                : StatusCode::kInternal,
                            f[1].value_or("")};
      }
      if (f[2]) {
        NONSTOP_ASSIGN_OR_RETURN(std::vector<int64_t> k, StepsOf(*f[2]));
        if (k.size() != 3 || k[2] < 0) return Status::Corruption("a rank's gathered key does not parse");
        p.key = ReshardKey{static_cast<int>(k[0]), k[1], static_cast<uint64_t>(k[2])};
      }
      picks.push_back(std::move(p));
    }
    NONSTOP_ASSIGN_OR_RETURN(ReshardAgreement::Next next, agree.OnPicks(picks));
    if (next == ReshardAgreement::Next::kNone) return std::optional<ReshardKey>();
    if (next != ReshardAgreement::Next::kProceed) continue;
    // Every rank chose agree.key(): its own pick.
    Status rebuilt = hooks.rebuild(*pick.value());
    const bool damage = rebuilt.code() == StatusCode::kCorruption;
    std::optional<std::string> fatal = damage ? std::nullopt : ErrorLine(rebuilt);
    if (Aborted(rebuilt)) fatal = StoppedLine(rebuilt);  // told, as the pick's above
    Result<std::vector<Fields>> gathered_outcomes =
        GatherFields(hooks.gather, {damage ? ErrorLine(rebuilt) : std::nullopt, fatal});
    if (Aborted(rebuilt)) return rebuilt;
    NONSTOP_ASSIGN_OR_RETURN(std::vector<Fields> outcomes, std::move(gathered_outcomes));
    std::vector<ReshardAgreement::Rebuilt> all;
    for (const Fields& f : outcomes) all.push_back({f[0], f[1]});
    NONSTOP_ASSIGN_OR_RETURN(next, agree.OnRebuilt(all, pick.value()->archive));
    if (next == ReshardAgreement::Next::kDone) return std::optional<ReshardKey>(agree.key());
    if (warnings) warnings->push_back(agree.warning());
  }
}

}  // namespace

Result<std::optional<ReshardKey>> ReshardTogether(const std::string& dir, int world,
                                                  const ReshardHooks& hooks,
                                                  std::vector<std::string>* warnings) {
  std::string missing;  // "rank R: ..." of the old ranks' files on no peer
  if (hooks.missing) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<Fields> every, GatherFields(hooks.gather, {hooks.missing}));
    std::vector<std::optional<std::string>> lines;
    for (const Fields& f : every) lines.push_back(f[0] && !f[0]->empty() ? f[0] : std::nullopt);
    missing = PerRank(lines);
    if (!hooks.missing->empty() && warnings) {
      warnings->push_back("nonstop: resharding from peers' memory: " + *hooks.missing +
                          "; the reshard reads the disk for them");
    }
  }
  Result<std::optional<ReshardKey>> got = ReshardRounds(dir, world, hooks, warnings);
  if (got.ok() || missing.empty() || Aborted(got.status())) return got;
  return Status(got.status().code(),
                got.status().message() + "; not on any surviving peer either: " + missing);
}

}  // namespace nonstop::dist
