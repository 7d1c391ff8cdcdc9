// Where a VM's vCPUs sit (benchmarks only; ffi/README.md, Limits): the extension's
// core_round_trip_ns and gdn_recurrent_kernel_bench --tag-seconds.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace gdn {

// Median nanoseconds of a round trip of one cache line between two threads pinned to CPUs a
// and b (`trips` round trips per batch, the median of 15 batches); nullopt where threads cannot
// be pinned. Benchmarks only: it tells where a VM's two vCPUs sit (ffi/README.md, Limits).
inline std::optional<double> core_round_trip_ns(int a, int b, int trips) {
#if defined(__linux__)
  if (a >= CPU_SETSIZE || b >= CPU_SETSIZE) return std::nullopt;
  auto pin = [](int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
  };
  constexpr int kBatches = 15;
  alignas(64) std::atomic<int64_t> flag{0};
  std::atomic<int> ready{0};  // 1: the other thread is pinned, 2: it could not be
  std::thread other([&] {
    ready = pin(b) ? 1 : 2;
    if (ready == 2) return;
    for (int64_t i = 0; i < int64_t(trips) * kBatches; ++i) {  // answers each odd value with the next even one
      int64_t f;
      while ((f = flag.load(std::memory_order_acquire)) != 2 * i + 1)
        if (f < 0) return;  // the caller could not be pinned
      flag.store(2 * i + 2, std::memory_order_release);
    }
  });
  while (ready == 0) std::this_thread::yield();
  cpu_set_t saved;
  const bool have_saved = pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0;
  // Both pinned or no timing: two spinning threads on one CPU would hand over once per tick.
  if (ready == 2 || !pin(a)) {
    flag.store(-1, std::memory_order_release);
    other.join();
    if (have_saved) pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
    return std::nullopt;
  }
  std::vector<double> ns;
  for (int r = 0; r < kBatches; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = int64_t(r) * trips; i < int64_t(r + 1) * trips; ++i) {
      flag.store(2 * i + 1, std::memory_order_release);
      while (flag.load(std::memory_order_acquire) != 2 * i + 2) {
      }
    }
    ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / trips);
  }
  other.join();
  if (have_saved) pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
  std::sort(ns.begin(), ns.end());
  return ns[kBatches / 2];
#else
  (void)a, (void)b, (void)trips;
  return std::nullopt;
#endif
}

}  // namespace gdn
