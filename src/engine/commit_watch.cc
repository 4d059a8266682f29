#include "engine/commit_watch.h"

#include <algorithm>
#include <utility>

namespace nonstop {
namespace {
constexpr size_t kUntrackedKept = 64;  // as many as EngineStats::recent
}  // namespace

WatchOutcome CommitWatch::Outcome(const CheckpointStats& rec) {
  WatchOutcome o;
  o.counter = rec.counter;
  o.step = rec.step;
  o.record = rec;
  if (rec.committed) return o;
  const std::string msg = rec.error.empty() ? "failed" : rec.error;
  o.error = "checkpoint of step " + std::to_string(rec.step) + " failed: " + msg;
  const bool cancelled = msg.find("superseded") != std::string::npos ||
                         msg.find("abandoned") != std::string::npos;
  o.kind = cancelled ? WatchOutcome::Kind::kCancelled : WatchOutcome::Kind::kFailed;
  return o;
}

void CommitWatch::Settle(int64_t step, const CheckpointStats& rec) {
  if (rec.committed && agreement_ && (!agreed_ || *agreed_ < step)) {
    unagreed_[rec.counter] = {step, rec};
    return;
  }
  ready_.push_back(Outcome(rec));
  cv_.SignalAll();
}

void CommitWatch::Track(uint64_t counter, int64_t step) {
  MutexLock l(&mu_);
  auto it = untracked_.find(counter);
  if (it == untracked_.end()) {
    tracked_[counter] = step;
    return;
  }
  const CheckpointStats rec = std::move(it->second);
  untracked_.erase(it);
  Settle(step, rec);
}

void CommitWatch::Finished(const CheckpointStats& rec) {
  MutexLock l(&mu_);
  auto it = tracked_.find(rec.counter);
  if (it == tracked_.end()) {
    untracked_[rec.counter] = rec;
    if (untracked_.size() > kUntrackedKept) untracked_.erase(untracked_.begin());
    return;
  }
  const int64_t step = it->second;
  tracked_.erase(it);
  Settle(step, rec);
}

void CommitWatch::Agreed(int64_t step) {
  MutexLock l(&mu_);
  agreed_ = step;
  for (auto it = unagreed_.begin(); it != unagreed_.end();) {
    if (it->second.first > step) {
      ++it;
      continue;
    }
    ready_.push_back(Outcome(it->second.second));
    it = unagreed_.erase(it);
  }
  cv_.SignalAll();
}

std::optional<std::vector<WatchOutcome>> CommitWatch::Next() {
  MutexLock l(&mu_);
  cv_.Wait(&mu_, [&]() REQUIRES(mu_) { return stopped_ || !ready_.empty(); });
  if (ready_.empty()) return std::nullopt;
  std::vector<WatchOutcome> out;
  out.swap(ready_);
  return out;
}

void CommitWatch::Stop() {
  MutexLock l(&mu_);
  stopped_ = true;
  cv_.SignalAll();
}

std::vector<WatchOutcome> CommitWatch::Abandon(const std::string& why) {
  MutexLock l(&mu_);
  stopped_ = true;
  cv_.SignalAll();
  std::vector<WatchOutcome> out;
  out.swap(ready_);
  std::map<uint64_t, int64_t> left = std::move(tracked_);
  tracked_.clear();
  for (const auto& [counter, held] : unagreed_) left[counter] = held.first;
  unagreed_.clear();
  for (const auto& [counter, step] : left) {
    WatchOutcome o;
    o.counter = counter;
    o.step = step;
    o.kind = WatchOutcome::Kind::kCancelled;
    o.error = "checkpoint of step " + std::to_string(step) + ": " + why;
    out.push_back(std::move(o));
  }
  return out;
}

}  // namespace nonstop
