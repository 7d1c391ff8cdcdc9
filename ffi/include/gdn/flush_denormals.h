// Denormals flushed to zero while a kernel's work runs (every Parallel range, on whichever
// thread runs it): MXCSR FTZ + DAZ on x86, FPCR.FZ on AArch64; the caller's setting is put
// back after the range. Intel cores take a microcode assist of ~100+ cycles per denormal
// result or operand, and strong decays make them common here (Gamma = e^(Gc_i - Gc_j)
// underflows within a chunk, then every product with it): with them the chunk ran at half its
// speed on a Xeon with AMX (ffi/README.md, "Numerics shared by all kernels"). XLA's own threads
// already run so; this makes the kernels' values and speed the same under any caller (core
// tests, benchmarks, a runtime that does not flush). No headers: compiler builtins only (see
// types.h).
#pragma once

namespace gdn {

class FlushDenormals {
 public:
  // The control register and the bits that flush (none where no control is known).
#if defined(__x86_64__) || defined(__i386__)
  using Word = unsigned;
  static constexpr Word kBits = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)
  static Word control() { return __builtin_ia32_stmxcsr(); }
  static void set_control(Word w) { __builtin_ia32_ldmxcsr(w); }
#elif defined(__aarch64__)
  using Word = unsigned long long;
  static constexpr Word kBits = 1ull << 24;  // FZ: inputs and results
  static Word control() { return __builtin_aarch64_get_fpcr64(); }
  static void set_control(Word w) { __builtin_aarch64_set_fpcr64(w); }
#else
  using Word = unsigned;
  static constexpr Word kBits = 0;  // IEEE denormals
  static Word control() { return 0; }
  static void set_control(Word) {}
#endif

  FlushDenormals() : saved_(control()) {
    if (!flushes(saved_)) set_control(saved_ | kBits);
  }
  ~FlushDenormals() {
    if (!flushes(saved_)) set_control(saved_);
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

  static bool active() { return flushes(control()); }

 private:
  static bool flushes(Word w) { return kBits != 0 && (w & kBits) == kBits; }
  Word saved_;
};

}  // namespace gdn
