// How the workers of one parallel-for (parallel.cc) share its ranges: one contiguous block of
// ranges per worker. A worker runs its own block from the front, then what is left of the others
// from their backs. In a loop of calls of one shape each worker so keeps the same ranges, and
// what a range writes (outputs XLA places at the same address call after call) is already in
// the cache of the core that writes it again instead of another core's: with the two vCPUs on
// different CCDs that move made the conv update B = 8 take ~1.2-1.4x as long (ffi/README.md,
// "Threads"). A worker that starts late finds its block drained by the others, so nobody waits
// on a worker that has not started. No XLA dependency: tests/cpp runs it on std::threads.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace gdn {

class WorkBlocks {
 public:
  // ranges [0, num_ranges) cut into `workers` blocks, worker w's being
  // [w R / workers, (w + 1) R / workers). num_ranges < 2^32.
  WorkBlocks(int64_t num_ranges, int64_t workers) : workers_(std::max<int64_t>(1, workers)), blocks_(new Block[workers_]) {
    for (int64_t w = 0; w < workers_; ++w) {
      const uint64_t lo = uint64_t(w * num_ranges / workers_), hi = uint64_t((w + 1) * num_ranges / workers_);
      blocks_[w].span.store(lo | hi << 32, std::memory_order_relaxed);
    }
  }

  // Calls run(r) for ranges r claimed by worker `home` (its block first, in order, then the
  // others' leftovers) until none is left; returns how many it ran. Each range is claimed once.
  template <class Run>
  int64_t drain(int64_t home, Run&& run) {
    int64_t ran = 0;
    for (int64_t k = 0; k < workers_; ++k) {
      Block& blk = blocks_[(home + k) % workers_];
      for (int64_t r; (r = blk.claim(k != 0)) >= 0; ++ran) run(r);
    }
    return ran;
  }

 private:
  // The unclaimed ranges [lo, hi) of one block, packed lo | hi << 32: the owner claims from the
  // front, the others from the back, so they meet only on its last range. One cache line each.
  struct alignas(64) Block {
    std::atomic<uint64_t> span{0};

    int64_t claim(bool from_back) {  // a range, or -1 when the block is empty
      uint64_t v = span.load(std::memory_order_relaxed);
      for (;;) {
        const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
        if (lo >= hi) return -1;
        const uint64_t next = from_back ? (lo | (hi - 1) << 32) : ((lo + 1) | hi << 32);
        if (span.compare_exchange_weak(v, next, std::memory_order_relaxed)) return int64_t(from_back ? hi - 1 : lo);
      }
    }
  };

  int64_t workers_;
  std::unique_ptr<Block[]> blocks_;
};

}  // namespace gdn
