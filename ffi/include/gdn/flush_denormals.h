// Denormals flushed to zero while a kernel's work runs (every Parallel range, on whichever
// thread runs it): MXCSR FTZ + DAZ on x86, FPCR.FZ on AArch64; the caller's setting is put
// back after the range. Intel cores take a microcode assist of ~100+ cycles per denormal
// result or operand, and strong decays make them common here (Gamma = e^(Gc_i - Gc_j)
// underflows within a chunk, then every product with it): with them the chunk ran at half its
// speed on a Xeon with AMX (ffi/README.md, "Denormals"). XLA's own threads already run so;
// this makes the kernels' values and speed the same under any caller (core tests, benchmarks,
// a runtime that does not flush). No headers: compiler builtins only (see types.h).
#pragma once

namespace gdn {

class FlushDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kBits = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)
  FlushDenormals() : saved_(__builtin_ia32_stmxcsr()) {
    if ((saved_ & kBits) != kBits) __builtin_ia32_ldmxcsr(saved_ | kBits);
  }
  ~FlushDenormals() {
    if ((saved_ & kBits) != kBits) __builtin_ia32_ldmxcsr(saved_);
  }
  static bool active() { return (__builtin_ia32_stmxcsr() & kBits) == kBits; }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  static constexpr unsigned long long kBits = 1ull << 24;  // FZ: inputs and results
  FlushDenormals() : saved_(__builtin_aarch64_get_fpcr64()) {
    if ((saved_ & kBits) != kBits) __builtin_aarch64_set_fpcr64(saved_ | kBits);
  }
  ~FlushDenormals() {
    if ((saved_ & kBits) != kBits) __builtin_aarch64_set_fpcr64(saved_);
  }
  static bool active() { return (__builtin_aarch64_get_fpcr64() & kBits) == kBits; }

 private:
  unsigned long long saved_;
#else
  static bool active() { return false; }  // no flush control known: IEEE denormals
#endif
 public:
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace gdn
