// The benchmarks' own thread pool (gdn_recurrent_kernel_bench, gdn_conv_kernel_bench): a
// caller-helps parallel-for whose helpers spin between calls (no wake-up cost) or sleep on a
// condition variable, as XLA's pool threads do once idle.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "gdn/types.h"
#include "work_blocks.h"

namespace gdn_bench {

using gdn::Parallel;

// A spinning thread leaves the core's other hardware thread its issue slots.
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Caller-helps parallel-for on helpers that spin for the next job, or (sleep) wait for it on a
// condition variable (ranges of n / (4 threads), shared as the extension shares them:
// work_blocks.h). The caller's join waits for every helper, also
// one that wakes after the last range (parallel.cc's waits only for claimed ranges): if anything,
// sleeping helpers are timed pessimistically.
class Workers {
 public:
  Workers(int threads, bool sleep) : threads_(threads), sleep_(sleep) {
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this, i] { helper(i); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : helpers_) t.join();
  }
  // While held, the helpers wait on the condition variable in either mode, leaving the CPUs to
  // something else (a round-trip measurement between calls).
  void hold(bool on) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      hold_.store(on);
    }
    cv_.notify_all();
  }
  Parallel parallel() {
    Parallel p;
    p.ctx = this;
    p.run_fn = &Workers::run;
    p.num_threads = threads_;
    return p;
  }

 private:
  static void run(void* ctx, int64_t n, int64_t grain, Parallel::Body body, void* body_ctx) {
    auto* self = static_cast<Workers*>(ctx);
    self->body_ = body;
    self->body_ctx_ = body_ctx;
    self->n_ = n;
    self->step_ = std::max<int64_t>(std::max<int64_t>(grain, 1), (n + 4 * self->threads_ - 1) / (4 * self->threads_));
    self->blocks_ = std::make_unique<gdn::WorkBlocks>((n + self->step_ - 1) / self->step_, self->threads_);
    self->busy_.store(self->threads_ - 1);
    if (self->sleep_) {
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        self->generation_.fetch_add(1, std::memory_order_release);
      }
      self->cv_.notify_all();
    } else {
      self->generation_.fetch_add(1, std::memory_order_release);
    }
    self->drain(0);
    while (self->busy_.load(std::memory_order_acquire) > 0) relax();
  }
  void drain(int home) {
    blocks_->drain(home, [&](int64_t r) { body_(body_ctx_, r * step_, std::min(n_, (r + 1) * step_)); });
  }
  void helper(int home) {
    int seen = 0;
    for (;;) {
      int g;
      if (sleep_) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_.load() || generation_.load(std::memory_order_acquire) != seen; });
        if (stop_.load()) return;
        g = generation_.load(std::memory_order_acquire);
      } else {
        while ((g = generation_.load(std::memory_order_acquire)) == seen) {
          if (stop_.load()) return;
          if (hold_.load()) {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return stop_.load() || !hold_.load() || generation_.load() != seen; });
            continue;
          }
          relax();
        }
      }
      seen = g;
      drain(home);
      busy_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  int threads_;
  bool sleep_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> helpers_;
  std::atomic<int> generation_{0}, busy_{0};
  std::atomic<bool> stop_{false}, hold_{false};
  std::unique_ptr<gdn::WorkBlocks> blocks_;
  Parallel::Body body_ = nullptr;
  void* body_ctx_ = nullptr;
  int64_t n_ = 0, step_ = 1;
};

}  // namespace gdn_bench
