// Tests only: N ranks in one process for the collective drivers of
// nonstop/dist.h (Recover, ReshardTogether, and planned_steps.h's), each on
// its own thread, gathering like the Comm's gather does in python: each
// call returns every rank's text of that round, rank 0 first, once all
// ranks gave theirs.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nonstop/dist.h"

namespace nonstop::dist {

class RankThreads {
 public:
  explicit RankThreads(int n) : n_(n), rounds_(n, 0) {}

  // Runs f(rank, gather) on every rank at once; returns when all did.
  void Run(const std::function<void(int, const Gather&)>& f) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) threads.emplace_back([this, &f, r] { f(r, For(r)); });
    for (std::thread& t : threads) t.join();
  }

 private:
  Gather For(int rank) {
    return [this, rank](const std::string& mine) -> Result<std::vector<std::string>> {
      std::unique_lock<std::mutex> l(mu_);
      const int round = rounds_[rank]++;
      std::vector<std::string>& texts = texts_[round];
      texts.resize(n_);
      texts[rank] = mine;
      ++got_[round];
      cv_.notify_all();
      if (!cv_.wait_for(l, std::chrono::seconds(30), [&] { return got_[round] == n_; })) {
        return Status::Unavailable("a rank never gathered round " + std::to_string(round));
      }
      return texts;
    };
  }

  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> rounds_;
  std::map<int, std::vector<std::string>> texts_;
  std::map<int, int> got_;
};

}  // namespace nonstop::dist
