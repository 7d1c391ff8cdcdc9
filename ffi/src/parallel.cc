// Caller-helps parallel-for on XLA's pool: the caller is worker 0 and schedules one helper per
// pool thread but one (worker i + 1); the workers share the ranges as WorkBlocks
// (work_blocks.h), so a helper that starts late finds its ranges taken and the caller never
// waits on a task that has not started (safe when the handler itself runs on a pool thread, or
// the pool has one thread). The caller then waits only for ranges already claimed.
#include "parallel.h"
#include "work_blocks.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

namespace gdn {
namespace {

// How long the caller polls for the helpers' last ranges before it sleeps on the condition
// variable. The last range usually ends within microseconds of the caller's own, and waking a
// sleeping thread costs tens of microseconds here (a futex wake-up in a VM): the decode op at
// B = 1 (~0.2 ms) ran ~12% faster with this poll (ffi/README.md, "Threads").
constexpr auto kJoinPoll = std::chrono::microseconds(50);

std::atomic<int64_t> g_counters[kNumParallelCounters];

inline void count(ParallelCounter c, int64_t v) { g_counters[c].fetch_add(v, std::memory_order_relaxed); }

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct Job {
  Job(Parallel::Body body, void* body_ctx, int64_t n, int64_t step, int64_t num_ranges, int64_t workers)
      : body(body), body_ctx(body_ctx), n(n), step(step), num_ranges(num_ranges), blocks(num_ranges, workers) {}

  Parallel::Body body;
  void* body_ctx;
  int64_t n, step, num_ranges;
  WorkBlocks blocks;
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  bool finished() const { return done.load(std::memory_order_acquire) == num_ranges; }

  // Runs ranges for worker `home` (WorkBlocks) until none is left; returns how many. Touches
  // body/body_ctx only for claimed ranges, which the caller waits for, so a late helper never
  // uses a dead frame.
  int64_t drain(int64_t home) {
    const int64_t ran = blocks.drain(home, [&](int64_t r) {
      const int64_t b = r * step, e = std::min(n, b + step);
      body(body_ctx, b, e);
    });
    // One count per worker, not per range: the counter's cache line moves between cores once.
    if (ran > 0 && done.fetch_add(ran, std::memory_order_acq_rel) + ran == num_ranges) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
    return ran;
  }
};

void run(void* ctx, int64_t n, int64_t grain, Parallel::Body body, void* body_ctx) {
  auto* pool = static_cast<xla::ffi::ThreadPool*>(ctx);
  const int64_t threads = std::max<int64_t>(1, pool->num_threads());
  grain = std::max<int64_t>(1, grain);
  // A few ranges per thread for balance, none shorter than the grain.
  const int64_t max_ranges = std::max<int64_t>(1, (n + grain - 1) / grain);
  const int64_t want = std::min<int64_t>(max_ranges, threads * 4);
  const int64_t step = (n + want - 1) / want;
  const int64_t num_ranges = (n + step - 1) / step;
  // The caller works too, so threads - 1 helpers make as many workers as the pool has threads.
  // One more (as before 2026-12-01) put three threads on a 2-core host: the third waited ~0.6 ms
  // for a core (0.03 ms without it) and shared one with another worker (ffi/README.md, "Threads").
  const int64_t helpers = std::min<int64_t>(threads - 1, num_ranges - 1);
  auto job = std::make_shared<Job>(body, body_ctx, n, step, num_ranges, helpers + 1);
  const int64_t t_sched = now_ns();
  for (int64_t i = 0; i < helpers; ++i)
    pool->Schedule([job, t_sched, i] {
      const int64_t late = now_ns() - t_sched;
      count(kHelperStartNs, late);
      int64_t prev = g_counters[kHelperStartMaxNs].load(std::memory_order_relaxed);
      while (late > prev && !g_counters[kHelperStartMaxNs].compare_exchange_weak(prev, late)) {
      }
      const int64_t ran = job->drain(i + 1);
      count(kHelperRanges, ran);
      if (ran == 0) count(kLateHelpers, 1);
    });
  job->drain(0);
  const int64_t t_join = now_ns();
  // Poll (yielding, so that a helper sharing this core runs) before sleeping: see kJoinPoll.
  const auto poll_end = std::chrono::steady_clock::now() + kJoinPoll;
  while (!job->finished() && std::chrono::steady_clock::now() < poll_end) {
    for (int i = 0; i < 16; ++i) cpu_relax();
    std::this_thread::yield();
  }
  if (!job->finished()) {
    count(kJoinSleeps, 1);
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->finished(); });
  }
  count(kJobs, 1);
  count(kHelpers, helpers);
  count(kRanges, job->num_ranges);
  const int64_t t_end = now_ns();
  count(kJoinWaitNs, t_end - t_join);
  count(kJobNs, t_end - t_sched);
}

}  // namespace

StepTimer::StepTimer() : t0_(now_ns()) { g_counters[kStepEntryNs].store(t0_, std::memory_order_relaxed); }

StepTimer::~StepTimer() {
  const int64_t t1 = now_ns();
  count(kSteps, 1);
  count(kStepNs, t1 - t0_);
  g_counters[kStepExitNs].store(t1, std::memory_order_relaxed);
}

void parallel_counters(int64_t out[kNumParallelCounters], bool reset) {
  for (int i = 0; i < kNumParallelCounters; ++i)
    out[i] = reset ? g_counters[i].exchange(0, std::memory_order_relaxed) : g_counters[i].load(std::memory_order_relaxed);
}

Parallel make_parallel(xla::ffi::ThreadPool* pool) {
  Parallel p;
  p.ctx = pool;
  p.run_fn = run;
  p.num_threads = pool ? int(std::max<int64_t>(1, pool->num_threads())) : 1;
  if (!pool) p.run_fn = nullptr;
  return p;
}

}  // namespace gdn
