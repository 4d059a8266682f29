// SlotQueue: the free slots of a slot file, as a bounded lock-free MPMC queue.
//
// Why a queue is enough to keep the newest committed checkpoint intact
// (DESIGN.md invariant 2), for S = N + 1 + extra slots and N in flight:
//   * A slot id is in exactly one place at a time: in this queue, owned by one
//     in-flight checkpoint, or retained as the newest committed one (or, in
//     distributed mode, the last globally agreed one: the `extra` slot).
//   * Only the committer moves a slot out of "retained", and only after a
//     newer checkpoint has committed and taken its place; a failed or
//     superseded checkpoint's own slot goes straight back to the queue. So the
//     retained slot is never in the queue and can never be handed out.
//   * The committer pushes a slot back *before* it decrements the in-flight
//     count (release), and Checkpoint() pops only after it has observed the
//     in-flight count below N (acquire). Hence whenever a caller is allowed to
//     start, free = S - in_flight - retained >= S - (N-1) - (1+extra) >= 1, and
//     Pop() cannot fail; the engine still checks and reports Internal if it does.
//
// The queue itself is the classic bounded MPMC ring with one sequence number
// per cell (Vyukov): a producer claims a cell by CAS on the tail when the
// cell's sequence equals the tail, writes the value, then publishes it by
// storing sequence = tail + 1 (release); a consumer claims by CAS on the head
// when sequence == head + 1, reads, then frees the cell for the next lap with
// sequence = head + capacity. Positions are 64-bit, so they never wrap.
// Unlike the textbook version, Push fails only when the queue is really full
// and Pop returns empty only when no Push has claimed a cell at its position:
// where a peer is between its claim and its publish (a few instructions) the
// caller yields and retries. So an id is never lost to a transient, at the
// price of waiting on a peer preempted inside that window.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>

namespace nonstop {

class SlotQueue {
 public:
  // Holds up to `capacity` ids (rounded up to a power of two).
  explicit SlotQueue(uint32_t capacity) {
    cap_ = 1;
    while (cap_ < capacity) cap_ <<= 1;
    cells_ = std::make_unique<Cell[]>(cap_);
    for (uint64_t i = 0; i < cap_; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  SlotQueue(const SlotQueue&) = delete;
  SlotQueue& operator=(const SlotQueue&) = delete;

  // False when full (cannot happen while ids are conserved; see above).
  bool Push(uint32_t slot) {
    uint64_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & (cap_ - 1)];
      const uint64_t seq = c.seq.load(std::memory_order_acquire);
      const int64_t diff = static_cast<int64_t>(seq - pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.value = slot;
          c.seq.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        // The cell still holds the previous lap's value: either the queue is
        // full, or a consumer has claimed it and not yet released it. Only the
        // first is a real failure; the second lasts a few instructions. `pos`
        // may be stale by now (this thread preempted here while peers pushed
        // and popped past it): head beyond pos is not "full", just a retry.
        const uint64_t head = head_.load(std::memory_order_acquire);
        if (head <= pos && pos - head >= cap_) return false;
        std::this_thread::yield();
        pos = tail_.load(std::memory_order_relaxed);
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  // nullopt when empty.
  std::optional<uint32_t> Pop() {
    uint64_t pos = head_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & (cap_ - 1)];
      const uint64_t seq = c.seq.load(std::memory_order_acquire);
      const int64_t diff = static_cast<int64_t>(seq - (pos + 1));
      if (diff == 0) {
        if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          const uint32_t v = c.value;
          c.seq.store(pos + cap_, std::memory_order_release);
          return v;
        }
      } else if (diff < 0) {
        // Empty, or a producer has claimed this cell and not yet published
        // it. Wait out the second so that a Push that returned before this
        // Pop began is always seen (the engine's argument above needs that).
        if (tail_.load(std::memory_order_acquire) <= pos) return std::nullopt;
        std::this_thread::yield();
        pos = head_.load(std::memory_order_relaxed);
      } else {
        pos = head_.load(std::memory_order_relaxed);
      }
    }
  }

  // A snapshot, exact only when no Push/Pop runs concurrently (tests, stats).
  uint64_t SizeApprox() const {
    return tail_.load(std::memory_order_acquire) - head_.load(std::memory_order_acquire);
  }

 private:
  struct Cell {
    std::atomic<uint64_t> seq{0};
    uint32_t value = 0;  // written by the claiming producer, read by the claiming consumer
  };
  uint64_t cap_ = 1;
  std::unique_ptr<Cell[]> cells_;
  alignas(64) std::atomic<uint64_t> head_{0};
  alignas(64) std::atomic<uint64_t> tail_{0};
};

}  // namespace nonstop
