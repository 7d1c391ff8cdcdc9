// Parallel-for on XLA's own intra-op pool (ffi::ThreadPool): never our own threads.
#pragma once
#include "gdn/types.h"
#include "xla/ffi/api/ffi.h"

namespace gdn {

// The returned Parallel refers to `pool`; use it only during the handler call.
Parallel make_parallel(xla::ffi::ThreadPool* pool);

// Benchmarks only: what the fork/joins of make_parallel cost, summed since the last reset
// (relaxed counters, a clock read per helper start and per join). Indices of parallel_counters.
enum ParallelCounter {
  kJobs,             // parallel-fors that scheduled helpers
  kHelpers,          // helper tasks scheduled
  kHelperStartNs,    // sum over helpers of (start - schedule) in ns
  kHelperStartMaxNs, // the largest of those
  kLateHelpers,      // helpers that found no range left
  kHelperRanges,     // ranges run by helpers (the rest ran on the caller)
  kRanges,           // ranges in all
  kJoinWaitNs,       // caller's time from its last range to the end of the job
  kJoinSleeps,       // joins that went past the poll into the condition variable
  kJobNs,            // wall time of the parallel-fors, first schedule to join, in ns
  kSteps,            // serving-step handler calls (gdn_jax_step), timed by StepTimer
  kStepNs,           // their wall time, entry to return, summed, in ns
  kStepEntryNs,      // the last one's entry and return on CLOCK_MONOTONIC (Python's time.monotonic_ns),
  kStepExitNs,       // so that a caller can tell dispatch before the handler from the handler itself
  kNumParallelCounters
};
void parallel_counters(int64_t out[kNumParallelCounters], bool reset);

// Benchmarks only: counts the enclosing handler call as one step (kSteps .. kStepExitNs).
class StepTimer {
 public:
  StepTimer();
  ~StepTimer();
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

 private:
  int64_t t0_;
};

}  // namespace gdn
